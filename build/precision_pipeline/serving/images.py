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


__all__ = ["ServingImage", "CATALOG", "lookup", "CHECK_INSIDE"]
