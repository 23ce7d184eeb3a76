"""Hardware catalog: every GPU the planner knows, with the number's source next to it.

Each entry is keyed by a canonical id (``h100-sxm``, ``a100-80gb``, ...) and has aliases
(``h100`` -> ``h100-sxm``, ``a100`` -> ``a100-80gb``; an alias of a product sold with several memory
sizes, ``a100``/``a800``, is read as the larger and ``variant_note`` says so). Names are matched exactly after
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
that they are refused by name with that reason instead of "unknown GPU"; older names (P100, P40,
K80, M60, GTX 10xx, RTX 20xx, Quadro RTX ...) are a name -> SM table (``_LEGACY``) refused the same way.

Unknown names are never answered with a GPU of another architecture: non-ASCII names (look-alike
letters) and other vendors' accelerators are refused saying so, names several architectures share
("RTX 6000") list every reading, and a "closest known GPU" is offered only for a typing slip with the
same letters and model digits (``_typo_of``). Entries whose figures could not be checked against an
NVIDIA datasheet say "unverified" / "approximate" in ``note``.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import asdict, dataclass, replace
from typing import Optional

from precision_pipeline.core.errors import UserError

MIB = 1 << 20
GIB = 1 << 30

ARCH_BY_SM = {
    35: "Kepler", 37: "Kepler", 50: "Maxwell", 52: "Maxwell", 60: "Pascal", 61: "Pascal", 70: "Volta", 75: "Turing", 80: "Ampere", 86: "Ampere", 87: "Ampere", 89: "Ada Lovelace",
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
    ``int8_tops``: dense INT8 Tensor Core TOPS (``_INT8_DENSE_TOPS``; None where not catalogued).
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
    int8_tops: Optional[float] = None

    def tensor_peak(self, math: Optional[str]) -> tuple[Optional[float], str]:
        """(dense Tensor Core peak in TFLOPS / TOPS, the catalog field it came from) for the GEMM math
        ``math``: None = the model dtype (BF16), ``fp8``, ``nvfp4`` (FP4) or ``int8``. The value is
        None where the GPU has no such Tensor Core format (or it is not catalogued)."""
        name = {None: "bf16_tflops", "fp8": "fp8_tflops", "nvfp4": "fp4_tflops", "int8": "int8_tops"}[math]
        return getattr(self, name), name

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
_A100 = "NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/a100/ (80GB PCIe 1,935 GB/s, 80GB SXM 2,039 GB/s)"
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
_A2 = "NVIDIA A2 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/products/a2/"
_A16 = "NVIDIA A16 GPU datasheet (per GPU = board / 4), https://www.nvidia.com/en-us/data-center/products/a16-gpu/"
_A30 = "NVIDIA A30 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/products/a30-gpu/"
_A40 = "NVIDIA A40 GPU datasheet, https://www.nvidia.com/en-us/data-center/a40/"
_A800 = "NVIDIA A800 Tensor Core GPU datasheet (China market), https://www.nvidia.cn/data-center/a800/"
_RTXA = "NVIDIA RTX A6000 / A5000 / A4000 datasheets, https://www.nvidia.com/en-us/design-visualization/rtx-a6000/"
_GA102_WP = "NVIDIA Ampere GA102 GPU Architecture whitepaper (RTX 3090), https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf"
_ORIN = "NVIDIA Jetson AGX Orin Series datasheet / technical brief, https://www.nvidia.com/en-us/autonomous-machines/embedded-systems/jetson-orin/"
_L40 = "NVIDIA L40 GPU datasheet, https://www.nvidia.com/en-us/data-center/l40/"
_L20 = "NVIDIA L20 product brief (China market; no public NVIDIA datasheet page), figures as reported by server vendors"
_RTX_ADA = "NVIDIA RTX 5000 / 4500 / 4000 Ada Generation datasheets, https://www.nvidia.com/en-us/design-visualization/rtx-5000/"
_H800 = "NVIDIA H800 Tensor Core GPU datasheet (China market), https://www.nvidia.cn/data-center/h800/"
_H20 = "NVIDIA H20 product brief (China market; no public NVIDIA datasheet page), figures as reported by server vendors"
_H200NVL = "NVIDIA H200 NVL datasheet, https://www.nvidia.com/en-us/data-center/h200/"
_GB10 = "NVIDIA DGX Spark datasheet (GB10 Grace Blackwell), https://www.nvidia.com/en-us/products/workstations/dgx-spark/"
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
            ("a100", "a100-80g", "a100-sxm4-80gb", "a100-sxm-80gb")),
    GPUSpec("a100-80gb-pcie", "NVIDIA A100 80GB PCIe", 80, 81920, 80, 1935, 312, None, None, _A100,
            ("a100-pcie-80gb", "a100-80g-pcie"),
            "PCIe card: 1,935 GB/s (the SXM4 card has 2,039), same Tensor Core peaks (A100 datasheet table)."),
    GPUSpec("a30", "NVIDIA A30", 80, 24258, 24, 933, 165, None, None, _A30,
            ("a30-24gb",), "GA100 like A100: SM 80 (not 86). Driver MiB approximate."),
    GPUSpec("a800-40gb", "NVIDIA A800 40GB PCIe", 80, 40960, 40, 1555, 312, None, None, _A800,
            ("a800-40g", "a800-pcie-40gb"), "China-market A100 (NVLink limited): SM 80; driver MiB as A100 40GB."),
    GPUSpec("a800-80gb", "NVIDIA A800-SXM4-80GB", 80, 81920, 80, 2039, 312, None, None, _A800,
            ("a800", "a800-80g", "a800-sxm4-80gb", "a800-pcie-80gb"),
            "China-market A100 (NVLink limited): SM 80; the PCIe card has 1,935 GB/s. Driver MiB as A100 80GB."),
    GPUSpec("a40", "NVIDIA A40", 86, 46068, 48, 696, 149.7, None, None, _A40, ("a40-48gb",), "GA102: SM 86."),
    GPUSpec("a16", "NVIDIA A16", 86, 15356, 16, 200, 35.9, None, None, _A16, ("a16-16gb",),
            "One of the board's four GA107 GPUs (SM 86), 16 GB each. Driver MiB approximate."),
    GPUSpec("a2", "NVIDIA A2", 86, 15356, 16, 200, 18, None, None, _A2, ("a2-16gb",),
            "GA107: SM 86. Driver MiB approximate."),
    GPUSpec("rtx-a6000", "NVIDIA RTX A6000", 86, 49140, 48, 768, 154.8, None, None, _RTXA,
            ("a6000", "rtx-a6000-48gb"),
            "Ampere GA102 (SM 86): not the Ada RTX 6000 nor the Turing Quadro RTX 6000. Dense = half the sparse figure."),
    GPUSpec("rtx-a5000", "NVIDIA RTX A5000", 86, 24564, 24, 768, 111.1, None, None, _RTXA, ("a5000",),
            "Ampere GA102 (SM 86). Dense = half the sparse figure; driver MiB approximate."),
    GPUSpec("rtx-a4000", "NVIDIA RTX A4000", 86, 16376, 16, 448, 76.7, None, None, _RTXA, ("a4000",),
            "Ampere GA104 (SM 86). Dense = half the sparse figure; driver MiB approximate."),
    GPUSpec("rtx-3090", "NVIDIA GeForce RTX 3090", 86, 24576, 24, 936, 71, None, None, _GA102_WP,
            ("3090", "rtx3090"), "GA102 (SM 86). Dense BF16 with FP32 accumulate (GeForce), as for rtx-4090."),
    GPUSpec("rtx-3090-ti", "NVIDIA GeForce RTX 3090 Ti", 86, 24564, 24, 1008, 80, None, None, _GA102_WP,
            ("3090-ti", "rtx3090-ti"),
            "GA102 (SM 86). Unverified: TFLOPS computed as 84 SMs x 1.86 GHz x 512 (FP32 accumulate); driver MiB approximate."),
    GPUSpec("jetson-agx-orin", "NVIDIA Jetson AGX Orin 64GB", 87, 62841, 64, 204.8, 42.5, None, None, _ORIN,
            ("agx-orin", "jetson-agx-orin-64gb"),
            "Ampere SM 87, memory shared with the CPU. Unverified: BF16 = 170 sparse INT8 TOPS / 4; MiB approximate. "
            "TensorRT-LLM ships Jetson support in a separate branch, not in the 1.x wheels."),
    # --- Ada Lovelace (SM 89) ----------------------------------------------------------
    GPUSpec("l4", "NVIDIA L4", 89, 23034, 24, 300, 121, 242.5, None, _L4, ("l4-24gb",)),
    GPUSpec("l40s", "NVIDIA L40S", 89, 46068, 48, 864, 362.05, 733, None, _L40S, ("l40s-48gb",)),
    GPUSpec("rtx-4090", "NVIDIA GeForce RTX 4090", 89, 24564, 24, 1008, 165.2, 330.3, None, _ADA_WP,
            ("4090", "rtx4090"), "Dense TFLOPS with FP32 accumulate (GeForce)."),
    GPUSpec("rtx-6000-ada", "NVIDIA RTX 6000 Ada Generation", 89, 49140, 48, 960, 364.2, 728.5, None, _ADA_WP,
            ("rtx6000-ada", "rtx-6000-ada-generation"),
            "Ada (SM 89), not the Ampere RTX A6000 nor the Turing Quadro RTX 6000."),
    GPUSpec("l40", "NVIDIA L40", 89, 46068, 48, 864, 181.05, 362, None, _L40, ("l40-48gb",)),
    GPUSpec("l20", "NVIDIA L20", 89, 46068, 48, 864, 119.5, 239, None, _L20, ("l20-48gb",),
            "China-market AD102 (SM 89). Unverified TFLOPS (vendor figures 119.5 BF16 / 239 FP8 dense); MiB approximate."),
    GPUSpec("rtx-5000-ada", "NVIDIA RTX 5000 Ada Generation", 89, 32760, 32, 576, 261.1, 522.2, None, _RTX_ADA,
            ("rtx5000-ada", "rtx-5000-ada-generation"),
            "Ada (SM 89). FP8 = 1,044.4 AI TOPS (sparse) / 2, BF16 = FP8 / 2; driver MiB approximate."),
    GPUSpec("rtx-4500-ada", "NVIDIA RTX 4500 Ada Generation", 89, 24570, 24, 432, 158.5, 317, None, _RTX_ADA,
            ("rtx4500-ada", "rtx-4500-ada-generation"),
            "Ada (SM 89). FP8 = 634 AI TOPS (sparse) / 2, BF16 = FP8 / 2; driver MiB approximate."),
    GPUSpec("rtx-4000-ada", "NVIDIA RTX 4000 Ada Generation", 89, 20475, 20, 360, 76.7, 153.4, None, _RTX_ADA,
            ("rtx4000-ada", "rtx-4000-ada-generation"),
            "Ada (SM 89). FP8 = 306.8 AI TOPS (sparse) / 2, BF16 = FP8 / 2; driver MiB approximate."),
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
    GPUSpec("h200-nvl", "NVIDIA H200 NVL", 90, 143771, 141, 4800, 835.5, 1670.5, None, _H200NVL,
            ("h200-nvl-141gb",), "PCIe H200 (600 W): dense = half the sparse figures; driver MiB as H200."),
    GPUSpec("h800-sxm", "NVIDIA H800 80GB HBM3", 90, 81559, 80, 3350, 989.4, 1978.9, None, _H800,
            ("h800", "h800-sxm5", "h800-80gb"), "China-market H100 SXM (NVLink limited): same Tensor Core peaks; unverified."),
    GPUSpec("h800-pcie", "NVIDIA H800 PCIe", 90, 81559, 80, 2000, 756, 1513, None, _H800,
            ("h800-pcie-80gb",), "China-market H100 PCIe: same Tensor Core peaks; unverified."),
    GPUSpec("h20", "NVIDIA H20", 90, 97871, 96, 4000, 148, 296, None, _H20, ("h20-96gb",),
            "China-market Hopper (SM 90), compute cut to ~15% of H100. Unverified (vendor figures); MiB approximate. "
            "A 141 GB HBM3e variant exists and is not this entry."),
    # --- Blackwell (SM 100 / 103 / 120) ------------------------------------------------
    GPUSpec("b200", "NVIDIA B200", 100, 183359, 180, 7700, 2250, 4500, 9000, _B200,
            ("b200-180gb", "hgx-b200", "dgx-b200"),
            "Bandwidth 7.7 TB/s per GPU as NVIDIA's current HGX B200 table states (read for issue 30); earlier B200 "
            "material said 8 TB/s. Unverified here: the live page could not be re-read (no internet)."),
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
    GPUSpec("gb10", "NVIDIA GB10 (DGX Spark)", 121, 122570, 128, 273, 125, 250, 500, _GB10,
            ("dgx-spark", "gb10-dgx-spark"),
            "SM 121, 128 GB LPDDR5x shared with the CPU (MiB = what CUDA can see, approximate). Unverified: FP4 = "
            "1 PFLOP (sparse) / 2, FP8 and BF16 halved per step as on other SM 12x parts."),
    # --- Refused by TensorRT-LLM 1.x (SM < 80); present so they are refused by name -----
    GPUSpec("v100", "Tesla V100-SXM2-32GB", 70, 32510, 32, 900, None, None, None, _V100,
            ("v100-32gb", "v100-sxm2-32gb", "v100-16gb", "v100-sxm2"), "Volta: no BF16; TensorRT-LLM 1.x needs SM >= 80."),
    GPUSpec("t4", "Tesla T4", 75, 15360, 16, 320, None, None, None, _T4,
            ("t4-16gb",), "Turing: no BF16; TensorRT-LLM 1.x needs SM >= 80."),
]

# Dense INT8 Tensor Core TOPS (= half the datasheet's "with sparsity" figure where only that is printed),
# from the same datasheet as each entry's ``source``: A100 624 (1,248 sparse), A30 330, A10 250, A40 299.3,
# L4 242.5 (485 sparse), L40 362, L40S 733 (1,466 sparse), H100 SXM 1,979 (3,958 sparse), H100 PCIe 1,513,
# H100 NVL 1,670.5, H200 1,979, H200 NVL 1,670.5. Only the GPUs where INT8 SmoothQuant builds and the figure
# is printed by NVIDIA; others are None (the estimate then says the INT8 peak is not catalogued).
_INT8_DENSE_TOPS: dict[str, float] = {
    "a100-40gb": 624, "a100-80gb": 624, "a30": 330, "a10": 250, "a40": 299.3, "l4": 242.5, "l40": 362,
    "l40s": 733, "a100-80gb-pcie": 624, "h100-sxm": 1979, "h100-pcie": 1513, "h100-nvl": 1670.5, "h200": 1979, "h200-nvl": 1670.5,
}
_SPECS = [replace(g, int8_tops=_INT8_DENSE_TOPS.get(g.id)) for g in _SPECS]


@dataclass(frozen=True)
class Interconnect:
    """How the GPUs of one tensor-parallel engine talk: ``kind`` (NVLink / PCIe), ``gbs`` = GB/s per GPU
    per direction (half the datasheet's bidirectional figure), ``latency_us`` = time of one small
    all-reduce (a launch plus a few hops; no datasheet states it: approximate, flagged in ``note``),
    ``source`` of the bandwidth."""

    kind: str
    gbs: float
    latency_us: float
    source: str
    note: str = ""

    def to_json(self) -> dict:
        return dict(self.__dict__)


_LAT_NOTE = ("latency approximate: one small all-reduce through TensorRT-LLM's custom all-reduce kernels takes a "
             "few microseconds on NVLink and tens on PCIe (no datasheet figure)")
_NVLINK_LAT_US, _PCIE_LAT_US = 8.0, 25.0
# (kind, bidirectional GB/s per GPU from the entry's datasheet) -> per direction = half. NVLink: H100/H200 SXM
# "NVLink: 900GB/s", H100 NVL "NVLink: 600GB/s" (bridge), H200 NVL "2- or 4-way NVLink bridge: 900GB/s", A100 SXM
# "NVLink: 600GB/s", HGX B200 / GB200 / B300 "NVLink 5: 1.8TB/s", H800 SXM "NVLink: 400GB/s". PCIe Gen5 x16 128 GB/s,
# Gen4 x16 64 GB/s (PCI-SIG), for cards without NVLink or with an optional 2-GPU bridge only.
_INTERCONNECT: dict[str, tuple[str, float]] = {
    "h100-sxm": ("NVLink 4", 900), "h200": ("NVLink 4", 900), "gh200": ("NVLink 4", 900), "h100-nvl": ("NVLink bridge", 600),
    "h200-nvl": ("NVLink bridge", 900), "h800-sxm": ("NVLink 4", 400), "a100-80gb": ("NVLink 3", 600),
    "a100-40gb": ("NVLink 3", 600), "a800-80gb": ("NVLink 3", 400), "b200": ("NVLink 5", 1800), "gb200": ("NVLink 5", 1800),
    "b300": ("NVLink 5", 1800), "h100-pcie": ("PCIe Gen5", 128), "h800-pcie": ("PCIe Gen5", 128), "h20": ("NVLink 4", 900),
    "rtx-pro-6000-blackwell": ("PCIe Gen5", 128), "rtx-5090": ("PCIe Gen5", 128), "l4": ("PCIe Gen4", 64),
    "l40s": ("PCIe Gen4", 64), "l40": ("PCIe Gen4", 64), "a100-80gb-pcie": ("PCIe Gen4", 64), "a10": ("PCIe Gen4", 64),
    "a10g": ("PCIe Gen4", 64), "rtx-4090": ("PCIe Gen4", 64), "rtx-6000-ada": ("PCIe Gen4", 64),
}


def interconnect(gpu: GPUSpec) -> Interconnect:
    """The tensor-parallel link of ``gpu`` (``_INTERCONNECT``; a GPU not listed is a PCIe Gen4 x16 card,
    64 GB/s bidirectional, which the note says)."""
    kind, bidir = _INTERCONNECT.get(gpu.id, ("PCIe Gen4", 64))
    lat = _NVLINK_LAT_US if kind.startswith("NVLink") else _PCIE_LAT_US
    listed = gpu.id in _INTERCONNECT
    src = (f"{gpu.source} ({kind}: {bidir:g} GB/s bidirectional)" if listed and kind.startswith("NVLink")
           else f"PCI-SIG {kind} x16: {bidir:g} GB/s bidirectional")
    note = _LAT_NOTE + ("" if listed else f"; {gpu.id}: no NVLink catalogued, PCIe Gen4 x16 assumed (unverified)")
    if gpu.id == "h20":
        note += "; H20 NVLink figure from vendor reports (unverified)"
    return Interconnect(kind, bidir / 2, lat, src, note)


CATALOG: dict[str, GPUSpec] = {g.id: g for g in _SPECS}
"""Canonical id -> GPUSpec."""

_ALIASES: dict[str, str] = {}
for _g in _SPECS:
    _ALIASES[_g.id] = _g.id
    for _a in _g.aliases:
        assert _a not in _ALIASES, _a
        _ALIASES[_a] = _g.id

_PREFIX = re.compile(r"^(nvidia-)?(geforce-|tesla-|quadro-)?")
_SRC = "build/precision_pipeline/spec/hardware.py"
_MIN_SM = 80  # TensorRT-LLM 1.x (formats.MIN_TRTLLM_SM; not imported: formats imports this module)
_MAX_SHOWN = 64  # characters of a user's name quoted in a message


def _compact(key: str) -> str:
    """A normalised name without its '-' separators ('rtx-a6000' -> 'rtxa6000')."""
    return key.replace("-", "")


_COMPACT: dict[str, str] = {}
for _a, _gid in _ALIASES.items():
    assert _COMPACT.setdefault(_compact(_a), _gid) == _gid, _a

# Old NVIDIA GPUs TensorRT-LLM 1.x cannot run (SM < 80), refused by name with their SM. V100 and T4 are
# full catalog entries (refused by the gpu.supported rule); these are not, so that ``gpus_with_sm``, the
# "known GPUs" list and ``invoke profiles --gpu`` stay about GPUs one can plan for. SMs from NVIDIA's
# CUDA GPU compute capability table, https://developer.nvidia.com/cuda-gpus.
# (regex on the compact name with any nvidia/geforce/tesla/quadro prefix removed, product name, SM)
_SUFFIX = r"(?:pcie|sxm\d?|\d+gb?|ti|super|maxq|mobile|laptop)*"
_LEGACY: tuple[tuple[str, str, int], ...] = (
    (r"k80", "Tesla K80", 37), (r"k40[cm]?", "Tesla K40", 35), (r"k20[xcm]?", "Tesla K20", 35),
    (r"m60", "Tesla M60", 52), (r"m40", "Tesla M40", 52), (r"m4", "Tesla M4", 52), (r"m10", "Tesla M10", 50),
    (r"p100", "Tesla P100", 60), (r"p40", "Tesla P40", 61), (r"p4", "Tesla P4", 61), (r"p6", "Tesla P6", 61),
    (r"[pg]p100", "Quadro GP100", 60), (r"p[1-6]000", "Quadro P-series (Pascal)", 61),
    (r"gtx10[5-8]0", "GeForce GTX 10xx", 61), (r"titanxp?|titanxpascal", "TITAN X (Pascal)", 61),
    (r"titanv", "TITAN V", 70), (r"gv100", "Quadro GV100", 70),
    (r"(?:gtx)?16[5-6]0", "GeForce GTX 16xx", 75), (r"(?:rtx)?20[6-8]0", "GeForce RTX 20xx", 75),
    (r"titanrtx", "TITAN RTX", 75), (r"rtx8000", "Quadro RTX 8000", 75),
    (r"quadrortx4000", "Quadro RTX 4000", 75), (r"quadrortx5000", "Quadro RTX 5000", 75),
    (r"quadrortx6000", "Quadro RTX 6000", 75),
)
_LEGACY_RE = [(re.compile(f"^(?:{pat}){_SUFFIX}$"), prod, sm) for pat, prod, sm in _LEGACY]
# GTX 10xx written without "gtx" ("1080 ti") is unambiguous too
_LEGACY_RE.append((re.compile(f"^10[5-8]0{_SUFFIX}$"), "GeForce GTX 10xx", 61))

# Names shared by GPUs of different architectures: refused with every reading, never guessed.
_AMBIGUOUS: dict[str, str] = {
    f"rtx{n}000": (f"'RTX {n}000' names GPUs of three architectures: rtx-{n}000-ada (RTX {n}000 Ada, SM 89), "
                   f"rtx-a{n}000 (RTX A{n}000, Ampere SM 86) and Quadro RTX {n}000 (Turing SM 75, not supported by "
                   "TensorRT-LLM 1.x); give the full name")
    for n in ("4", "5", "6")
}

# Accelerators of other vendors (compact names): not NVIDIA GPUs at all.
_OTHER_VENDORS: tuple[tuple[re.Pattern, str], ...] = tuple((re.compile(p), v) for p, v in (
    (r"^(?:amd)?(?:instinct)?mi\d{2,3}[a-z]*$|^amd|radeon|^rx\d{3,4}", "AMD"),
    (r"gaudi|habana|^intel|^arc[ab]?\d{3}|pontevecchio|^(?:datacenter)?gpumax|^max1[15]\d0|^flex1[47]0|xeon", "Intel"),
    (r"tpu|^google", "Google TPU"),
    (r"trainium|^trn\d|inferentia|^inf\d|^aws", "AWS Trainium/Inferentia"),
    (r"ascend|^910[bc]?$|huawei", "Huawei Ascend"),
    (r"^apple|^m\d(?:pro|max|ultra)$", "Apple silicon"),
    (r"cerebras|^wse\d|groq|^lpu|qualcomm|cloudai100|^sn\d0|sambanova", "another vendor's accelerator"),
))

# Characters that look like Latin letters/digits (Cyrillic and Greek), for the "typed in ASCII" hint.
_CONFUSABLE = str.maketrans("аеіорсхһкмнтвАВЕНІКМОРСТХаΑΒΕΗΙΚΜΝΟΡΤΧΥΖοικνρτυχ",
                            "aeiopcxhkmhtbABEHIKMOPCTXaABEHIKMNOPTXYZoikvptux")


def normalize_gpu_name(name: str) -> str:
    """Lower case, runs of spaces/underscores -> '-', leading 'nvidia-'/'geforce-'/'tesla-'/'quadro-' dropped."""
    s = re.sub(r"[\s_]+", "-", str(name).strip().lower())
    s = re.sub(r"-+", "-", s).strip("-")
    return _PREFIX.sub("", s, count=1)


def _shown(name: str) -> str:
    """``repr`` of a user's name, cut to ``_MAX_SHOWN`` characters (a message never quotes a whole input)."""
    if len(name) <= _MAX_SHOWN:
        return repr(name)
    return f"{name[:_MAX_SHOWN]!r}... ({len(name):,} characters)"


def _fold_digits(s: str) -> str:
    """'o' next to a digit read as '0' ('h1oo' -> 'h100'): the commonest typo in model numbers."""
    prev = None
    while prev != s:
        prev = s
        s = re.sub(r"(?<=\d)o|o(?=\d)", "0", s)
    return s


def _edit_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions, adjacent swaps."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def _model(s: str) -> tuple[str, list[str]]:
    """(letters before the first digit, digit runs) of a compact name: 'a10080gb' -> ('a', ['100', '80'])."""
    m = re.match(r"[a-z]*", s)
    return m.group(0), re.findall(r"\d+", s)


def _typo_of(key: str) -> Optional[str]:
    """The catalog id ``key`` is a typing slip of, or None.

    A suggestion needs all of: edit distance <= 1 (<= 2 for names of 8+ characters) to an id or alias
    after reading 'o' beside a digit as '0'; the same letters before the model number; the same digit
    runs, except that the model number may be cut short ('h10' -> 'h100', never 'a1000' -> 'a100': an
    extra digit is another product); and one GPU only at the smallest distance.
    """
    k = _fold_digits(_compact(key))
    if len(k) < 2 or len(k) > _MAX_SHOWN:
        return None
    kp, kd = _model(k)
    if not kd:
        return None
    found: dict[str, int] = {}
    for alias, gid in _ALIASES.items():
        c = _fold_digits(_compact(alias))
        cp, cd = _model(c)
        if cp != kp or len(cd) != len(kd) or cd[1:] != kd[1:]:
            continue
        if not (cd[0] == kd[0] or (len(kd[0]) >= 2 and cd[0].startswith(kd[0]))):
            continue
        d = _edit_distance(k, c)
        if d <= (2 if len(c) >= 8 else 1):
            found[gid] = min(d, found.get(gid, d))
    if not found:
        return None
    best = min(found.values())
    ids = [g for g, d in found.items() if d == best]
    return ids[0] if len(ids) == 1 else None


def _refuse(reason: str, fix: str, rule: str = "gpu.known"):
    raise UserError("target.gpu", reason, fix, rule=rule, source=_SRC)


def resolve_gpu(name: str) -> GPUSpec:
    """The catalog entry for an id or alias (exact after normalisation; never by substring).

    Also exact: the name without its '-' separators ('RTXA6000' = 'rtx-a6000'). Raises UserError on
    ``target.gpu`` (rule ``gpu.known``) for an empty name, a name with non-ASCII characters (look-alikes
    such as Cyrillic 'һ' are named), another vendor's accelerator, a name several architectures share
    ('RTX 6000') and any other unknown name; the fix lists the known ids and suggests one only for a
    typing slip of it (see ``_typo_of``: same letters and model digits, so never another architecture).
    Raises UserError with rule ``gpu.supported`` for an old NVIDIA GPU (SM < 80), naming its SM.
    """
    known = f"known GPUs: {', '.join(CATALOG)}."
    if not isinstance(name, str) or not name.strip():
        _refuse("is empty.", f"use one of: {', '.join(CATALOG)}.")
    shown = _shown(name)
    if not name.isascii():
        ch = next(c for c in name if not c.isascii())
        uname = unicodedata.name(ch, "unnamed character")
        ascii_form = unicodedata.normalize("NFKC", name).translate(_CONFUSABLE)
        gid = _ALIASES.get(normalize_gpu_name(ascii_form)) if ascii_form.isascii() and len(name) <= _MAX_SHOWN else None
        hint = f"typed in ASCII it reads {ascii_form.strip()!r} ({gid}); " if gid else ""
        _refuse(f"unknown GPU {shown}: it contains {ch!r} (U+{ord(ch):04X} {uname}), a non-ASCII character "
                "(it may only look like a Latin letter or digit); GPU names are plain ASCII.",
                f"retype the name in ASCII; {hint}{known}")
    key = normalize_gpu_name(name)
    gid = _ALIASES.get(key) or _COMPACT.get(_compact(key))
    if gid is not None:
        return CATALOG[gid]
    full = _compact(re.sub(r"^nvidia-", "", re.sub(r"[\s_]+", "-", name.strip().lower())))
    bare = _compact(key)
    for pat, vendor in _OTHER_VENDORS:
        if pat.search(bare) or pat.search(full):
            _refuse(f"{shown} is not an NVIDIA GPU ({vendor}); TensorRT-LLM runs on NVIDIA GPUs with SM >= {_MIN_SM}.",
                    f"plan for an NVIDIA GPU; {known}")
    for pat, product, sm in _LEGACY_RE:
        if pat.match(bare) or pat.match(full):
            _refuse(f"{shown} ({product}) is SM {sm} ({ARCH_BY_SM[sm]}); TensorRT-LLM 1.x supports SM >= {_MIN_SM} only "
                    "(Ampere, Ada, Hopper, Blackwell).",
                    "use an Ampere or newer GPU, e.g. a100-80gb, l4, h100-sxm.", rule="gpu.supported")
    if bare in _AMBIGUOUS:
        _refuse(f"unknown GPU {shown}.", f"{_AMBIGUOUS[bare]}; {known}")
    hint = _typo_of(key)
    near = f"the closest known GPU is {hint!r}; " if hint else ""
    _refuse(f"unknown GPU {shown}.", f"{near}{known}")


_VARIANTS: dict[str, tuple[str, ...]] = {
    "a100": ("a100-80gb", "a100-40gb"),
    "a800": ("a800-80gb", "a800-40gb"),
}
"""Aliases that name a product sold with different memory sizes (the A100 datasheet lists 40 GB and 80 GB
cards): the alias resolves to the first id, and ``variant_note`` says so (rule ``gpu.variant`` warns)."""


def variant_note(name: str) -> Optional[str]:
    """For an alias of a product with several memory sizes (``_VARIANTS``, e.g. ``a100``): a sentence naming
    the id it was read as and the other choices, with their memory; None for an exact id or any other name."""
    if not isinstance(name, str):
        return None
    ids = _VARIANTS.get(normalize_gpu_name(name))
    if not ids:
        return None
    chosen, others = CATALOG[ids[0]], [CATALOG[i] for i in ids[1:]]
    alts = ", ".join(f"{g.id} ({g.memory_gb:g} GB, {g.bandwidth_gbs:,.0f} GB/s)" for g in others)
    return (f"{_shown(name)} is read as {chosen.id} ({chosen.memory_gb:g} GB, {chosen.bandwidth_gbs:,.0f} GB/s); it also "
            f"names {alts}, for which memory plans and KV capacity differ")


def gpus_with_sm(ranges) -> list[GPUSpec]:
    """Catalog entries whose SM lies in any inclusive (lo, hi) range."""
    return [g for g in _SPECS if any(lo <= g.sm <= hi for lo, hi in ranges)]


__all__ = ["GPUSpec", "Interconnect", "interconnect", "CATALOG", "resolve_gpu", "normalize_gpu_name", "gpus_with_sm", "variant_note",
           "MIB", "GIB", "ARCH_BY_SM"]
