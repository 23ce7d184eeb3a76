"""What this machine offers for building engines, probed without importing torch or tensorrt_llm.

``trtllm-build`` (TensorRT-LLM 1.2, ``tensorrt_llm/commands/build.py``) needs the
``tensorrt_llm`` package (NVIDIA's package index only), the ``trtllm-build`` command and a
CUDA GPU of the target SM. ``Toolchain`` is part of the engine stage's key: installing
TensorRT-LLM, or moving to a node with other GPUs, changes the key, so a stage that was
skipped for lack of them runs as soon as they are there.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import subprocess
from typing import Optional

from pydantic import BaseModel, ConfigDict


class Toolchain(BaseModel):
    """``tensorrt_llm``: the package is importable (``tensorrt_llm_version`` from its metadata, if any);
    ``trtllm_build``: path of the command (None: not on PATH); ``gpu_sms``: each visible GPU's SM (e.g. 90)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tensorrt_llm: bool
    trtllm_build: Optional[str]
    gpu_sms: tuple[int, ...] = ()
    tensorrt_llm_version: Optional[str] = None

    def __init__(self, tensorrt_llm: bool, trtllm_build: Optional[str] = None, gpu_sms=(), **kw):
        super().__init__(tensorrt_llm=tensorrt_llm, trtllm_build=trtllm_build, gpu_sms=tuple(gpu_sms), **kw)

    def reason_not_buildable(self, sm: int) -> Optional[str]:
        """Why an engine for compute capability ``sm`` (e.g. 90) cannot be built here, or None."""
        if not self.tensorrt_llm:
            return "tensorrt_llm is not installed (NVIDIA's package index only; build on a GPU node with TensorRT-LLM 1.2)"
        if self.trtllm_build is None:
            return "the trtllm-build command is not on PATH"
        if not self.gpu_sms:
            return "no NVIDIA GPU is visible (nvidia-smi found none)"
        if sm not in self.gpu_sms:
            return f"the profile targets SM {sm} but this node has SM {sorted(set(self.gpu_sms))}"
        return None


def _gpu_sms() -> list[int]:
    sms: list[int] = []
    smi = shutil.which("nvidia-smi")
    if not smi:
        return sms
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    for line in out.split():
        major, _, minor = line.strip().partition(".")
        if major.isdigit():
            sms.append(int(major) * 10 + int(minor or 0))
    return sms


def detect_toolchain() -> Toolchain:
    """Probe for ``tensorrt_llm`` (import spec, not an import), ``trtllm-build`` on PATH and GPUs (``nvidia-smi``)."""
    has_trtllm = importlib.util.find_spec("tensorrt_llm") is not None
    version = None
    if has_trtllm:
        try:
            version = importlib.metadata.version("tensorrt_llm")
        except importlib.metadata.PackageNotFoundError:
            version = None
    return Toolchain(has_trtllm, shutil.which("trtllm-build"), _gpu_sms(), tensorrt_llm_version=version)


__all__ = ["Toolchain", "detect_toolchain"]
