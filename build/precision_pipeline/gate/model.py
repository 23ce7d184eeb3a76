"""The gate's torch model of a TensorRT-LLM checkpoint: an HF model that computes what the checkpoint says, on CPU.

``load_checkpoint_model(ckpt_dir, hf_model_dir)`` reads the checkpoint with the checkpoint reader
(``checkpoint.reader.dequantize_checkpoint``: every weight dequantized to float32, ranks reassembled)
and builds the family's HF model (``spec.families``: the HF class of the checkpoint's ``architecture``, e.g.
``LlamaForCausalLM``, ``Qwen2ForCausalLM`` with the q/k/v biases the checkpoint stores, ``MistralForCausalLM`` with
the HF config's ``sliding_window``) on the ``meta`` device with every parameter from the checkpoint. Quantized linears
become ``QuantLinear`` (the input fake-quant the checkpoint's format declares, ``GemmFormat.act_fake_quant``);
the KV cache is fake-quantized with the checkpoint's k/v scales inside a custom attention function
(registered in ``transformers.AttentionInterface`` as ``ATTN_IMPL``) before SDPA. The fake-quant
numerics are ``checkpoint/codecs.py``'s; the reader's module doc describes the tensors.

Used by the accuracy gate, the CPU reference backend that serves a checkpoint and the per-layer
sensitivity analysis (which swaps single linears with ``split_qkv`` / ``QuantLinear``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from precision_pipeline.checkpoint.codecs import FAKE_QUANT, FIELD
from precision_pipeline.checkpoint.reader import (DequantizedCheckpoint, LinearSpec, checkpoint_layout,
                                                  dequantize_checkpoint)
from precision_pipeline.core.errors import UserError
from precision_pipeline.spec import formats as FMT
from precision_pipeline.spec.families import family, qkv_rows

ATTN_IMPL = "trtllm_kvq_sdpa"


def split_qkv(qkv: LinearSpec, q_rows: int, kv_rows: int) -> list[tuple[str, LinearSpec]]:
    """The fused ``attention.qkv`` (rows ``[q; k; v]``, ``spec.families.qkv_rows`` at tp 1) as the three HF
    linears ``[("q_proj", ...), ("k_proj", ...), ("v_proj", ...)]``.

    Each part keeps the fused GEMM's format (``quant_algo``, ``group_size``), input scales (``act_scale``,
    ``pre``: q/k/v read one input), the per-row activation scales that fall in its rows, shifted to
    its own row numbers, and its rows of the bias (Qwen2's ``attention.qkv.bias``) when there is one. Raises UserError when the weight does not have ``q_rows + 2 x kv_rows`` rows.
    The one q/k/v split: the gate's model and the sensitivity analysis both call it.
    """
    rows = qkv.weight.shape[0]
    if rows != q_rows + 2 * kv_rows:
        raise UserError(FIELD, f"attention.qkv has {rows} rows; expected {q_rows} + 2 x {kv_rows}.",
                        "use the HF folder the checkpoint was made from.")
    out = []
    for name, (a, b) in (("q_proj", (0, q_rows)), ("k_proj", (q_rows, q_rows + kv_rows)),
                         ("v_proj", (q_rows + kv_rows, q_rows + 2 * kv_rows))):
        sub_rows = [(max(s, a) - a, min(e, b) - a, sc) for s, e, sc in qkv.act_scale_rows if s < b and e > a]
        out.append((name, LinearSpec(weight=qkv.weight[a:b], quantized=qkv.quantized, act_scale=qkv.act_scale,
                                     act_scale_rows=sub_rows, pre=qkv.pre, quant_algo=qkv.quant_algo,
                                     group_size=qkv.group_size, bias=None if qkv.bias is None else qkv.bias[a:b])))
    return out


class SharedInputQuant:
    """The input fake-quant of ``consumers`` linears that read the same tensor, computed once.

    q/k/v (split from one fused ``qkv``) and gate/up read one input with one activation scale and
    prequant scale, so their fake-quantized inputs are equal: the first call computes it, the next
    ``consumers - 1`` calls with the *same tensor object* get that result, then both are dropped
    (nothing is held between layers). A call with another tensor recomputes (identity is safe: the
    held tensor cannot be freed, so its id cannot be reused). Same numbers, fewer passes.
    """

    def __init__(self, consumers: int):
        self.consumers = consumers
        self._x: Optional[torch.Tensor] = None
        self._y: Optional[torch.Tensor] = None
        self._left = 0

    def __call__(self, x: torch.Tensor, compute) -> torch.Tensor:
        if self._x is x and self._left > 0:
            y = self._y
            self._left -= 1
            if self._left == 0:
                self._x = self._y = None
            assert y is not None
            return y
        y = compute(x)
        self._x, self._y, self._left = (x, y, self.consumers - 1) if self.consumers > 1 else (None, None, 0)
        return y


def _shares_input_quant(specs: list["LinearSpec"]) -> bool:
    """True when every spec fake-quantizes its input identically (one format, equal act and prequant
    scales, no per-row scales): their ``QuantLinear`` s may share one ``SharedInputQuant``."""
    first = specs[0]

    def same(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
        return (a is None and b is None) or (a is not None and b is not None and a.shape == b.shape and torch.equal(a, b))

    return all(s.quantized == first.quantized and s.quant_algo == first.quant_algo and not s.act_scale_rows
               and same(s.act_scale, first.act_scale) and same(s.pre, first.pre) for s in specs)


class QuantLinear(nn.Module):
    """A linear with the checkpoint's dequantized weight and its input fake-quant.

    ``act_format``: None, "fp8", "int8", "nvfp4". Input ``x [..., in]`` -> ``[..., out]``:
    ``x * pre`` (if any), then fake-quant with ``act_scale``, then ``x @ weight.T`` (``+ bias`` when the
    checkpoint stores one: unquantized, added after the GEMM).
    """

    def __init__(self, spec: LinearSpec, act_format: Optional[str], dtype: torch.dtype,
                 shared: Optional["SharedInputQuant"] = None):
        super().__init__()
        self.weight = nn.Parameter(spec.weight.to(dtype), requires_grad=False)
        self.act_format = act_format
        self.shared = shared if act_format is not None and not spec.act_scale_rows else None
        self.register_buffer("pre", None if spec.pre is None else spec.pre.to(torch.float32))
        self.register_buffer("act_scale", None if spec.act_scale is None else spec.act_scale.to(torch.float32))
        self.register_buffer("bias", None if spec.bias is None else spec.bias.to(dtype))
        self.act_scale_rows = [(a, b, s.to(torch.float32)) for a, b, s in spec.act_scale_rows]
        self.in_features = spec.weight.shape[1]
        self.out_features = spec.weight.shape[0]

    def _quant(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        fn = FAKE_QUANT.get(self.act_format or "")
        return fn(x, scale) if fn is not None else x

    def _prepared(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre is not None:
            x = (x.to(torch.float32) * self.pre).to(x.dtype)
        return self._quant(x, self.act_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_format is None:
            if self.pre is not None:
                x = (x.to(torch.float32) * self.pre).to(x.dtype)
            return F.linear(x, self.weight, self.bias)
        if self.act_scale_rows:
            if self.pre is not None:
                x = (x.to(torch.float32) * self.pre).to(x.dtype)
            outs = [F.linear(self._quant(x, s), self.weight[a:b], None if self.bias is None else self.bias[a:b])
                    for a, b, s in self.act_scale_rows]
            return torch.cat(outs, dim=-1)
        if self.shared is not None:
            return F.linear(self.shared(x, self._prepared), self.weight, self.bias)
        return F.linear(self._prepared(x), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, act={self.act_format}, pre={self.pre is not None}"


def act_fake_quant(quant_algo: Optional[str]) -> Optional[str]:
    """The activation fake-quant kind (``fp8`` / ``int8`` / ``nvfp4``, keys of ``codecs.FAKE_QUANT``)
    that a linear of ``quant_algo`` gets (``GemmFormat.act_fake_quant``); None for weight-only,
    unquantized or unknown formats."""
    fmt = FMT.GEMM.get(quant_algo) if quant_algo else None
    return fmt.act_fake_quant if fmt is not None else None


# KV fake-quant kinds the CPU model reproduces (KvFormat.cpu_model) -> function (x, per-head scale)
KV_FAKE_QUANT = {k.fake_quant: FAKE_QUANT[k.fake_quant] for k in FMT.KV.values() if k.fake_quant and k.cpu_model}


_KV_CACHE = threading.local()   # .by_module: {id(attention module): the cache its current call updates}
_KVQ_DONE = "_precision_pipeline_kvq_layers"  # attribute of a cache: layer indices stored fake-quantized


def _kv_cache_prehook(module, args, kwargs):
    """Forward pre-hook of a KV fake-quant attention: note the cache this call updates (or None)."""
    by = getattr(_KV_CACHE, "by_module", None)
    if by is None:
        by = _KV_CACHE.by_module = {}
    by[id(module)] = kwargs.get("past_key_values")


def _appending_storage(module, key: torch.Tensor, value: torch.Tensor):
    """The cache whose storage ``key``/``value`` are when that storage only appends new positions at the
    end (a transformers ``DynamicCache`` with plain ``DynamicLayer`` s, the cache ``generate`` and the
    gate use), else None (no cache, or another kind: fake-quantized out of place, as a whole)."""
    cache = (getattr(_KV_CACHE, "by_module", None) or {}).pop(id(module), None)
    if cache is None or torch.is_grad_enabled():
        return None
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
        layer = cache.layers[module.layer_idx]
    except (ImportError, AttributeError, IndexError, TypeError):
        return None
    if type(cache) is not DynamicCache or type(layer) is not DynamicLayer:
        return None
    return cache if layer.keys is key and layer.values is value else None


def _kvq_sdpa(module, query, key, value, attention_mask, **kwargs):
    """SDPA with the KV cache fake-quantized as the checkpoint says (module.kv_format/k_scale/v_scale).

    Fake-quant is elementwise with a per-head scale and idempotent (``fq(fq(x)) == fq(x)``: the
    codes of an FP8 value survive the round trip), so when the keys/values are the storage of an
    appending ``DynamicCache`` (``_appending_storage``) they are fake-quantized *in place* and the
    cache remembers it per layer: later calls quantize only their ``query.shape[-2]`` new positions
    instead of the whole cache on every decode step. The attention sees the same numbers either way.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    fmt = getattr(module, "kv_format", None)
    cache = _appending_storage(module, key, value) if fmt is not None else None
    if fmt is not None:
        ks = module.k_scale.view(1, -1, 1, 1)  # [1, kv_heads, 1, 1]
        vs = module.v_scale.view(1, -1, 1, 1)
        fn = KV_FAKE_QUANT.get(fmt)
        if fn is not None and cache is None:
            key = fn(key, ks)
            value = fn(value, vs)
        elif fn is not None:
            done = getattr(cache, _KVQ_DONE, None)
            if done is None:
                done = set()
                setattr(cache, _KVQ_DONE, done)
            new = query.shape[-2] if module.layer_idx in done else key.shape[-2]
            new = min(new, key.shape[-2])
            key[..., -new:, :] = fn(key[..., -new:, :], ks)
            value[..., -new:, :] = fn(value[..., -new:, :], vs)
            done.add(module.layer_idx)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_attention() -> None:
    """Register the KV fake-quant attention and its mask function under ``ATTN_IMPL``.

    The mask function matters: transformers (masking_utils ``_preprocess_mask_arguments``) builds
    NO attention mask for an implementation name it has no mask function for, so left-padded
    batches (batched greedy in the gate, batched requests in the CPU reference backend) would
    attend to padding. SDPA's mask is the right one (the attention itself is SDPA).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPL, _kvq_sdpa)
    AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)


def _set_param(module: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(module, name)
    if tuple(old.shape) != tuple(value.shape):
        raise UserError(FIELD, f"checkpoint tensor for {type(module).__name__}.{name} has shape {tuple(value.shape)}; "
                        f"the model expects {tuple(old.shape)}.", "use the HF folder the checkpoint was made from.")
    setattr(module, name, nn.Parameter(value, requires_grad=False))


def read_dequantized(ckpt_dir: Path) -> DequantizedCheckpoint:
    """The dequantized checkpoint in either layout (``checkpoint.reader.checkpoint_layout``): a TensorRT-LLM
    checkpoint (``dequantize_checkpoint``) or ModelOpt's unified HF checkpoint
    (``checkpoint.hf_unified.dequantize_hf_checkpoint``: fused FP8 groups re-quantized as TensorRT-LLM's PyTorch
    backend loads them), in the reader's TensorRT-LLM names. Raises UserError as those do."""
    if checkpoint_layout(ckpt_dir) == "hf_unified":
        from precision_pipeline.checkpoint.hf_unified import dequantize_hf_checkpoint

        return dequantize_hf_checkpoint(ckpt_dir)
    return dequantize_checkpoint(ckpt_dir)


def _swap_linear(parent: nn.Module, attr: str, spec: LinearSpec, act: Optional[str], dtype: torch.dtype,
                 shared: Optional[SharedInputQuant], where: str) -> None:
    """Replace ``parent.attr`` (an HF linear on ``meta``) by the checkpoint's ``QuantLinear``; UserError when the
    shapes differ or one of them has a bias the other lacks (the family's HF class says which linears carry one:
    a Qwen2 checkpoint without its q/k/v biases, or biases in a Llama checkpoint, would be gated as another model)."""
    old = getattr(parent, attr)
    if tuple(old.weight.shape) != tuple(spec.weight.shape):
        raise UserError(FIELD, f"{where} has shape {tuple(spec.weight.shape)}; the model expects {tuple(old.weight.shape)}.",
                        "use the HF folder the checkpoint was made from.")
    if (getattr(old, "bias", None) is not None) != (spec.bias is not None):
        has = "has no bias" if spec.bias is None else "has a bias"
        raise UserError(FIELD, f"{where} {has} but the {type(parent).__name__}'s {attr} {'has one' if spec.bias is None else 'has none'} "
                        "(spec/families.py attention_bias).", "use the HF folder the checkpoint was made from, or re-export it.")
    setattr(parent, attr, QuantLinear(spec, act, dtype, shared))


def _swap_linears(layer: nn.Module, base: str, ck: DequantizedCheckpoint, fam, qkv: tuple[int, int], act,
                  dtype: torch.dtype) -> None:
    """Every linear of decoder layer ``layer`` from the checkpoint (``base`` = ``transformer.layers.N.``): the fused
    ``attention.qkv`` split into q/k/v (``split_qkv`` with ``qkv`` = (q rows, kv rows)), the others one to one by the
    family's names (``spec.families``); q/k/v and the fused gate/up pair each share one input fake-quant."""
    specs = split_qkv(ck.linears[base + "attention.qkv"], *qkv)
    shared = SharedInputQuant(3) if _shares_input_quant([sp for _, sp in specs]) else None
    for name, spec in specs:
        _swap_linear(layer.self_attn, name, spec, act(spec), dtype, shared, f"{base}attention.qkv ({name})")
    # the fused group that spans two GEMMs (gate/up: mlp.fc + mlp.gate) reads one input: one shared input fake-quant
    fused_mlp = next(fam.gemms_of(g) for g in fam.fused if len(fam.gemms_of(g)) > 1)
    mlp_in = [ck.linears[base + trt] for trt in fused_mlp]
    shared = SharedInputQuant(2) if _shares_input_quant(mlp_in) else None
    for trt in fam.gemms:
        if len(fam.gemm_hf(trt)) != 1:
            continue
        parent_name, attr = fam.gemm_hf(trt)[0].split(".")
        spec = ck.linears[base + trt]
        _swap_linear(getattr(layer, parent_name), attr, spec, act(spec), dtype, shared if trt in fused_mlp else None,
                     base + trt)


def load_checkpoint_model(ckpt_dir: Path, hf_model_dir: Path, dtype: torch.dtype = torch.float32,
                          device: str = "cpu") -> nn.Module:
    """The family's HF model (``spec.families``: ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` with its q/k/v biases,
    ``MistralForCausalLM`` with the HF config's ``sliding_window``) that computes what the checkpoint says, on CPU
    (``device="cuda"``: built on the host, then placed over the visible GPUs, ``place_on_cuda``).

    Either layout (``read_dequantized``). Architecture from ``hf_model_dir``'s config (checked against the checkpoint's config.json);
    every weight from the checkpoint, dequantized to float32 (then ``dtype``). Quantized linears
    become ``QuantLinear`` (input fake-quant per the checkpoint's quant_algo); excluded ones plain
    weights; the KV cache is fake-quantized per kv_cache_quant_algo with the checkpoint's
    k/v scales. lm_head is untied from the embedding (both come from the checkpoint).
    Raises UserError for mismatched architectures or a broken checkpoint.
    """
    import transformers
    from transformers import AutoConfig

    ck = read_dequantized(Path(ckpt_dir))  # refuses an architecture the gate does not read (GATE_ARCHITECTURES)
    cfg = ck.config
    fam = family(str(cfg.get("architecture")))
    hf_cfg = AutoConfig.from_pretrained(str(hf_model_dir))
    checks = {
        "hidden_size": (cfg.get("hidden_size"), hf_cfg.hidden_size),
        "num_hidden_layers": (cfg.get("num_hidden_layers"), hf_cfg.num_hidden_layers),
        "num_attention_heads": (cfg.get("num_attention_heads"), hf_cfg.num_attention_heads),
        "num_key_value_heads": (cfg.get("num_key_value_heads"), hf_cfg.num_key_value_heads),
        "intermediate_size": (cfg.get("intermediate_size"), hf_cfg.intermediate_size),
        "vocab_size": (cfg.get("vocab_size"), hf_cfg.vocab_size),
    }
    bad = {k: v for k, v in checks.items() if v[0] != v[1]}
    if bad:
        raise UserError(FIELD, "checkpoint and HF config disagree: " + ", ".join(f"{k} {a} vs {b}" for k, (a, b) in bad.items()) + ".",
                        "pass the HF folder the checkpoint was exported from.")
    kv_algo = ck.kv_cache_quant_algo
    kvf = FMT.KV.get(kv_algo) if kv_algo else None
    if kv_algo and (kvf is None or not kvf.is_quantized or not kvf.cpu_model):
        # NVFP4 KV (KvFormat.cpu_model False): the meaning of the exported k/v scales for
        # TensorRT-LLM's FP4 cache was not verified here, so it is refused rather than approximated
        modelled = " and ".join(k.value for k in FMT.KV.values() if k.is_quantized and k.cpu_model)
        raise UserError(FIELD, f"kv_cache_quant_algo {kv_algo} is not modelled by this reader ({modelled} are).",
                        "gate an FP8-KV variant of the profile, or evaluate this one on the engine.")

    def act(spec: LinearSpec) -> Optional[str]:  # per linear: MIXED_PRECISION layers differ
        return act_fake_quant(spec.quant_algo) if spec.quantized else None

    register_attention()
    hf_cfg.tie_word_embeddings = False
    hf_cfg._attn_implementation = ATTN_IMPL
    with torch.device("meta"):
        model = getattr(transformers, fam.architecture)(hf_cfg)  # the family's HF class (spec/families.py)
    model.config.tie_word_embeddings = False
    emb = ck.tensors["transformer.vocab_embedding.weight"].to(dtype)
    _set_param(model.model.embed_tokens, "weight", emb)
    _set_param(model.model.norm, "weight", ck.tensors["transformer.ln_f.weight"].to(dtype))
    head = ck.linears.get("lm_head")
    if head is None:  # share_embedding_table
        model.lm_head = QuantLinear(LinearSpec(weight=ck.tensors["transformer.vocab_embedding.weight"], quantized=False), None, dtype)
    else:
        model.lm_head = QuantLinear(head, act(head), dtype)
    hd = int(cfg.get("head_size") or hf_cfg.hidden_size // hf_cfg.num_attention_heads)
    nq, nkv = qkv_rows(hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads, hd)
    for i, layer in enumerate(model.model.layers):
        base = f"transformer.layers.{i}."
        _set_param(layer.input_layernorm, "weight", ck.tensors[base + "input_layernorm.weight"].to(dtype))
        _set_param(layer.post_attention_layernorm, "weight", ck.tensors[base + "post_layernorm.weight"].to(dtype))
        _swap_linears(layer, base, ck, fam, (nq, nkv), act, dtype)
        attn = layer.self_attn
        if kv_algo:
            ks, vs = ck.kv_scales[i]
            attn.kv_format = kvf.fake_quant
            attn.register_buffer("k_scale", ks.to(torch.float32))
            attn.register_buffer("v_scale", vs.to(torch.float32))
            attn.register_forward_pre_hook(_kv_cache_prehook, with_kwargs=True)
        else:
            attn.kv_format = None
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_cfg, device="cpu")  # the family's own RoPE class
    leftover = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p is not None and p.is_meta]
    if leftover:
        raise UserError(FIELD, f"no checkpoint tensor for {', '.join(leftover[:5])}.", "re-export the checkpoint.")
    model.eval()
    return place_on_cuda(model) if device == "cuda" else model


def place_on_cuda(model: nn.Module) -> nn.Module:
    """Spread ``model`` over the visible GPUs in whole decoder layers (accelerate's
    ``infer_auto_device_map`` + ``dispatch_model``, what ``from_pretrained(device_map="auto")`` does);
    the per-row activation scales of fused q/k/v (a plain list, not buffers) follow their weights."""
    from accelerate import dispatch_model, infer_auto_device_map

    device_map = infer_auto_device_map(model, no_split_module_classes=list(getattr(model, "_no_split_modules", None) or []))
    model = dispatch_model(model, device_map=device_map)
    for mod in model.modules():
        if isinstance(mod, QuantLinear) and mod.act_scale_rows:
            dev = mod.weight.device
            mod.act_scale_rows = [(a, b, s.to(dev)) for a, b, s in mod.act_scale_rows]
    return model


__all__ = ["read_dequantized", "ATTN_IMPL", "split_qkv", "SharedInputQuant", "QuantLinear", "act_fake_quant", "KV_FAKE_QUANT", "register_attention",
           "load_checkpoint_model", "place_on_cuda"]
