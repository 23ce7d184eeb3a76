"""Verification of an HF checkpoint with MXFP4 experts as gpt-oss ships it, before the gate reads it.

The layout (``reader.checkpoint_layout`` ``"hf_mxfp4"``): config.json with ``quantization_config.quant_method``
``mxfp4`` (no ``hf_quant_config.json``), ``*.safetensors`` holding each layer's expert projections as
``mlp.experts.<proj>_blocks`` uint8 ``[E, out, in/32, 16]`` (two E2M1 codes a byte) and ``mlp.experts.<proj>_scales``
uint8 ``[E, out, in/32]`` (one E8M0 exponent per 32 inputs), ``<proj>`` = ``gate_up_proj`` (out = 2 x
``intermediate_size``, in = ``hidden_size``; gate/up rows interleaved) and ``down_proj`` (out = ``hidden_size``, in =
``intermediate_size``), with ``<proj>_bias`` ``[E, out]``; everything else (attention with its biases and sinks, the
router, norms, embedding, lm_head) unquantized. Sources: transformers ``integrations/mxfp4.py``
(``convert_moe_packed_tensors``), TensorRT-LLM ``tensorrt_llm/_torch/models/checkpoints/hf/gpt_oss_weight_mapper.py``
(the PyTorch backend loads this checkpoint as shipped; ``spec/formats.py`` ``SRC_MX_MOE``).

``verify_mxfp4_checkpoint(ckpt_dir, expect)`` reads config.json, the safetensors headers and the scale tensors only
and refuses (``UserError``, exit 2, every problem with the tensor, the rule and the fix):

* ``mx.metadata``: config.json names a family shipped with MXFP4 experts (``spec.families`` ``MoE.expert_format``:
  gpt-oss) with its sizes, ``quant_method`` mxfp4; the plan (``expect``) asks a format the gate reads of it
  (``families.MXFP4_READ_FORMATS``) with an unquantized KV cache.
* ``hf.router``: the router stored unquantized, without scales (``families.router_problems``; also a router stored as
  MXFP4 blocks).
* ``mx.layout``: every layer's two expert projections stored as blocks/scales of the shapes above (uint8), the
  inputs a multiple of 32, an unquantized ``[E, out]`` bias; no other tensor stored as blocks/scales or in a
  non-float dtype.
* ``mx.scales``: every E8M0 code <= ``MAX_E8M0`` (255 is NaN; from 253 the largest element, 6 x 2^(code - 127),
  overflows float32 and BF16).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from precision_pipeline.checkpoint.codecs import PLAIN_DTYPES
from precision_pipeline.checkpoint.hf_verify import Found as HFFound
from precision_pipeline.checkpoint.reader import safetensors_header
from precision_pipeline.core.errors import UserError
from precision_pipeline.spec.algos import KVCacheQuantAlgo, QuantAlgo
from precision_pipeline.spec.families import FAMILIES, MXFP4_READ_FORMATS, router_problems
from precision_pipeline.spec.formats import MX_BLOCK

MAX_E8M0 = 252
"""The largest E8M0 code whose largest MXFP4 element (6 x 2^(252 - 127) = 2.6e38) is finite in float32 and BF16."""
EXPERT_PROJ = ("gate_up_proj", "down_proj")
FIX = "give the model's MXFP4 checkpoint as shipped (e.g. openai/gpt-oss-20b), unmodified."
MX_RULES = {
    "mx.metadata": "config.json names a family shipped with MXFP4 experts, quant_method mxfp4, and the plan asks "
                   f"{'/'.join(MXFP4_READ_FORMATS)} with an unquantized KV cache",
    "mx.layout": "each layer's expert projections are uint8 blocks [E, out, in/32, 16] and scales [E, out, in/32] with "
                 "an unquantized [E, out] bias; every other tensor unquantized",
    "mx.scales": f"every E8M0 scale code <= {MAX_E8M0} (255 is NaN; larger codes overflow BF16)",
    "hf.router": "a MoE router is stored unquantized, without scales (spec/families.py router_problems)",
}
class _Found(HFFound):
    RULES = MX_RULES
    FIX = FIX


def _metadata(cfg: dict, expect: Optional[Mapping[str, Any]], p: _Found):
    """The family and its sizes ``(fam, layers, experts, hidden, inter)`` from config.json (``mx.metadata``)."""
    arch = (cfg.get("architectures") or [None])[0]
    fam = FAMILIES.get(arch)
    if fam is None or fam.moe is None or fam.moe.expert_format != "MXFP4":
        p.add("config.json: architectures", "mx.metadata", f"{arch!r} is not a family shipped with MXFP4 experts "
              f"(spec/families.py MoE.expert_format: {', '.join(a for a, f in FAMILIES.items() if f.moe and f.moe.expert_format)}).")
    if (cfg.get("quantization_config") or {}).get("quant_method") != "mxfp4":
        p.add("config.json: quantization_config", "mx.metadata", "has no quant_method mxfp4.")
    sizes = [cfg.get(k) for k in ("num_hidden_layers", "num_local_experts", "hidden_size", "intermediate_size")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes):
        p.add("config.json", "mx.metadata", "num_hidden_layers, num_local_experts, hidden_size and intermediate_size "
              f"must be positive integers; got {sizes}.")
    if expect:
        qa, kv = expect.get("quant_algo"), expect.get("kv_cache_quant_algo")
        if qa not in MXFP4_READ_FORMATS or kv not in (None, KVCacheQuantAlgo.NONE.value):
            p.add("quantization.quant_algo", "mx.metadata", f"the plan asks {qa} / KV {kv}; this checkpoint is weight-only "
                  f"MXFP4 with an unquantized KV cache ({'/'.join(MXFP4_READ_FORMATS)} / NONE).",
                  f"use quant_algo {MXFP4_READ_FORMATS[0]} and kv_cache_quant_algo NONE.")
    p.raise_if_any()
    return fam, *sizes


def _expert_layout(header: dict, i: int, dims: tuple[int, int, int], p: _Found) -> set[str]:
    """``mx.layout`` of layer ``i``'s expert projections; returns the tensor names it checked."""
    e, hidden, inter = dims
    seen = set()
    for proj, (out, inp) in zip(EXPERT_PROJ, ((2 * inter, hidden), (hidden, inter))):
        stem = f"model.layers.{i}.mlp.experts.{proj}"
        if inp % MX_BLOCK:
            p.add(stem, "mx.layout", f"has {inp} inputs, not a multiple of the MXFP4 block ({MX_BLOCK}).")
            continue
        want = {"_blocks": ("U8", [e, out, inp // MX_BLOCK, MX_BLOCK // 2]), "_scales": ("U8", [e, out, inp // MX_BLOCK]),
                "_bias": (PLAIN_DTYPES, [e, out])}
        for suffix, (dtypes, shape) in want.items():
            meta = header.get(stem + suffix)
            seen.add(stem + suffix)
            if meta is None:
                p.add(stem + suffix, "mx.layout", f"is missing (layer {i} of {e} experts: {'/'.join(want)}).")
            elif meta["dtype"] not in dtypes or meta["shape"] != shape:
                p.add(stem + suffix, "mx.layout", f"is {meta['dtype']} {meta['shape']}; config.json's sizes give "
                      f"{'/'.join(dtypes) if isinstance(dtypes, tuple) else dtypes} {shape}.")
    return seen


def verify_mxfp4_checkpoint(ckpt_dir: Path, expect: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Verify gpt-oss's MXFP4 checkpoint ``ckpt_dir`` (module doc). ``expect``: ``{"quant_algo",
    "kv_cache_quant_algo"}`` the plan assumes (None: not compared). Returns ``{"tensors", "scale_tensors",
    "scale_values", "linears" (attention q/k/v/o + one gate_up and one down per expert, per layer, + lm_head; the
    router is no linear), "files", "scale_bytes", "seconds", "rules", "e8m0_min", "e8m0_max"}``; raises UserError."""
    import torch
    from safetensors import safe_open

    t0, ck, p = time.perf_counter(), Path(ckpt_dir), _Found()
    try:
        cfg = json.loads((ck / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError("config.json", f"{ck / 'config.json'} cannot be read as JSON ({err}).", FIX, rule="mx.metadata")
    fam, layers, experts, hidden, inter = _metadata(cfg if isinstance(cfg, dict) else {}, expect, p)
    files = sorted(ck.glob("*.safetensors"))
    if not files:
        raise UserError("checkpoint", f"{ck} has no *.safetensors.", FIX, rule="mx.layout")
    header, where = {}, {}
    for f in files:
        for name, meta in safetensors_header(f, field="checkpoint").items():
            if name != "__metadata__":
                header[name], where[name] = meta, f
    stored = {n: m["dtype"] for n, m in header.items()}
    for name, why in router_problems(fam, stored):
        p.add(name, "hf.router", why, f"store the router in BF16 (ModelOpt and gpt-oss keep {fam.moe.router_hf} "
              f"unquantized; exclude_modules {', '.join(fam.moe.router_patterns)}).")
    p.raise_if_any()  # a quantized router first, as the other verifiers do
    seen = set()
    for i in range(layers):
        seen |= _expert_layout(header, i, (experts, hidden, inter), p)
    for name, meta in header.items():
        if name not in seen and (name.endswith(("_blocks", "_scales")) or meta["dtype"] not in PLAIN_DTYPES):
            rule = "hf.router" if f".{fam.moe.router_hf}" in name else "mx.layout"
            p.add(name, rule, f"is {meta['dtype']} {meta['shape']}: only the experts' {'/'.join(EXPERT_PROJ)} are "
                  "stored MXFP4; every other tensor stays unquantized (BF16).")
    p.raise_if_any()
    lo, hi, n_values, n_bytes = 255, 0, 0, 0
    for i in range(layers):
        for proj in EXPERT_PROJ:
            name = f"model.layers.{i}.mlp.experts.{proj}_scales"
            with safe_open(str(where[name]), framework="pt") as st:
                codes = st.get_tensor(name).to(torch.int32)
            n_values, n_bytes = n_values + codes.numel(), n_bytes + codes.numel()
            lo, hi = min(lo, int(codes.min())), max(hi, int(codes.max()))
            if int(codes.max()) > MAX_E8M0:
                p.add(name, "mx.scales", f"holds {int((codes > MAX_E8M0).sum())} E8M0 code(s) above {MAX_E8M0} (max "
                      f"{int(codes.max())}; 255 is NaN, 253-254 overflow BF16 at the largest element 6).")
    p.raise_if_any()
    return {"tensors": len(header), "scale_tensors": 2 * layers, "scale_values": n_values,
            "linears": layers * (4 + 2 * experts) + 1, "files": [f.name for f in files] + ["config.json"],
            "scale_bytes": n_bytes, "seconds": round(time.perf_counter() - t0, 4), "rules": sorted(MX_RULES),
            "e8m0_min": lo, "e8m0_max": hi}


def mxfp4_layer_table(ckpt_dir: Path) -> dict:
    """The checkpoint linear by linear from the headers (no tensor data), as ``reader.layer_table``: ``{"quant_algo",
    "kv_cache_quant_algo", "source", "architecture", "linears": [{"name", "quant_algo", "group_size", "params",
    "bytes", "bits_per_weight"}], "by_format", "effective_bits", "bytes" (all safetensors files)}``. The experts'
    ``<proj>_blocks`` + ``_scales`` are ``MXFP4_READ_FORMATS[0]`` (what TensorRT-LLM runs the checkpoint as on
    Hopper), every other 2-D ``.weight`` (attention, router, lm_head) NO_QUANT."""
    from precision_pipeline.checkpoint.reader import format_rows

    ck = Path(ckpt_dir)
    cfg = json.loads((ck / "config.json").read_text())
    mx = MXFP4_READ_FORMATS[0]
    sizes: dict[str, list] = {}  # stem -> [quant_algo, stored elements, bytes]
    for f in sorted(ck.glob("*.safetensors")):
        for name, meta in safetensors_header(f, field="checkpoint").items():
            if name == "__metadata__":
                continue
            nbytes, n = meta["data_offsets"][1] - meta["data_offsets"][0], 1
            for d in meta["shape"]:
                n *= int(d)
            if name.endswith(("_blocks", "_scales")):
                s = sizes.setdefault(name.rsplit("_", 1)[0], [mx, 0, 0])
                s[1], s[2] = s[1] + (n if name.endswith("_blocks") else 0), s[2] + nbytes
            elif name.endswith(".weight") and len(meta["shape"]) == 2 and "embed_tokens" not in name:
                sizes[name[: -len(".weight")]] = [QuantAlgo.NO_QUANT.value, n, nbytes]
    rows, by_fmt, bits, params = format_rows((stem, algo, MX_BLOCK if algo == mx else None, n, b)
                                             for stem, (algo, n, b) in sorted(sizes.items()))
    return {"quant_algo": mx, "kv_cache_quant_algo": KVCacheQuantAlgo.NONE.value,
            "source": "HF checkpoint with MXFP4 experts (config.json quant_method mxfp4, *.safetensors headers)",
            "architecture": (cfg.get("architectures") or [None])[0], "linears": rows,
            "by_format": dict(sorted(by_fmt.items())), "effective_bits": round(bits / params, 4) if params else None,
            "bytes": sum(f.stat().st_size for f in ck.glob("*.safetensors"))}


__all__ = ["verify_mxfp4_checkpoint", "mxfp4_layer_table", "MX_RULES", "MAX_E8M0"]
