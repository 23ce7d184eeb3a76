"""The user calibration dataset (``calibration.dataset``): where it is, and whether it is a usable JSONL.

One implementation, used by the resolve rule ``calibration.dataset`` (so ``invoke check`` and
``invoke build`` refuse a bad file before anything is written) and by the quantize stage's
calibration set (``quantize/calibration.py``, which adds the checks that need the tokenizer:
texts longer than ``calibration.seq_len`` tokens).

* ``"builtin"`` is the shipped set; any other value is a path.
* A relative path is relative to the folder of the profile file that was given (``--profile
  path/to/p.yaml``; for a shipped name, ``precision_profiles/``), never to the current directory:
  ``with_dataset_resolved`` makes it absolute right after the profile is loaded.
* Refused (``Problem`` on ``calibration.dataset``): an empty value, a misspelt ``builtin``, a
  missing file, a directory or anything that is not a regular file (``/dev/zero``), a file over
  ``MAX_USER_FILE_BYTES``, bytes that are not UTF-8 (with the line), and, naming line numbers:
  invalid JSON, lines that are not an object with a string ``text``, blank lines or texts, texts of
  more than ``seq_len x MAX_TOKEN_BYTES`` bytes (with their sizes: more tokens than ``seq_len`` for
  sure, found without a tokenizer), and fewer usable lines than ``calibration.num_samples``.
* Read only as far as needed: ``sample_pool(num_samples)`` = 4 x ``num_samples`` usable lines, from the
  top; the seed chooses among those. Lines after them are never read (nor checked).
"""

from __future__ import annotations

import difflib
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from precision_pipeline.core.errors import Problem

FIELD = "calibration.dataset"
BUILTIN = "builtin"
MAX_USER_FILE_BYTES = 1 << 30  # 1 GiB
MAX_REPORTED_LINES = 20
_FORMAT_FIX = "write one JSON object per line: {\"text\": \"...\"}."


@dataclass(frozen=True)
class UserDataset:
    """A readable JSONL: ``texts`` are (line number from 1, text) of the usable lines read; ``lines``: lines
    read (the whole file unless reading stopped at ``stop_after`` usable lines); ``sha256``: the file's."""

    path: Path
    sha256: str
    lines: int
    texts: tuple[tuple[int, str], ...]


def lines_msg(nums: list[int]) -> str:
    """``line 3`` / ``lines 2, 5 (and 7 more)``."""
    shown = ", ".join(str(n) for n in nums[:MAX_REPORTED_LINES])
    more = f" (and {len(nums) - MAX_REPORTED_LINES} more)" if len(nums) > MAX_REPORTED_LINES else ""
    return f"line{'s' if len(nums) > 1 else ''} {shown}{more}"


def _short(s: str, n: int = 120) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")


def with_dataset_resolved(profile: Any, profile_file: Optional[Path]) -> Any:
    """``profile`` with a relative ``calibration.dataset`` made absolute against ``profile_file``'s folder.

    ``"builtin"``, ``""``, absolute and ``~`` paths are returned unchanged (the rule judges them);
    ``profile_file`` None (a profile built in code) leaves relative paths as they are."""
    ds = profile.calibration.dataset
    if not ds or ds == BUILTIN or profile_file is None:
        return profile
    p = Path(ds).expanduser()
    if p.is_absolute():
        return profile
    absolute = Path(profile_file).resolve().parent / p
    if _near_builtin(ds) and not os.path.lexists(absolute):
        return profile  # refused as a misspelt 'builtin'
    absolute = str(absolute)
    return profile.model_copy(update={"calibration": profile.calibration.model_copy(update={"dataset": absolute})})


def _near_builtin(ds: str) -> bool:
    """A value that reads as a misspelt ``builtin`` (``Builtin``, ``built-in``, ``bultin``), not a path."""
    s = ds.strip().lower()
    return ds != BUILTIN and "/" not in s and "." not in s and (
        s.replace("-", "").replace("_", "").replace(" ", "") == BUILTIN
        or bool(difflib.get_close_matches(s, [BUILTIN], n=1, cutoff=0.7)))


def _path_problem(ds: str) -> tuple[Optional[Path], Optional[Problem]]:
    fix = "write 'builtin' or the path of a JSONL file with one {\"text\": ...} per line (relative to the profile's folder)."
    if not isinstance(ds, str) or not ds.strip():
        return None, Problem(FIELD, "is empty.", fix)
    if _near_builtin(ds) and not os.path.lexists(Path(ds).expanduser()):
        return None, Problem(FIELD, f"{_short(ds)} is not 'builtin' (the shipped set) nor a file path.",
                             "did you mean 'builtin'? Write it in lower case, as one word.")
    p = Path(ds).expanduser()
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return None, Problem(FIELD, f"no file at {_short(ds)} (not 'builtin' either).", fix)
    except (OSError, ValueError) as e:
        return None, Problem(FIELD, f"{_short(ds)} cannot be read ({type(e).__name__}: {str(e)[:120]}).", fix)
    if stat.S_ISDIR(st.st_mode):
        return None, Problem(FIELD, f"{_short(ds)} is a directory, not a JSONL file.", fix)
    if not stat.S_ISREG(st.st_mode):
        return None, Problem(FIELD, f"{_short(ds)} is not a regular file (a device, pipe or socket).", fix)
    if st.st_size > MAX_USER_FILE_BYTES:
        return None, Problem(FIELD, f"{p} is {st.st_size} bytes (more than {MAX_USER_FILE_BYTES}).", "use a smaller file.")
    return p, None


MAX_TOKEN_BYTES = 256
"""Most UTF-8 bytes one token of any tokenizer the pipeline loads decodes to (SmolLM2's longest is 81 bytes;
byte-level BPE vocabularies of Llama 3 / Qwen 2 stay well below 256). A text of more than
``seq_len x MAX_TOKEN_BYTES`` bytes therefore has more than ``seq_len`` tokens and is refused *without a
tokenizer* (``invoke check``), before a 300 MB line is ever handed to one (a tokenizer allocates several
times a text's size: one such line aborted a build at 5.5 GB)."""

POOL_FACTOR = 4
"""A user dataset is read until ``POOL_FACTOR x num_samples`` usable lines (``sample_pool``), never further:
the seed chooses ``num_samples`` of them. A 3-million-line file with ``num_samples: 16`` reads 64 lines."""

PROGRESS_EVERY_S = 2.0


def sample_pool(num_samples: int) -> int:
    """How many usable lines of a user dataset are read and checked (``POOL_FACTOR`` x ``num_samples``)."""
    return POOL_FACTOR * int(num_samples)


def max_text_bytes(seq_len: int) -> int:
    """Most bytes a text of ``seq_len`` tokens can have (``MAX_TOKEN_BYTES`` per token)."""
    return int(seq_len) * MAX_TOKEN_BYTES


def scan_user_dataset(ds: str, stop_after: Optional[int] = None, seq_len: Optional[int] = None,
                      say: Optional[Callable[[str], None]] = None) -> tuple[Optional[UserDataset], list[Problem]]:
    """Read the JSONL at ``ds`` (a path; not ``"builtin"``) line by line. Returns (dataset or None, problems).

    None with one problem when the file itself is unusable (see the module docstring); otherwise
    the dataset and the problems of its lines (invalid JSON, no string ``text``, blank, and with ``seq_len``
    texts of more than ``max_text_bytes(seq_len)`` bytes, with their sizes). ``stop_after``: stop reading
    once that many usable lines were found (``sample_pool``; later lines are never read, so a huge file
    costs what its first lines cost). ``say(message)``: a progress line every ``PROGRESS_EVERY_S`` seconds
    of reading. ``sha256`` is the whole file's (memoized by ``core.fingerprint``)."""
    from precision_pipeline.core.fingerprint import file_digests

    path, problem = _path_problem(ds)
    if problem is not None:
        return None, [problem]
    bad_json: list[int] = []
    not_text: list[int] = []
    blank: list[int] = []
    too_big: list[tuple[int, int]] = []
    texts: list[tuple[int, str]] = []
    limit = max_text_bytes(seq_len) if seq_len is not None else None
    size = path.stat().st_size
    no = 0
    t_last = time.monotonic()
    try:
        with open(path, "rb") as f:
            while stop_after is None or len(texts) < stop_after:
                raw = f.readline(limit + 1) if limit is not None else f.readline()
                if not raw:
                    break
                no += 1
                if say is not None and time.monotonic() - t_last >= PROGRESS_EVERY_S:
                    t_last = time.monotonic()
                    say(f"[calibration] reading {path}: line {no:,}, {f.tell() / 1e6:,.1f} of {size / 1e6:,.1f} MB, "
                        f"{len(texts):,} usable texts" + (f" of the {stop_after:,} needed" if stop_after else ""))
                if limit is not None and len(raw) > limit:  # never held whole: the rest is skipped in chunks
                    n = len(raw)
                    while not raw.endswith(b"\n"):
                        raw = f.readline(1 << 20)
                        if not raw:
                            break
                        n += len(raw)
                    too_big.append((no, n - 1 if raw.endswith(b"\n") else n))
                    continue
                try:
                    line = raw.decode("utf-8-sig" if no == 1 else "utf-8")  # a BOM (Notepad) is no JSON error: hostile s12 F-H
                except UnicodeDecodeError:
                    return None, [Problem(FIELD, f"{path} is not UTF-8 (line {no}).", "save the file as UTF-8 JSONL.")]
                line = line.rstrip("\n").rstrip("\r")
                if not line.strip():
                    blank.append(no)
                    continue
                try:
                    obj = json.loads(line)
                except (json.JSONDecodeError, RecursionError):
                    bad_json.append(no)
                    continue
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    not_text.append(no)
                    continue
                if not obj["text"].strip():
                    blank.append(no)
                    continue
                texts.append((no, obj["text"]))
        digest = file_digests(path)[path.name]
    except OSError as e:
        return None, [Problem(FIELD, f"{path} cannot be read ({type(e).__name__}: {str(e)[:120]}).", "check the file's permissions.")]
    problems = []
    if too_big:
        shown = ", ".join(f"line {n} ({b:,} bytes)" for n, b in too_big[:MAX_REPORTED_LINES])
        more = f" (and {len(too_big) - MAX_REPORTED_LINES} more)" if len(too_big) > MAX_REPORTED_LINES else ""
        problems.append(Problem(FIELD, f"{path}: {shown}{more}: more than {limit:,} bytes, so more than calibration.seq_len "
                                f"= {seq_len} tokens (at most {MAX_TOKEN_BYTES} bytes per token); texts are never "
                                "truncated, and a text that size would be tokenized whole.",
                                "split those texts into samples of at most seq_len tokens, or raise calibration.seq_len."))
    if bad_json:
        problems.append(Problem(FIELD, f"{path}: {lines_msg(bad_json)} {'are' if len(bad_json) > 1 else 'is'} not valid JSON.", _FORMAT_FIX))
    if not_text:
        problems.append(Problem(FIELD, f"{path}: {lines_msg(not_text)} {'have' if len(not_text) > 1 else 'has'} no string \"text\" field.",
                                _FORMAT_FIX))
    if blank:
        problems.append(Problem(FIELD, f"{path}: {lines_msg(blank)} {'are' if len(blank) > 1 else 'is'} empty or blank text.",
                                "remove empty lines and empty texts."))
    return UserDataset(path, digest, no, tuple(texts)), problems


def count_problem(path: Path, usable: int, num_samples: int) -> Optional[Problem]:
    """The problem when ``usable`` lines are fewer than ``calibration.num_samples``."""
    if usable >= num_samples:
        return None
    return Problem(FIELD, f"{path}: {usable} usable sample{'s' if usable != 1 else ''}, but calibration.num_samples = {num_samples}.",
                   f"add at least {num_samples - usable} more lines, or lower calibration.num_samples.")


def dataset_problems(ds: str, num_samples: int, seq_len: Optional[int] = None) -> list[Problem]:
    """Every problem of ``calibration.dataset`` that needs no tokenizer ([] for ``"builtin"``), in the lines a
    build reads (``sample_pool(num_samples)`` usable lines); with ``seq_len``, texts too large in bytes."""
    if ds == BUILTIN:
        return []
    data, problems = scan_user_dataset(ds, stop_after=sample_pool(num_samples), seq_len=seq_len)
    if data is not None:
        c = count_problem(data.path, len(data.texts), num_samples)
        problems += [c] if c else []
    return problems



def load_build_profile(profile_ref: str) -> Any:
    """``spec.profile.load_profile`` plus what depends on where the profile file is: a relative
    ``calibration.dataset`` becomes absolute against the profile file's folder (``invoke build``
    and ``invoke check`` both load profiles through this)."""
    from precision_pipeline.spec.profile import load_profile, resolve_profile_path

    return with_dataset_resolved(load_profile(profile_ref), resolve_profile_path(profile_ref))


__all__ = ["FIELD", "BUILTIN", "UserDataset", "scan_user_dataset", "count_problem", "dataset_problems",
           "with_dataset_resolved", "lines_msg", "MAX_USER_FILE_BYTES", "MAX_TOKEN_BYTES", "POOL_FACTOR", "sample_pool",
           "max_text_bytes", "load_build_profile"]
