"""The model-family registry (spec/families.py): its facts, the lookups made of it, and that no other module
keeps its own copy of the HF <-> TensorRT-LLM linear table."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.spec import families as FAM
from precision_pipeline.spec.model_arch import arch_from_config

PKG = Path(__file__).resolve().parents[2] / "build" / "precision_pipeline"


def test_llama_names_are_tensorrt_llms():
    """tensorrt_llm/models/model_weights_loader.py:50-61: "fc": "gate_proj", "gate": "up_proj", "proj": "down_proj",
    "dense": "o_proj", "qkv": [q, k, v]; llama/convert.py splits gate/up/qkv on dim 0 (column), o/down on dim 1 (row)."""
    L = FAM.LLAMA
    assert L.hf_to_trt == {"self_attn.q_proj": "attention.qkv", "self_attn.k_proj": "attention.qkv",
                           "self_attn.v_proj": "attention.qkv", "self_attn.o_proj": "attention.dense",
                           "mlp.gate_proj": "mlp.fc", "mlp.up_proj": "mlp.gate", "mlp.down_proj": "mlp.proj"}
    assert L.gemms == ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")
    assert {g: L.parallel(g) for g in L.gemms} == {"attention.qkv": "column", "attention.dense": "row",
                                                   "mlp.fc": "column", "mlp.gate": "column", "mlp.proj": "row"}
    assert L.gemm_hf("attention.qkv") == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    assert L.gemms_of(("mlp.gate_proj", "mlp.up_proj")) == ("mlp.fc", "mlp.gate")
    assert L.fused_partners("mlp.up_proj") == ("mlp.gate_proj", "mlp.up_proj")
    assert L.fused_partners("self_attn.o_proj") == ("self_attn.o_proj",)
    assert L.norms == {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_layernorm"}
    assert FAM.trtllm_name("model.layers.0.mlp.gate_proj") == "transformer.layers.0.mlp.fc"
    assert FAM.trtllm_name("model.norm") == "transformer.ln_f"
    assert all(f.sources.get("linears") for f in FAM.FAMILIES.values())


def test_which_families_do_what():
    assert FAM.SUPPORTED_ARCHITECTURES == ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM",
                                           "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM",
                                           "Qwen3MoeForCausalLM", "GptOssForCausalLM")
    assert FAM.EXPORTED_ARCHITECTURES == ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM")
    assert FAM.GATE_ARCHITECTURES == ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
    # ModelOpt 0.47 model_utils.py MODEL_NAME_TO_TYPE: Mixtral and Mistral -> "llama", QWen -> "qwen"
    assert {a: f.export_decoder for a, f in FAM.FAMILIES.items() if f.export_decoder} == {
        "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "MixtralForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen"}
    assert FAM.family_of_model_type("mixtral") is FAM.FAMILIES["MixtralForCausalLM"]
    assert FAM.family_of_model_type("gpt2") is None
    # a build refuses a family the gate does not read (rule model.gate_reads), before quantize: so every family the
    # gate reads must be one the quantize stage exports (the quantize stage checks no family itself)
    assert set(FAM.GATE_ARCHITECTURES) <= set(FAM.EXPORTED_ARCHITECTURES)
    with pytest.raises(UserError, match="not supported"):
        FAM.family("GPT2LMHeadModel")


def test_every_family_reads_from_a_config():
    for arch, f in FAM.FAMILIES.items():
        cfg = {"architectures": [arch], "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100}
        if f.moe is not None:
            cfg["num_experts"] = 4
        m = arch_from_config(cfg)
        assert m.architecture == arch and m.attention_bias == f.attention_bias and m.is_moe == (f.moe is not None)


def test_moe_experts_are_fused_per_expert():
    """TensorRT-LLM stores [w3; w1] of each expert in one mlp.fc (llama/convert.py): excluding w1 of an expert
    keeps its w3 too, and no other expert's."""
    mix = FAM.FAMILIES["MixtralForCausalLM"]
    assert mix.moe.router_trt == "mlp.router" and mix.moe.router_hf == "block_sparse_moe.gate"
    assert mix.fused_partners("block_sparse_moe.experts.5.w1") == ("block_sparse_moe.experts.5.w1",
                                                                   "block_sparse_moe.experts.5.w3")
    names = [f"model.layers.0.block_sparse_moe.experts.{e}.{w}" for e in range(2) for w in ("w1", "w2", "w3")]
    kept, _ = FAM.resolve_exclusions(names, ["*experts.1.w1"], 0, 0, 1, mix)
    assert kept == ["model.layers.0.block_sparse_moe.experts.1.w1", "model.layers.0.block_sparse_moe.experts.1.w3"]
    assert mix.layer_linears() == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                   "block_sparse_moe.experts.0.w1", "block_sparse_moe.experts.0.w3",
                                   "block_sparse_moe.experts.0.w2")


def test_qkv_rows_by_hand_with_gqa():
    """9 heads, 3 KV heads, head_dim 64 (the default model): q 576 rows, k = v 192 at tp 1; tp 3: 192 / 64;
    4 heads, 2 KV heads, head_dim 2 at tp 4: KV heads are shared, each rank holds one (2 rows)."""
    assert FAM.qkv_rows(9, 3, 64) == (576, 192)
    assert FAM.qkv_rows(9, 3, 64, tp=3) == (192, 64)
    assert FAM.qkv_rows(4, 2, 2, tp=4) == (2, 2)
    assert FAM.qkv_rows_of_config({"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}) == (576, 192, 64)
    assert FAM.qkv_rows_of_config({"num_attention_heads": 4, "hidden_size": 8, "head_size": 4}, tp=2) == (8, 8, 4)


# HF / TensorRT-LLM linear names as string constants: only the registry may spell them out in code
_TABLE_NAMES = {n for f in FAM.FAMILIES.values() for lin in f.linears for n in (lin.hf, lin.trt)
                if "." in n} - {"attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"}


def _string_constants(path: Path) -> set[str]:
    return {n.value for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_no_other_module_spells_the_hf_linear_table():
    """The HF linear names (``mlp.gate_proj``, ``self_attn.o_proj``, ...) appear as code constants in spec/families.py
    only: every other "which HF linear is which TensorRT-LLM GEMM" table is a lookup now."""
    assert "mlp.gate_proj" in _TABLE_NAMES and "self_attn.q_proj" in _TABLE_NAMES
    found = {str(p.relative_to(PKG)): sorted(_string_constants(p) & _TABLE_NAMES) for p in PKG.rglob("*.py")}
    assert {k: v for k, v in found.items() if v and k != "spec/families.py"} == {}


def test_experts_on_a_dense_family_are_refused():
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 100, "num_experts": 4}
    with pytest.raises(UserError, match="LlamaForCausalLM 4 experts, but that family has no experts") as e:
        arch_from_config(cfg)
    assert e.value.problems[0].field == "--model"


def test_qwen2_bias_and_trtllm_config_facts():
    """Qwen2: q/k/v carry a bias (one fused attention.qkv bias in TensorRT-LLM, none on o_proj or the MLP) and the
    TensorRT-LLM checkpoint needs qwen_type qwen2 (qwen/model.py: 'qwen' halves the MLP); Llama and Mistral none."""
    q, m = FAM.FAMILIES["Qwen2ForCausalLM"], FAM.FAMILIES["MistralForCausalLM"]
    assert q.bias_linears == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    assert q.bias_gemms == ("attention.qkv",)
    assert q.trtllm_config == {"qwen_type": "qwen2", "attn_bias": True, "mlp_bias": False}
    assert FAM.LLAMA.bias_linears == () == m.bias_gemms and FAM.LLAMA.trtllm_config == {} == m.trtllm_config
    assert m.sliding_window and not q.sliding_window and not FAM.LLAMA.sliding_window
    assert "qwen/model.py" in q.sources["trtllm_config"] and "model_utils.py:36" in q.sources["export"]
    assert q.routes == m.routes == ("engine", "llm_api")
