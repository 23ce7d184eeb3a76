"""A reused checkpoint (``--checkpoint``): its files against the profile (rule ``layout.checkpoint_mapping``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from precision_pipeline.spec import formats as F
from precision_pipeline.spec.profile import KVCacheQuantAlgo, Profile, QuantAlgo

from precision_pipeline.resolve.derive import derive_mapping
from precision_pipeline.resolve.registry import Finding, refuse


HF_QUANT_CONFIG = "hf_quant_config.json"
"""A unified HF checkpoint holds it (``checkpoint.reader.checkpoint_layout``, the one layout rule; checkpoint/ is a
layer above resolve, so the file name is repeated here)."""


def checkpoint_mapping_findings(p: Profile, checkpoint_dir: Optional[Path]) -> list[Finding]:
    """Compare a reused checkpoint's quantization (and, for a TRT-LLM checkpoint, its config.json ``mapping``) with
    the profile. A unified HF checkpoint's quantization is its ``hf_quant_config.json`` ``quantization``; it is not
    split per rank, so it has no mapping to compare. An HF ``quant_method`` mxfp4 checkpoint (gpt-oss as shipped)
    holds MXFP4 weights and an unquantized KV cache (``_mxfp4_quantization``), no mapping either.

    ``checkpoint_dir`` None or without config.json -> nothing to compare.
    """
    if checkpoint_dir is None or not (Path(checkpoint_dir) / "config.json").is_file():
        return []
    hf = (Path(checkpoint_dir) / HF_QUANT_CONFIG).is_file()
    path = Path(checkpoint_dir) / (HF_QUANT_CONFIG if hf else "config.json")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return [refuse("--checkpoint", f"{path} is not valid JSON ({e}).", "leave out --checkpoint so that the build quantizes.")]
    if not isinstance(cfg, dict):
        return [refuse("--checkpoint", f"{path} does not hold a JSON object.", "leave out --checkpoint so that the build quantizes.")]
    if not hf and isinstance(cfg.get("quantization_config"), dict) and cfg["quantization_config"].get("quant_method") == MXFP4_METHOD:
        hf, cfg = True, {"quantization": _mxfp4_quantization(p)}  # gpt-oss's checkpoint as shipped: not split per rank
    want = derive_mapping(p)
    got = {} if hf else (cfg.get("mapping") or {})
    if not isinstance(got, dict):
        got = {}
    out = []
    diffs = []
    for k in ("tp_size", "pp_size"):
        g = got.get(k, 1)
        if g != want[k] and not hf:
            diffs.append(f"{k} {g} (profile {want[k]})")
    for k in ("moe_tp_size", "moe_ep_size"):
        if k in got and got[k] != want[k]:
            diffs.append(f"{k} {got[k]} (profile {want[k]})")
    if diffs:
        out.append(refuse("parallel.tp_size", f"the reused checkpoint {checkpoint_dir} was exported with " + ", ".join(diffs) + ".",
                          "re-quantize: the checkpoint's rank*.safetensors are split for its own mapping "
                          "(delete the checkpoint or change the profile's parallel layout back)."))
    qz = cfg.get("quantization") or {}
    if isinstance(qz, dict):
        qa = qz.get("quant_algo") or QuantAlgo.NO_QUANT.value
        kv = qz.get("kv_cache_quant_algo") or KVCacheQuantAlgo.NONE.value
        if qa != p.quantization.quant_algo.value or kv != p.quantization.kv_cache_quant_algo.value:
            out.append(refuse("quantization.quant_algo",
                              f"the reused checkpoint {checkpoint_dir} holds quant_algo {qa} / kv_cache_quant_algo {kv}, "
                              f"the profile asks for {p.quantization.quant_algo.value} / {p.quantization.kv_cache_quant_algo.value}.",
                              "leave out --checkpoint so that the build quantizes, or use a profile that matches it."))
        elif F.GEMM[p.quantization.quant_algo].per_layer:
            out.extend(_mixed_reuse_findings(p, Path(checkpoint_dir)))
    return out


MXFP4_METHOD = "mxfp4"
"""An HF checkpoint's ``quantization_config.quant_method`` for MXFP4 experts as gpt-oss ships it
(``checkpoint.reader.checkpoint_layout`` ``hf_mxfp4``)."""


def _mxfp4_quantization(p: Profile) -> dict:
    """What an HF mxfp4 checkpoint holds, as a ``quantization`` section: MXFP4 weights, which TensorRT-LLM runs as the
    profile's MXFP4 QuantAlgo when it asks one (W4A16_MXFP4 on Hopper, W4A8_MXFP4_MXFP8 on Blackwell:
    ``tensorrt_llm/_torch/model_config.py`` ``get_mxfp4_quant_algo``), and an unquantized KV cache."""
    asked = p.quantization.quant_algo.value
    mx = tuple(a.value for a in (QuantAlgo.W4A16_MXFP4, QuantAlgo.W4A8_MXFP4_FP8, QuantAlgo.W4A8_MXFP4_MXFP8))
    return {"quant_algo": asked if asked in mx else "MXFP4 (quant_method mxfp4)", "kv_cache_quant_algo": None}


def _mixed_reuse_findings(p: Profile, ckpt: Path) -> list[Finding]:
    """A reused MIXED_PRECISION checkpoint must use only the profile's candidates and meet its budget."""
    fix = "leave out --checkpoint so that the build runs the search, or change the profile to match."
    try:
        qc = json.loads((ckpt / "quant_cfg.json").read_text(encoding="utf-8"))
        layers = qc.get("quantized_layers") if isinstance(qc, dict) else None
        used = {e.get("quant_algo") for e in layers.values() if isinstance(e, dict)} if isinstance(layers, dict) else set()
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return []  # the checkpoint reader reports a missing/broken quant_cfg.json with its own message
    want = {c.value for c in p.quantization.auto_quantize_formats}
    out = []
    extra = sorted(str(u) for u in used - want)
    if extra:
        out.append(refuse("quantization.auto_quantize_formats",
                          f"the reused checkpoint {ckpt} has layers in {', '.join(extra)}, which the profile's candidates "
                          f"({', '.join(sorted(want)) or 'none'}) do not include.", fix))
    try:
        achieved = json.loads((ckpt / "autoquant.json").read_text(encoding="utf-8")).get("effective_bits_achieved")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        achieved = None
    budget = p.quantization.auto_quantize_bits
    if isinstance(achieved, (int, float)) and budget is not None and achieved > budget + 1e-6:
        out.append(refuse("quantization.auto_quantize_bits",
                          f"the reused checkpoint {ckpt} averages {achieved:.3f} bits per searched weight, over the "
                          f"profile's budget of {budget}.", fix))
    return out
