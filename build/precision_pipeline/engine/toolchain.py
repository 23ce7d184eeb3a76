"""What this machine offers for building engines, probed without importing torch or tensorrt_llm.

``trtllm-build`` (TensorRT-LLM 1.2, ``tensorrt_llm/commands/build.py``) needs the
``tensorrt_llm`` package (NVIDIA's package index only), the ``trtllm-build`` command and a
CUDA GPU of the target SM. ``Toolchain`` is part of the engine stage's key: installing
TensorRT-LLM, or moving to a node with other GPUs, changes the key, so a stage that was
skipped for lack of them runs as soon as they are there.

GPUs come from ``nvidia-smi --query-gpu=index,uuid,name,compute_cap,memory.total,driver_version
--format=csv,noheader,nounits`` (memory in MiB; ``compute_cap`` needs driver >= 510), filtered by
``CUDA_VISIBLE_DEVICES`` the way the CUDA runtime reads it (comma-separated indices or ``GPU-``
UUID prefixes, the list ends at the first entry that matches no device; empty or ``-1`` hides
every GPU), because ``nvidia-smi`` itself ignores that variable. Versions come from the installed
distributions' metadata (``tensorrt_llm``, ``tensorrt`` / ``tensorrt-cu12`` / ``tensorrt-cu13``,
``nvidia-modelopt``, ``torch``, ``nvidia-cuda-runtime-cu12/13``); the CUDA version the driver
supports from the ``CUDA Version:`` line of plain ``nvidia-smi``.

``image_versions(image)``: the TensorRT-LLM / TensorRT a *serving image* ships, read inside it (its
installed distributions' metadata, run with the image's ``python3``) where ``docker`` or ``podman``
is on PATH and has the image locally (never pulled), else from the tag catalog
(``serving/images.py``); the result says which (``source``, ``why``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict

from precision_pipeline.core.versions import dist_version

SMI_QUERY = "index,uuid,name,compute_cap,memory.total,driver_version"
SMI_TIMEOUT_S = 20
TENSORRT_DISTS = ("tensorrt", "tensorrt-cu12", "tensorrt-cu13", "tensorrt_cu12", "tensorrt_cu13")
CUDA_RUNTIME_DISTS = ("nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime")


class GpuInfo(BaseModel):
    """One visible GPU: ``index`` (nvidia-smi's), ``uuid``, ``name`` (NVML device name, e.g.
    ``NVIDIA H100 80GB HBM3``), ``sm`` (compute capability x 10, e.g. 90), ``memory_mib`` (driver-reported)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int
    uuid: str = ""
    name: str
    sm: int
    memory_mib: int = 0


class Toolchain(BaseModel):
    """``tensorrt_llm``: the package is importable (``tensorrt_llm_version`` from its metadata, if any);
    ``trtllm_build``: path of the command (None: not on PATH); ``gpu_sms``: each visible GPU's SM (e.g. 90);
    ``gpus``: each visible GPU in full (name, SM, memory); ``versions``: the other components' versions
    (tensorrt, modelopt, torch, cuda_runtime, cuda_driver, driver; None where not found)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tensorrt_llm: bool
    trtllm_build: Optional[str]
    gpu_sms: tuple[int, ...] = ()
    tensorrt_llm_version: Optional[str] = None
    gpus: tuple[GpuInfo, ...] = ()
    versions: tuple[tuple[str, Optional[str]], ...] = ()

    def __init__(self, tensorrt_llm: bool, trtllm_build: Optional[str] = None, gpu_sms=(), **kw):
        gpus = tuple(kw.pop("gpus", ()) or ())
        if not gpu_sms and gpus:
            gpu_sms = [g.sm for g in gpus]
        versions = kw.pop("versions", ())
        if isinstance(versions, dict):
            versions = tuple(sorted(versions.items()))
        super().__init__(tensorrt_llm=tensorrt_llm, trtllm_build=trtllm_build, gpu_sms=tuple(gpu_sms), gpus=gpus,
                         versions=tuple(versions), **kw)

    def version(self, name: str) -> Optional[str]:
        """A recorded component version (``tensorrt``, ``modelopt``, ``torch``, ``cuda_runtime``, ``cuda_driver``, ``driver``)."""
        return dict(self.versions).get(name)

    def present(self) -> bool:
        """tensorrt_llm, trtllm-build and at least one GPU are there: a build node (preflight decides the rest)."""
        return self.tensorrt_llm and self.trtllm_build is not None and bool(self.gpu_sms)

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


def parse_sm(text: str) -> Optional[int]:
    """``"9.0"`` -> 90, ``"12.1"`` -> 121; None when it is not a compute capability."""
    major, _, minor = text.strip().partition(".")
    if not major.isdigit() or (minor and not minor.isdigit()):
        return None
    return int(major) * 10 + int(minor or 0)


def visible(gpus: list[GpuInfo], env: Optional[str]) -> list[GpuInfo]:
    """The GPUs a CUDA process sees under ``CUDA_VISIBLE_DEVICES=env`` (None: all), in that order."""
    if env is None:
        return list(gpus)
    out: list[GpuInfo] = []
    for tok in (t.strip() for t in env.split(",")):
        if tok.isdigit():
            match = [g for g in gpus if g.index == int(tok)]
        elif tok.startswith(("GPU-", "MIG-")):
            match = [g for g in gpus if g.uuid and g.uuid.startswith(tok)]
            match = match if len(match) == 1 else []
        else:
            match = []
        if not match or match[0] in out:
            break  # the CUDA runtime stops at the first entry it cannot use
        out.append(match[0])
    return out


def probe_gpus(smi: Optional[str] = None) -> tuple[list[GpuInfo], dict[str, Optional[str]]]:
    """(visible GPUs, {"driver", "cuda_driver"}) from nvidia-smi; ([], {}) when it is missing or fails."""
    smi = smi or shutil.which("nvidia-smi")
    if not smi:
        return [], {}
    try:
        out = subprocess.run([smi, f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return [], {}
    if out.returncode != 0:
        return [], {}
    gpus: list[GpuInfo] = []
    driver = None
    for line in out.stdout.splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) < 4 or not cols[0].isdigit():
            continue
        sm = parse_sm(cols[3])
        if sm is None:
            continue
        mem = cols[4] if len(cols) > 4 else ""
        gpus.append(GpuInfo(index=int(cols[0]), uuid=cols[1], name=cols[2], sm=sm,
                            memory_mib=int(mem) if mem.isdigit() else 0))
        driver = driver or (cols[5] if len(cols) > 5 and cols[5] else None)
    cuda = None
    try:
        plain = subprocess.run([smi], capture_output=True, text=True, timeout=SMI_TIMEOUT_S).stdout
        m = re.search(r"CUDA Version:\s*([0-9.]+)", plain)
        cuda = m.group(1) if m else None
    except (OSError, subprocess.SubprocessError):
        pass
    return visible(gpus, os.environ.get("CUDA_VISIBLE_DEVICES")), {"driver": driver, "cuda_driver": cuda}


def _gpu_sms() -> list[int]:
    return [g.sm for g in probe_gpus()[0]]


def detect_toolchain() -> Toolchain:
    """Probe for ``tensorrt_llm`` (import spec, not an import), ``trtllm-build`` on PATH, GPUs (``nvidia-smi``)
    and the versions of the components an engine depends on."""
    has_trtllm = importlib.util.find_spec("tensorrt_llm") is not None
    version = dist_version("tensorrt_llm", "tensorrt-llm") if has_trtllm else None
    gpus, smi = probe_gpus()
    versions = {"tensorrt": dist_version(*TENSORRT_DISTS), "modelopt": dist_version("nvidia-modelopt"),
                "torch": dist_version("torch"), "cuda_runtime": dist_version(*CUDA_RUNTIME_DISTS), **smi}
    return Toolchain(has_trtllm, shutil.which("trtllm-build"), tensorrt_llm_version=version, gpus=tuple(gpus),
                     versions=versions)


CONTAINER_RUNTIMES = ("docker", "podman")
IMAGE_PROBE_TIMEOUT_S = 120
IMAGE_VERSION_SCRIPT = (
    "import importlib.metadata as m\n"
    "def v(*names):\n"
    "    for n in names:\n"
    "        try:\n"
    "            return m.version(n)\n"
    "        except m.PackageNotFoundError:\n"
    "            pass\n"
    "    return ''\n"
    "print('tensorrt_llm=' + v('tensorrt_llm', 'tensorrt-llm'))\n"
    f"print('tensorrt=' + v(*{TENSORRT_DISTS!r}))\n")
"""Run with the image's ``python3``: the installed distributions' metadata (nothing is imported, so
no GPU is needed); one ``name=version`` line each, empty when not installed."""


class ImageVersions(BaseModel):
    """TensorRT-LLM / TensorRT of a serving image and where they come from.

    ``source``: ``image`` (read inside the image with ``runtime``: package metadata), ``catalog``
    (``serving/images.py``'s tag catalog: no container runtime, or the image is not present locally),
    or ``unknown`` (neither). ``why``: how it was chosen, for the promote output and the release record."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    image: str
    tensorrt_llm: Optional[str] = None
    tensorrt: Optional[str] = None
    source: Literal["image", "catalog", "unknown"] = "unknown"
    runtime: Optional[str] = None
    why: str = ""


def run_quiet(argv: list[str], timeout: float) -> Optional[subprocess.CompletedProcess]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None


__all__ = ["GpuInfo", "Toolchain", "detect_toolchain", "probe_gpus", "visible", "parse_sm", "dist_version",
           "ImageVersions", "IMAGE_VERSION_SCRIPT", "CONTAINER_RUNTIMES"]
