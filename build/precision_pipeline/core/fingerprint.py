"""One content-fingerprint policy for files and folders (models, checkpoints, data files).

A ``Fingerprint`` is what a stage key may hold for something on disk: the sha256 of its
content. Its ``path`` says where the content is (stages need it to read the files) but is
never hashed, so the same model in two folders has the same fingerprint.

``fingerprint(path)`` is a full sha256 over every regular file (relative POSIX path + the
file's own sha256, in sorted order; the same digest as ``store.hash_dir``). Each file's sha256
is memoized in ``<cache dir>/fingerprints.json`` (``precision_pipeline.core.paths.cache_dir()``,
i.e. ``$PRECISION_CACHE_DIR`` or ``<repo>/.cache``), so an unchanged 140 GB model is read once.
A memo row is trusted only when the file's size, mtime_ns, ctime_ns and inode are what they were
*and* its ``sample_digest`` (16 blocks of 64 KiB spread over the file, ~1 MiB read) is unchanged:
a file rewritten in place with its size and mtime put back (``touch -r``) still changes its ctime,
which no user can set, and the sample is a second, content-level guard. Any miss rehashes the file.

``model_fingerprint(model_dir)`` covers only the files a Hugging Face loader reads (``LOADER_FILES``):
a README.md, a LICENSE or a .git folder added to the model folder changes no key.

``inventory(folder)`` / ``inventory_problem(folder, inv)``: {file: [size, sample_digest, mtime_ns]} of a
stage's output, stored in its record and checked on every cache hit (``core.stage``), so a checkpoint
truncated or rewritten after its build is never reused as what the record says: the sample catches a
rewrite with the size kept, the modification time a one-byte edit between the sampled blocks (``dd
conv=notrunc``; hostile s16b F7). The change time is not used: pack hard-links a build's checkpoint into its
unit, which changes the checkpoint files' ctime but not their content or mtime.
Errors: ``FileNotFoundError`` when ``path`` does not exist.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

from precision_pipeline.core.store import atomic_write_text, hash_file, locked

MEMO_FILE = "fingerprints.json"
MEMO_VERSION = 2  # 2: rows [size, mtime_ns, ctime_ns, inode, sample, sha256]


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


SAMPLE_BLOCK = 64 * 1024
SAMPLE_BLOCKS = 16


def sample_digest(path: Path, size: Optional[int] = None) -> str:
    """sha256 of a file's size and a content sample: the whole file up to ``SAMPLE_BLOCKS`` x ``SAMPLE_BLOCK``
    bytes (1 MiB), else ``SAMPLE_BLOCKS`` blocks of ``SAMPLE_BLOCK`` bytes at evenly spaced offsets from the
    first byte to the last block (so the header and the tail are always in it). Reads at most 1 MiB."""
    size = os.stat(path).st_size if size is None else size
    h = hashlib.sha256(str(size).encode() + b"\0")
    with open(path, "rb") as f:
        if size <= SAMPLE_BLOCK * SAMPLE_BLOCKS:
            h.update(f.read())
        else:
            last = size - SAMPLE_BLOCK
            for i in range(SAMPLE_BLOCKS):
                f.seek(last * i // (SAMPLE_BLOCKS - 1))
                h.update(f.read(SAMPLE_BLOCK))
    return h.hexdigest()


def inventory(folder: Path, skip_suffixes: tuple[str, ...] = ()) -> dict[str, list]:
    """{relative POSIX path: [size in bytes, sample_digest, st_mtime_ns]} of every regular file under ``folder``,
    except names ending with one of ``skip_suffixes``. What a stage record vouches for (``inventory_problem``)."""
    folder = Path(folder)
    out: dict[str, list] = {}
    for p in _files(folder):
        if skip_suffixes and p.name.endswith(skip_suffixes):
            continue
        st = p.stat()
        out[p.relative_to(folder).as_posix()] = [st.st_size, sample_digest(p, st.st_size), st.st_mtime_ns]
    return out


def inventory_problem(folder: Path, expected: Any, skip_suffixes: tuple[str, ...] = ()) -> Optional[str]:
    """Why ``folder`` is not what ``expected`` (an ``inventory``) describes, or None when every file is there
    with its size, sample and modification time (rows of an older record hold no time: not compared) and no other
    file was added. Never raises (an unreadable folder is a problem)."""
    if not isinstance(expected, dict):
        return "its record holds no inventory of the files"
    try:
        now = inventory(folder, skip_suffixes)
    except OSError as e:
        return f"{folder} cannot be read ({e.strerror or e})"
    for rel, row in sorted(expected.items()):
        got = now.get(rel)
        if got is None:
            return f"{rel} is missing"
        if not isinstance(row, list) or len(row) not in (2, 3) or got[0] != row[0]:
            return f"{rel} is {got[0]:,} bytes, its record says {row[0] if isinstance(row, list) and row else '?'}"
        if got[1] != row[1]:
            return f"{rel} changed after it was written (its content sample differs)"
        if len(row) == 3 and got[2] != row[2]:
            return (f"{rel} was modified after it was written (its modification time differs from the record's; a "
                    "copy of a build output keeps the times with cp -a or rsync -a)")
    extra = sorted(set(now) - set(expected))
    if extra:
        return f"{extra[0]} was added after the stage wrote the folder"
    return None


LOADER_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                "tokenizer.json", "tokenizer.*.json", "tokenizer_config.json", "special_tokens_map.json",
                "added_tokens.json", "*.model", "*.tiktoken", "vocab.json", "vocab.txt", "merges.txt",
                "chat_template.jinja", "chat_template.json", "additional_chat_templates/*.jinja", "*.py")
"""The files of a Hugging Face model folder that the loaders read (fnmatch on the relative POSIX path):
``transformers/utils/__init__.py`` CONFIG_NAME, GENERATION_CONFIG_NAME, SAFE_WEIGHTS_NAME,
SAFE_WEIGHTS_INDEX_NAME (sharded ``model-0000x-of-0000y.safetensors``), CHAT_TEMPLATE_FILE / CHAT_TEMPLATE_DIR;
``transformers/tokenization_utils_base.py`` FULL_TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE,
ADDED_TOKENS_FILE; the tokenizers' VOCAB_FILES_NAMES (``tokenizer.model``, ``vocab.json``, ``merges.txt``,
``vocab.txt``, ``*.tiktoken``); ``*.py`` for models with their own code. A TensorRT-LLM checkpoint's
``config.json`` + ``rank*.safetensors`` match too. Anything else (README.md, LICENSE, .git/, images) is
documentation and goes into no key."""


def loader_files(root: Path) -> list[Path]:
    """The files under ``root`` that ``LOADER_FILES`` names (sorted)."""
    root = Path(root)
    return [p for p in _files(root)
            if any(fnmatch.fnmatchcase(p.relative_to(root).as_posix(), pat) for pat in LOADER_FILES)]


def file_digests(root: Path, memo: bool = True, files: Optional[list[Path]] = None) -> dict[str, str]:
    """{relative POSIX path: sha256} for every regular file under ``root`` (``root`` itself if a file);
    ``files``: only these (paths under ``root``)."""
    root = Path(root).absolute()
    files = _files(root) if files is None else [Path(f).absolute() for f in files]
    memo_path = _memo_path() if memo else None
    table = _load_memo(memo_path) if memo_path else {}
    out: dict[str, str] = {}
    changed = False
    for p in files:
        st = p.stat()
        ident = str(p.resolve())
        row = table.get(ident)
        head = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        sample = sample_digest(p, st.st_size)
        if isinstance(row, list) and len(row) == 6 and row[:4] == head and row[4] == sample:
            digest = row[5]
        else:
            digest = hash_file(p)
            table[ident] = [*head, sample, digest]
            changed = True
        out[p.name if p == root else p.relative_to(root).as_posix()] = digest
    if memo_path is not None and changed:
        try:  # the memo is a cache: a full disk or a file-size limit (ulimit -f) while writing it costs a re-hash next
            # time, never the build (the atomic write leaves the previous memo intact)
            with locked(memo_path.parent / f".{MEMO_FILE}.lock"):
                merged = {**_load_memo(memo_path), **table}
                atomic_write_text(memo_path, json.dumps({"version": MEMO_VERSION, "files": merged}, sort_keys=True) + "\n")
        except OSError:
            pass
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
    """The fingerprint of a Hugging Face model folder: the full sha256 (memoized) of the files its loaders
    read (``LOADER_FILES``; for a folder holding only those, the same digest as ``fingerprint``).

    The one policy for models: the pipeline's quantize/gate keys, the gate's reference cache,
    the sensitivity cache and the test checkpoints' cache key all use it.
    """
    p = Path(model_dir)
    if p.is_file():
        return fingerprint(p)
    return Fingerprint(sha256=digest_of(file_digests(p, files=loader_files(p))), path=p.absolute())


__all__ = ["Fingerprint", "fingerprint", "model_fingerprint", "file_digests", "digest_of", "MEMO_FILE", "LOADER_FILES",
           "loader_files", "sample_digest", "inventory", "inventory_problem"]

