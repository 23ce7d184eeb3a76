"""``engine/provenance.json``: what built an engine, for which GPUs, from which checkpoint; verified on read.

Written by the engine stage after ``trtllm-build`` returned 0 (the product never writes engine
files itself), into the same folder, before the folder is renamed into place::

    {"format": "precision-pipeline-engine-provenance", "version": 1,
     "build_id": sha256 over the sorted (file, sha256) pairs below,
     "versions": {"tensorrt_llm", "tensorrt", "modelopt", "torch", "cuda_runtime", "cuda_driver", "driver"},
     "engine_version": config.json "version" (the TensorRT-LLM that wrote the engine),
     "toolchain": the engine stage's probed Toolchain (what its key hashed),
     "gpus": [{"index", "uuid", "name", "sm", "memory_mib"}, ...]   (visible ones, CUDA_VISIBLE_DEVICES respected),
     "sm": the SM the engine was built for, "world_size": tp x pp, "image": $PRECISION_IMAGE or null,
     "checkpoint_key": the quantize stage's content key, "argv": ["trtllm-build", ...] exactly as run,
     "trtllm_build_help": {"sha256", "size"}, "files": {"config.json": {"sha256", "size"}, "rank0.engine": ...},
     "log": path of the build log, "time": ISO 8601, "host": hostname, "seconds": build time}

``verify_engine_dir`` reads it back and refuses (``UserError``, exit 2, naming the file) a missing,
truncated (size) or altered (sha256) file, an engine file that provenance does not list, a rank
file count other than ``world_size`` (gaps included) and a ``build_id`` that does not match the
files. Sizes are compared before hashes, so a truncated multi-GB rank file is refused at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any, Optional

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.store import atomic_write_json, hash_file

PROVENANCE_FILE = "provenance.json"
FORMAT = "precision-pipeline-engine-provenance"
VERSION = 1
IMAGE_ENV = "PRECISION_IMAGE"
"""Environment variable naming the container image a build runs in (the k8s Job sets it)."""
OWN_FILES = (PROVENANCE_FILE, "trtllm-build.args.json", "ENGINE_ABSENT", "cpu_reference.json", "checkpoint")
"""Top-level names in an engine folder that the pipeline writes, not trtllm-build (not hashed as engine
files): ours, and what serving/pack.py adds next to the engine in an engine unit (CPU reference files)."""
_RANK = re.compile(r"^rank(\d+)\.engine$")


def engine_files(engine_dir: Path) -> list[str]:
    """Relative paths of every regular file trtllm-build wrote under ``engine_dir`` (ours excluded), sorted."""
    root = Path(engine_dir)
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel.split("/", 1)[0] not in OWN_FILES:
            out.append(rel)
    return out


def build_id(files: dict[str, dict]) -> str:
    """sha256 of the sorted ``name:sha256`` lines of the engine files: one id per build, the same for every rank."""
    return hashlib.sha256("".join(f"{k}:{files[k]['sha256']}\n" for k in sorted(files)).encode()).hexdigest()


def rank_indices(names) -> list[int]:
    return sorted(int(m.group(1)) for m in (_RANK.match(Path(n).name) for n in names if "/" not in n) if m)


def write_provenance(engine_dir: Path, *, toolchain, sm: int, world_size: int, checkpoint_key: str, argv: list[str],
                     help_sha256: str = "", help_size: int = 0, log: str = "", seconds: float = 0.0) -> dict:
    """Hash every engine file in ``engine_dir`` and write ``provenance.json`` there; returns the record."""
    engine_dir = Path(engine_dir)
    files = {rel: {"sha256": hash_file(engine_dir / rel), "size": (engine_dir / rel).stat().st_size}
             for rel in engine_files(engine_dir)}
    try:
        cfg = json.loads((engine_dir / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    versions = {"tensorrt_llm": toolchain.tensorrt_llm_version, **dict(toolchain.versions)}
    rec = {
        "format": FORMAT, "version": VERSION, "build_id": build_id(files),
        "versions": versions, "toolchain": toolchain.model_dump(mode="json"), "engine_version": str(cfg.get("version")) if isinstance(cfg, dict) and cfg.get("version") else None,
        "gpus": [g.model_dump() for g in toolchain.gpus], "sm": int(sm), "world_size": int(world_size),
        "image": os.environ.get(IMAGE_ENV) or None, "checkpoint_key": checkpoint_key, "argv": list(argv),
        "trtllm_build_help": {"sha256": help_sha256, "size": int(help_size)}, "files": files, "log": log,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(), "seconds": round(float(seconds), 3),
    }
    atomic_write_json(engine_dir / PROVENANCE_FILE, rec)
    return rec


def read_provenance(engine_dir: Path) -> Optional[dict]:
    """The provenance record of ``engine_dir`` as stored (unverified), or None when there is none or it is not ours."""
    try:
        rec = json.loads((Path(engine_dir) / PROVENANCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("format") == FORMAT else None


def verify_engine_dir(engine_dir: Path, field: str = "engine") -> dict:
    """Check ``engine_dir`` against its provenance; return the record. UserError (exit 2) naming the file otherwise."""
    engine_dir = Path(engine_dir)
    fix = "rebuild the engine (invoke build on the GPU node, or the k8s build Job); never copy rank files between builds."
    p = engine_dir / PROVENANCE_FILE
    if not p.is_file():
        raise UserError(field, f"{engine_dir} has no {PROVENANCE_FILE}: nothing records which TensorRT-LLM, TensorRT and "
                        "GPU built it, so it cannot be checked against the serving image.", fix)
    rec = read_provenance(engine_dir)
    if rec is None or not isinstance(rec.get("files"), dict) or rec.get("version") != VERSION:
        raise UserError(f"{field}: {p}", f"is not a provenance record of format {FORMAT} version {VERSION}.", fix)
    files: dict[str, Any] = rec["files"]
    for rel, meta in sorted(files.items()):
        f = engine_dir / rel
        if not f.is_file():
            raise UserError(f"{field}: {f}", "is missing (provenance lists it).", fix)
        size = f.stat().st_size
        if size != meta.get("size"):
            raise UserError(f"{field}: {f}", f"is {size} bytes but was {meta.get('size')} when built (truncated or replaced).", fix)
        if hash_file(f) != meta.get("sha256"):
            raise UserError(f"{field}: {f}", "does not match the sha256 recorded when it was built (altered after the build).", fix)
    extra = [rel for rel in engine_files(engine_dir) if rel not in files]
    if extra:
        raise UserError(f"{field}: {engine_dir / extra[0]}", f"is not listed in {PROVENANCE_FILE}"
                        + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else "") + ": it comes from another build.", fix)
    if build_id(files) != rec.get("build_id"):
        raise UserError(f"{field}: {p}", "build_id does not match its files (edited record).", fix)
    ranks = rank_indices(files)
    world = int(rec.get("world_size") or 0)
    if ranks != list(range(world)):
        raise UserError(f"{field}: {engine_dir}", f"has rank engines {ranks or 'none'} but the engine is for "
                        f"{world} GPU(s) (rank0..rank{world - 1}.engine).", fix)
    return rec


__all__ = ["PROVENANCE_FILE", "IMAGE_ENV", "OWN_FILES", "write_provenance", "read_provenance", "verify_engine_dir",
           "engine_files", "build_id", "rank_indices"]
