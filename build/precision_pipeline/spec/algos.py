"""The vocabulary of formats: TensorRT-LLM 1.2 ``QuantAlgo`` names and KV-cache formats.

Only the names live here; everything the pipeline knows about each format is its entry in the
registry (``spec/formats.py``). Source: ``tensorrt_llm/quantization/mode.py`` (``QuantAlgo``,
``KV_CACHE_QUANT_ALGO_LIST``).
"""

from __future__ import annotations

from enum import Enum


class QuantAlgo(str, Enum):
    """GEMM formats a profile may ask for (TensorRT-LLM 1.2 ``QuantAlgo`` names).

    ``NO_QUANT`` means BF16/FP16 GEMMs (no quantization).
    """

    NO_QUANT = "NO_QUANT"
    FP8 = "FP8"
    NVFP4 = "NVFP4"
    W4A16_AWQ = "W4A16_AWQ"
    W4A8_AWQ = "W4A8_AWQ"
    W8A8_SQ_PER_CHANNEL = "W8A8_SQ_PER_CHANNEL"
    W8A16 = "W8A16"
    W4A16_NVFP4 = "W4A16_NVFP4"  # ModelOpt exports it; TensorRT-LLM 1.2 cannot build it (refused by a rule)
    MIXED_PRECISION = "MIXED_PRECISION"
    # MXFP4 weights (E2M1, E8M0 scale per 32), mode.py QuantAlgo lines 44-46 (NVIDIA/TensorRT-LLM 1.2-era, the
    # enum of shared/reference/trtllm-1.2-build-reference.md section 4); MXFP8 is not in that enum (added later).
    W4A16_MXFP4 = "W4A16_MXFP4"
    W4A8_MXFP4_FP8 = "W4A8_MXFP4_FP8"
    W4A8_MXFP4_MXFP8 = "W4A8_MXFP4_MXFP8"
    MXFP8 = "MXFP8"


class KVCacheQuantAlgo(str, Enum):
    """KV-cache formats (``KV_CACHE_QUANT_ALGO_LIST`` in quantization/mode.py, plus none)."""

    NONE = "NONE"  # KV cache in the model dtype (BF16)
    FP8 = "FP8"
    INT8 = "INT8"
    NVFP4 = "NVFP4"


__all__ = ["QuantAlgo", "KVCacheQuantAlgo"]
