"""Serving images: which TensorRT-LLM and TensorRT each Triton ``*-trtllm-python-py3`` tag ships.

A TensorRT engine deserializes only under the TensorRT that built it ("version tag does not
match", "failed to deserialize cuda engine"), and TensorRT-LLM reads only engines of its own
version. Each row names its source; ``None`` = not confirmed by a source we have (then the
comparison is a warning that says what to check inside the image). Tags not listed are unknown:
a warning, never silently accepted. A self-built image can carry another TensorRT than its tag
suggests (triton-inference-server/server#8462), so the build Job records ``$PRECISION_IMAGE`` and
the versions it found *inside* the image in ``engine/provenance.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ServingImage:
    tag: str
    tensorrt_llm: str
    tensorrt: Optional[str]
    source: str


_MATRIX = ("Triton release compatibility matrix, docs.nvidia.com/deeplearning/triton-inference-server/user-guide/docs/"
           "introduction/compatibility.html (shared/reference/upstream-2026-12.md)")
CATALOG: tuple[ServingImage, ...] = (
    ServingImage("nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3", "1.1.0", None, _MATRIX),
    ServingImage("nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3", "1.2.1", None,
                 "github.com/triton-inference-server/server/issues/8805 (2026-05-29; shared/reference/upstream-2026-12.md)"),
)
CHECK_INSIDE = ("python3 -c 'import tensorrt, tensorrt_llm; print(tensorrt.__version__, tensorrt_llm.__version__)' "
                "inside the image")


def lookup(image: str, catalog: tuple[ServingImage, ...] = CATALOG) -> Optional[ServingImage]:
    """The catalog row of ``image`` (exact tag; ``@sha256:`` digests are not matched), or None."""
    return next((r for r in catalog if r.tag == image), None)


def image_versions(image: str, *, runtimes: tuple[str, ...] | None = None,
                   timeout_s: float | None = None):
    """The serving image's TensorRT-LLM and TensorRT versions (``engine.toolchain.ImageVersions``): from inside
    the image where a container runtime (``docker``/``podman`` on PATH) has it locally (``<rt> image inspect``
    succeeds; nothing is pulled), by ``<rt> run --rm --network none --entrypoint python3 IMAGE -c
    IMAGE_VERSION_SCRIPT``; else from this tag catalog (``lookup``), saying so. Never raises."""
    import shutil

    from precision_pipeline.engine.toolchain import (CONTAINER_RUNTIMES, IMAGE_PROBE_TIMEOUT_S, IMAGE_VERSION_SCRIPT,
                                                     ImageVersions, run_quiet)

    runtimes = CONTAINER_RUNTIMES if runtimes is None else runtimes
    timeout_s = IMAGE_PROBE_TIMEOUT_S if timeout_s is None else timeout_s
    tried: list[str] = []
    for rt in runtimes:
        exe = shutil.which(rt)
        if not exe:
            continue
        ins = run_quiet([exe, "image", "inspect", image], min(timeout_s, 30))
        if ins is None or ins.returncode != 0:
            tried.append(f"{rt} has no local copy of it")
            continue
        out = run_quiet([exe, "run", "--rm", "--network", "none", "--entrypoint", "python3", image, "-c",
                    IMAGE_VERSION_SCRIPT], timeout_s)
        if out is None or out.returncode != 0:
            tried.append(f"{rt} could not run python3 in it")
            continue
        vals = dict(ln.split("=", 1) for ln in out.stdout.splitlines() if "=" in ln)
        trtllm, trt = vals.get("tensorrt_llm") or None, vals.get("tensorrt") or None
        if trtllm is None:
            tried.append(f"{rt}: no tensorrt_llm distribution inside it")
            continue
        return ImageVersions(image=image, tensorrt_llm=trtllm, tensorrt=trt, source="image", runtime=rt,
                             why=f"read inside the image with {rt} (package metadata)")
    where = "; ".join(tried) if tried else "no container runtime (docker, podman) on PATH"
    row = lookup(image)
    if row is not None:
        return ImageVersions(image=image, tensorrt_llm=row.tensorrt_llm, tensorrt=row.tensorrt, source="catalog",
                             why=f"the tag catalog (serving/images.py: {row.source}) was used: {where}")
    return ImageVersions(image=image, source="unknown", why=f"not in the tag catalog, and {where}")


__all__ = ["image_versions", "ServingImage", "CATALOG", "lookup", "CHECK_INSIDE"]
