"""Where the build's heavy work runs (``--device auto|cpu|cuda``) and what the machine offers.

Calibration, the per-layer search and the checkpoint gate run on the chosen device. ``cpu`` is
what the pipeline always did (FP32 on the host). ``cuda`` runs them on every visible GPU: a model
that does not fit one GPU is spread over them layer by layer (``device_map="auto"``, as ModelOpt's
``examples/llm_ptq`` does), in the dtype the profile states (``quantization.dtype``). ``auto``
(the default) takes CUDA when torch sees a GPU, else the CPU, and says why.

* ``select_device(asked, machine)`` is pure: the choice and its reason from a ``Machine``
  (tests build machines by hand; no torch).
* ``probe_machine(asked)`` reads the real machine: host memory from ``/proc/meminfo``
  (``MemAvailable``: what can be allocated now without swapping; Linux ``proc(5)``), and, unless
  the CPU was asked for, the GPUs from ``torch.cuda`` (``is_available``, ``device_count``,
  ``get_device_properties``, ``mem_get_info``). Without an NVIDIA driver (no
  ``/proc/driver/nvidia/gpus`` entries and no ``/dev/nvidia0``) torch is not even imported.
  ``probe_cuda`` is the one function of this torch-free layer that imports torch; only the
  pipeline and the tasks call it (``tests/test_layers.py`` ``SET_UP_ONLY``), never resolve.

The memory the chosen device must hold is planned before anything is loaded
(``resolve.build_memory.build_memory_plan``, rule ``memory.build_fit``).
Units: bytes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict

from precision_pipeline.core.errors import UserError

DEVICE_CHOICES = ("auto", "cpu", "cuda")
REFERENCE_DTYPES = ("float32", "bfloat16")
"""The gate's reference: FP32 (the default; its BF16 copy is the noise floor) or BF16 (when FP32 does not fit)."""
CPU_COMPUTE_DTYPE = "float32"
"""On the CPU every model runs in FP32, as before devices were chosen (quantize/ptq.py says why)."""
NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")
NVIDIA_DEV = Path("/dev/nvidia0")


class GpuInfo(BaseModel):
    """One visible CUDA device: torch's index, name, total and free memory (bytes, ``torch.cuda.mem_get_info``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int
    name: str
    total_bytes: int
    free_bytes: int


class Machine(BaseModel):
    """What the build can use here. ``gpus`` empty: no CUDA, and ``no_cuda`` says why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host_available_bytes: int
    host_total_bytes: int
    gpus: tuple[GpuInfo, ...] = ()
    no_cuda: str = ""
    torch_cuda: Optional[str] = None
    """``torch.version.cuda`` when torch was asked (None: a CPU-only torch, or torch not asked)."""


class DeviceChoice(BaseModel):
    """The device of one build, why, and what it offers (``to_json`` goes into plan.json and the manifest)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    asked: Literal["auto", "cpu", "cuda"]
    device: Literal["cpu", "cuda"]
    reason: str
    gpus: tuple[GpuInfo, ...] = ()
    host_available_bytes: int
    host_total_bytes: int
    reference_dtype: Literal["float32", "bfloat16"] = "float32"

    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"

    def compute_dtype(self, profile_dtype: str) -> str:
        """Dtype of calibration and of the gate's candidate: FP32 on the CPU, the profile's dtype on CUDA."""
        return profile_dtype if self.is_cuda else CPU_COMPUTE_DTYPE

    def device_map(self) -> Optional[str]:
        """``from_pretrained(device_map=...)``: None on the CPU (as before), ``"auto"`` on CUDA
        (accelerate fills GPU 0, then 1, ...: one GPU when the model fits it, all of them otherwise)."""
        return "auto" if self.is_cuda else None

    def short(self) -> str:
        """``cpu`` or ``cuda x8 (NVIDIA H100 80GB HBM3)``."""
        if not self.is_cuda:
            return "cpu"
        names = sorted({g.name for g in self.gpus})
        return f"cuda x{len(self.gpus)} ({', '.join(names)})"

    def to_json(self) -> dict:
        return {"asked": self.asked, "device": self.device, "reason": self.reason,
                "gpus": [g.model_dump() for g in self.gpus], "host_available_bytes": self.host_available_bytes,
                "host_total_bytes": self.host_total_bytes, "reference_dtype": self.reference_dtype}


def _gib(x: float) -> str:
    return f"{x / 2**30:,.1f} GiB"


def select_device(asked: str, machine: Machine, reference_dtype: str = "float32") -> DeviceChoice:
    """The device for ``--device asked`` on ``machine``, with the reason.

    Raises UserError on ``--device`` for a value outside ``DEVICE_CHOICES`` or ``cuda`` without a
    visible GPU (the reason names what is missing), and on ``--reference-dtype`` for a dtype outside
    ``REFERENCE_DTYPES``.
    """
    a = str(asked).strip().lower() if asked is not None else "auto"
    if a not in DEVICE_CHOICES:
        raise UserError("--device", f"{str(asked)[:40]!r} is not a device.", f"use one of: {', '.join(DEVICE_CHOICES)}.")
    if reference_dtype not in REFERENCE_DTYPES:
        raise UserError("--reference-dtype", f"{str(reference_dtype)[:40]!r} is not a reference dtype.",
                        f"use one of: {', '.join(REFERENCE_DTYPES)} (float32 is the default; bfloat16 when FP32 does not fit).")
    host = f"host memory {_gib(machine.host_available_bytes)} available of {_gib(machine.host_total_bytes)}"
    common = dict(asked=a, host_available_bytes=machine.host_available_bytes, host_total_bytes=machine.host_total_bytes,
                  reference_dtype=reference_dtype)
    if a == "cpu":
        return DeviceChoice(device="cpu", reason=f"--device cpu asked; {host}", **common)
    if not machine.gpus:
        if a == "cuda":
            raise UserError("--device", f"cuda was asked but no CUDA device is usable here: {machine.no_cuda}.",
                            "run on a GPU node (inside NVIDIA's TensorRT-LLM container, see README 'GPU build node'), "
                            "or use --device auto / cpu.")
        return DeviceChoice(device="cpu", reason=f"auto: no CUDA device ({machine.no_cuda}), so the CPU; {host}", **common)
    free = sum(g.free_bytes for g in machine.gpus)
    gpus = ", ".join(sorted({g.name for g in machine.gpus}))
    why = f"{'--device cuda asked' if a == 'cuda' else 'auto: torch sees CUDA'}: {len(machine.gpus)} GPU(s) ({gpus}), " \
          f"{_gib(free)} free in all; {host}"
    return DeviceChoice(device="cuda", reason=why, gpus=machine.gpus, **common)


def host_memory() -> tuple[int, int]:
    """(available, total) host memory in bytes: ``/proc/meminfo`` MemAvailable and MemTotal (kB),
    else ``os.sysconf`` pages x page size for both."""
    try:
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, _, v = line.partition(":")
            parts = v.split()
            if parts and parts[0].isdigit():
                info[k] = int(parts[0]) * 1024
        if "MemAvailable" in info and "MemTotal" in info:
            return info["MemAvailable"], info["MemTotal"]
    except OSError:
        pass
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total, total


def nvidia_driver_present() -> bool:
    """An NVIDIA kernel driver is loaded here (``/proc/driver/nvidia/gpus/*`` or ``/dev/nvidia0``)."""
    try:
        if NVIDIA_PROC.is_dir() and any(NVIDIA_PROC.iterdir()):
            return True
    except OSError:
        pass
    return NVIDIA_DEV.exists()


def probe_cuda() -> tuple[tuple[GpuInfo, ...], str, Optional[str]]:
    """(visible GPUs, why none, torch.version.cuda) from torch.cuda; imports torch.

    Makes CUDA calls only after ``torch.cuda.is_available()`` is True (a CPU-only torch is never
    asked for a device).
    """
    import torch

    built = getattr(torch.version, "cuda", None)
    if built is None:
        return (), f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)", None
    if not torch.cuda.is_available():
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        extra = f"; CUDA_VISIBLE_DEVICES={vis!r}" if vis is not None else ""
        return (), f"torch {torch.__version__} (CUDA {built}) sees no GPU (torch.cuda.is_available() is False{extra})", built
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        gpus.append(GpuInfo(index=i, name=str(props.name), total_bytes=int(total), free_bytes=int(free)))
    return tuple(gpus), "" if gpus else "torch.cuda.device_count() is 0", built


def probe_machine(asked: str = "auto") -> Machine:
    """This machine: host memory, and (unless ``asked`` is ``cpu``) the GPUs torch can use."""
    avail, total = host_memory()
    if str(asked).strip().lower() == "cpu":
        return Machine(host_available_bytes=avail, host_total_bytes=total, no_cuda="not asked (--device cpu)")
    if not nvidia_driver_present():
        return Machine(host_available_bytes=avail, host_total_bytes=total,
                       no_cuda=f"no NVIDIA driver on this machine ({NVIDIA_PROC} and {NVIDIA_DEV} absent)")
    gpus, why, built = probe_cuda()
    return Machine(host_available_bytes=avail, host_total_bytes=total, gpus=gpus, no_cuda=why, torch_cuda=built)



def choose_device(device: str = "auto", reference_dtype: str = "float32") -> DeviceChoice:
    """``--device`` / ``--reference-dtype`` on this machine (probe, then ``select_device``).
    UserError for an unknown value or ``cuda`` without a usable GPU."""
    # a bad value is refused before torch is asked: checked against this machine's host side with the values that
    # need no GPU (``cuda`` itself is judged on the real probe below, so its refusal names what is missing)
    select_device("cpu" if str(device).strip().lower() == "cuda" else device, probe_machine("cpu"), reference_dtype)
    return select_device(device, probe_machine(device), reference_dtype)


__all__ = ["DEVICE_CHOICES", "REFERENCE_DTYPES", "CPU_COMPUTE_DTYPE", "GpuInfo", "Machine", "DeviceChoice",
           "select_device", "probe_machine", "probe_cuda", "host_memory", "nvidia_driver_present", "choose_device"]
