"""Verification of an exported TensorRT-LLM checkpoint against its formats, before the gate reads it.

``verify_checkpoint(ckpt_dir, expect)`` reads the safetensors headers of every rank file and the
scale tensors only (never a weight's data) and refuses (``UserError``, exit 2: every problem names
the tensor or file, the rule and the fix) a checkpoint that TensorRT-LLM 1.2's loader would load
wrongly or not at all, or that does not say what the plan assumed:

* ``verify.metadata``: ``config.json`` ``quantization`` names known formats (``spec/formats.py``);
  every other metadata file that states them (``quant_cfg.json``, ``hf_quant_config.json``) agrees
  with it about ``quant_algo`` and ``kv_cache_quant_algo``; both equal the plan's (``expect``); a
  quantized KV cache has its ``k/v_cache_scaling_factor`` on every attention of every rank and an
  unquantized one has none; ``mapping.world_size`` = ``tp_size`` x ``pp_size``.
* ``verify.known_tensors``: every tensor is one of the Llama layout's names (``checkpoint/reader.py``
  module doc; TensorRT-LLM ``tensorrt_llm/models/llama/model.py`` loads by these names); leftover
  ModelOpt internals (``*_quantizer*``, ``*_amax``, ``*_pre_quant_scale``) are named as such.
* ``verify.layout``: per linear and rank, the weight and each scale tensor its declared format stores
  (``codecs.Codec.layout``: dtype, packing, block/group scale shapes; ``GemmFormat.needs_act_scale``,
  ``scales.prequant``) against this rank's slice ``[out, in]`` computed from ``config.json``
  (heads, KV heads, head size, intermediate size, ``tp_size``); nothing missing, nothing extra.
* ``verify.exclusions``: a linear ``exclude_modules`` matches is stored in high precision with no
  scales; one it does not match is stored quantized (MIXED_PRECISION: ``quant_cfg.json`` decides).
* ``verify.coverage``: every layer's linears, norms and (quantized KV) cache scales on ``tp_size`` ranks.
* ``verify.scales_finite``: every scale value finite (FP8 E4M3 NaN codes included); per-tensor scales
  (weight, global, activation, KV) > 0; block/group/channel scales >= 0.
* ``verify.family``: the family's TensorRT-LLM config fields and biases (``_family_rules``; Qwen2: ``qwen_type``,
  ``attn_bias``, ``mlp_bias`` and an unquantized ``attention.qkv.bias`` on every rank).
* ``verify.fused_scales``: GEMMs TensorRT-LLM fuses at build time must carry equal per-tensor scales:
  gate/up (``mlp.gate`` + ``mlp.fc``) of a format with ``GemmFormat.fused_mlp`` (FP8):
  ``fuse_gate_mlp`` (``tensorrt_llm/models/modeling_utils.py``) takes the max of the two
  ``weights_scaling_factor`` / ``activation_scaling_factor`` and re-quantizes the other half, numbers
  the gate never measured; both halves must also have that format; and the fused QKV's activation
  scale on every tensor-parallel rank (one input, one scale; ``reader.merge_linear`` reads no other).

Cost: headers (a few kB per file) plus the scale tensors. Measured on SmolLM2-135M (30 layers, 151
linears): see README "Verification" (about 0.1-0.2 s). For Llama-3.1-70B (80 layers, 561 linears,
~70e9 weights) the header and per-tensor scale part stays well under a second; what grows is the
block / group scales: NVFP4 reads one FP8 byte per 16 weights (~4.4 GB), W4A16/W4A8 AWQ group 128 one
F32 per 128 weights (~2.2 GB), SmoothQuant / W8A16 one F32 per output channel (MBs), FP8 per-tensor
(kB): seconds at disk speed for the block-scale formats, below a second for FP8.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from precision_pipeline.checkpoint import codecs
from precision_pipeline.checkpoint.hf_verify import verify_hf_checkpoint
from precision_pipeline.checkpoint.reader import (KV_SCALE_NAMES, LINEAR_NAMES, SCALE_SUFFIXES, checkpoint_layout, linear_format,
                                                  rank_files, read_config, read_quant_cfg, safetensors_header)
from precision_pipeline.core.errors import Problem, UserError
from precision_pipeline.spec import formats as FMT
from precision_pipeline.spec.families import FAMILIES, GATE_ARCHITECTURES, Family, family, qkv_rows_of_config, router_problems

FIELD = "checkpoint"
FIX_EXPORT = "re-export the checkpoint (run the build without --checkpoint, or quantize again)."
METADATA_FILES = ("quant_cfg.json", "hf_quant_config.json")
"""Metadata files besides config.json that may state the formats (MIXED_PRECISION's per-layer table;
ModelOpt's unified HF export); each must agree with config.json."""
RULES = {
    "verify.metadata": "config.json, the other metadata files, the KV scale tensors and the plan agree on the formats",
    "verify.known_tensors": "every tensor is a name of the architecture's TensorRT-LLM layout (no ModelOpt leftovers)",
    "verify.layout": "each linear's weight and scale tensors have its declared format's dtype and shape",
    "verify.exclusions": "excluded linears are stored in high precision without scales; the others quantized",
    "verify.coverage": "every layer is on tp_size ranks with its norms and (quantized KV) cache scales",
    "verify.scales_finite": "every scale value finite; per-tensor scales > 0",
    "verify.fused_scales": "GEMMs fused at build time (gate/up for FP8, QKV over ranks) carry equal per-tensor scales",
    "verify.router": "a MoE router (mlp.router) is stored unquantized, without scales (spec/families.py router_problems)",
    "verify.family": "config.json has the fields the family's TensorRT-LLM model class reads; its biased GEMMs store "
                     "an unquantized bias on every rank (spec/families.py trtllm_config, bias_gemms)",
}
MAX_SHOWN = 12  # problems listed in one refusal (the count of the rest is given)
_LAYER = re.compile(r"^transformer\.layers\.(\d+)\.(.+)$")
_MODELOPT_BUFFER = re.compile(r"(quantizer|_amax$|\.amax$|_pre_quant_scale$|_bias_value$)")
_PER_TENSOR = ("weights_scaling_factor_2", "activation_scaling_factor") + KV_SCALE_NAMES


def _norm(v: Any, none: str) -> str:
    return str(v) if v not in (None, "") else none


def _dims(cfg: dict) -> dict[str, Any]:
    """This rank's ``(out, in)`` of each linear of a Llama layer (``spec.families.qkv_rows``: q heads / tp,
    KV heads / tp but at least one), and the other tensor shapes."""
    m = cfg.get("mapping") or {}
    tp = int(m.get("tp_size", 1))
    h = int(cfg["hidden_size"])
    nh = int(cfg["num_attention_heads"])
    inter = int(cfg["intermediate_size"])
    vocab = int(cfg["vocab_size"])
    q_rows, kv_rows, hd = qkv_rows_of_config(cfg, tp)
    vocab_rank = -(-vocab // tp)
    emb = (vocab, h)
    if cfg.get("use_parallel_embedding") and tp > 1:
        emb = (vocab_rank, h) if int(cfg.get("embedding_sharding_dim", 0)) == 0 else (vocab, h // tp)
    return {"tp": tp, "hidden": h, "layers": int(cfg["num_hidden_layers"]), "embedding": emb,
            "linears": {"attention.qkv": (q_rows + 2 * kv_rows, h), "attention.dense": (h, hd * nh // tp),
                        "mlp.fc": (inter // tp, h), "mlp.gate": (inter // tp, h), "mlp.proj": (h, inter // tp),
                        "lm_head": (vocab_rank if tp > 1 else vocab, h)}}


class _Problems:
    def __init__(self) -> None:
        self.items: list[Problem] = []

    def add(self, where: str, rule: str, reason: str, fix: str = FIX_EXPORT) -> None:
        self.items.append(Problem(where, reason, fix, rule=rule, source=RULES[rule]))

    def raise_if_any(self) -> None:
        if not self.items:
            return
        shown = self.items[:MAX_SHOWN]
        if len(self.items) > MAX_SHOWN:
            shown.append(Problem(FIELD, f"{len(self.items) - MAX_SHOWN} more problems of the same kinds.", FIX_EXPORT))
        raise UserError(shown)


def _metadata(ckpt: Path, cfg: dict, expect: Optional[Mapping[str, Any]], p: _Problems) -> tuple[str, str]:
    q = cfg.get("quantization")
    if q is not None and not isinstance(q, dict):
        p.add("config.json: quantization", "verify.metadata", f"is {type(q).__name__}, not an object.")
        return FMT.QuantAlgo.NO_QUANT.value, FMT.KVCacheQuantAlgo.NONE.value
    q = q or {}
    algo = _norm(q.get("quant_algo"), FMT.QuantAlgo.NO_QUANT.value)
    kv = _norm(q.get("kv_cache_quant_algo"), FMT.KVCacheQuantAlgo.NONE.value)
    if FMT.GEMM.get(algo) is None:
        p.add("config.json: quantization.quant_algo", "verify.metadata", f"{algo!r} is not a known format.")
    if FMT.KV.get(kv) is None:
        p.add("config.json: quantization.kv_cache_quant_algo", "verify.metadata", f"{kv!r} is not a known KV-cache format.")
    for name in METADATA_FILES:
        f = ckpt / name
        if not f.is_file():
            continue
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            p.add(name, "verify.metadata", f"cannot be read as JSON ({e}).")
            continue
        sec = doc.get("quantization") if isinstance(doc, dict) and isinstance(doc.get("quantization"), dict) else doc
        if not isinstance(sec, dict):
            continue
        for key, mine, none in (("kv_cache_quant_algo", kv, FMT.KVCacheQuantAlgo.NONE.value),
                                ("quant_algo", algo, FMT.QuantAlgo.NO_QUANT.value)):
            if key in sec and _norm(sec[key], none) != mine:
                p.add(f"{name}: {key}", "verify.metadata",
                      f"says {_norm(sec[key], none)} but config.json quantization.{key} says {mine}: the engine "
                      "would be built from one and the gate would have measured the other.")
    for key, mine in (("quant_algo", algo), ("kv_cache_quant_algo", kv)):
        want = (expect or {}).get(key)
        if want is not None and _norm(getattr(want, "value", want), "") != mine:
            p.add(f"config.json: quantization.{key}", "verify.metadata",
                  f"is {mine} but the plan (profile quantization.{key}) is {getattr(want, 'value', want)}.",
                  "build from the profile the checkpoint was made with, or re-export it with this profile.")
    m = cfg.get("mapping") or {}
    world, tp, pp = (int(m.get(k, 1)) for k in ("world_size", "tp_size", "pp_size"))
    if world != tp * pp:
        p.add("config.json: mapping", "verify.metadata", f"world_size {world} is not tp_size {tp} x pp_size {pp}.")
    return algo, kv


def _excluded(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pat) for pat in patterns)


_FP8: Optional[np.ndarray] = None  # value of each FP8 E4M3 code


def _scale_values(st, name: str, dtype: str) -> tuple[int, int, int, float, float]:
    """(elements, non-finite, negative, min, max) of one scale tensor (FP8 E4M3 by its codes)."""
    import torch

    t = st.get_tensor(name)
    if t.dtype == torch.float8_e4m3fn:  # count the 256 codes, then look their values up once
        global _FP8
        if _FP8 is None:
            _FP8 = codecs.fp8_e4m3_to_float(torch.arange(256, dtype=torch.int32).to(torch.uint8)).numpy()
        counts = np.bincount(t.reshape(-1).view(torch.uint8).numpy(), minlength=256)
        used = _FP8[counts > 0]
        nan = int(counts[0x7F] + counts[0xFF])  # E4M3 has NaN codes only (no infinities)
        neg = int(counts[0x81:0xFF].sum())  # sign bit set, magnitude not zero
        fin = used[np.isfinite(used)]
        return int(counts.sum()), nan, neg, float(fin.min()) if fin.size else math.nan, float(fin.max()) if fin.size else math.nan
    else:
        v = t.reshape(-1).float().numpy()
        nan = int(np.count_nonzero(~np.isfinite(v)))
        neg = int(np.count_nonzero(v < 0))
    fin = v[np.isfinite(v)]
    return int(v.size), nan, neg, float(fin.min()) if fin.size else math.nan, float(fin.max()) if fin.size else math.nan


def _router_stored_plain(ckpt: Path, cfg: dict, arch: Any) -> Any:
    """Rule verify.router: UserError naming every quantized router tensor of a MoE family's checkpoint; returns
    ``arch``."""
    fam = FAMILIES.get(arch)
    if fam is None or fam.moe is None:
        return arch
    p = _Problems()
    for f in rank_files(ckpt, cfg):
        h = safetensors_header(f)
        for name, why in router_problems(fam, {n: m["dtype"] for n, m in h.items() if n != "__metadata__"}):
            p.add(f"{name} ({f.name})", "verify.router", f"{why}.", "keep the router out of quantization "
                  f"(exclude_modules {list(fam.moe.router_patterns)}, ModelOpt's default) and export again.")
    p.raise_if_any()
    return arch


def _verify_hf_layout(ckpt: Path, expect: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """The LLM-API route's checkpoints: ModelOpt's unified HF one (``hf_verify``) or gpt-oss's as shipped, MXFP4
    experts (``mxfp4_verify``)."""
    if checkpoint_layout(ckpt) == "hf_mxfp4":
        from precision_pipeline.checkpoint.mxfp4_verify import verify_mxfp4_checkpoint

        return verify_mxfp4_checkpoint(ckpt, expect)
    return verify_hf_checkpoint(ckpt, expect)


def verify_checkpoint(ckpt_dir: Path, expect: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Verify checkpoint ``ckpt_dir`` (module doc; a unified HF checkpoint by ``hf_verify``'s rules). ``expect``:
    ``{"quant_algo", "kv_cache_quant_algo"}`` the plan assumes (None: not compared). Returns ``{"tensors",
    "scale_tensors", "scale_values", "linears", "files", "scale_bytes" (bytes of scale data read), "seconds",
    "rules"}``; raises ``UserError`` (exit 2) listing every problem found (field = tensor or file, rule, fix)."""
    from safetensors import safe_open
    if checkpoint_layout(Path(ckpt_dir)) in ("hf_unified", "hf_mxfp4"):  # the LLM-API route's (reader.checkpoint_layout)
        return _verify_hf_layout(Path(ckpt_dir), expect)
    t0, ckpt = time.perf_counter(), Path(ckpt_dir)
    cfg = read_config(ckpt)
    p = _Problems()
    algo, kv = _metadata(ckpt, cfg, expect, p)
    p.raise_if_any()  # the rest reads the formats these name
    qinfo = read_quant_cfg(ckpt, cfg)
    arch = _router_stored_plain(ckpt, cfg, cfg.get("architecture"))
    if arch not in GATE_ARCHITECTURES or cfg.get("moe"):
        raise UserError("config.json: architecture", f"{arch!r} checkpoints are not verified here (the layout is "
                        f"known for {', '.join(GATE_ARCHITECTURES)} without MoE).",
                        "build a model of the verified architectures (the gate reads no other either).",
                        rule="verify.known_tensors")
    dims = _dims(cfg)
    tp = dims["tp"]
    kvf, files = FMT.kv(kv), rank_files(ckpt, cfg)
    bias, fam = bool(cfg.get("bias")), family(arch)
    holders: dict[tuple[int, str], list[int]] = defaultdict(list)  # (layer, linear) -> ranks holding its weight
    members: dict[tuple[int, str], set[str]] = {}  # (rank, linear stem) -> stored suffixes
    headers = []
    scales: list[tuple[int, str, str]] = []  # (rank, tensor, dtype) of every scale tensor
    n_tensors = 0
    for r, f in enumerate(files):
        h = safetensors_header(f)
        headers.append(h)
        where = f.name
        for name, meta in h.items():
            if name == "__metadata__":
                continue
            n_tensors += 1
            m = _LAYER.match(name)
            rest = m.group(2) if m else name
            stem, _, leaf = name.rpartition(".")
            lin = stem.rsplit(".", 2)
            lin_name = ".".join(lin[-2:]) if m else stem
            if m and rest in ("input_layernorm.weight", "post_layernorm.weight") or name == "transformer.ln_f.weight":
                if meta["dtype"] not in codecs.PLAIN_DTYPES or meta["shape"] != [dims["hidden"]]:
                    p.add(f"{name} ({where})", "verify.layout", f"is {meta['dtype']} {meta['shape']}; a norm weight is "
                          f"{'/'.join(codecs.PLAIN_DTYPES)} [{dims['hidden']}].")
                if m:
                    holders[(int(m.group(1)), rest)].append(r)
            elif name == "transformer.vocab_embedding.weight":
                if meta["dtype"] not in codecs.PLAIN_DTYPES or tuple(meta["shape"]) != dims["embedding"]:
                    p.add(f"{name} ({where})", "verify.layout", f"is {meta['dtype']} {meta['shape']}; expected "
                          f"{'/'.join(codecs.PLAIN_DTYPES)} {list(dims['embedding'])} (vocab_size, hidden_size, "
                          "use_parallel_embedding).")
            elif m and rest.startswith("attention.") and leaf in KV_SCALE_NAMES and stem.endswith(".attention"):
                if not kvf.is_quantized:
                    p.add(f"{name} ({where})", "verify.metadata", f"is a KV-cache scale, but config.json says "
                          f"kv_cache_quant_algo {kv}: the checkpoint was exported with a quantized KV cache the metadata "
                          "does not declare.")
                elif meta["dtype"] != "F32" or tuple(meta["shape"]) not in ((), (1,)):
                    p.add(f"{name} ({where})", "verify.layout", f"is {meta['dtype']} {meta['shape']}; a KV-cache scale "
                          "is F32 [1].")
                scales.append((r, name, meta["dtype"]))
                holders[(int(m.group(1)), "attention." + leaf)].append(r)
            elif (m and lin_name in LINEAR_NAMES or stem == "lm_head") and (
                    leaf in ("weight",) + SCALE_SUFFIXES or (leaf == "bias" and (bias or lin_name in fam.bias_gemms))):
                members.setdefault((r, stem), set()).add(leaf)
                if leaf in SCALE_SUFFIXES:
                    scales.append((r, name, meta["dtype"]))
                if leaf == "weight" and m:
                    holders[(int(m.group(1)), lin_name)].append(r)
            else:
                why = (" It looks like a ModelOpt internal buffer left in the export (quantizer state), not a tensor "
                       "TensorRT-LLM loads." if _MODELOPT_BUFFER.search(name) else "")
                p.add(f"{name} ({where})", "verify.known_tensors",
                      f"is not a tensor of a {arch} TensorRT-LLM checkpoint (checkpoint/reader.py layout).{why}",
                      FIX_EXPORT if why else "remove it, or re-export the checkpoint.")
    # per linear and rank: the declared format's layout
    n_linears = 0
    for (r, stem), leaves in sorted(members.items()):
        n_linears += 1
        h = headers[r]
        where = files[r].name
        key = "lm_head" if stem == "lm_head" else stem.rsplit(".", 2)[-2] + "." + stem.rsplit(".", 1)[-1]
        n_out, n_in = dims["linears"][key]
        declared, group = linear_format(qinfo, stem)
        fmt = FMT.gemm(declared)
        codec = codecs.CODECS.get(fmt.codec or "")
        if codec is None:
            p.add(f"{stem} ({where})", "verify.layout", f"is declared {declared}, which no codec reads.")
            continue
        excluded = (not fmt.per_layer and _excluded(stem, qinfo["exclude_modules"])) and FMT.gemm(qinfo["quant_algo"]).is_quantized
        layout = codec.layout(fmt, n_out, n_in, group)
        w = h.get(stem + ".weight")
        if w is None:
            p.add(f"{stem}.weight ({where})", "verify.layout", f"is missing; {stem} has {sorted(leaves)} only.")
            continue
        if fmt.is_quantized and w["dtype"] in codecs.PLAIN_DTYPES:
            p.add(f"{stem}.weight ({where})", "verify.exclusions", f"is stored in high precision ({w['dtype']}) but declared "
                  f"{declared}" + ("" if FMT.gemm(qinfo["quant_algo"]).per_layer else " (exclude_modules does not match it)") + ".",
                  "add it to quantization.exclude_modules and re-export, or re-export it quantized.")
            continue
        if not fmt.is_quantized and w["dtype"] not in codecs.PLAIN_DTYPES:
            p.add(f"{stem}.weight ({where})", "verify.exclusions", f"is stored quantized ({w['dtype']}) but declared "
                  "unquantized" + (" (exclude_modules matches it)" if excluded else " (not in quant_cfg.json)") + ".")
            continue
        for leaf, slot in layout.items():
            meta = h.get(f"{stem}.{leaf}")
            if meta is None:
                p.add(f"{stem}.{leaf} ({where})", "verify.layout", f"is missing; {declared} stores {slot.text()} here "
                      f"(rank slice [{n_out}, {n_in}]).")
            elif meta["dtype"] not in slot.dtypes or not slot.fits(meta["shape"]):
                p.add(f"{stem}.{leaf} ({where})", "verify.layout", f"is {meta['dtype']} {meta['shape']}; {declared} stores "
                      f"{slot.text()} for this rank's [{n_out}, {n_in}] slice"
                      + (f" (group_size {group})" if fmt.grouping == "per_group" else "")
                      + (f" (one FP8 scale per {FMT.NVFP4_BLOCK} inputs)" if fmt.grouping == "fixed_block" else "") + ".")
        extra = sorted(set(leaves) - set(layout) - ({"bias"} if bias or key in fam.bias_gemms else set()))
        for leaf in extra:
            rule = "verify.exclusions" if not fmt.is_quantized else "verify.layout"
            p.add(f"{stem}.{leaf} ({where})", rule, f"is not part of {declared}'s layout"
                  + (" (the linear is excluded: stored in high precision, so it has no scales)" if excluded else "") + ".")
    # coverage: every layer's tensors on tp_size ranks
    want = list(LINEAR_NAMES) + ["input_layernorm.weight", "post_layernorm.weight"]
    if kvf.is_quantized:
        want.append("attention.kv_cache_scaling_factor")
    for i in range(dims["layers"]):
        for part in want:
            if part == "attention.kv_cache_scaling_factor":
                ranks = {*holders.get((i, "attention.k_cache_scaling_factor"), []),
                         *holders.get((i, part), [])}
                ranks_v = {*holders.get((i, "attention.v_cache_scaling_factor"), []), *holders.get((i, part), [])}
                if len(ranks) != tp or len(ranks_v) != tp:
                    p.add(f"transformer.layers.{i}.attention.k/v_cache_scaling_factor", "verify.metadata",
                          f"is on {min(len(ranks), len(ranks_v))} of {tp} ranks but config.json says kv_cache_quant_algo {kv}.")
            elif len(holders.get((i, part), [])) != tp:
                p.add(f"transformer.layers.{i}.{part}", "verify.coverage",
                      f"is on {len(holders.get((i, part), []))} rank file(s); tp_size is {tp}.")
    _family_rules(cfg, fam, headers, files, dims, p)
    p.raise_if_any()
    # scale values, fused groups
    values: dict[tuple[int, str], float] = {}
    n_values = scale_bytes = 0
    by_rank: dict[int, list[tuple[str, str]]] = defaultdict(list)
    for r, name, dt in scales:
        by_rank[r].append((name, dt))
    for r, items in sorted(by_rank.items()):
        with safe_open(str(files[r]), framework="pt") as st:
            for name, dt in items:
                meta = headers[r][name]
                scale_bytes += meta["data_offsets"][1] - meta["data_offsets"][0]
                n, nan, neg, lo, hi = _scale_values(st, name, dt)
                n_values += n
                leaf = name.rsplit(".", 1)[-1]
                per_tensor = leaf in _PER_TENSOR or n == 1
                if nan:
                    p.add(f"{name} ({files[r].name})", "verify.scales_finite", f"has {nan} NaN/inf of {n} values.")
                elif neg or (per_tensor and not lo > 0):
                    p.add(f"{name} ({files[r].name})", "verify.scales_finite",
                          f"has {neg} negative values" if neg else f"is {lo:g}; a per-tensor scale must be > 0 (the engine divides by it).")
                if n == 1:
                    values[(r, name)] = hi
    for r in range(len(files)):
        for i in range(dims["layers"]):
            base = f"transformer.layers.{i}."
            fc, gate = base + "mlp.fc", base + "mlp.gate"
            if (r, fc) not in members or (r, gate) not in members:
                continue
            fa, fb = linear_format(qinfo, fc)[0], linear_format(qinfo, gate)[0]
            if not FMT.gemm(fa).fused_mlp or FMT.gemm(fa).per_layer:
                continue
            if fa != fb:
                p.add(f"{gate} ({files[r].name})", "verify.fused_scales", f"is {fb} but {fc} is {fa}; TensorRT-LLM fuses "
                      "gate/up into one GEMM for this format (use_fused_mlp, fuse_gate_mlp), so both need one format.")
                continue
            for leaf in ("weights_scaling_factor", "activation_scaling_factor", "weights_scaling_factor_2"):
                a, b = values.get((r, f"{fc}.{leaf}")), values.get((r, f"{gate}.{leaf}"))
                if a is not None and b is not None and a != b:
                    p.add(f"{gate}.{leaf} ({files[r].name})", "verify.fused_scales",
                          f"is {b:.6g} but {fc}.{leaf} is {a:.6g}: TensorRT-LLM fuses gate/up into one {fa} GEMM "
                          "(fuse_gate_mlp, tensorrt_llm/models/modeling_utils.py) with the larger scale and re-quantizes "
                          "the other half, numbers the gate did not measure.",
                          "re-export with ModelOpt's shared-input scales for gate/up (export unifies them), or "
                          "quantize again.")
    if tp > 1:
        for i in range(dims["layers"]):
            name = f"transformer.layers.{i}.attention.qkv.activation_scaling_factor"
            got = {values[(r, name)] for r in range(len(files)) if (r, name) in values}
            if len(got) > 1:
                p.add(name, "verify.fused_scales", f"differs over the {tp} ranks ({', '.join(f'{v:.6g}' for v in sorted(got))}); "
                      "q, k and v read one input with one activation scale.")
    p.raise_if_any()
    return {"tensors": n_tensors, "scale_tensors": len(scales), "scale_values": n_values, "linears": n_linears,
            "files": [f.name for f in files] + [n for n in ("config.json",) + METADATA_FILES if (ckpt / n).is_file()],
            "scale_bytes": scale_bytes, "seconds": round(time.perf_counter() - t0, 4), "rules": sorted(RULES)}


def _family_rules(cfg: dict, fam: Family, headers: list[dict], files: list[Path], dims: dict, p: _Problems) -> None:
    """``verify.family``: config.json carries the family's TensorRT-LLM fields (``Family.trtllm_config``: a Qwen2
    checkpoint without ``qwen_type`` builds as Qwen 1 with half the MLP, ``tensorrt_llm/models/qwen/model.py``
    lines 104-110 at 04a2cac), and each of the family's biased GEMMs (``Family.bias_gemms``: Qwen2's
    ``attention.qkv``, ``Attention(bias=config.attn_bias)`` line 67) stores its bias on every rank, unquantized
    (ModelOpt exports biases in the export dtype and TensorRT-LLM adds them in high precision after the GEMM) with
    this rank's rows."""
    for key, want in fam.trtllm_config.items():
        if cfg.get(key) != want:
            p.add(f"config.json: {key}", "verify.family", f"is {cfg.get(key)!r}; TensorRT-LLM's {fam.trtllm_class} needs "
                  f"{want!r} for a {fam.architecture} ({fam.sources.get('trtllm_config', 'spec/families.py')}).")
    for f, h in zip(files, headers):
        for i in range(dims["layers"]):
            for g in fam.bias_gemms:
                name, rows = f"transformer.layers.{i}.{g}.bias", dims["linears"][g][0]
                meta = h.get(name)
                if meta is None:
                    p.add(f"{name} ({f.name})", "verify.family", f"is missing; a {fam.architecture} {g} carries a bias "
                          "(spec/families.py attention_bias): the engine would run without it.")
                elif meta["dtype"] not in codecs.PLAIN_DTYPES or meta["shape"] != [rows]:
                    p.add(f"{name} ({f.name})", "verify.family", f"is {meta['dtype']} {meta['shape']}; the bias is stored "
                          f"unquantized ({'/'.join(codecs.PLAIN_DTYPES)}) with this rank's {rows} rows.")


LAYOUT_NAMES = {"trtllm_checkpoint": "a TensorRT-LLM checkpoint (config.json + rank*.safetensors)",
                "hf_unified": "a unified HF checkpoint (ModelOpt export_hf_checkpoint: config.json, *.safetensors, "
                              "hf_quant_config.json)",
                "hf_mxfp4": "an HF checkpoint with MXFP4 experts as gpt-oss ships it (config.json quant_method mxfp4, "
                            "*_blocks / *_scales)"}
ROUTE_LOADS = {"trtllm_checkpoint": ("trtllm_checkpoint",), "hf_unified": ("hf_unified", "hf_mxfp4")}
"""Checkpoint layouts each route's serving layout stands for (``quantize.job.EXPORT_FORMAT_OF_ROUTE``): the LLM API
also loads an HF ``quant_method`` mxfp4 checkpoint as is (``tensorrt_llm/_torch/model_config.py``
``get_mxfp4_quant_algo``; ``checkpoints/hf/gpt_oss_weight_mapper.py``)."""
LAYOUT_READER = {"trtllm_checkpoint": "trtllm-build reads TensorRT-LLM checkpoints only",
                 "hf_unified": "LLM(...) loads HF checkpoints with ModelOpt's hf_quant_config.json (tensorrt_llm/_torch/"
                               "model_config.py ModelConfig.from_pretrained), not TensorRT-LLM's rank files"}


def check_checkpoint_dir(checkpoint: str, layout: str | None = None, route: str = "") -> Path:
    """``--checkpoint``: a checkpoint folder of either layout (``reader.checkpoint_layout``) whose tensors are what it
    declares (each safetensors file's byte ranges, then ``verify_checkpoint``: the ``verify.*`` rules, or the ``hf.*``
    rules for a unified HF checkpoint), before anything is copied. ``layout``: the one the profile's serving
    ``route`` loads (``quantize.job.EXPORT_FORMAT_OF_ROUTE``; None: either): the other is refused first, naming both.
    Returns the folder resolved; raises UserError naming ``--checkpoint`` (or the rule's tensor/file)."""
    from precision_pipeline.checkpoint.reader import check_declared_formats, checkpoint_layout, safetensors_header
    from precision_pipeline.core.errors import UserError

    ck = Path(checkpoint).expanduser().resolve()
    found = checkpoint_layout(ck) if (ck / "config.json").is_file() else None
    if found is not None and layout is not None and found not in ROUTE_LOADS.get(layout, (layout,)):
        other = "engine" if layout == "trtllm_checkpoint" else "llm_api"
        raise UserError("--checkpoint", f"{checkpoint} is {LAYOUT_NAMES[found]}, but the profile's route {route or other} "
                        f"serves {LAYOUT_NAMES[layout]}: {LAYOUT_READER[layout]}.",
                        f"give the checkpoint/ folder of a previous route-{route or other} build, use a profile with the "
                        "route this checkpoint was exported for, or leave --checkpoint out to quantize.")
    if found == "hf_mxfp4":
        verify_checkpoint(ck)  # every header's byte ranges, then the mx.* rules (the verify stage repeats them)
        return ck
    if found == "hf_unified":
        from precision_pipeline.checkpoint.hf_unified import hf_files

        for f in hf_files(ck):
            safetensors_header(f, field="--checkpoint")  # every tensor's byte range within the file, before any copy
        verify_checkpoint(ck)  # the hf.* rules (the verify stage repeats them against the plan after the copy)
        return ck
    if found is None or not list(ck.glob("rank*.safetensors")):
        raise UserError("--checkpoint", f"{checkpoint} is not {LAYOUT_NAMES['trtllm_checkpoint']} or "
                        f"{LAYOUT_NAMES['hf_unified']}.", "give a checkpoint directory written by a previous build, or "
                        "leave --checkpoint out to quantize.")
    for f in sorted(ck.glob("rank*.safetensors")):
        safetensors_header(f, field="--checkpoint")  # every tensor's byte range within the file, before any copy
    check_declared_formats(ck)  # header-level: a broken checkpoint is refused before anything is written
    verify_checkpoint(ck)  # layouts, scales, metadata (the verify stage repeats it against the plan after the copy)
    return ck


__all__ = ["verify_checkpoint", "RULES", "METADATA_FILES", "FIELD", "check_checkpoint_dir"]
