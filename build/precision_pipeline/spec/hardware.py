"""Hardware catalog: every GPU the planner knows, with the number's source next to it.

Each entry is keyed by a canonical id (``h100-sxm``, ``a100-80gb``, ...) and has aliases
(``h100`` -> ``h100-sxm``, ``a100`` -> ``a100-80gb``). Names are matched exactly after
normalisation (lower case, spaces/underscores -> ``-``, a leading ``nvidia-``/``geforce-``/
``tesla-`` dropped) -- never by substring, because marketing names mislead:

* "RTX 6000 Ada" is Ada Lovelace (SM 89), not Ampere; the older "Quadro RTX 6000" is Turing.
* "RTX PRO 6000 Blackwell" and "RTX 5090" are SM 120 (consumer/workstation Blackwell), not SM 100.
* "GB200" is SM 100 like B200; "B300"/"GB300" (Blackwell Ultra) is SM 103.
* "A10"/"A10G" are SM 86 (GA102), not SM 80 like A100.

Units: ``memory_mib`` is what the driver reports (``nvidia-smi --query-gpu=memory.total``, MiB =
2**20 bytes; an "80 GB" H100 reports 81,559 MiB); ``memory_gb`` is the datasheet figure (GB =
10**9 bytes, as marketed); ``bandwidth_gbs`` in GB/s; TFLOPS are *dense* (no 2:4 sparsity) Tensor
Core peaks, ``None`` where the GPU has no such format.

Driver-reported sizes are the values ``nvidia-smi`` prints on common driver versions (they vary
by a few MiB with ECC mode and driver); they are used only for memory planning, which keeps
margins. Data-sheet numbers are from the named NVIDIA datasheets / whitepapers.

TensorRT-LLM 1.x supports SM >= 80 only (docs/source/legacy/reference/support-matrix.md,
"Hardware": Ampere, Ada, Hopper, Blackwell). V100 (SM 70) and T4 (SM 75) are in the catalog so
that they are refused by name with that reason instead of "unknown GPU".
"""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass
from typing import Optional

from precision_pipeline.core.errors import UserError, closest

MIB = 1 << 20
GIB = 1 << 30

ARCH_BY_SM = {
    70: "Volta", 75: "Turing", 80: "Ampere", 86: "Ampere", 87: "Ampere", 89: "Ada Lovelace",
    90: "Hopper", 100: "Blackwell", 103: "Blackwell Ultra", 120: "Blackwell (GeForce/RTX PRO)",
    121: "Blackwell (GB10)",
}


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model.

    ``memory_mib``: MiB as the driver reports it (what the runtime can see).
    ``memory_gb``: GB (10**9 bytes) as the datasheet states it.
    ``bandwidth_gbs``: memory bandwidth, GB/s. ``*_tflops``: dense Tensor Core TFLOPS.
    ``source``: datasheet name / URL the numbers come from.
    """

    id: str
    name: str
    sm: int
    memory_mib: int
    memory_gb: float
    bandwidth_gbs: float
    bf16_tflops: Optional[float]
    fp8_tflops: Optional[float]
    fp4_tflops: Optional[float]
    source: str
    aliases: tuple[str, ...] = ()
    note: str = ""

    @property
    def arch(self) -> str:
        """Architecture name for the SM (e.g. 'Hopper')."""
        return ARCH_BY_SM.get(self.sm, f"SM {self.sm}")

    @property
    def memory_bytes(self) -> int:
        """Driver-reported memory in bytes (``memory_mib`` x 2**20)."""
        return self.memory_mib * MIB

    def to_json(self) -> dict:
        d = asdict(self)
        d["aliases"] = list(self.aliases)
        d["arch"] = self.arch
        d["memory_bytes"] = self.memory_bytes
        return d


_A10 = "NVIDIA A10 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/products/a10-gpu/"
_A10G = "AWS EC2 G5 instances (A10G, 24 GB, 600 GB/s), https://aws.amazon.com/ec2/instance-types/g5/"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/a100/"
_L4 = "NVIDIA L4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/l4/"
_L40S = "NVIDIA L40S datasheet, https://www.nvidia.com/en-us/data-center/l40s/"
_ADA_WP = "NVIDIA Ada GPU Architecture whitepaper (RTX 4090 / RTX 6000 Ada), https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/"
_GH200 = "NVIDIA GH200 Grace Hopper Superchip datasheet, https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/"
_B200 = "NVIDIA HGX B200 / DGX B200 datasheet (per GPU), https://www.nvidia.com/en-us/data-center/hgx/"
_GB200 = "NVIDIA GB200 NVL72 datasheet (per GPU = rack / 72), https://www.nvidia.com/en-us/data-center/gb200-nvl72/"
_B300 = "NVIDIA HGX B300 datasheet (Blackwell Ultra, per GPU), https://www.nvidia.com/en-us/data-center/hgx/"
_BW_WP = "NVIDIA RTX Blackwell GPU Architecture whitepaper (RTX 5090), https://images.nvidia.com/aem-dam/Solutions/geforce/blackwell/nvidia-rtx-blackwell-gpu-architecture.pdf"
_PRO6000 = "NVIDIA RTX PRO 6000 Blackwell datasheet, https://www.nvidia.com/en-us/products/workstations/professional-desktop-gpus/rtx-pro-6000/"
_V100 = "NVIDIA V100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/v100/"
_T4 = "NVIDIA T4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/tesla-t4/"

_SPECS: list[GPUSpec] = [
    # --- Ampere (SM 80 / 86) -----------------------------------------------------------
    GPUSpec("a10", "NVIDIA A10", 86, 23028, 24, 600, 125, None, None, _A10,
            ("a10-24gb",), "GA102: SM 86, not SM 80 like A100."),
    GPUSpec("a10g", "NVIDIA A10G", 86, 23028, 24, 600, 70, None, None, _A10G,
            ("a10g-24gb",), "AWS variant of GA102 (SM 86); Tensor TFLOPS are AWS's figure, approximate."),
    GPUSpec("a100-40gb", "NVIDIA A100-SXM4-40GB", 80, 40960, 40, 1555, 312, None, None, _A100,
            ("a100-40g", "a100-sxm4-40gb", "a100-pcie-40gb")),
    GPUSpec("a100-80gb", "NVIDIA A100-SXM4-80GB", 80, 81920, 80, 2039, 312, None, None, _A100,
            ("a100", "a100-80g", "a100-sxm4-80gb", "a100-sxm-80gb", "a100-pcie-80gb")),
    # --- Ada Lovelace (SM 89) ----------------------------------------------------------
    GPUSpec("l4", "NVIDIA L4", 89, 23034, 24, 300, 121, 242.5, None, _L4, ("l4-24gb",)),
    GPUSpec("l40s", "NVIDIA L40S", 89, 46068, 48, 864, 362.05, 733, None, _L40S, ("l40s-48gb",)),
    GPUSpec("rtx-4090", "NVIDIA GeForce RTX 4090", 89, 24564, 24, 1008, 165.2, 330.3, None, _ADA_WP,
            ("4090", "rtx4090"), "Dense TFLOPS with FP32 accumulate (GeForce)."),
    GPUSpec("rtx-6000-ada", "NVIDIA RTX 6000 Ada Generation", 89, 49140, 48, 960, 364.2, 728.5, None, _ADA_WP,
            ("rtx6000-ada", "rtx-6000-ada-generation"),
            "Ada (SM 89), not the Ampere RTX A6000 nor the Turing Quadro RTX 6000."),
    # --- Hopper (SM 90) ----------------------------------------------------------------
    GPUSpec("h100-pcie", "NVIDIA H100 PCIe", 90, 81559, 80, 2000, 756, 1513, None, _H100,
            ("h100-pcie-80gb",)),
    GPUSpec("h100-sxm", "NVIDIA H100 80GB HBM3", 90, 81559, 80, 3350, 989.4, 1978.9, None, _H100,
            ("h100", "h100-sxm5", "h100-80gb", "h100-sxm-80gb", "h100-80gb-hbm3", "h100-sxm5-80gb")),
    GPUSpec("h100-nvl", "NVIDIA H100 NVL", 90, 95830, 94, 3900, 835.5, 1670.5, None, _H100,
            ("h100-nvl-94gb",)),
    GPUSpec("h200", "NVIDIA H200", 90, 143771, 141, 4800, 989.4, 1978.9, None, _H200,
            ("h200-sxm", "h200-141gb")),
    GPUSpec("gh200", "NVIDIA GH200 480GB", 90, 97871, 96, 4000, 989.4, 1978.9, None, _GH200,
            ("gh200-96gb", "grace-hopper"), "96 GB HBM3 variant (the 144 GB HBM3e variant has more)."),
    # --- Blackwell (SM 100 / 103 / 120) ------------------------------------------------
    GPUSpec("b200", "NVIDIA B200", 100, 183359, 180, 8000, 2250, 4500, 9000, _B200,
            ("b200-180gb", "hgx-b200", "dgx-b200")),
    GPUSpec("gb200", "NVIDIA GB200", 100, 189471, 186, 8000, 2500, 5000, 10000, _GB200,
            ("gb200-nvl72", "gb200-nvl"), "Grace Blackwell: SM 100 like B200."),
    GPUSpec("b300", "NVIDIA B300", 103, 275040, 288, 8000, 2250, 4500, 13500, _B300,
            ("b300-sxm", "hgx-b300", "gb300", "blackwell-ultra"),
            "Blackwell Ultra: SM 103. Driver-reported MiB approximate (288 GB decimal)."),
    GPUSpec("rtx-5090", "NVIDIA GeForce RTX 5090", 120, 32607, 32, 1792, 209.5, 419, 838, _BW_WP,
            ("5090", "rtx5090"), "Consumer Blackwell: SM 120, not SM 100; TFLOPS with FP16 accumulate."),
    GPUSpec("rtx-pro-6000-blackwell", "NVIDIA RTX PRO 6000 Blackwell", 120, 97887, 96, 1792, 500, 1000, 2000, _PRO6000,
            ("rtx-pro-6000", "rtx-pro-6000-blackwell-server-edition", "rtx-pro-6000-blackwell-workstation-edition",
             "rtx-pro-6000-server"),
            "Workstation/server Blackwell: SM 120, not SM 100. TFLOPS from 4,000 AI TOPS (FP4, sparse), dense = half."),
    # --- Refused by TensorRT-LLM 1.x (SM < 80); present so they are refused by name -----
    GPUSpec("v100", "Tesla V100-SXM2-32GB", 70, 32510, 32, 900, None, None, None, _V100,
            ("v100-32gb", "v100-sxm2-32gb", "v100-16gb", "v100-sxm2"), "Volta: no BF16; TensorRT-LLM 1.x needs SM >= 80."),
    GPUSpec("t4", "Tesla T4", 75, 15360, 16, 320, None, None, None, _T4,
            ("t4-16gb",), "Turing: no BF16; TensorRT-LLM 1.x needs SM >= 80."),
]

CATALOG: dict[str, GPUSpec] = {g.id: g for g in _SPECS}
"""Canonical id -> GPUSpec."""

_ALIASES: dict[str, str] = {}
for _g in _SPECS:
    _ALIASES[_g.id] = _g.id
    for _a in _g.aliases:
        assert _a not in _ALIASES, _a
        _ALIASES[_a] = _g.id

_PREFIX = re.compile(r"^(nvidia-)?(geforce-|tesla-|quadro-)?")


def normalize_gpu_name(name: str) -> str:
    """Lower case, runs of spaces/underscores -> '-', leading 'nvidia-'/'geforce-'/'tesla-' dropped."""
    s = re.sub(r"[\s_]+", "-", str(name).strip().lower())
    s = re.sub(r"-+", "-", s).strip("-")
    return _PREFIX.sub("", s, count=1)


def resolve_gpu(name: str) -> GPUSpec:
    """The catalog entry for an id or alias (exact after normalisation; never by substring).

    Raises UserError on ``target.gpu`` listing the known ids and the closest one.
    """
    if not isinstance(name, str) or not name.strip():
        raise UserError("target.gpu", "is empty.", f"use one of: {', '.join(CATALOG)}.", rule="gpu.known",
                        source="build/precision_pipeline/spec/hardware.py")
    key = normalize_gpu_name(name)
    gid = _ALIASES.get(key)
    if gid is not None:
        return CATALOG[gid]
    hint = closest(key, list(_ALIASES)) or next(iter(difflib.get_close_matches(key, list(_ALIASES), n=1, cutoff=0.0)), None)
    near = f"the closest known GPU is {_ALIASES[hint]!r}; " if hint else ""
    raise UserError("target.gpu", f"unknown GPU {name!r}.",
                    f"{near}known GPUs: {', '.join(CATALOG)}.", rule="gpu.known", source="build/precision_pipeline/spec/hardware.py")


def gpus_with_sm(ranges) -> list[GPUSpec]:
    """Catalog entries whose SM lies in any inclusive (lo, hi) range."""
    return [g for g in _SPECS if any(lo <= g.sm <= hi for lo, hi in ranges)]


__all__ = ["GPUSpec", "CATALOG", "resolve_gpu", "normalize_gpu_name", "gpus_with_sm", "MIB", "GIB", "ARCH_BY_SM"]
