"""HF Llama module names -> TensorRT-LLM checkpoint names, and which linears ``exclude_modules`` keeps.

Shared by the resolve rules (what would be quantized), the PTQ export and the search; torch-free.

Mapping (``modelopt/torch/export/layer_utils.py``, verified by comparing exported weights with
the HF ones): q/k/v_proj -> ``attention.qkv`` (rows [q; k; v]), o_proj -> ``attention.dense``,
gate_proj -> ``mlp.fc``, up_proj -> ``mlp.gate``, down_proj -> ``mlp.proj``.
"""

from __future__ import annotations

import fnmatch
import re

# HF Llama linear name (last components) -> TensorRT-LLM name (relative to transformer.layers.N.)
HF_TO_TRT = {
    "self_attn.q_proj": "attention.qkv",
    "self_attn.k_proj": "attention.qkv",
    "self_attn.v_proj": "attention.qkv",
    "self_attn.o_proj": "attention.dense",
    "mlp.gate_proj": "mlp.fc",
    "mlp.up_proj": "mlp.gate",
    "mlp.down_proj": "mlp.proj",
}
LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")


def trtllm_name(hf_name: str) -> str:
    """TensorRT-LLM checkpoint module name of an HF Llama module name.

    ``model.layers.3.self_attn.k_proj`` -> ``transformer.layers.3.attention.qkv``;
    ``lm_head`` -> ``lm_head``; ``model.embed_tokens`` -> ``transformer.vocab_embedding``;
    anything else is returned unchanged.
    """
    m = LAYER_RE.match(hf_name)
    if m:
        idx, rest = m.groups()
        if rest in HF_TO_TRT:
            return f"transformer.layers.{idx}.{HF_TO_TRT[rest]}"
    if hf_name == "model.embed_tokens":
        return "transformer.vocab_embedding"
    if hf_name == "model.norm":
        return "transformer.ln_f"
    return hf_name


# Linears TensorRT-LLM fuses into one GEMM: excluding one member keeps the whole group unquantized.
_FUSED = [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")]


def llama_linear_names(num_layers: int) -> list[str]:
    """HF names of a Llama model's quantizable linears: every decoder layer's seven, then ``lm_head``."""
    return [f"model.layers.{i}.{rest}" for i in range(num_layers) for rest in HF_TO_TRT] + ["lm_head"]


def _matches(pattern: str, hf_name: str) -> bool:
    trt = trtllm_name(hf_name)
    last = hf_name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(n, pattern) for n in (hf_name, trt, last))


def resolve_exclusions(linear_names: list[str], exclude_patterns: list[str], keep_first: int, keep_last: int,
                       num_layers: int) -> tuple[list[str], list[str]]:
    """HF names of the linears to keep unquantized, and the patterns that matched nothing.

    ``linear_names``: HF names of the model's linears. Fused groups are expanded (see module doc).
    """
    excluded: set[str] = set()
    unmatched = []
    for p in exclude_patterns:
        hit = [n for n in linear_names if _matches(p, n)]
        if not hit:
            unmatched.append(p)
        excluded.update(hit)
    keep = set(range(min(keep_first, num_layers))) | set(range(max(0, num_layers - keep_last), num_layers))
    for n in linear_names:
        m = LAYER_RE.match(n)
        if m and int(m.group(1)) in keep:
            excluded.add(n)
    # fused groups
    for n in list(excluded):
        m = LAYER_RE.match(n)
        if not m:
            continue
        prefix = n[: len(n) - len(m.group(2))]
        for group in _FUSED:
            if m.group(2) in group:
                excluded.update(prefix + g for g in group if prefix + g in linear_names)
    order = {n: i for i, n in enumerate(linear_names)}
    return sorted(excluded, key=lambda n: order[n]), unmatched


__all__ = ["HF_TO_TRT", "LAYER_RE", "trtllm_name", "llama_linear_names", "resolve_exclusions"]

