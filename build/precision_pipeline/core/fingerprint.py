"""One content-fingerprint policy for files and folders (models, checkpoints, data files).

A ``Fingerprint`` is what a stage key may hold for something on disk: the sha256 of its
content. Its ``path`` says where the content is (stages need it to read the files) but is
never hashed, so the same model in two folders has the same fingerprint.

``fingerprint(path)`` is a full sha256 over every regular file (relative POSIX path + the
file's own sha256, in sorted order; the same digest as ``store.hash_dir``). Each file's sha256
is memoized by (absolute path, size, mtime_ns) in ``<cache dir>/fingerprints.json``
(``precision_pipeline.core.paths.cache_dir()``, i.e. ``$PRECISION_CACHE_DIR`` or
``<repo>/.cache``), so an unchanged 140 GB model is read once, and later builds only ``stat``
its files. A file rewritten in place keeps its path but changes size or mtime_ns, so it is
rehashed. Errors: ``FileNotFoundError`` when ``path`` does not exist.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from precision_pipeline.core.store import atomic_write_text, hash_file, locked

MEMO_FILE = "fingerprints.json"
MEMO_VERSION = 1


class Fingerprint(BaseModel):
    """Content identity of a file or folder: ``sha256`` goes into keys, ``path`` never does."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="hex sha256 of the content (see module doc)")
    path: Path = Field(description="where the content is; not part of any key")

    def canonical(self) -> dict[str, str]:
        """The part of a Fingerprint that keys see."""
        return {"sha256": self.sha256}


def _memo_path() -> Path:
    from precision_pipeline.core.paths import cache_dir

    return cache_dir() / MEMO_FILE


def _load_memo(path: Path) -> dict[str, list]:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != MEMO_VERSION or not isinstance(data.get("files"), dict):
        return {}
    return data["files"]


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"{root} does not exist")
    return sorted(q for q in root.rglob("*") if q.is_file())


def file_digests(root: Path, memo: bool = True) -> dict[str, str]:
    """{relative POSIX path: sha256} for every regular file under ``root`` (``root`` itself if a file)."""
    root = Path(root).absolute()
    files = _files(root)
    memo_path = _memo_path() if memo else None
    table = _load_memo(memo_path) if memo_path else {}
    out: dict[str, str] = {}
    changed = False
    for p in files:
        st = p.stat()
        ident = str(p.resolve())
        row = table.get(ident)
        if isinstance(row, list) and len(row) == 3 and row[0] == st.st_size and row[1] == st.st_mtime_ns:
            digest = row[2]
        else:
            digest = hash_file(p)
            table[ident] = [st.st_size, st.st_mtime_ns, digest]
            changed = True
        out[p.name if p == root else p.relative_to(root).as_posix()] = digest
    if memo_path is not None and changed:
        with locked(memo_path.parent / f".{MEMO_FILE}.lock"):
            merged = {**_load_memo(memo_path), **table}
            atomic_write_text(memo_path, json.dumps({"version": MEMO_VERSION, "files": merged}, sort_keys=True) + "\n")
    return out


def digest_of(digests: dict[str, str]) -> str:
    """sha256 over sorted (relative path NUL file sha256) pairs (= ``store.hash_dir`` of the folder)."""
    h = hashlib.sha256()
    for rel in sorted(digests):
        h.update(rel.encode() + b"\0")
        h.update(digests[rel].encode())
    return h.hexdigest()


def fingerprint(path: Path | str, memo: bool = True) -> Fingerprint:
    """Full-content ``Fingerprint`` of a file or folder (memoized per file; see module doc)."""
    p = Path(path)
    return Fingerprint(sha256=digest_of(file_digests(p, memo=memo)), path=p.absolute())


def model_fingerprint(model_dir: Path | str) -> Fingerprint:
    """The fingerprint of a Hugging Face model folder: every file's full sha256 (memoized).

    The one policy for models: the pipeline's quantize/gate keys, the gate's reference cache,
    the sensitivity cache and the test checkpoints' cache key all use it.
    """
    return fingerprint(model_dir)


__all__ = ["Fingerprint", "fingerprint", "model_fingerprint", "file_digests", "digest_of", "MEMO_FILE"]

