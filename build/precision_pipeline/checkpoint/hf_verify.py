"""Verification of ModelOpt's unified HF checkpoint (the LLM-API route), before the gate reads it.

``verify_hf_checkpoint(ckpt_dir, expect)`` reads config.json, ``hf_quant_config.json`` (and ``quant_cfg.json``),
the safetensors headers and the scale tensors only, and refuses (``UserError``, exit 2, every problem with the
tensor or file, the rule and the fix) what TensorRT-LLM's LLM API (PyTorch backend,
``tensorrt_llm/_torch/model_config.py`` ``ModelConfig.from_pretrained``) would refuse, plus what it would load
silently wrong:

* ``hf.metadata``: ``hf_quant_config.json`` names known formats and equals the plan's (``expect``); config.json's
  ``quantization_config`` agrees with it on quant_algo, kv_cache_quant_algo, group_size, the exclude set and the
  per-layer table (the runtime takes ``hf_quant_config.json`` and only logs a warning when they differ:
  ``tensorrt_llm/quantization/modelopt_config.py`` ``warn_if_inline_quant_config_differs``, lines 197-245 at
  2edf354, fields ``_INVARIANT_FIELDS`` lines 178-182); MIXED_PRECISION's ``quant_cfg.json`` has the same
  ``kv_cache_quant_algo`` (the runtime raises RuntimeError, ``ModelConfig._build_modelopt_quant_config``).
* ``hf.names``: every ``exclude_modules`` pattern and every ``quantized_layers`` name matches a module of the
  checkpoint (one that matches none leaves the layer it meant quantized, or loads it unquantized, silently).
* ``hf.known_tensors``: every tensor is a Llama HF name with a suffix its format stores (no ModelOpt leftovers); for
  a family with ``Family.hf_read`` (Qwen3, Qwen3-MoE, Mixtral, Qwen2-MoE) also each expert's and shared expert's
  linears (``families.hf_linear_shapes``), the router and a shared-expert gate (``MoE.router_modules``)
  (unquantized: ``hf.router``) and the family's norms (QK-norm).
* ``hf.layout``: per linear the weight and scales its declared format stores (the codecs' layouts,
  ``codecs.Codec.layout``, under the HF names ``hf_unified.HF_SUFFIX``): FP8 weight F8_E4M3 with F32
  ``weight_scale`` and ``input_scale``; NVFP4 U8 packed with F8_E4M3 block ``weight_scale`` and F32
  ``weight_scale_2``; W4A16 AWQ U8 ``[out/2, in]`` with F32 group scales and ``pre_quant_scale`` only where
  the export did not fold it into the norm (``hf_unified.hf_slots``); an excluded linear stored in high precision
  with no scales.
* ``hf.kv_scales``: a quantized KV cache has ``k_proj.k_scale`` and ``v_proj.v_scale`` (F32 scalar) in every layer;
  an unquantized one has none.
* ``hf.scales_finite``: every scale value finite, per-tensor scales > 0, block scales >= 0.
* ``hf.biases``: the family's biased linears (``spec.families`` ``Family.bias_linears``: Qwen2's q/k/v,
  ``tensorrt_llm/_torch/models/modeling_qwen.py`` ``QwenAttention(bias=True, dense_bias=False)``) store a bias in
  every layer, unquantized, ``[out]``; a bias anywhere else is an unknown tensor (``hf.known_tensors``).
* ``hf.fused_scales``: q/k/v and gate/up (one fused GEMM in the runtime) have one format and equal ``input_scale``
  (the runtime takes the max of them silently, ``FP8QDQLinearMethod.load_weights_fused_qkv_linear``).
"""

from __future__ import annotations

import fnmatch
import json
import math
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from precision_pipeline.checkpoint import codecs
from precision_pipeline.checkpoint.hf_unified import (HF_SUFFIX, KV_SCALE_OF, QUANT_CFG, hf_headers, hf_linear_format,
                                                      hf_slots, module_names, parse_quant_config, read_hf_quant)
from precision_pipeline.checkpoint.reader import HF_QUANT_CONFIG
from precision_pipeline.core.errors import Problem, UserError
from precision_pipeline.spec import formats as FMT
from precision_pipeline.spec.families import (FAMILIES, GATE_ARCHITECTURES, family, hf_linear_shapes, num_experts_of,
                                              router_problems)

FIX = "re-export the checkpoint (quantize again with export_format hf_unified)."
HF_RULES = {
    "hf.metadata": "hf_quant_config.json, config.json quantization_config, quant_cfg.json and the plan agree",
    "hf.names": "every exclude_modules pattern and quantized_layers name matches a module of the checkpoint",
    "hf.known_tensors": "every tensor is a name of the HF Llama layout (a Family.hf_read family's experts, shared "
                        "expert, router and QK-norm) with a suffix its format stores",
    "hf.layout": "each linear's weight and scale tensors have its declared format's dtype and shape",
    "hf.kv_scales": "a quantized KV cache has k_scale / v_scale in every layer; an unquantized one has none",
    "hf.scales_finite": "every scale value finite; per-tensor scales > 0",
    "hf.fused_scales": "q/k/v and gate/up (fused in the runtime) have one format and equal input scales",
    "hf.router": "a MoE router (and shared-expert gate) is stored unquantized, without scales (spec/families.py "
                 "router_problems)",
    "hf.biases": "the family's biased linears (Qwen2's q/k/v) store an unquantized bias in every layer; no other does",
}
MAX_SHOWN = 12


class Found(list):
    """Problems found by a verifier: each names its rule (``RULES``: rule -> what it requires); ``raise_if_any``
    raises one UserError showing at most ``MAX_SHOWN`` of them. A verifier of another layout subclasses it with its
    own ``RULES`` and ``FIX`` (checkpoint/mxfp4_verify.py)."""

    RULES: Mapping[str, str] = HF_RULES
    FIX: str = FIX

    def add(self, where: str, rule: str, reason: str, fix: Optional[str] = None) -> None:
        self.append(Problem(where, reason, fix or self.FIX, rule=rule, source=self.RULES[rule]))

    def raise_if_any(self) -> None:
        if self:
            shown = self[:MAX_SHOWN] + ([Problem("checkpoint", f"{len(self) - MAX_SHOWN} more problems of the same "
                                                 "kinds.", self.FIX)] if len(self) > MAX_SHOWN else [])
            raise UserError(shown)


def _histogram(layers: dict) -> dict:
    out: dict[str, int] = {}
    for e in layers.values():
        a = str((e or {}).get("quant_algo", "UNKNOWN")).upper() if isinstance(e, dict) else "UNKNOWN"
        out[a] = out.get(a, 0) + 1
    return out


def _metadata(d: Path, cfg: dict, expect: Optional[Mapping[str, Any]], p: Found) -> Optional[dict]:
    try:
        raw = json.loads((d / HF_QUANT_CONFIG).read_text())
        file_q = parse_quant_config(raw, HF_QUANT_CONFIG)
    except (OSError, ValueError) as e:
        p.add(HF_QUANT_CONFIG, "hf.metadata", f"cannot be read as JSON ({e}).")
        return None
    except UserError as e:
        p.add(HF_QUANT_CONFIG, "hf.metadata", str(e))
        return None
    algo, kv = file_q["quant_algo"] or FMT.QuantAlgo.NO_QUANT.value, file_q["kv_cache_quant_algo"]
    if FMT.GEMM.get(algo) is None:
        p.add(f"{HF_QUANT_CONFIG}: quantization.quant_algo", "hf.metadata", f"{algo!r} is not a known format.")
    if kv is not None and FMT.KV.get(kv) is None:
        p.add(f"{HF_QUANT_CONFIG}: quantization.kv_cache_quant_algo", "hf.metadata", f"{kv!r} is not a known KV format.")
    inline = cfg.get("quantization_config")
    if inline is None:
        p.add("config.json: quantization_config", "hf.metadata", f"is missing but {HF_QUANT_CONFIG} declares {algo}: "
              "a loader that reads config.json only would load the quantized tensors as a plain model.")
    else:
        try:
            in_q = parse_quant_config(inline, "config.json: quantization_config")
        except UserError as e:
            p.add("config.json: quantization_config", "hf.metadata", str(e))
            in_q = None
        if in_q is not None:
            for key in ("quant_algo", "kv_cache_quant_algo", "group_size"):
                if in_q[key] != file_q[key]:
                    p.add(f"config.json: quantization_config.{key}", "hf.metadata",
                          f"is {in_q[key]!r} but {HF_QUANT_CONFIG} says {file_q[key]!r}: TensorRT-LLM serves the latter "
                          "and only logs a warning (warn_if_inline_quant_config_differs), other loaders the former.")
            if set(in_q["exclude_modules"]) != set(file_q["exclude_modules"]):
                p.add("config.json: quantization_config.ignore", "hf.metadata",
                      f"lists {sorted(in_q['exclude_modules'])} but {HF_QUANT_CONFIG} exclude_modules lists "
                      f"{sorted(file_q['exclude_modules'])}.")
            if _histogram(in_q["quantized_layers"]) != _histogram(file_q["quantized_layers"]):
                p.add("config.json: quantization_config.quantized_layers", "hf.metadata",
                      f"differs from {HF_QUANT_CONFIG}'s per-layer table.")
    try:
        q = read_hf_quant(d)  # quant_cfg.json laid over, its kv_cache_quant_algo checked (the runtime raises)
    except UserError as e:
        for pr in e.problems:
            p.add(pr.field, "hf.metadata", pr.reason, pr.fix)
        return None
    for key, mine in (("quant_algo", q["quant_algo"]), ("kv_cache_quant_algo", q["kv_cache_quant_algo"] or FMT.KVCacheQuantAlgo.NONE.value)):
        want = (expect or {}).get(key)
        want = getattr(want, "value", want)
        if want is not None and want != mine:
            p.add(f"{HF_QUANT_CONFIG}: quantization.{key}", "hf.metadata", f"is {mine} but the plan (profile "
                  f"quantization.{key}) is {want}.", "build from the profile the checkpoint was made with, or re-export it.")
    for name, e in q["layers"].items():
        if FMT.GEMM.get(e["quant_algo"]) is None or FMT.GEMM[e["quant_algo"]].per_layer:
            p.add(f"{HF_QUANT_CONFIG}: quantized_layers.{name}", "hf.metadata", f"has quant_algo {e['quant_algo']!r}, "
                  "not a single known format.")
    return q


def _scale_stats(st, name: str) -> tuple[int, int, int, float]:
    import torch

    t = st.get_tensor(name)
    v = codecs.fp8_e4m3_to_float(t) if t.dtype == torch.float8_e4m3fn else t.to(torch.float32)
    v = v.reshape(-1)
    fin = v[torch.isfinite(v)]
    return v.numel(), int((~torch.isfinite(v)).sum()), int((fin < 0).sum()), float(fin.min()) if fin.numel() else math.nan


def _names(headers: dict, cfg: dict, q: dict, p: Found) -> None:
    """``hf.names``: every exclude pattern and per-layer name matches a module of the checkpoint."""
    modules = module_names(headers, cfg)
    for pat in q["exclude_modules"]:
        if not any(fnmatch.fnmatchcase(m, pat) for m in modules):
            p.add(f"{HF_QUANT_CONFIG}: exclude_modules {pat!r}", "hf.names", "matches no module of the checkpoint: the "
                  "layer it was meant to keep in high precision is loaded as the checkpoint's format, or the pattern "
                  "is stale.", "name HF modules (model.layers.N.self_attn.q_proj, lm_head) and re-export.")
    for name in q["layers"]:
        if name not in modules:
            p.add(f"{HF_QUANT_CONFIG}: quantized_layers.{name}", "hf.names", "is no module of the checkpoint: TensorRT-LLM "
                  "finds no per-layer entry for the real layer and loads it unquantized, silently.", FIX)


def _dims(cfg: dict) -> dict[str, tuple[int, int]]:
    """``(out, in)`` of each HF linear of a layer of the config's family (relative name; experts included) and of
    ``lm_head`` (``families.hf_linear_shapes``)."""
    return hf_linear_shapes(cfg)


def _classify(headers: dict, cfg: dict, q: dict, dims: dict, arch: str, p: Found) -> tuple[dict, list]:
    """Each tensor by its role (``hf.known_tensors``, norms' dtype, ``hf.kv_scales``): returns ({linear: {leaf:
    header}}, [scale tensor names])."""
    kvf = FMT.kv(q["kv_cache_quant_algo"] or FMT.KVCacheQuantAlgo.NONE.value)
    linears: dict[str, dict[str, dict]] = {}  # module -> {leaf: header}
    scales: list[str] = []
    fam = family(arch)
    roles = {f"{n}.weight" for n in fam.norms}  # the family's norms (Qwen3-MoE: self_attn.q_norm / k_norm too)
    routers = fam.moe.router_modules if fam.moe is not None else ()  # unquantized: router_problems ran before
    for name, (f, meta) in headers.items():
        stem, _, leaf = name.rpartition(".")
        rel = stem.split(".", 3)[3] if stem.startswith("model.layers.") and stem.count(".") >= 3 else stem
        if name in ("model.embed_tokens.weight", "model.norm.weight") or (stem.startswith("model.layers.") and (
                rel + "." + leaf in roles or (rel in routers and leaf in ("weight", "bias")))):
            if meta["dtype"] not in codecs.PLAIN_DTYPES:
                p.add(f"{name} ({f.name})", "hf.layout", f"is {meta['dtype']}; it is stored in {'/'.join(codecs.PLAIN_DTYPES)}.")
        elif rel in KV_SCALE_OF and leaf == KV_SCALE_OF[rel]:
            if not kvf.is_quantized:
                p.add(f"{name} ({f.name})", "hf.kv_scales", f"is a KV-cache scale but kv_cache_quant_algo is "
                      f"{q['kv_cache_quant_algo']}: the export quantized a KV cache the metadata does not declare.")
            elif meta["dtype"] != "F32" or tuple(meta["shape"]) not in ((), (1,)):
                p.add(f"{name} ({f.name})", "hf.kv_scales", f"is {meta['dtype']} {meta['shape']}; a KV scale is F32 [].")
            scales.append(name)
        elif rel in dims and (leaf == "weight" or leaf in HF_SUFFIX):
            linears.setdefault(stem, {})[leaf] = meta
            if leaf in HF_SUFFIX:
                scales.append(name)
        elif leaf == "bias" and rel in family(arch).bias_linears:
            if meta["dtype"] not in codecs.PLAIN_DTYPES or meta["shape"] != [dims[rel][0]]:
                p.add(f"{name} ({f.name})", "hf.biases", f"is {meta['dtype']} {meta['shape']}; the bias is stored "
                      f"unquantized ({'/'.join(codecs.PLAIN_DTYPES)}) [{dims[rel][0]}].")
        else:
            p.add(f"{name} ({f.name})", "hf.known_tensors", f"is not a tensor of a {arch} unified HF checkpoint"
                  + (" (a ModelOpt quantizer buffer left in the export)" if "quantizer" in name or "amax" in name else "") + ".")
    for i in range(int(cfg["num_hidden_layers"])):
        for rel in family(arch).bias_linears:  # Qwen2: transformers modeling_qwen2.py q/k/v_proj bias=True
            if f"model.layers.{i}.{rel}.bias" not in headers:
                p.add(f"model.layers.{i}.{rel}.bias", "hf.biases", f"is missing; a {arch} {rel} carries a bias "
                      "(spec/families.py attention_bias): the runtime would run without it.")
    if kvf.is_quantized:
        for i in range(int(cfg["num_hidden_layers"])):
            for rel, leaf in KV_SCALE_OF.items():
                if f"model.layers.{i}.{rel}.{leaf}" not in headers:
                    p.add(f"model.layers.{i}.{rel}.{leaf}", "hf.kv_scales", f"is missing; kv_cache_quant_algo is "
                          f"{q['kv_cache_quant_algo']}.")
    return linears, scales


def _layouts(linears: dict, q: dict, dims: dict, p: Found) -> None:
    """``hf.layout``: each linear's tensors against its declared format's layout (the codecs')."""
    for stem, leaves in sorted(linears.items()):
        rel = stem.split(".", 3)[3] if stem.startswith("model.layers.") else stem
        algo, group = hf_linear_format(q, stem)
        fmt = FMT.gemm(algo)
        codec = codecs.CODECS.get(fmt.codec or "")
        if codec is None:
            p.add(stem, "hf.layout", f"is declared {algo}, which no codec reads.")
            continue
        want, optional = hf_slots(fmt, rel, codec.layout(fmt, *dims[rel], group))
        w = leaves.get("weight")
        if w is None:
            p.add(f"{stem}.weight", "hf.layout", "is missing.")
            continue
        if fmt.is_quantized != (w["dtype"] not in codecs.PLAIN_DTYPES):
            p.add(f"{stem}.weight", "hf.layout", f"is stored {w['dtype']} but declared {algo} (exclude_modules / "
                  "quantized_layers decide).")
            continue
        for leaf, slot in want.items():
            meta = leaves.get(leaf)
            if meta is None:
                p.add(f"{stem}.{leaf}", "hf.layout", f"is missing; {algo} stores {slot.text()} here.")
            elif meta["dtype"] not in slot.dtypes or not slot.fits(meta["shape"]):
                p.add(f"{stem}.{leaf}", "hf.layout", f"is {meta['dtype']} {meta['shape']}; {algo} stores {slot.text()} "
                      f"for [{dims[rel][0]}, {dims[rel][1]}]" + (f" (group_size {group})" if group else "") + ".")
        for leaf in sorted(set(leaves) - set(want) - optional):
            p.add(f"{stem}.{leaf}", "hf.layout", f"is not part of {algo}'s layout"
                  + (" (the linear is excluded: stored in high precision, so it has no scales)" if not fmt.is_quantized else "")
                  + ".")


def _values(headers: dict, scales: list, p: Found) -> tuple[dict[str, float], int, int]:
    """``hf.scales_finite`` over the scale tensors' values; returns (per-tensor values, values read, bytes read)."""
    from safetensors import safe_open

    values: dict[str, float] = {}
    n_values = scale_bytes = 0
    by_file: dict[Path, list[str]] = {}
    for n in scales:
        by_file.setdefault(headers[n][0], []).append(n)
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as st:
            for n in names:
                meta = headers[n][1]
                scale_bytes += meta["data_offsets"][1] - meta["data_offsets"][0]
                count, nan, neg, lo = _scale_stats(st, n)
                n_values += count
                per_tensor = count == 1
                if nan:
                    p.add(n, "hf.scales_finite", f"has {nan} NaN/inf of {count} values.")
                elif neg or (per_tensor and not lo > 0):
                    p.add(n, "hf.scales_finite", f"has {neg} negative values" if neg else
                          f"is {lo:g}; a per-tensor scale must be > 0 (the runtime divides by it).")
                if per_tensor:
                    values[n] = lo
    return values, n_values, scale_bytes


def _fused(cfg: dict, q: dict, values: dict, arch: str, p: Found) -> None:
    """``hf.fused_scales``: q/k/v and gate/up (each expert's too: ``MoE.fused``) of one format with equal input scales."""
    groups = family(arch).hf_fused_groups(num_experts_of(cfg))
    for i in range(int(cfg["num_hidden_layers"])):
        for group in groups:
            mods = [f"model.layers.{i}.{m}" for m in group]
            algos = {hf_linear_format(q, m)[0] for m in mods}
            if len(algos) > 1:
                p.add(", ".join(mods), "hf.fused_scales", f"are {', '.join(sorted(algos))}: the runtime runs them as one "
                      "fused GEMM of one format.", "exclude the whole group (spec/families.py fused groups) and re-export.")
                continue
            acts = {values.get(m + ".input_scale") for m in mods}
            if len(acts) > 1 and None not in acts:
                p.add(mods[0] + ".input_scale", "hf.fused_scales", f"the group's input scales differ "
                      f"({', '.join(f'{a:.6g}' for a in sorted(acts))}): the runtime quantizes their one input with "
                      "the max of them (load_weights_fused_qkv_linear), a number the gate did not measure.",
                      "re-export with ModelOpt's shared-input scales (export_hf_checkpoint unifies them).")


def verify_hf_checkpoint(ckpt_dir: Path, expect: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Verify the unified HF checkpoint ``ckpt_dir`` (module doc). ``expect``: ``{"quant_algo",
    "kv_cache_quant_algo"}`` the plan assumes (None: not compared). Returns ``{"tensors", "scale_tensors",
    "scale_values", "linears", "files", "scale_bytes", "seconds", "rules"}`` (as ``verify.verify_checkpoint``);
    raises ``UserError`` listing every problem (field = tensor or file, rule, fix)."""

    t0 = time.perf_counter()
    d = Path(ckpt_dir)
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError("config.json", f"cannot be read ({e}).", FIX, rule="hf.metadata")
    p = Found()
    q = _metadata(d, cfg, expect, p)
    p.raise_if_any()
    assert q is not None
    arch = (cfg.get("architectures") or [None])[0]
    fam = FAMILIES.get(arch)
    if fam is not None and fam.moe is not None:  # before the layout refusal below: a quantized router is named
        for name, why in router_problems(fam, {n: meta["dtype"] for n, (_, meta) in hf_headers(d).items()}):
            p.add(name, "hf.router", f"{why}.", "keep the router out of quantization (exclude_modules "
                  f"{list(fam.moe.router_patterns)}, ModelOpt's default) and export again.")
        p.raise_if_any()
    if arch not in GATE_ARCHITECTURES and not (fam is not None and fam.hf_read):
        raise UserError("config.json: architectures", f"{arch!r} checkpoints are not verified here (the layout is known "
                        f"for {', '.join(GATE_ARCHITECTURES)} and the Family.hf_read families).",
                        "build a model of the verified architectures.",
                        rule="hf.known_tensors")
    headers = hf_headers(d)
    _names(headers, cfg, q, p)
    linears, scales = _classify(headers, cfg, q, _dims(cfg), arch, p)
    _layouts(linears, q, _dims(cfg), p)
    p.raise_if_any()
    values, n_values, scale_bytes = _values(headers, scales, p)
    _fused(cfg, q, values, arch, p)
    p.raise_if_any()
    files = sorted({f.name for f, _ in headers.values()})
    return {"tensors": len(headers), "scale_tensors": len(scales), "scale_values": n_values, "linears": len(linears),
            "files": files + [n for n in ("config.json", HF_QUANT_CONFIG, QUANT_CFG) if (d / n).is_file()],
            "scale_bytes": scale_bytes, "seconds": round(time.perf_counter() - t0, 4), "rules": sorted(HF_RULES)}


__all__ = ["verify_hf_checkpoint", "HF_RULES", "Found"]
