"""What makes a folder a build output, and which folders a build may write into (one home; read by
``pipeline``, ``engine.job`` and the tasks).

Whose folder: a build writes only into a new or empty ``--out``, or into one holding the marker
``.precision-build.json`` (``{"format": "precision-pipeline-build", "version": 1}``) that a build
wrote. Any other non-empty folder is refused (exit 2), whatever files it holds (a
``manifest.json`` or ``plan.json`` of a web project is not ours). An output of a pipeline version
from before the marker (``manifest.json`` with ``stages`` and ``.stages/``) is refused too, with
the fix to delete it or pick a new ``--out``: it cannot be told apart from a user's folder safely.

The output is locked while a build writes it (``output_lock``: ``.build.lock`` inside it, plus an
``flock`` on the output folder itself, so deleting ``.build.lock`` lets no second build in; a
writable ``--out`` in a read-only parent works).
"""

from __future__ import annotations

import errno
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.paths import REPO_ROOT
from precision_pipeline.core.store import atomic_write_json, locked, read_json_safe

OUTPUT_MARKER = ".precision-build.json"
"""The file that makes a folder a build output (written by the first build into it)."""
OUTPUT_FORMAT = "precision-pipeline-build"
OUTPUT_VERSION = 1


SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/run", "/sbin", "/sys", "/usr", "/var")
"""Top-level folders of the operating system (Filesystem Hierarchy Standard): never an output folder themselves."""
SYSTEM_TREES = ("/boot", "/dev", "/etc", "/proc", "/sys")
"""System folders no output is ever written under (configuration, kernel and device trees)."""


def refuse_filesystem_root(path: Path, field: str = "--out", what: str = "a build output") -> Path:
    """``path`` resolved, unless it is a filesystem root (``/``), one of ``SYSTEM_DIRS`` or inside one of
    ``SYSTEM_TREES`` (``/etc/x``): UserError (exit 2) on ``field`` then. A build (``--out``), the engine build
    Job and the nightly's output root (``OUT/<profile>/``, ``OUT/nightly/``) never write there (a nightly
    ``--out /etc`` built into /etc/fp8-h100: hostile s7 #37)."""
    from precision_pipeline.core.errors import UserError

    p = Path(path).expanduser().resolve()
    if p == Path(p.anchor):
        raise UserError(field, f"{p} is the filesystem root, not {what}.", f"give a folder for {what}, e.g. {field} artifacts.")
    tree = next((d for d in SYSTEM_TREES if p.is_relative_to(d)), None)
    if str(p) in SYSTEM_DIRS or tree:
        where = f"inside the system folder {tree}" if tree and str(p) != tree else "a system folder"
        raise UserError(field, f"{p} is {where}, not {what}.", f"give a folder for {what}, e.g. {field} artifacts.")
    return p


SERVING_MARKERS = ("releases.json", "ensemble/config.pbtxt")
"""Files that make a folder a serving repository's (``releases.json`` beside the model repository, written by
``serving/release_state.py``; ``ensemble/config.pbtxt`` in it, written by pack)."""


def refuse_serving_repository(path: Path, field: str = "--out", what: str = "an output root") -> Path:
    """``path`` resolved, unless it or a folder above it holds a serving repository (``SERVING_MARKERS``): UserError
    (exit 2, nothing written) on ``field``. Triton lists every folder of a model repository as a model, and
    retention and recovery own the folder beside it (hostile s12 F-R: ``nightly --out`` wrote fp8-h100/ and
    nightly/ into a live repository)."""
    from precision_pipeline.core.errors import UserError

    p = Path(path).expanduser().resolve()
    for d in (p, *p.parents):
        hit = next((m for m in SERVING_MARKERS if (d / m).is_file()), None)
        if hit:
            raise UserError(field, f"{p} is {'' if d == p else 'inside '}a serving repository ({d / hit} is there), not "
                            f"{what}: its folders would be listed as models, and retention owns it.",
                            f"give a folder outside it for {what}, e.g. {field} artifacts.")
    return p


def refuse_out_inside_inputs(out: Path, inputs: dict[str, Path | None], field: str = "--out") -> None:
    """UserError (exit 2, nothing written) on ``field`` when the build output ``out`` is one of the build's input
    folders or inside one (``inputs``: {flag: folder}, e.g. ``--model``, ``--checkpoint``): its files would become part
    of that input -- the model's content fingerprint covers every file under its folder, so every gated build of that
    model would stop being promotable and the per-model gate bar would no longer apply (hostile s16 H6)."""
    from precision_pipeline.core.errors import UserError

    o = Path(out).expanduser().resolve()
    for flag, folder in inputs.items():
        if folder is None:
            continue
        f = Path(folder).expanduser().resolve()
        if o == f or o.is_relative_to(f):
            raise UserError(field, f"{o} is {'' if o == f else 'inside '}the {flag} folder {f}: the build's files would "
                            f"become part of that input (the model's content fingerprint covers every file under its "
                            "folder, so every build judged on it would stop being promotable); nothing was written.",
                            f"give a folder outside {f}, e.g. {field} artifacts/<profile>.")


def read_output_marker(out: Path) -> dict | None:
    """The marker of build output ``out`` ({"format", "version", ...}), or None when it has none (or not ours)."""
    m = read_json_safe(Path(out) / OUTPUT_MARKER)
    return m if isinstance(m, dict) and m.get("format") == OUTPUT_FORMAT else None


def write_output_marker(out: Path, profile: str = "") -> None:
    """Mark ``out`` as a build output (``.precision-build.json``)."""
    atomic_write_json(Path(out) / OUTPUT_MARKER, {"format": OUTPUT_FORMAT, "version": OUTPUT_VERSION,
                                                  "created": time.time(), "profile": profile})


def default_out_dir(profile_name: str) -> Path:
    """``artifacts/<profile>`` under the repository: a build's output when ``--out`` is not given."""
    return REPO_ROOT / "artifacts" / profile_name


LOCK_FILE = ".build.lock"
"""The build lock, inside the output; its sidecar ``.build.lock.json`` names the holder (core.store.locked)."""
_OWN_FILES = (OUTPUT_MARKER, LOCK_FILE, LOCK_FILE + ".json")


def _looks_like_old_output(out: Path, folders: tuple[str, ...]) -> bool:
    m = read_json_safe(out / "manifest.json")
    return isinstance(m, dict) and isinstance(m.get("stages"), dict) and "profile" in m and (
        (out / ".stages").is_dir() or any((out / f).is_dir() for f in folders))


def validate_out_dir(out: Path, folders: tuple[str, ...] = ()) -> Path:
    """``--out``: new, empty, or a build output (its marker); ``folders``: the stage folders a build writes (an
    unmarked output of an old pipeline holds them). Returns it resolved; raises UserError otherwise (nothing written)."""
    out = Path(out).expanduser()
    field = "--out"
    try:
        refuse_filesystem_root(out, field)
        exists, is_dir = out.exists(), out.is_dir()
    except (OSError, ValueError) as e:  # hostile s15b F4: say why (a name over 255 bytes: ENAMETOOLONG)
        long = max((len(part.encode()) for part in out.parts), default=0)
        why = (f"a folder name of {long} bytes; names are at most 255" if getattr(e, "errno", None) == errno.ENAMETOOLONG
               and long > 255 else getattr(e, "strerror", None) or type(e).__name__)
        raise UserError(field, f"{str(out)[:200]!r} cannot be used ({why}).", "give a directory path.")
    refuse_serving_repository(out, field, "a build output")  # hostile s15 F11: <repo>/junk was accepted
    if exists and not is_dir:
        raise UserError(field, f"{out} exists and is not a directory.", "give a directory path.")
    if not exists:
        anc = out.parent
        while not anc.exists() and anc != anc.parent:
            anc = anc.parent
        if not anc.is_dir() or not os.access(anc, os.W_OK | os.X_OK):
            raise UserError(field, f"{out} does not exist and {anc} is not writable, so it cannot be created.",
                            "create the folder (writable) first, or give a path in a writable place.")
        return out.resolve()
    try:
        entries = [p.name for p in out.iterdir() if p.name not in _OWN_FILES]
    except OSError as e:
        raise UserError(field, f"{out} cannot be listed ({type(e).__name__}).", "give a readable, writable directory.")
    if not os.access(out, os.W_OK | os.X_OK):
        raise UserError(field, f"{out} is not writable.", "give a writable directory.")
    odd = next((out / n for n in _OWN_FILES if (out / n).exists() and not (out / n).is_file()), None)
    if odd is not None:  # a folder named .precision-build.json: the build's atomic replace of it failed (a traceback)
        raise UserError(field, f"{odd} is not a regular file ({'a folder' if odd.is_dir() else 'a special file'}); a "
                        "build writes that name itself.", f"remove it if it is not yours (rm -r {odd}), or give another --out.")
    marker = read_json_safe(out / OUTPUT_MARKER)
    if isinstance(marker, dict) and marker.get("format") == OUTPUT_FORMAT:
        v = marker.get("version")
        if not isinstance(v, int) or isinstance(v, bool) or v > OUTPUT_VERSION:
            raise UserError(field, f"{out} is a build output of format version {v!r}; this pipeline writes version "
                            f"{OUTPUT_VERSION}.", "use the pipeline version that wrote it, or give a new --out.")
        return out.resolve()
    if not entries:
        return out.resolve()
    shown = ", ".join(sorted(entries)[:5]) + (f" (+{len(entries) - 5} more)" if len(entries) > 5 else "")
    if (out / OUTPUT_MARKER).is_file() and _looks_like_old_output(out, folders):
        # hostile s15b F5: a damaged marker beside intact stage records read as "missing", fix `rm -r` the output
        raise UserError(field, f"{out / OUTPUT_MARKER} is damaged (not the JSON object a build writes) beside a "
                        "build's stage records.", f"if {out} is a build output of this pipeline, rewrite the marker: "
                        f"`printf '{{\"format\": \"{OUTPUT_FORMAT}\", \"version\": {OUTPUT_VERSION}}}' > "
                        f"{out / OUTPUT_MARKER}`, then build again (every stage still right is reused); else give a new --out.")
    if _looks_like_old_output(out, folders):
        raise UserError(field, f"{out} looks like the output of a build from before output folders were marked "
                        f"({OUTPUT_MARKER} is missing), and this pipeline does not take over unmarked folders: "
                        "it cannot tell them from a folder of yours.",
                        f"delete it yourself (rm -r {out}) and build again, or give a new --out.")
    raise UserError(field, f"{out} is not empty ({shown}) and is not a build output (no {OUTPUT_MARKER}); "
                    "a build replaces its stage folders, so its files would be lost.",
                    "give a new or empty directory, or a previous build's output folder.")


SERVING_PATH_RE = re.compile(r"^[A-Za-z0-9/._+@:,=~-]+$")
"""Characters a build output (and ``--repo-root``) may have in its path. The packed Triton repository names
its files by this path (``gpt_model_path``, ``tokenizer_dir``, the Python models' folders), and Triton's
Python backend starts each stub as ``execvp("bash", {"bash", "-c", " exec <stub> <model_path> ..."})`` with the
paths joined by spaces, unquoted (triton-inference-server/python_backend ``src/stub_launcher.cc``,
``StubLauncher::Launch``), so a space splits the model path and the stub never starts: ``serve`` waits for
ever. Shell characters break the same command line; non-ASCII names are refused as well (a traceback before)."""


NAME_MAX = 255
"""Longest path component on Linux file systems, in bytes (linux/limits.h NAME_MAX)."""
SERVING_PATH_MAX = 1024
"""Longest build output or serving repository path accepted, in bytes: the configs append unit, version and file
names (``/tensorrt_llm_<h12>/1/engine/rank0.engine``) and the backend opens them, all within Linux's PATH_MAX of 4096
(linux/limits.h); 1024 leaves room."""


def path_length_problem(path: str) -> str | None:
    """Why ``path`` is too long for a build output or serving repository (more than ``SERVING_PATH_MAX`` bytes, or a
    part of more than ``NAME_MAX`` bytes, which every file call on it refuses with ENAMETOOLONG), or None."""
    n = len(path.encode("utf-8", "surrogateescape"))
    longest = max((len(c.encode("utf-8", "surrogateescape")) for c in path.split("/")), default=0)
    if longest > NAME_MAX:
        return (f"{path[:60]!r}... has a folder name of {longest} bytes; Linux allows at most {NAME_MAX} "
                "(NAME_MAX), so no file below it can be opened")
    if n > SERVING_PATH_MAX:
        return (f"{path[:60]!r}... is {n} bytes long; at most {SERVING_PATH_MAX} leave room for the unit files the "
                "server opens below it within Linux's PATH_MAX of 4096")
    return None


def serving_path_problem(path: str) -> str | None:
    """Why ``path`` cannot hold a servable build (``SERVING_PATH_RE``, naming the first bad character, or
    ``path_length_problem``); None if fine."""
    if SERVING_PATH_RE.match(path):
        return path_length_problem(path)
    bad = next((c for c in path if not SERVING_PATH_RE.match(c)), " ")
    what = ("a space" if bad == " " else "whitespace" if bad.isspace() else
            f"the non-ASCII character {bad!r} (U+{ord(bad):04X})" if not bad.isascii() else f"the character {bad!r}")
    return (f"{path[:200]!r} contains {what}. Triton's Python backend starts its stubs through a shell command "
            "line with the model paths unquoted, so the served repository would never become ready")


SERVING_PATH_CHARS = "ASCII letters, digits and / . _ - + @ : , = ~"


def check_serving_path(path: Path | str, field: str, fix: Optional[str] = None) -> None:
    """UserError on ``field`` when ``path`` cannot hold a servable build (``serving_path_problem``); ``fix``
    replaces the build's fix (a new --out)."""
    why = serving_path_problem(str(path))
    if why:
        raise UserError(field, why + ".", fix or f"build into a path of {SERVING_PATH_CHARS} "
                        "(e.g. --out artifacts/my-build), or move the checkout to such a path.")


def say(message: str) -> None:
    """A progress line on stderr."""
    print(message, file=sys.stderr, flush=True)


def output_lock(out_dir: Path, what: str, wait: bool = True, on_wait: Optional[Callable[[str], None]] = None):
    """The build lock of output ``out_dir`` (a context manager): ``.build.lock`` (its sidecar names the holder)
    plus an ``flock`` on ``out_dir`` itself (``core.store.locked(folder_lock=True)``), so deleting
    ``.build.lock`` during a build lets no second build in. ``wait``: False refuses at once (UserError on
    ``--out`` naming the holder)."""
    return locked(Path(out_dir) / LOCK_FILE, timeout_s=None if wait else 0, what=what, field="--out",
                  on_wait=on_wait or say, folder_lock=True,
                  busy_fix="wait for that build to finish (leave out --no-wait to wait for it), or give another --out.")


__all__ = ["OUTPUT_MARKER", "OUTPUT_FORMAT", "OUTPUT_VERSION", "read_output_marker", "refuse_filesystem_root", "write_output_marker",
           "default_out_dir", "LOCK_FILE", "validate_out_dir", "SERVING_PATH_RE", "SERVING_PATH_CHARS", "serving_path_problem",
           "check_serving_path", "path_length_problem", "NAME_MAX", "SERVING_PATH_MAX", "output_lock", "say"]
