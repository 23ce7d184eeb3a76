"""Artifact store: content hashing, atomic writes and directory swaps, and locks.

Every stage writes its artifact directory aside (``<dir>.tmp-<pid>``) and renames it into
place, so a crash mid-stage leaves the previous artifact intact. A stage's *content key* is
the sha256 of the strict canonical JSON of its inputs (``canonical``: unknown types are a
TypeError, never hashed by their ``str()``); the runner in ``core/stage.py`` computes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from filelock import FileLock

_CHUNK = 1 << 20


def canonical(obj: Any, where: str = "$") -> Any:
    """The strict canonical form of ``obj``: plain JSON values only, or ``TypeError``.

    Allowed: None, bool, int, finite float, str, list/tuple (-> list), dict with str keys,
    enums (-> their value), pydantic models (-> their fields, by name; a model with a
    ``canonical()`` method, such as ``core.fingerprint.Fingerprint``, is replaced by what that
    returns). Anything else -- a Path outside a Fingerprint, a set, bytes, NaN or infinity, an
    arbitrary object -- raises ``TypeError`` naming the path of the value (``$.inputs.model``),
    so nothing is ever hashed by its ``str()``.
    """
    from enum import Enum

    from pydantic import BaseModel

    if isinstance(obj, Enum):
        return canonical(obj.value, where)
    if obj is None or isinstance(obj, bool):
        return obj
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise TypeError(f"{where}: {obj!r} is not a finite float; keys hash only finite numbers")
        return obj
    if isinstance(obj, (list, tuple)):
        return [canonical(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: dict key {k!r} is a {type(k).__name__}, not a str")
            out[k] = canonical(v, f"{where}.{k}")
        return out
    if isinstance(obj, BaseModel):
        custom = getattr(obj, "canonical", None)
        if callable(custom):
            return canonical(custom(), where)
        return {name: canonical(getattr(obj, name), f"{where}.{name}") for name in type(obj).model_fields}
    raise TypeError(f"{where}: {type(obj).__module__}.{type(obj).__qualname__} is not a canonical type "
                    "(None, bool, int, finite float, str, list, dict with str keys, enum, pydantic model, "
                    "Fingerprint for paths)")


def canonical_json(obj: Any) -> str:
    """JSON of ``canonical(obj)`` with sorted keys and no whitespace variation (the form that is hashed).

    Raises TypeError for any value ``canonical`` refuses."""
    return json.dumps(canonical(obj), sort_keys=True, separators=(",", ":"), allow_nan=False)


def hash_obj(obj: Any) -> str:
    """sha256 hex digest of ``canonical_json(obj)`` (TypeError for non-canonical values)."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def hash_file(path: Path) -> str:
    """sha256 hex digest of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def hash_dir(path: Path, exclude: tuple[str, ...] = (), suffixes: tuple[str, ...] | None = None) -> str:
    """sha256 over the relative paths and contents of every regular file under ``path``.

    Files whose top-level name is in ``exclude`` are skipped; with ``suffixes`` only files
    whose name ends with one of them are hashed. Order-independent of the
    filesystem (paths are sorted).
    """
    path = Path(path)
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        rel = p.relative_to(path).as_posix()
        if rel.split("/")[0] in exclude or (suffixes is not None and not p.name.endswith(suffixes)):
            continue
        h.update(rel.encode() + b"\0")
        h.update(hash_file(p).encode())
    return h.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temp file in the same directory + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    """``atomic_write_text`` of ``obj`` as indented, key-sorted JSON."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


@contextlib.contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a fresh temporary directory; on success it replaces ``target`` atomically.

    On an exception the temporary directory is removed and ``target`` is left untouched.
    The old ``target`` is moved aside first and deleted only after the new one is in place.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def clean_stale(parent: Path) -> None:
    """Remove leftovers of interrupted atomic writes (``.NAME.tmp-*`` / ``.NAME.old-*``) in ``parent``."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    for p in parent.iterdir():
        if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()


@contextlib.contextmanager
def locked(path: Path, timeout_s: float = 600) -> Iterator[None]:
    """Hold an inter-process file lock at ``path`` (``filelock``) for the duration."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path), timeout=timeout_s):
        yield


def read_json(path: Path, default: Any = None) -> Any:
    """Parse JSON at ``path``; ``default`` when the file does not exist."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return default
