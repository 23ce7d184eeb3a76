"""Model architecture from a Hugging Face ``config.json`` (no torch, no transformers: fast).

``read_model_arch(model_dir)`` reads the few numbers the planner needs: layers, hidden size,
attention/KV heads, head_dim, MLP width, vocabulary, position limit, rope scaling and MoE shape.

Supported architectures: the model-family registry's (``spec/families.py`` ``FAMILIES``; MoE shape from
``num_local_experts`` (Mixtral) or ``num_experts`` and ``moe_intermediate_size`` (Qwen MoE)).

The rope scaling factor follows ``tensorrt_llm/builder.py`` ``_init_max_seq_len``: the
``factor`` of ``rope_scaling`` unless its type is ``su``, ``longrope`` or ``llama3`` (those
already describe the position range in ``max_position_embeddings``), else 1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict

from precision_pipeline.core.errors import UserError
from precision_pipeline.spec.families import SUPPORTED_ARCHITECTURES, family

# rope types whose factor does not extend max_position_embeddings (tensorrt_llm/builder.py)
_ROPE_NO_FACTOR = ("su", "longrope", "llama3")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope", "yarn")
"""``rope_scaling`` types a build handles: the ones both the CPU side reads (transformers 4.57
``modeling_rope_utils.ROPE_INIT_FUNCTIONS``; quantize, the gate and the CPU reference backend build
their rotary embedding with it, and any other type is a ``KeyError`` there) and TensorRT-LLM 1.2 builds
(``tensorrt_llm/functional.py`` ``RotaryScalingType``: none/"default", linear, dynamic, longrope,
llama3, yarn, mrope; ``from_string`` raises "Unsupported rotary scaling type" for others)."""


class ModelArch(BaseModel):
    """Shape of a decoder-only transformer (counts are elements, not bytes).

    ``num_experts`` is 0 for a dense model. ``num_params`` counts every weight element once
    (tied embeddings counted once), as the HF model holds them.
    """

    model_config = ConfigDict(frozen=True)

    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: Optional[int]
    rope_scaling_factor: float = 1.0
    rope_type: Optional[str] = None
    tied_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    attention_bias: bool = False
    sliding_window: Optional[int] = None
    """Tokens each position attends to (``config.json`` ``sliding_window``) for a family with a window
    (``Family.sliding_window``: Mistral); None: every token."""
    dtype: str = "bfloat16"
    num_params: int = 0
    quantized_as: Optional[str] = None
    """``quantization_config.quant_method`` when config.json says the weights are already quantized."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def qkv_out(self) -> int:
        """Output width of the fused QKV projection: (heads + 2 x kv_heads) x head_dim."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


HEAD_DIM_MULTIPLE, HEAD_DIM_MIN = 8, 16
"""head_dim a TensorRT-LLM attention kernel takes: a multiple of 8, at least 16. Its masked multi-head attention
(generation) and fused context kernels are instantiated per head size, each a multiple of 8 (e.g. 32, 64, 80, 96,
104, 128, 256; tensorrt_llm/kernels/decoderMaskedMultiheadAttention, whose dispatch throws "unsupported head_size"
otherwise); a config.json head_dim of 7 is a typo, not a model (hostile s12 F-A)."""


def count_params(a: "ModelArch | dict") -> int:
    """Weight elements of the HF model (embeddings, decoder layers, final norm, lm_head if untied)."""
    g = a if isinstance(a, dict) else a.model_dump()
    h, hd = g["hidden_size"], g["head_dim"]
    attn = h * (g["num_heads"] + 2 * g["num_kv_heads"]) * hd + g["num_heads"] * hd * h
    if g["attention_bias"]:
        attn += (g["num_heads"] + 2 * g["num_kv_heads"]) * hd
    if g["num_experts"]:
        mlp = g["num_experts"] * 3 * h * g["moe_intermediate_size"] + h * g["num_experts"]
        mlp += 3 * h * g["shared_expert_intermediate_size"]
    else:
        mlp = 3 * h * g["intermediate_size"]
    per_layer = attn + mlp + 2 * h
    emb = g["vocab_size"] * h
    return g["num_layers"] * per_layer + emb + h + (0 if g["tied_embeddings"] else emb)


# Sanity bounds (far above any real model) so a corrupt config cannot make planning slow.
_MAX = {"num_hidden_layers": 4096, "hidden_size": 1 << 20, "num_attention_heads": 4096, "num_key_value_heads": 4096,
        "head_dim": 8192, "intermediate_size": 1 << 24, "moe_intermediate_size": 1 << 24, "vocab_size": 1 << 24,
        "max_position_embeddings": 1 << 30}


def _int(cfg: dict, key: str, path: Path, default: Any = None, required: bool = True) -> Optional[int]:
    v = cfg.get(key, default)
    if v is None:
        if required:
            raise UserError("--model", f"{path} has no {key!r}.", "give a Hugging Face model folder whose config.json is complete.")
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise UserError("--model", f"{path}: {key} must be a positive integer, got {v!r}.",
                        "fix the model's config.json.")
    if v > _MAX.get(key, 1 << 40):
        raise UserError("--model", f"{path}: {key} {v} is implausibly large (limit {_MAX[key]}).", "fix the model's config.json.")
    return v


def _refuse_impossible(path, arch: str, moe_family: bool, head_dim: int, num_experts: int, topk: int) -> None:
    """UserError (``--model``) for a shape no engine can have (hostile s12 F-A: each was planned with numbers): a
    ``head_dim`` no attention kernel takes (``HEAD_DIM_MULTIPLE``, ``HEAD_DIM_MIN``), a mixture-of-experts
    architecture with no experts (planned as a dense model), a router top-k above the expert count."""
    if head_dim % HEAD_DIM_MULTIPLE or head_dim < HEAD_DIM_MIN:
        raise UserError("--model", f"{path}: head_dim {head_dim} has no attention kernel (TensorRT-LLM's are built for "
                        f"head sizes that are multiples of {HEAD_DIM_MULTIPLE}, at least {HEAD_DIM_MIN}).",
                        "fix head_dim (or hidden_size / num_attention_heads) in the model's config.json.")
    if not num_experts and moe_family:
        raise UserError("--model", f"{path}: config.json gives {arch} (a mixture-of-experts family) no experts "
                        "(num_local_experts / num_experts is 0 or missing).", "fix the expert count in config.json.")
    if topk > num_experts:
        raise UserError("--model", f"{path}: num_experts_per_tok {topk} is more than the {num_experts} experts each token "
                        "can be routed to.", "fix num_experts_per_tok (the router's top-k) in config.json.")


def arch_from_config(cfg: dict, name: str = "model", path: Path | str = "config.json") -> ModelArch:
    """Build a ModelArch from a parsed HF config dict (UserError on ``--model`` if invalid)."""
    path = Path(path)
    if not isinstance(cfg, dict):
        raise UserError("--model", f"{path} does not hold a JSON object.", "give a Hugging Face model folder.")
    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if arch is None:
        raise UserError("--model", f"{path} has no 'architectures' list.",
                        f"set architectures to one of: {', '.join(SUPPORTED_ARCHITECTURES)}.")
    fam = family(arch)  # UserError naming the supported architectures (spec/families.py)
    layers = _int(cfg, "num_hidden_layers", path)
    hidden = _int(cfg, "hidden_size", path)
    heads = _int(cfg, "num_attention_heads", path)
    kv = _int(cfg, "num_key_value_heads", path, default=heads)
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise UserError("--model", f"{path}: hidden_size {hidden} is not divisible by num_attention_heads {heads} and head_dim is missing.",
                            "add head_dim to config.json.")
        head_dim = hidden // heads
    head_dim = _int({"head_dim": head_dim}, "head_dim", path)
    if heads % kv:
        raise UserError("--model", f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}.",
                        "fix the model's config.json.")
    vocab = _int(cfg, "vocab_size", path)
    max_pos = _int(cfg, "max_position_embeddings", path, required=False)
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or not 0 <= num_experts <= 4096:
        raise UserError("--model", f"{path}: number of experts must be a non-negative integer, got {num_experts!r}.",
                        "fix the model's config.json.")
    if num_experts and fam.moe is None:
        raise UserError("--model", f"{path}: config.json gives {arch} {num_experts} experts, but that family has no "
                        "experts (spec/families.py).", "fix config.json, or name the family's MoE architecture "
                        "(e.g. MixtralForCausalLM).")
    inter = _int(cfg, "intermediate_size", path, required=not num_experts) or 0
    moe_inter = 0
    if num_experts:
        moe_inter = cfg.get("moe_intermediate_size") or inter
        moe_inter = _int({"moe_intermediate_size": moe_inter}, "moe_intermediate_size", path)
    shared = _int(cfg, "shared_expert_intermediate_size", path, required=False) or 0
    topk = _int(cfg, "num_experts_per_tok", path, required=False) or (2 if num_experts else 0)
    _refuse_impossible(path, arch, fam.moe is not None, head_dim, num_experts, topk)
    rs = cfg.get("rope_scaling")
    factor, rtype = 1.0, None
    if isinstance(rs, dict):
        rtype = rs.get("rope_type", rs.get("type"))
        if rtype is not None and rtype not in ROPE_TYPES:
            raise UserError("--model", f"{path}: rope_scaling type {str(rtype)[:40]!r} is not supported (quantize, the gate "
                            f"and TensorRT-LLM 1.2 read {', '.join(ROPE_TYPES)}).",
                            "use a model whose config.json rope_scaling type is one of those, or remove rope_scaling "
                            "if the model was not trained with it.")
        f = rs.get("factor", 1.0)
        if rtype not in _ROPE_NO_FACTOR:
            try:
                factor = float(f)
            except (TypeError, ValueError):
                raise UserError("--model", f"{path}: rope_scaling.factor must be a number, got {f!r}.", "fix the model's config.json.")
            if not math.isfinite(factor) or factor <= 0:
                raise UserError("--model", f"{path}: rope_scaling.factor must be positive, got {f!r}.", "fix the model's config.json.")
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    fields = dict(
        name=name, architecture=arch, num_layers=layers, hidden_size=hidden, num_heads=heads,
        num_kv_heads=kv, head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
        max_position_embeddings=max_pos, rope_scaling_factor=factor, rope_type=rtype,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), num_experts=num_experts,
        num_experts_per_tok=int(topk), moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=int(shared),
        attention_bias=bool(cfg.get("attention_bias", fam.attention_bias)),
        sliding_window=_int(cfg, "sliding_window", path, required=False) if fam.sliding_window else None,
        dtype=str(dtype),
    )
    qc = cfg.get("quantization_config")
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        fields["quantized_as"] = str(method)[:40] if method else "unknown"
    fields["num_params"] = count_params(fields)
    return ModelArch(**fields)


def read_model_arch(model_dir: Path) -> ModelArch:
    """Read ``<model_dir>/config.json`` into a ModelArch. UserError naming ``--model`` on failure."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise UserError("--model", f"no config.json in {model_dir}.",
                        "pass --model with a local Hugging Face model folder (or run the set-up to convert the default model).")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError("--model", f"{path} is not valid JSON: {e}.", "fix or re-create the model's config.json.")
    return arch_from_config(cfg, name=model_dir.name, path=path)


__all__ = ["ModelArch", "read_model_arch", "arch_from_config", "count_params", "ROPE_TYPES"]
