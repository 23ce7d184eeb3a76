"""HF Llama module names -> TensorRT-LLM checkpoint names (shared by the PTQ export and the search).

Mapping (``modelopt/torch/export/layer_utils.py``, verified by comparing exported weights with
the HF ones): q/k/v_proj -> ``attention.qkv`` (rows [q; k; v]), o_proj -> ``attention.dense``,
gate_proj -> ``mlp.fc``, up_proj -> ``mlp.gate``, down_proj -> ``mlp.proj``.
"""

from __future__ import annotations

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


__all__ = ["HF_TO_TRT", "LAYER_RE", "trtllm_name"]
