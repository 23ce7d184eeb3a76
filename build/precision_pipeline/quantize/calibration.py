"""Calibration set for post-training quantization: real text, stratified, deterministic.

Builtin set (``calibration.dataset: builtin``), three *kinds* of real text shipped in packages
(nothing is downloaded, no random tokens):

* ``news`` -- the 300 Lee news articles of the gensim wheel,
  ``gensim/test/test_data/lee_background.cor`` (one article per line, UTF-8). gensim is
  installed with ``--no-deps`` and never imported: the folder comes from
  ``importlib.util.find_spec("gensim").submodule_search_locations[0]``. The 50 other articles of
  ``lee.cor`` are HELD OUT for the gate's perplexity (``heldout_news_texts``) and are never
  used for calibration.
* ``docs`` -- English technical prose: Python's language-reference topics,
  ``pydoc_data/topics.py`` (``from pydoc_data.topics import topics``, a dict of strings).
* ``code`` -- Python source: ``*.py`` files of the standard library
  (``sysconfig.get_paths()["stdlib"]``, ``site-packages`` excluded), listed sorted, chosen
  with the seed. The files differ between Python versions, so ``composition`` records the
  Python version and the chosen files.

Strata: kind (news / docs / code) x length (short / medium / long). The token length of a
sample in each length stratum is fixed relative to ``calibration.seq_len``:

* short  = ``max(8, seq_len // 4)`` tokens
* medium = ``max(8, seq_len // 2)`` tokens
* long   = ``seq_len`` tokens

``num_samples`` is spread over the 9 strata as evenly as possible (``num_samples // 9`` each;
the remainder goes to strata in a seed-shuffled order). Each sample is a window of the exact
stratum length cut from one document, starting at a line start (news articles and docs topics
start at the document start or a seed-chosen line; code at a seed-chosen line). When a document
is too short, the following documents of the same kind are appended (joined by a blank line),
so every stratum can be filled for any ``seq_len``. Same (seed, num_samples, seq_len,
tokenizer, Python version) -> identical token ids (``composition["sha256"]``).

Encoding (decided here, to be used alike by calibration, the gate and serving of raw text):
text is encoded as RAW text, ``tokenizer(text, add_special_tokens=False)`` -- no BOS. The
GGUF-converted SmolLM2 tokenizer has ``add_bos_token: true`` with ``<|im_start|>`` as its BOS
(checked: ``tok("Hello world").input_ids == [1, 19556, 905]``, ``1 = <|im_start|>``), but
``<|im_start|>`` is the chat-turn marker, not a document start; the original SmolLM2 tokenizer
prepends nothing to plain text. ``encode_raw`` is the one function that does this.

User set (``calibration.dataset: <path>``): a JSONL file, one ``{"text": "..."}`` object per
line, read by ``resolve/dataset.py`` (the same reader the ``calibration.dataset`` resolve rule uses,
so ``invoke check`` refuses what the build would; a relative path is relative to the profile's
folder). Refused with ``UserError("calibration.dataset", ...)`` naming line numbers: invalid JSON,
a line that is not an object with a string ``text``, blank lines or blank texts, texts longer
than ``seq_len`` tokens (never silently truncated; texts of more than ``seq_len x MAX_TOKEN_BYTES``
bytes are refused before they are tokenized), fewer usable lines than ``num_samples``. Only the first
``sample_pool(num_samples)`` = 4 x ``num_samples`` usable lines are read; the seed chooses
``num_samples`` of them (kept in file order).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from precision_pipeline.core.errors import Problem, UserError
from precision_pipeline.resolve.dataset import (MAX_USER_FILE_BYTES, count_problem, lines_msg,  # noqa: F401
                                                sample_pool, scan_user_dataset)

KINDS = ("news", "docs", "code")
LENGTHS = ("short", "medium", "long")
FIELD = "calibration.dataset"

NEWS_FILE = "test/test_data/lee_background.cor"
HELDOUT_NEWS_FILE = "test/test_data/lee.cor"


@dataclass
class CalibrationSet:
    """Token-id samples plus a description of where they came from.

    ``samples``: list of ``num_samples`` lists of token ids (ints in ``[0, vocab)``), lengths as
    the strata say (builtin) or each text's own length (user JSONL).
    ``composition``: ``{"dataset", "sources", "strata": {"news/short": n, ...},
    "stratum_tokens": {...}, "lengths": {"short": 64, ...}, "num_samples", "total_tokens",
    "min_len", "max_len", "seed", "seq_len", "encoding", "sha256"}`` (sha256 of the canonical
    JSON of ``samples``).
    """

    samples: list[list[int]]
    composition: dict[str, Any] = field(default_factory=dict)
    kinds: list[str] = field(default_factory=list)  # per sample: "news/short", ... or "user/<len-stratum>"

    @property
    def total_tokens(self) -> int:
        return sum(len(s) for s in self.samples)

    def batches(self, batch_size: int) -> list[list[list[int]]]:
        """Samples grouped into batches of equal length (no padding needed), at most
        ``batch_size`` each, in a deterministic order (by length, then sample index)."""
        by_len: dict[int, list[list[int]]] = {}
        for s in self.samples:
            by_len.setdefault(len(s), []).append(s)
        out = []
        for n in sorted(by_len):
            group = by_len[n]
            for i in range(0, len(group), batch_size):
                out.append(group[i:i + batch_size])
        return out


# --------------------------------------------------------------------------------------------
# Encoding


def encode_raw(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as raw text: ``tokenizer(text, add_special_tokens=False)`` (no BOS).

    See the module docstring for why no ``<|im_start|>`` BOS is prepended.
    """
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stratum_lengths(seq_len: int) -> dict[str, int]:
    """Token length of each length stratum: short seq_len//4, medium seq_len//2, long seq_len (>= 8)."""
    return {"short": max(8, seq_len // 4), "medium": max(8, seq_len // 2), "long": seq_len}


def length_stratum(n_tokens: int, seq_len: int) -> str:
    """Stratum of a sample of ``n_tokens`` (user data): short <= seq_len/4 < medium <= seq_len/2 < long."""
    if n_tokens * 4 <= seq_len:
        return "short"
    if n_tokens * 2 <= seq_len:
        return "medium"
    return "long"


# --------------------------------------------------------------------------------------------
# Sources


def _gensim_dir() -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(FIELD, "the builtin calibration set needs the gensim wheel's news articles, "
                        "but package gensim is not installed.",
                        "run the set-up script (pip install --no-deps gensim==4.3.3), or give a JSONL path.")
    return Path(list(spec.submodule_search_locations)[0])


def _read_articles(rel: str) -> list[str]:
    path = _gensim_dir() / rel
    if not path.is_file():
        raise UserError(FIELD, f"{path} is missing from the gensim wheel.", "reinstall gensim==4.3.3 --no-deps.")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:  # lee.cor is cp1252 (0xa3 = pound sign)
        text = raw.decode("cp1252", errors="replace")
    return [line.strip() for line in text.splitlines() if line.strip()]


def news_texts() -> list[str]:
    """The 300 calibration news articles (``lee_background.cor``), in file order."""
    return _read_articles(NEWS_FILE)


def heldout_news_texts() -> list[str]:
    """The 50 held-out news articles of gensim's ``test/test_data/lee.cor`` (for the gate's
    perplexity), in file order. Never used for calibration. Decoded as UTF-8, or cp1252 where
    the bytes are not UTF-8 (``lee.cor`` holds a cp1252 pound sign)."""
    return _read_articles(HELDOUT_NEWS_FILE)


def docs_texts() -> list[str]:
    """Python language-reference prose: the values of ``pydoc_data.topics.topics``, sorted by key."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics) if topics[k].strip()]


def stdlib_files() -> list[Path]:
    """``*.py`` files of the standard library (site-packages excluded, 1 KB..256 KB), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root).parts
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        try:
            size = p.stat().st_size
        except OSError:
            continue
        if 1024 <= size <= 256 * 1024:
            out.append(p)
    return sorted(out, key=lambda q: q.relative_to(root).as_posix())


# --------------------------------------------------------------------------------------------
# Builtin set


def _allocate(num_samples: int, rng: random.Random) -> dict[tuple[str, str], int]:
    strata = [(k, l) for k in KINDS for l in LENGTHS]
    base, rem = divmod(num_samples, len(strata))
    counts = {s: base for s in strata}
    order = list(strata)
    rng.shuffle(order)
    for s in order[:rem]:
        counts[s] += 1
    return counts


def _window(tokenizer: Any, docs: Sequence[str], doc_idx: int, length: int, rng: random.Random,
            from_start: bool) -> list[int] | None:
    """``length`` tokens starting at a line start of ``docs[doc_idx]`` (following docs appended)."""
    lines = docs[doc_idx].split("\n")
    start_line = 0
    if not from_start and len(lines) > 1:
        start_line = rng.randrange(len(lines))
        # start on a non-blank line
        while start_line < len(lines) - 1 and not lines[start_line].strip():
            start_line += 1
    text = "\n".join(lines[start_line:]).lstrip("\n")
    budget = length * 12  # characters: generous bound (>= 12 chars/token is never needed)
    j = doc_idx + 1
    while len(text) < budget and j < doc_idx + 64 and j < len(docs):
        text += "\n\n" + docs[j]
        j += 1
    ids = encode_raw(tokenizer, text[:budget])
    if len(ids) < length + 1:  # +1: the last token may be cut mid-word by the character bound
        return None
    return ids[:length]


def _builtin_set(tokenizer: Any, num_samples: int, seq_len: int, seed: int,
                 progress: Callable[[int], None] | None = None) -> CalibrationSet:
    rng = random.Random(f"calibration:{seed}")
    counts = _allocate(num_samples, rng)
    lens = stratum_lengths(seq_len)
    news = news_texts()
    docs = docs_texts()
    files = stdlib_files()
    stdlib_root = Path(sysconfig.get_paths()["stdlib"])
    sources: dict[str, Any] = {
        "news": {"file": "gensim/" + NEWS_FILE, "articles_available": len(news), "used": []},
        "docs": {"file": "pydoc_data/topics.py", "topics_available": len(docs), "used": []},
        "code": {"root": "stdlib", "python": sys.version.split()[0], "files_available": len(files), "used": []},
        "heldout_excluded": "gensim/" + HELDOUT_NEWS_FILE,
    }
    topic_keys = None
    samples: list[list[int]] = []
    kinds: list[str] = []
    strata_out: dict[str, int] = {}
    stratum_tokens: dict[str, int] = {}
    for kind in KINDS:
        # each kind draws documents without replacement (seeded order); long strata first so the
        # longest windows get the first choice
        if kind == "news":
            pool: Sequence[Any] = news
        elif kind == "docs":
            pool = docs
        else:
            pool = files
        order = list(range(len(pool)))
        krng = random.Random(f"calibration:{seed}:{kind}")
        krng.shuffle(order)
        cursor = 0
        for length_name in LENGTHS:
            n = counts[(kind, length_name)]
            L = lens[length_name]
            got = 0
            tries = 0
            while got < n:
                if tries > 4 * len(pool) + 16:
                    raise UserError("calibration.seq_len", f"cannot cut {n} windows of {L} tokens of kind "
                                    f"{kind!r} from the builtin texts.", "lower calibration.seq_len or num_samples.")
                idx = order[cursor % len(pool)]
                cursor += 1
                tries += 1
                if kind == "code":
                    try:
                        text = files[idx].read_text(encoding="utf-8")
                    except (UnicodeDecodeError, OSError):
                        continue
                    ids = _window(tokenizer, [text], 0, L, krng, from_start=False)
                    label = files[idx].relative_to(stdlib_root).as_posix()
                else:
                    # news: whole articles from their start (one article per line);
                    # docs: a topic from its start or a seeded line
                    ids = _window(tokenizer, pool, idx, L, krng, from_start=(kind == "news"))
                    if kind == "docs":
                        if topic_keys is None:
                            from pydoc_data.topics import topics
                            topic_keys = [k for k in sorted(topics) if topics[k].strip()]
                        label = topic_keys[idx]
                    else:
                        label = idx
                if ids is None:
                    continue
                samples.append(ids)
                kinds.append(f"{kind}/{length_name}")
                sources[kind]["used"].append(label)
                got += 1
                if progress is not None:
                    progress(1)
            strata_out[f"{kind}/{length_name}"] = got
            stratum_tokens[f"{kind}/{length_name}"] = got * L
    comp = {
        "dataset": "builtin",
        "sources": sources,
        "strata": strata_out,
        "stratum_tokens": stratum_tokens,
        "lengths": lens,
    }
    return _finish(samples, kinds, comp, seed, seq_len)


def _finish(samples: list[list[int]], kinds: list[str], comp: dict, seed: int, seq_len: int) -> CalibrationSet:
    comp = dict(comp)
    comp.update({
        "num_samples": len(samples),
        "total_tokens": sum(len(s) for s in samples),
        "min_len": min((len(s) for s in samples), default=0),
        "max_len": max((len(s) for s in samples), default=0),
        "seed": seed,
        "seq_len": seq_len,
        "encoding": "raw text, add_special_tokens=False (no BOS)",
        "sha256": token_sha256(samples),
    })
    return CalibrationSet(samples=samples, composition=comp, kinds=kinds)


def token_sha256(samples: Iterable[Sequence[int]]) -> str:
    """sha256 hex of the canonical JSON of the token-id lists (``[[1,2],[3]]``, no spaces)."""
    return hashlib.sha256(json.dumps([list(map(int, s)) for s in samples], separators=(",", ":")).encode()).hexdigest()


# --------------------------------------------------------------------------------------------
# User JSONL


def _user_set(tokenizer: Any, path_str: str, num_samples: int, seq_len: int, seed: int,
              say: Callable[[str], None] | None = None) -> CalibrationSet:
    # the file and its lines are checked by the one reader the resolve rule uses (resolve/dataset.py), which
    # reads only the first sample_pool(num_samples) usable lines and refuses texts too large in bytes before
    # any is tokenized; what needs the tokenizer (texts longer than seq_len tokens) is checked here
    data, problems = scan_user_dataset(path_str, stop_after=sample_pool(num_samples), seq_len=seq_len, say=say)
    if data is None:
        raise UserError(problems)
    path = data.path
    encoded: list[tuple[int, list[int]]] = []
    too_long: list[tuple[int, int]] = []
    t_last = time.monotonic()
    for i, (no, text) in enumerate(data.texts):
        if say is not None and time.monotonic() - t_last >= 2.0:
            t_last = time.monotonic()
            say(f"[calibration] tokenizing {path}: text {i:,} of {len(data.texts):,}")
        ids = encode_raw(tokenizer, text)
        if len(ids) > seq_len:
            too_long.append((no, len(ids)))
        encoded.append((no, ids))
    if too_long:
        shown = ", ".join(f"line {n} ({t:,} tokens)" for n, t in too_long[:20]) + (
            f" (and {len(too_long) - 20} more)" if len(too_long) > 20 else "")
        problems.append(Problem(FIELD, f"{path}: {shown} {'are' if len(too_long) > 1 else 'is'} longer than "
                                f"calibration.seq_len = {seq_len} tokens (texts are never truncated).",
                                "split those texts, or raise calibration.seq_len."))
    count = count_problem(path, len(encoded) - len(too_long), num_samples)
    if count is not None:
        problems.append(count)
    if problems:
        raise UserError(problems)
    rng = random.Random(f"calibration-user:{seed}")
    chosen = sorted(rng.sample(range(len(encoded)), num_samples))
    samples = [encoded[i][1] for i in chosen]
    kinds = [f"user/{length_stratum(len(s), seq_len)}" for s in samples]
    strata: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for k, s in zip(kinds, samples):
        strata[k] = strata.get(k, 0) + 1
        tokens[k] = tokens.get(k, 0) + len(s)
    comp = {
        "dataset": str(path),
        "sources": {"user": {"file": str(path), "sha256": data.sha256,
                             "lines": data.lines, "lines_used": [encoded[i][0] for i in chosen]}},
        "strata": strata,
        "stratum_tokens": tokens,
        "lengths": stratum_lengths(seq_len),
    }
    return _finish(samples, kinds, comp, seed, seq_len)


# --------------------------------------------------------------------------------------------
# Entry point


def load_tokenizer(model_dir: Path) -> Any:
    """The HF tokenizer of ``model_dir`` (``AutoTokenizer``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def build_calibration_set(calibration: Any, tokenizer: Any,
                          progress: Callable[[int], None] | None = None,
                          say: Callable[[str], None] | None = None) -> CalibrationSet:
    """The calibration set the profile's ``calibration`` section asks for.

    ``calibration``: ``precision_pipeline.spec.profile.Calibration`` (dataset, num_samples, seq_len, seed).
    ``tokenizer``: an HF tokenizer (or a model folder ``Path``). Returns ``CalibrationSet``.
    Raises ``UserError`` (field ``calibration.dataset``) for a bad user JSONL, a missing file or
    missing builtin sources. ``say(message)``: progress lines while a user dataset is read and tokenized.
    """
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(Path(tokenizer))
    ds = calibration.dataset
    if ds == "builtin":
        return _builtin_set(tokenizer, calibration.num_samples, calibration.seq_len, calibration.seed, progress)
    return _user_set(tokenizer, ds, calibration.num_samples, calibration.seq_len, calibration.seed, say)


__all__ = [
    "CalibrationSet", "build_calibration_set", "encode_raw", "heldout_news_texts", "news_texts",
    "docs_texts", "stdlib_files", "stratum_lengths", "length_stratum", "token_sha256", "load_tokenizer",
]
