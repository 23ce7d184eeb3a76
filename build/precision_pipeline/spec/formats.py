"""Data tables of the rules: which formats run on which SM, bytes per element, suggestions.

Every entry names the TensorRT-LLM 1.2 source file (or NVIDIA document) it was read from.
``build/precision_pipeline/resolve/rules.py`` turns these tables into checks; nothing here has logic beyond look-ups.

Sources (NVIDIA/TensorRT-LLM, 1.0-1.2-era commits):

* ``docs/source/features/quantization.md`` "Hardware Support Matrix": NVFP4 on Blackwell
  sm100/103 and sm120; FP8 (per tensor) on Ada, Hopper, Blackwell; FP8 KV cache on Ampere, Ada,
  Hopper, Blackwell; W4A8 AWQ on Ada and Hopper only; W4A16 AWQ on Ampere, Ada, Hopper.
* ``tensorrt_llm/builder.py`` ``build()``: for ``100 <= SM < 120`` it raises
  "INT8/INT4 quantization is not supported on SM>=100." (INT8/INT4 weight-only, INT8 KV cache)
  and "SmoothQuant is not supported on SM>=100." (and per-channel/per-token scaling).
* ``tensorrt_llm/quantization/mode.py``: ``QUANT_ALGO_LIST`` (what ``QuantMode.from_quant_algo``
  asserts) lacks ``W4A16_NVFP4``; ``KV_CACHE_QUANT_ALGO_LIST = [FP8, INT8, NVFP4]``.
* ``docs/source/legacy/reference/support-matrix.md`` "Hardware"/"Precision": Ampere (SM80, SM86)
  and newer; BF16 on all of them.
* Bytes per element / scale tensors: shared/reference/trtllm-1.2-build-reference.md section 7
  (what ModelOpt 0.47 writes into a TensorRT-LLM checkpoint, measured on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from precision_pipeline.spec.hardware import gpus_with_sm

SRC_QUANT_MD = "tensorrt_llm docs/source/features/quantization.md (Hardware Support Matrix)"
SRC_BUILDER = "tensorrt_llm/builder.py build()"
SRC_MODE = "tensorrt_llm/quantization/mode.py (QUANT_ALGO_LIST, KV_CACHE_QUANT_ALGO_LIST)"
SRC_SUPPORT = "tensorrt_llm docs/source/legacy/reference/support-matrix.md (Hardware, Precision)"
SRC_CKPT = "shared/reference/trtllm-1.2-build-reference.md section 7 (ModelOpt 0.47 checkpoint tensors)"
SRC_COMMON = "tensorrt_llm/_common.py check_max_num_tokens()"
SRC_INIT_SEQ = "tensorrt_llm/builder.py _init_max_seq_len()"
SRC_BUILDCONFIG = "tensorrt_llm/builder.py BuildConfig (defaults)"
SRC_PLUGIN = "tensorrt_llm/plugin/plugin.py PluginConfig"
SRC_BUILD_CMD = "tensorrt_llm/commands/build.py (trtllm-build flags)"

# What the quantize stage (ModelOpt 0.47) cannot export although TensorRT-LLM could build it
# (modelopt/torch/quantization/config.py defines FP8_KV_CFG, FP8_AFFINE_KV_CFG, NVFP4_KV_CFG,
# NVFP4_AFFINE_KV_CFG, NVFP4_KV_ROTATE_CFG, and no INT8 KV-cache config): (reason, fix)
INT8_KV_NOT_EXPORTED = ("INT8 KV cache: ModelOpt 0.47 ships no INT8 KV-cache config (only FP8_KV_CFG and NVFP4_KV_CFG), "
                        "so no calibrated INT8 KV scales can be exported.",
                        "use kv_cache_quant_algo: FP8 (SM >= 89) or NONE.")
SRC_MAPPING = "tensorrt_llm/mapping.py Mapping (tp/pp/moe_tp/moe_ep)"
SRC_BACKEND = "tensorrtllm_backend all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt"
SRC_KVCONFIG = "tensorrt_llm/llmapi/llm_args.py KvCacheConfig (free_gpu_memory_fraction)"

ANY = 10_000  # upper bound meaning "and every later SM"
MIN_TRTLLM_SM = 80


@dataclass(frozen=True)
class FormatEntry:
    """Where a format runs.

    ``sm_ranges``: inclusive (lo, hi) SM ranges where TensorRT-LLM 1.2 builds it (empty = never).
    ``warn_ranges``: SMs where the builder accepts it but the support matrix does not list it.
    ``needs``: human text of the requirement, used in refusals.
    ``weight_bytes``: bytes per weight element of a quantized linear (without scales).
    """

    algo: str
    kind: str  # "gemm" or "kv"
    short: str
    label: str
    sm_ranges: tuple[tuple[int, int], ...]
    needs: str
    source: str
    weight_bytes: float = 2.0
    warn_ranges: tuple[tuple[int, int], ...] = ()
    refusal: str = ""

    def supports(self, sm: int) -> bool:
        return any(lo <= sm <= hi for lo, hi in self.sm_ranges)

    def untested(self, sm: int) -> bool:
        return any(lo <= sm <= hi for lo, hi in self.warn_ranges)

    def sm_text(self) -> str:
        """e.g. 'SM 100, 103 or 120-121' / 'SM >= 89'."""
        parts = []
        for lo, hi in self.sm_ranges:
            if hi >= ANY:
                parts.append(f">= {lo}")
            elif lo == hi:
                parts.append(str(lo))
            else:
                parts.append(f"{lo}-{hi}")
        if not parts:
            return "no SM"
        if len(parts) == 1:
            return "SM " + parts[0]
        return "SM " + ", ".join(parts[:-1]) + " or " + parts[-1]

    def gpu_ids(self) -> list[str]:
        """Catalog GPUs that run it."""
        return [g.id for g in gpus_with_sm(self.sm_ranges)]


# GEMM formats (quantization.quant_algo) --------------------------------------------------------
GEMM_FORMATS: dict[str, FormatEntry] = {e.algo: e for e in [
    FormatEntry("NO_QUANT", "gemm", "bf16", "BF16 (no quantization)", ((80, ANY),),
                "BF16 needs SM >= 80 (Ampere or newer)", SRC_SUPPORT, 2.0),
    FormatEntry("FP8", "gemm", "fp8", "FP8 E4M3, per-tensor scales", ((89, ANY),),
                "FP8 GEMMs need SM >= 89 (Ada, Hopper, Blackwell)", SRC_QUANT_MD, 1.0),
    FormatEntry("NVFP4", "gemm", "nvfp4", "NVFP4 (FP4 E2M1, FP8 scale per 16 elements)", ((100, 100), (103, 103), (120, 121)),
                "NVFP4 needs Blackwell: SM 100, 103, 120 or 121", SRC_QUANT_MD, 0.5),
    FormatEntry("W4A8_AWQ", "gemm", "w4a8-awq", "INT4 AWQ weights, FP8 activations", ((89, 90),),
                "W4A8 AWQ needs Ada or Hopper: SM 89 or 90", SRC_QUANT_MD, 0.5),
    FormatEntry("W4A16_AWQ", "gemm", "int4-awq", "INT4 AWQ weights, BF16 activations", ((80, 99), (120, ANY)),
                "INT4 weight-only (AWQ) is refused by trtllm-build on SM 100-119 ('INT8/INT4 quantization is not supported on SM>=100')", SRC_BUILDER, 0.5,
                warn_ranges=((120, ANY),)),
    FormatEntry("W8A16", "gemm", "int8-wo", "INT8 weight-only (per-channel)", ((80, 99), (120, ANY)),
                "INT8 weight-only is refused by trtllm-build on SM 100-119 ('INT8/INT4 quantization is not supported on SM>=100')", SRC_BUILDER, 1.0,
                warn_ranges=((120, ANY),)),
    FormatEntry("W8A8_SQ_PER_CHANNEL", "gemm", "int8-sq", "INT8 SmoothQuant (per-channel weights)", ((80, 99), (120, ANY)),
                "INT8 SmoothQuant is refused by trtllm-build on SM 100-119 ('SmoothQuant is not supported on SM>=100')", SRC_BUILDER, 1.0,
                warn_ranges=((120, ANY),)),
    FormatEntry("W4A16_NVFP4", "gemm", "w4a16-nvfp4", "NVFP4 weights, BF16 activations", (),
                "W4A16_NVFP4 is not a TensorRT-LLM 1.2 QuantAlgo", SRC_MODE, 0.5,
                refusal="W4A16_NVFP4 is written by ModelOpt (W4A16_NVFP4_CFG) but is not in TensorRT-LLM 1.2's "
                        "QUANT_ALGO_LIST, so trtllm-build cannot build it on any GPU."),
    FormatEntry("MIXED_PRECISION", "gemm", "mixed", "per-layer formats (mtq.auto_quantize)", ((80, ANY),),
                "each candidate format must run on the GPU", SRC_MODE, 1.0),
]}

# KV-cache formats (quantization.kv_cache_quant_algo) -------------------------------------------
KV_FORMATS: dict[str, FormatEntry] = {e.algo: e for e in [
    FormatEntry("NONE", "kv", "bf16", "KV cache in the model dtype", ((80, ANY),),
                "a BF16 KV cache needs SM >= 80", SRC_SUPPORT, 2.0),
    FormatEntry("FP8", "kv", "fp8", "FP8 KV cache", ((80, ANY),),
                "an FP8 KV cache needs SM >= 80 (the matrix lists it for Ampere too)", SRC_QUANT_MD, 1.0),
    FormatEntry("INT8", "kv", "int8", "INT8 KV cache", ((80, 99), (120, ANY)),
                "an INT8 KV cache is refused by trtllm-build on SM 100-119 ('INT8/INT4 quantization is not supported on SM>=100')", SRC_BUILDER, 1.0),
    FormatEntry("NVFP4", "kv", "nvfp4", "NVFP4 KV cache", ((100, 100), (103, 103), (120, 121)),
                "an NVFP4 KV cache needs Blackwell: SM 100, 103, 120 or 121", SRC_MODE + "; " + SRC_QUANT_MD, 0.5 + 1 / 16),
]}

# Formats suggested instead of a refused one, in order of preference (speed, then accuracy).
SUGGEST_ORDER = ("FP8", "NVFP4", "W4A8_AWQ", "W8A8_SQ_PER_CHANNEL", "W4A16_AWQ", "NO_QUANT")

# Quant algos for which the builder keeps use_fp8_context_fmha (builder.py build()).
FP8_CONTEXT_FMHA_ALGOS = ("FP8", "W4A8_AWQ", "NVFP4")
FP8_CONTEXT_FMHA_MIN_SM = 89

# Group / block sizes along the input dimension of a linear.
NVFP4_BLOCK = 16
AWQ_ALGOS = ("W4A16_AWQ", "W4A8_AWQ")

# KV cache bytes per element (K or V value) by kv_cache_quant_algo.
KV_BYTES = {"NONE": 2.0, "FP8": 1.0, "INT8": 1.0, "NVFP4": 0.5 + 1 / 16}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# BuildConfig defaults when a limit is left out (tensorrt_llm/builder.py BuildConfig).
DEFAULT_MAX_INPUT_LEN = 1024
DEFAULT_MAX_NUM_TOKENS = 8192
DEFAULT_MAX_SEQ_LEN_NO_POSITIONS = 2048  # _init_max_seq_len when max_position_embeddings is None
MAX_NUM_TOKENS_ADVISED = 16384  # _common.check_max_num_tokens warns above this

# Triton data types of the tensorrt_llm model's logits outputs (tensorrtllm_backend config.pbtxt).
TRITON_DTYPE = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16"}
# trtllm-build --logits_dtype choices (tensorrt_llm/commands/build.py).
LOGITS_DTYPES_TRTLLM_BUILD = ("float16", "float32")

# Memory planning constants (estimates, documented in build/precision_pipeline/resolve/plan.py).
RUNTIME_RESERVE_BYTES = 1 << 30  # CUDA context, cuBLAS/NCCL workspaces, Triton: ~1 GiB (estimate)
SCALE_F32 = 4


def linear_weight_bytes(algo: str, n_in: int, n_out: int, group_size: Optional[int], dtype_bytes: int = 2,
                        bits: Optional[float] = None) -> float:
    """Bytes of one quantized linear's checkpoint tensors (weight + scales), for ``n_in x n_out``.

    Per SRC_CKPT: FP8: F8 weight + F32 weight & activation scales. NVFP4: packed U8 (0.5 B/elt) +
    F8 scale per 16 inputs + two F32 scalars. W4A16_AWQ: int4 (0.5 B/elt) + F32 scale per group +
    BF16 pre-quant scale per input; W4A8_AWQ adds two F32 scalars. W8A8_SQ_PER_CHANNEL: I8 + F32
    per output channel + F32 activation scale + BF16 pre-quant scale. W8A16: I8 + F32 per output.
    MIXED_PRECISION: ``bits`` per element (estimate). NO_QUANT: model dtype.
    """
    n = n_in * n_out
    if algo == "FP8":
        return n + 2 * SCALE_F32
    if algo in ("NVFP4", "W4A16_NVFP4"):
        return n / 2 + n / NVFP4_BLOCK + 2 * SCALE_F32
    if algo in AWQ_ALGOS:
        g = group_size or 128
        b = n / 2 + SCALE_F32 * n_out * -(-n_in // g) + dtype_bytes * n_in
        return b + (2 * SCALE_F32 if algo == "W4A8_AWQ" else 0)
    if algo == "W8A8_SQ_PER_CHANNEL":
        return n + SCALE_F32 * n_out + SCALE_F32 + dtype_bytes * n_in
    if algo == "W8A16":
        return n + SCALE_F32 * n_out
    if algo == "MIXED_PRECISION":
        return n * (bits or 8.0) / 8
    return n * dtype_bytes


def supported_alternatives(sm: int, exclude: str = "") -> list[FormatEntry]:
    """GEMM formats of SUGGEST_ORDER that run on ``sm`` (minus ``exclude``)."""
    return [GEMM_FORMATS[a] for a in SUGGEST_ORDER if a != exclude and GEMM_FORMATS[a].supports(sm)]


def join_or(items: list[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    items = list(items)
    if not items:
        return ""
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " or " + items[-1]


__all__ = [n for n in dir() if n.isupper() or n in ("FormatEntry", "linear_weight_bytes", "supported_alternatives", "join_or")]
