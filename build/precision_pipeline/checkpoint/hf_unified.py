"""ModelOpt's unified HF checkpoint (the LLM-API route's checkpoint): metadata, names, and the dequantized model.

``modelopt.torch.export.export_hf_checkpoint`` (ModelOpt 0.47, ``modelopt/torch/export/unified_export_hf.py``
``export_hf_checkpoint`` / ``_write_hf_export_config``) writes a HF folder: ``config.json`` (the HF config with
``quantization_config`` inlined, ``convert_hf_config.py`` ``convert_hf_quant_config_format``: the flat shape
``{"quant_method": "modelopt", "quant_algo", "kv_cache_scheme", "ignore", "config_groups", "producer"}``),
``model*.safetensors`` with HF tensor names, and ``hf_quant_config.json`` (``{"producer", "quantization":
{"quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules", ("quantized_layers")}}``). It is recognised
by ``hf_quant_config.json`` at its root (``reader.checkpoint_layout``).

Tensor names (measured on SmolLM2-135M exports, FP8 / NVFP4 / INT8 SQ; the suffixes are what TensorRT-LLM's
PyTorch linears load, ``tensorrt_llm/_torch/modules/linear.py`` ``FP8QDQLinearMethod.load_weight_scales`` /
``load_kv_scales``): ``model.layers.N.<self_attn|mlp>.<proj>.weight`` plus, per format, ``weight_scale``,
``weight_scale_2``, ``input_scale``, ``pre_quant_scale`` (= the TensorRT-LLM checkpoint's
``weights_scaling_factor``, ``weights_scaling_factor_2``, ``activation_scaling_factor``,
``prequant_scaling_factor``, same dtypes and shapes: ``HF_SUFFIX``); the KV-cache scales are
``self_attn.k_proj.k_scale`` / ``self_attn.v_proj.v_scale`` (F32 ``[]``, amax / 448); a tied ``lm_head`` is not
stored (``tie_word_embeddings``). Unquantized tensors are written in the export dtype.

How TensorRT-LLM loads it (what the gate's model reproduces): q/k/v and gate/up are fused linears; for FP8
(``FP8QDQLinearMethod.load_weights_fused_qkv_linear`` / ``load_weights_fused_gate_up_linear``, linear.py) the
fused GEMM gets the max of the parts' ``input_scale`` and of their ``weight_scale``, and each part's FP8 weight is
dequantized in the model dtype and re-quantized with that max scale (``codecs.requantize_fp8_fused``).
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any, Optional

import torch

from precision_pipeline.checkpoint import codecs
from precision_pipeline.checkpoint.codecs import FIELD
from precision_pipeline.checkpoint.reader import (HF_QUANT_CONFIG, DequantizedCheckpoint, LinearSpec, format_rows,
                                                  safetensors_header)
from precision_pipeline.core.errors import UserError
from precision_pipeline.spec import formats as FMT
from precision_pipeline.spec.families import GATE_ARCHITECTURES, KV_PROJECTIONS, LLAMA

NO_QUANT = FMT.QuantAlgo.NO_QUANT.value
QUANT_CFG = "quant_cfg.json"
HF_SUFFIX = {"weight_scale": "weights_scaling_factor", "weight_scale_2": "weights_scaling_factor_2",
             "input_scale": "activation_scaling_factor", "pre_quant_scale": "prequant_scaling_factor"}
"""HF unified suffix -> the TensorRT-LLM checkpoint's name of the same tensor (the codecs' layouts use the latter)."""
KV_SCALE_OF = dict(zip(KV_PROJECTIONS, ("k_scale", "v_scale")))
"""Where the export stores the KV-cache scales (``<layer>.<linear>.<name>``; ModelOpt 0.47 ``postprocess_state_dict``)."""
RUNTIME_FP8_KV_SCALE = 1.0
"""The k/v scale TensorRT-LLM's PyTorch backend quantizes an FP8 KV cache with when it loads a HF checkpoint: the
exported ``k_scale`` / ``v_scale`` are not loaded (``tensorrt_llm/_torch/modules/linear.py``: the attention's
``kv_scales`` are created as ones, "K, V scales for NVFP4 KV cache", and the calibrated ones are read only for
NVFP4 and only with ``TRTLLM_LOAD_KV_SCALES=1``, "the calibrated kv scales may cause overflow"). The exported scales
are still verified (``hf_verify``); the gate's model uses this one. ModelOpt's TensorRT-LLM export writes 1.0 too."""
FIX = "re-export the checkpoint (quantize again with export_format hf_unified)."


def hf_slots(fmt: FMT.GemmFormat, rel: str, slots: dict[str, codecs.Slot]) -> tuple[dict[str, codecs.Slot], set[str]]:
    """The tensors one HF linear ``rel`` (``self_attn.q_proj``, ...) stores in ``fmt``: the codec's layout ``slots``
    under the HF names (``HF_SUFFIX``) with what the HF export does differently (measured on ModelOpt 0.47 exports of
    SmolLM2-135M): INT4 AWQ weights are stored U8 (the same ``[out/2, in]`` packing shape); the AWQ
    ``pre_quant_scale`` of a linear that shares its input (q/k/v, gate/up: ``spec.families`` fused groups) is folded
    into the preceding norm's weight and not stored (``unified_export_hf.py``
    ``requantize_resmooth_fused_llm_layers`` -> ``_fuse_shared_input_modules(..., fuse_layernorms=True)``). Returns
    ``({hf suffix: Slot}, optional suffixes)``."""
    trt_to_hf = {v: k for k, v in HF_SUFFIX.items()}
    out = {trt_to_hf.get(k, k): v for k, v in slots.items()}
    optional: set[str] = set()
    if fmt.codec == "int4_awq":
        out["weight"] = codecs.Slot(("U8",), out["weight"].shape)
        if any(rel in g for g in LLAMA.fused):
            out.pop("pre_quant_scale", None)
            optional.add("pre_quant_scale")
    return out, optional


def _json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(FIELD, f"{path} is missing.", FIX)
    except (OSError, ValueError) as e:
        raise UserError(FIELD, f"{path} cannot be read as JSON ({e}).", FIX)


def _kv_of_scheme(scheme: Any) -> Optional[str]:
    """``kv_cache_scheme`` of the flat shape -> a KV algo, as TensorRT-LLM reads it
    (``tensorrt_llm/quantization/modelopt_config.py`` ``_kv_cache_scheme_to_algo``, lines 91-97 at 2edf354:
    ``{"type": "float", "num_bits": 8}`` is FP8, anything else None). A string is what ModelOpt writes for other
    KV formats (``convert_hf_config.py``); it is kept so a NVFP4 KV cache is compared, not dropped."""
    if isinstance(scheme, dict):
        return FMT.QuantAlgo.FP8.value if scheme.get("type") == "float" and scheme.get("num_bits") == 8 else None
    return scheme if isinstance(scheme, str) else None


def parse_quant_config(raw: Any, where: str) -> dict:
    """A ModelOpt quant config in either shape (``modelopt_config.py`` ``parse_modelopt_quant_config``: the legacy
    ``{"quantization": {...}}`` wrapper or the flat inline one) as ``{"quant_algo", "kv_cache_quant_algo",
    "group_size", "exclude_modules", "quantized_layers"}``. Raises UserError naming ``where`` for a non-object."""
    if not isinstance(raw, dict):
        raise UserError(f"{where}", f"is {type(raw).__name__}, not a ModelOpt quantization object.", FIX)
    if "quantization" in raw:
        q = raw["quantization"]
        if not isinstance(q, dict):
            raise UserError(f"{where}: quantization", f"is {type(q).__name__}, not an object.", FIX)
        return {"quant_algo": q.get("quant_algo"), "kv_cache_quant_algo": q.get("kv_cache_quant_algo"),
                "group_size": q.get("group_size"), "exclude_modules": list(q.get("exclude_modules") or []),
                "quantized_layers": dict(q.get("quantized_layers") or {})}
    return {"quant_algo": raw.get("quant_algo"), "kv_cache_quant_algo": _kv_of_scheme(raw.get("kv_cache_scheme")),
            "group_size": raw.get("group_size"), "exclude_modules": list(raw.get("ignore") or []),
            "quantized_layers": dict(raw.get("quantized_layers") or {})}


def read_hf_quant(ckpt_dir: Path) -> dict:
    """What the runtime takes as the checkpoint's quantization: ``hf_quant_config.json`` (authoritative), with
    MIXED_PRECISION's ``quant_cfg.json`` laid over it (``tensorrt_llm/_torch/model_config.py``
    ``ModelConfig._build_modelopt_quant_config`` at 008e0af: ``json_quant_configs.update(quant_cfg)``; a different
    ``kv_cache_quant_algo`` there raises RuntimeError, so it is a UserError here). Returns
    ``{"quant_algo" (NO_QUANT for null), "kv_cache_quant_algo" (None for null), "group_size", "exclude_modules",
    "layers": {HF module: {"quant_algo", "group_size"}}}``."""
    d = Path(ckpt_dir)
    q = parse_quant_config(_json(d / HF_QUANT_CONFIG), HF_QUANT_CONFIG)
    if q["quant_algo"] == FMT.QuantAlgo.MIXED_PRECISION.value and (d / QUANT_CFG).is_file():
        extra = _json(d / QUANT_CFG)
        if not isinstance(extra, dict):
            raise UserError(QUANT_CFG, f"is {type(extra).__name__}, not an object.", FIX)
        kv_extra = extra.get("kv_cache_quant_algo")
        if kv_extra is not None and q["kv_cache_quant_algo"] is not None and kv_extra != q["kv_cache_quant_algo"]:
            raise UserError(f"{QUANT_CFG}: kv_cache_quant_algo", f"is {kv_extra} but {HF_QUANT_CONFIG} says "
                            f"{q['kv_cache_quant_algo']}: TensorRT-LLM refuses to load it (RuntimeError in "
                            "ModelConfig._build_modelopt_quant_config).", FIX)
        q["kv_cache_quant_algo"] = extra.get("kv_cache_quant_algo", q["kv_cache_quant_algo"])
        q["quantized_layers"] = dict(extra.get("quantized_layers") or q["quantized_layers"])
        q["group_size"] = extra.get("group_size", q["group_size"])
    layers = {}
    for name, e in q.pop("quantized_layers").items():
        if not isinstance(e, dict):
            raise UserError(f"{HF_QUANT_CONFIG}: quantized_layers.{name}", f"is {e!r}, not an object with quant_algo.", FIX)
        layers[name] = {"quant_algo": e.get("quant_algo"), "group_size": e.get("group_size")}
    q["layers"] = layers
    q["quant_algo"] = q["quant_algo"] or NO_QUANT
    return q


def hf_linear_format(qinfo: dict, module: str) -> tuple[str, Optional[int]]:
    """``(quant_algo, group_size)`` the checkpoint declares for HF linear ``module`` (``read_hf_quant``): its
    ``quantized_layers`` entry for MIXED_PRECISION (NO_QUANT when absent), NO_QUANT when an ``exclude_modules``
    pattern matches it, else the checkpoint's format."""
    fmt = FMT.GEMM.get(qinfo["quant_algo"])
    if fmt is not None and fmt.per_layer:
        e = qinfo["layers"].get(module)
        return (e["quant_algo"], e.get("group_size")) if e else (NO_QUANT, None)
    if fmt is None or not fmt.is_quantized or any(fnmatch.fnmatchcase(module, p) for p in qinfo["exclude_modules"]):
        return NO_QUANT, None
    return qinfo["quant_algo"], qinfo["group_size"]


def hf_files(ckpt_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files (``model.safetensors`` or the shards ``model-0000i-of-0000n.safetensors``
    an index names); UserError when there is none."""
    files = sorted(Path(ckpt_dir).glob("*.safetensors"))
    if not files:
        raise UserError(FIELD, f"{ckpt_dir} has {HF_QUANT_CONFIG} but no *.safetensors.", FIX)
    return files


def hf_headers(ckpt_dir: Path) -> dict[str, tuple[Path, dict]]:
    """tensor name -> (file, header entry) over every safetensors file; UserError for a name stored twice."""
    out: dict[str, tuple[Path, dict]] = {}
    for f in hf_files(ckpt_dir):
        for name, meta in safetensors_header(f).items():
            if name == "__metadata__":
                continue
            if name in out:
                raise UserError(FIELD, f"{name} is stored in both {out[name][0].name} and {f.name}.", FIX)
            out[name] = (f, meta)
    return out


def module_names(tensor_names, config: dict) -> set[str]:
    """Every module of the checkpoint: each dotted prefix of each tensor's module (``model``, ``model.layers``,
    ``model.layers.0.self_attn.q_proj``, ...), plus ``lm_head`` when it is tied to the embedding (not stored)."""
    out = {"lm_head"} if config.get("tie_word_embeddings") else set()
    for n in tensor_names:
        parts = n.split(".")[:-1]
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


def trt_config(config: dict) -> dict:
    """The TensorRT-LLM-style architecture facts of a HF ``config.json`` that the gate's model checks
    (``architecture``, sizes, ``head_size``, ``share_embedding_table`` for a tied lm_head)."""
    arch = (config.get("architectures") or [None])[0]
    nh = int(config["num_attention_heads"])
    return {"architecture": arch, "hidden_size": config.get("hidden_size"), "num_hidden_layers": config.get("num_hidden_layers"),
            "num_attention_heads": nh, "num_key_value_heads": config.get("num_key_value_heads") or nh,
            "intermediate_size": config.get("intermediate_size"), "vocab_size": config.get("vocab_size"),
            "head_size": config.get("head_dim") or int(config["hidden_size"]) // nh,
            "share_embedding_table": bool(config.get("tie_word_embeddings")), "mapping": {"tp_size": 1, "pp_size": 1}}


def _linear_tensors(st: dict, module: str) -> dict[str, torch.Tensor]:
    """One linear's stored tensors under the TensorRT-LLM checkpoint's names (``HF_SUFFIX``), for the codecs."""
    pre = module + "."
    return {pre + HF_SUFFIX.get(k[len(pre):], k[len(pre):]): v for k, v in st.items()
            if k.startswith(pre) and "." not in k[len(pre):]}


def _read_linear(st: dict, module: str, algo: str, group: Optional[int], used: set) -> LinearSpec:
    if module + ".weight" not in st:
        raise UserError(FIELD, f"{module}.weight is missing.", FIX)
    t = _linear_tensors(st, module)
    used.update(k for k in st if k.startswith(module + ".") and k.rsplit(".", 1)[-1] in ("weight", "bias", *HF_SUFFIX))
    w = codecs.dequantize(t, module + ".", FMT.gemm(algo), group)
    quantized = st[module + ".weight"].dtype in codecs.QUANTIZED_DTYPES
    act = t.get(module + ".activation_scaling_factor")
    pre = t.get(module + ".prequant_scaling_factor")
    bias = st.get(module + ".bias")  # unquantized (Qwen2's q/k/v: hf_verify rule hf.biases)
    if bias is not None and (bias.dtype in codecs.QUANTIZED_DTYPES or bias.numel() != w.shape[0]):
        raise UserError(FIELD, f"{module}.bias is {bias.dtype} {list(bias.shape)}; a bias is unquantized [{w.shape[0]}].", FIX)
    return LinearSpec(weight=w, quantized=quantized, quant_algo=algo if quantized else NO_QUANT,
                      act_scale=None if act is None else act.to(torch.float32).reshape(()),
                      pre=None if pre is None else pre.to(torch.float32).reshape(-1),
                      group_size=group if quantized and FMT.gemm(algo).grouping == "per_group" else None,
                      bias=None if bias is None else bias.to(torch.float32).reshape(-1))


def _fuse(st: dict, modules: list[str], parts: list[LinearSpec], dtype: torch.dtype) -> list[LinearSpec]:
    """The parts of one fused GEMM as TensorRT-LLM loads them: FP8 parts re-quantized with the max weight scale and
    given the max input scale (``codecs.requantize_fp8_fused``); unquantized parts as stored. Any other mix is
    refused (the gate measures only what it can reproduce)."""
    algos = {p.quant_algo for p in parts}
    if algos == {NO_QUANT}:
        return parts
    if len(algos) > 1 or FMT.gemm(next(iter(algos))).codec != "fp8":
        raise UserError(FIELD, f"{', '.join(modules)} are {', '.join(sorted(algos))}: the gate reads fused q/k/v and "
                        "gate/up of HF checkpoints in FP8 or unquantized only.",
                        "gate this format on the engine route (TensorRT-LLM checkpoint).")
    weights = [st[m + ".weight"] for m in modules]
    scales = [st[m + ".weight_scale"].to(torch.float32).reshape(()) for m in modules]
    fused, smax = codecs.requantize_fp8_fused(weights, scales, dtype)
    act = torch.stack([p.act_scale for p in parts]).max() if all(p.act_scale is not None for p in parts) else None
    return [LinearSpec(weight=codecs.fp8_e4m3_to_float(w) * smax, quantized=True, quant_algo=p.quant_algo, act_scale=act,
                       bias=p.bias) for w, p in zip(fused, parts)]


def dequantize_hf_checkpoint(ckpt_dir: Path) -> DequantizedCheckpoint:
    """Read and dequantize a unified HF checkpoint of a Llama-layout model into the reader's TensorRT-LLM names
    (``reader.DequantizedCheckpoint``: ``attention.qkv`` rows ``[q; k; v]``, ``mlp.fc`` = gate_proj, ``mlp.gate`` =
    up_proj, ``mlp.proj`` = down_proj), as TensorRT-LLM's PyTorch backend loads it (module doc: fused FP8 groups
    re-quantized in the config's dtype). Raises UserError for an unread architecture or format, a missing or
    unused tensor, or metadata the runtime refuses (``read_hf_quant``)."""
    from safetensors.torch import load_file

    d = Path(ckpt_dir)
    hf_cfg = _json(d / "config.json")
    cfg = trt_config(hf_cfg)
    if cfg["architecture"] not in GATE_ARCHITECTURES:
        raise UserError(FIELD, f"architecture {cfg['architecture']!r} is not read here ({', '.join(GATE_ARCHITECTURES)} only).",
                        "use a checkpoint of: " + ", ".join(GATE_ARCHITECTURES) + ".")
    qinfo = read_hf_quant(d)
    unread = sorted(a for a in {qinfo["quant_algo"], *(e["quant_algo"] for e in qinfo["layers"].values())}
                    if FMT.GEMM.get(a) is not None and FMT.GEMM[a].is_quantized and not FMT.GEMM[a].per_layer
                    and FMT.GEMM[a].codec != "fp8")
    if unread:
        raise UserError(FIELD, f"{d} is a unified HF checkpoint in {', '.join(unread)}: the gate reads HF checkpoints in FP8 "
                        "or unquantized only (how TensorRT-LLM's PyTorch backend fuses the other formats' q/k/v and "
                        "gate/up is not modelled here).", "gate this format on the engine route (TensorRT-LLM checkpoint).")
    dtype = getattr(torch, str(hf_cfg.get("dtype") or hf_cfg.get("torch_dtype") or "bfloat16"))
    st: dict[str, torch.Tensor] = {}
    for f in hf_files(d):
        st.update(load_file(str(f)))
    used: set = set()

    def plain(name: str, trt: str) -> torch.Tensor:
        if name not in st:
            raise UserError(FIELD, f"{name} is missing.", FIX)
        used.add(name)
        return st[name].to(torch.float32)

    tensors = {"transformer.vocab_embedding.weight": plain("model.embed_tokens.weight", ""),
               "transformer.ln_f.weight": plain("model.norm.weight", "")}
    linears: dict[str, LinearSpec] = {}
    kv_scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    kv_algo = qinfo["kv_cache_quant_algo"]
    nkv = int(cfg["num_key_value_heads"])
    for i in range(int(cfg["num_hidden_layers"])):
        hf, trt = f"model.layers.{i}.", f"transformer.layers.{i}."
        tensors[trt + "input_layernorm.weight"] = plain(hf + "input_layernorm.weight", "")
        tensors[trt + "post_layernorm.weight"] = plain(hf + "post_attention_layernorm.weight", "")
        specs: dict[str, LinearSpec] = {}
        for group in LLAMA.fused + tuple((m,) for g in LLAMA.gemms for m in LLAMA.gemm_hf(g)
                                         if not any(m in fg for fg in LLAMA.fused)):
            mods = [hf + m for m in group]
            parts = [_read_linear(st, m, *hf_linear_format(qinfo, m), used) for m in mods]
            specs.update(zip(group, _fuse(st, mods, parts, dtype) if len(group) > 1 else parts))
        for g in LLAMA.gemms:
            members = [specs[m] for m in LLAMA.gemm_hf(g)]
            first = members[0]
            if len({m.bias is None for m in members}) > 1:
                raise UserError(FIELD, f"{hf}: only some of {', '.join(LLAMA.gemm_hf(g))} carry a bias.", FIX)
            linears[trt + g] = first if len(members) == 1 else LinearSpec(
                weight=torch.cat([m.weight for m in members]), quantized=first.quantized, act_scale=first.act_scale,
                pre=first.pre, quant_algo=first.quant_algo, group_size=first.group_size,
                bias=None if first.bias is None else torch.cat([m.bias for m in members]))
        ks = {rel: st.get(f"{hf}{rel}.{leaf}") for rel, leaf in KV_SCALE_OF.items()}  # present: checked; not used
        used.update(f"{hf}{rel}.{leaf}" for rel, leaf in KV_SCALE_OF.items() if f"{hf}{rel}.{leaf}" in st)
        if kv_algo:
            if any(v is None for v in ks.values()):
                raise UserError(FIELD, f"kv_cache_quant_algo {kv_algo} but {hf}self_attn lacks k_proj.k_scale / "
                                "v_proj.v_scale.", FIX)
            kv_scales[i] = (torch.full((nkv,), RUNTIME_FP8_KV_SCALE), torch.full((nkv,), RUNTIME_FP8_KV_SCALE))
    if "lm_head.weight" in st:
        linears["lm_head"] = _read_linear(st, "lm_head", *hf_linear_format(qinfo, "lm_head"), used)
    elif not cfg["share_embedding_table"]:
        raise UserError(FIELD, "lm_head.weight is missing and tie_word_embeddings is false.", FIX)
    leftover = sorted(set(st) - used)
    if leftover:
        raise UserError(FIELD, f"{len(leftover)} tensors are not understood by the reader, e.g. {', '.join(leftover[:5])}.",
                        "this reader handles Llama-layout checkpoints (spec/families.py GATE_ARCHITECTURES); re-export or extend checkpoint/hf_unified.py.")
    return DequantizedCheckpoint(config=cfg, linears=linears, tensors=tensors, kv_scales=kv_scales,
                                 kv_cache_quant_algo=kv_algo)


def dequantize_hf_moe(ckpt_dir: Path) -> tuple[dict, dict[str, LinearSpec], dict[str, torch.Tensor]]:
    """Read and dequantize the unified HF checkpoint of a family the gate reads in its own HF names
    (``spec.families`` ``Family.hf_read``: Qwen3 (dense, QK-norm), Qwen3-MoE, Mixtral, Qwen2-MoE; one Linear per expert),
    as the gate's HF reader (``gate/moe_model.py``) loads it: returns (HF ``config.json``, ``{HF linear module:
    LinearSpec}`` for every stored linear (``families.hf_linear_shapes``: attention, MLP, experts, a shared expert,
    ``lm_head``), ``{tensor name: float32}`` for the rest: embedding, norms (QK-norm), router, shared-expert gate).
    Fused groups (q/k/v, gate/up, each expert's and a shared expert's gate/up: ``Family.hf_fused_groups``) are read as
    TensorRT-LLM's PyTorch backend loads them (``_fuse``: FP8 re-quantized with the max scale). FP8 or unquantized
    only, no quantized KV cache. Raises UserError for another family, format, a missing or unused tensor."""
    from safetensors.torch import load_file

    from precision_pipeline.spec.families import FAMILIES, MOE_HF_READ_FORMATS, hf_linear_shapes, num_experts_of

    d = Path(ckpt_dir)
    hf_cfg = _json(d / "config.json")
    arch = (hf_cfg.get("architectures") or [None])[0]
    fam = FAMILIES.get(arch)
    if fam is None or not fam.hf_read:
        raise UserError(FIELD, f"architecture {arch!r} is not read by the gate's HF reader (spec/families.py "
                        "Family.hf_read).", FIX)
    qinfo = read_hf_quant(d)
    if qinfo["quant_algo"] not in MOE_HF_READ_FORMATS or qinfo["layers"] or qinfo["kv_cache_quant_algo"]:
        raise UserError(FIELD, f"{d} is {qinfo['quant_algo']} (KV {qinfo['kv_cache_quant_algo'] or 'unquantized'}): the "
                        "gate's HF reader reads FP8 or unquantized weights with an unquantized KV cache only.",
                        "gate an FP8 profile without a quantized KV cache.")
    dtype = getattr(torch, str(hf_cfg.get("dtype") or hf_cfg.get("torch_dtype") or "bfloat16"))
    st: dict[str, torch.Tensor] = {}
    for f in hf_files(d):
        st.update(load_file(str(f)))
    used: set = set()
    groups = fam.hf_fused_groups(num_experts_of(hf_cfg))
    linears: dict[str, LinearSpec] = {}
    stems = sorted({n.rsplit(".", 1)[0] for n in st if n.endswith(".weight_scale") or n.endswith(".weight")})
    for i in range(int(hf_cfg["num_hidden_layers"])):
        hf = f"model.layers.{i}."
        for group in groups:
            mods = [hf + m for m in group]
            if all(m + ".weight" in st for m in mods):
                parts = [_read_linear(st, m, *hf_linear_format(qinfo, m), used) for m in mods]
                linears.update(zip(mods, _fuse(st, mods, parts, dtype)))
    linear_rels = set(hf_linear_shapes(hf_cfg, fam))  # the router and a shared-expert gate are none: read as stored
    for stem in stems:  # the linears in no fused group (o_proj, down_proj, each expert's down_proj, lm_head)
        rel = stem.split(".", 3)[3] if stem.startswith("model.layers.") and stem.count(".") >= 3 else stem
        if stem not in linears and rel in linear_rels:
            linears[stem] = _read_linear(st, stem, *hf_linear_format(qinfo, stem), used)
    plain = {n: t.to(torch.float32) for n, t in st.items() if n not in used}
    bad = sorted(n for n, t in st.items() if n not in used and t.dtype in codecs.QUANTIZED_DTYPES)
    if bad:
        raise UserError(FIELD, f"{len(bad)} quantized tensors are not understood by the gate's HF reader, e.g. "
                        f"{', '.join(bad[:5])}.", FIX)
    return hf_cfg, linears, plain


def hf_layer_table(ckpt_dir: Path) -> dict:
    """The checkpoint linear by linear from the headers (no tensor data): ``{"quant_algo", "kv_cache_quant_algo",
    "source", "linears": [{"name" (HF module), "quant_algo", "group_size", "params", "bytes", "bits_per_weight"}],
    "by_format": {quant_algo: {"linears", "params", "bytes"}}, "effective_bits"}`` (as ``reader.layer_table``)."""
    cfg = _json(Path(ckpt_dir) / "config.json")
    q = read_hf_quant(ckpt_dir)
    sizes: dict[str, list[int]] = {}
    for name, (_, meta) in hf_headers(ckpt_dir).items():
        stem, _, leaf = name.rpartition(".")
        if not (stem.endswith(tuple(m for g in LLAMA.gemms for m in LLAMA.gemm_hf(g))) or stem == "lm_head") \
                or leaf not in ("weight", *HF_SUFFIX):
            continue
        s = sizes.setdefault(stem, [0, 0])
        s[1] += meta["data_offsets"][1] - meta["data_offsets"][0]
        if leaf == "weight":
            n = 1
            for dim in meta["shape"]:
                n *= int(dim)
            s[0] += n
    rows, by_fmt, bits, params = format_rows((stem, *hf_linear_format(q, stem), n, nbytes)
                                             for stem, (n, nbytes) in sizes.items())
    return {"quant_algo": q["quant_algo"], "kv_cache_quant_algo": q["kv_cache_quant_algo"] or FMT.KVCacheQuantAlgo.NONE.value,
            "source": f"unified HF checkpoint ({HF_QUANT_CONFIG}, *.safetensors headers)", "architecture":
            (cfg.get("architectures") or [None])[0], "linears": rows, "by_format": dict(sorted(by_fmt.items())),
            "effective_bits": round(bits / params, 4) if params else None}


def hf_checkpoint_bytes(ckpt_dir: Path) -> int:
    """Bytes of the checkpoint's safetensors files."""
    return sum(f.stat().st_size for f in hf_files(ckpt_dir))


__all__ = ["dequantize_hf_moe", "RUNTIME_FP8_KV_SCALE", "HF_SUFFIX", "hf_slots", "KV_SCALE_OF", "QUANT_CFG", "parse_quant_config", "read_hf_quant", "hf_linear_format", "hf_files",
           "hf_headers", "module_names", "trt_config", "dequantize_hf_checkpoint", "hf_layer_table", "hf_checkpoint_bytes"]
