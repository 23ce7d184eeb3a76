"""Issue 29, the MoE families and gpt-oss in the family registry (spec/families.py): routes, lines and formats each
is served with (rule model.family_serves), the router kept out of quantization (router_patterns, router_problems),
planning gpt-oss from its config.json alone."""

from __future__ import annotations

import json

import pytest

from precision_pipeline.resolve.plan import evaluate
from precision_pipeline.spec import families as FAM
from tests.resolve.test_route_llm_api import _prof

GPT_OSS_TINY = {  # gpt-oss's config.json keys (openai/gpt-oss-20b) with tiny sizes
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
    "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 4096, "attention_bias": True,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "quantization_config": {"quant_method": "mxfp4"}}


def test_moe_entries():
    q, g = FAM.QWEN3_MOE, FAM.GPT_OSS
    assert FAM.FAMILIES["Qwen3MoeForCausalLM"] is q and FAM.FAMILIES["GptOssForCausalLM"] is g
    assert q.moe.router_hf == "mlp.gate" and q.moe.shared_experts == () and q.routes == ("engine", "llm_api")
    assert q.moe.router_patterns == ("*mlp.gate",)
    assert g.routes == ("llm_api",) and g.moe.packed_experts and g.moe.expert_format == "MXFP4" and g.attention_bias
    assert g.moe.router_patterns == ("*mlp.router",)
    assert FAM.FAMILIES["MixtralForCausalLM"].moe.router_patterns == ("*block_sparse_moe.gate",)
    q2 = FAM.FAMILIES["Qwen2MoeForCausalLM"]  # the one family with a shared expert: its gate is kept like the router
    assert q2.moe.shared_experts[-1] == "mlp.shared_expert_gate" and q3_shared_free(q)
    assert q2.moe.router_patterns == ("*mlp.gate", "*mlp.shared_expert_gate")
    assert [n for n, _ in FAM.router_problems(q2, {"model.layers.0.mlp.shared_expert_gate.weight": "F8_E4M3",
                                                   "model.layers.0.mlp.shared_expert.up_proj.weight": "F8_E4M3"})] == [
        "model.layers.0.mlp.shared_expert_gate.weight"]
    assert all(f.sources.get("routes") for f in (q, g))
    # gpt-oss: built on route llm_api (its only route) from its MXFP4 checkpoint as shipped, W4A16_MXFP4 only
    assert g.build_gaps() == () == g.build_gaps("llm_api", "W4A16_MXFP4", "NONE") and g.gate_reader is None
    assert "GptOssForCausalLM" not in FAM.GATE_ARCHITECTURES  # no TensorRT-LLM-checkpoint reader (engine route)
    assert [s for s, _ in g.build_gaps("llm_api", "NO_QUANT", "NONE")] == ["gate"] == [
        s for s, _ in g.build_gaps("llm_api", "W4A8_MXFP4_MXFP8", "NONE")]
    assert "reads an unquantized KV cache only, not FP8" in g.build_gaps("llm_api", "W4A16_MXFP4", "FP8")[0][1]
    # Qwen3-MoE: built on route llm_api only (unified HF export, gate/moe_model.py); refused on engine
    assert q.hf_read and not g.hf_read and q2.hf_read and FAM.FAMILIES["MixtralForCausalLM"].hf_read
    assert FAM.HF_READ_ARCHITECTURES == ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM",
                                         "Qwen3MoeForCausalLM")
    assert q.build_gaps("llm_api") == () and [s for s, _ in q.build_gaps("engine")] == ["quantize", "gate"]
    assert q.build_gaps("llm_api", "FP8", "NONE") == () == q.build_gaps("llm_api", "NO_QUANT", "NONE")
    assert [s for s, _ in q.build_gaps("llm_api", "NVFP4", "NONE")] == ["gate"]  # the MoE reader: FP8 / BF16 only
    assert "not FP8 (set quantization.kv_cache_quant_algo: NONE)" in q.build_gaps("llm_api", "FP8", "FP8")[0][1]
    assert [s for s, _ in g.build_gaps("engine")] == ["quantize", "gate"] and q2.build_gaps("llm_api") == ()
    assert [s for s, _ in q2.build_gaps("engine")] == ["quantize", "gate"]  # no TensorRT-LLM export or reader wired
    mx = FAM.FAMILIES["MixtralForCausalLM"]  # ModelOpt exports it for the engine (decoder llama); the gate reads it not
    assert mx.build_gaps("llm_api", "FP8", "NONE") == () and [s for s, _ in mx.build_gaps("engine")] == ["gate"]
    # the fused groups TensorRT-LLM loads as one GEMM: each expert's gate/up, Qwen2-MoE's shared expert's gate/up once
    assert mx.hf_fused_groups(2)[2:] == (("block_sparse_moe.experts.0.w1", "block_sparse_moe.experts.0.w3"),
                                         ("block_sparse_moe.experts.1.w1", "block_sparse_moe.experts.1.w3"))
    assert q2.hf_fused_groups(1)[2:] == (("mlp.experts.0.gate_proj", "mlp.experts.0.up_proj"),
                                         ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"))
    assert q2.moe.router_modules == ("mlp.gate", "mlp.shared_expert_gate")
    assert q.norms["self_attn.q_norm"] == "attention.q_layernorm"  # Qwen3's QK-norm (verification knows the tensor)


def test_qwen3_moe_expert_shapes_from_a_config():
    """hf_linear_shapes gives each Qwen-MoE expert's (out, in) from num_experts / moe_intermediate_size (the verifier's
    hf.layout shapes); a dense config gets none."""
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
           "vocab_size": 256, "num_experts": 3, "moe_intermediate_size": 32}
    sh = FAM.hf_linear_shapes(cfg)
    assert sorted(k for k in sh if k.startswith("mlp.experts.")) == [
        f"mlp.experts.{e}.{n}" for e in range(3) for n in ("down_proj", "gate_proj", "up_proj")]
    assert (sh["mlp.experts.2.gate_proj"], sh["mlp.experts.0.down_proj"], sh["self_attn.q_proj"]) == ((32, 64), (64, 32), (64, 64))
    assert not [k for k in FAM.hf_linear_shapes({**cfg, "num_experts": None}) if "experts" in k]
    # Mixtral: num_local_experts, the experts' width is intermediate_size, names block_sparse_moe.experts.{e}.w1/w3/w2
    mx = FAM.hf_linear_shapes({**cfg, "num_experts": None, "moe_intermediate_size": None, "num_local_experts": 2,
                               "architectures": ["MixtralForCausalLM"]})
    assert sorted(k for k in mx if "experts" in k) == [f"block_sparse_moe.experts.{e}.{n}" for e in range(2)
                                                       for n in ("w1", "w2", "w3")]
    assert (mx["block_sparse_moe.experts.1.w3"], mx["block_sparse_moe.experts.0.w2"]) == ((128, 64), (64, 128))
    # Qwen2-MoE: the shared expert's linears (shared_expert_intermediate_size); its gate is no linear (router_modules)
    q2 = FAM.hf_linear_shapes({**cfg, "shared_expert_intermediate_size": 48, "architectures": ["Qwen2MoeForCausalLM"]})
    assert {k: v for k, v in q2.items() if "shared" in k} == {
        "mlp.shared_expert.gate_proj": (48, 64), "mlp.shared_expert.up_proj": (48, 64), "mlp.shared_expert.down_proj": (64, 48)}


def q3_shared_free(fam) -> bool:
    return fam.moe.shared_experts == ()


def test_family_problems_name_where_it_is_served():
    g = FAM.GPT_OSS
    assert FAM.family_problems(g, "llm_api", "1.3", "W4A16_MXFP4") == []
    ((field, reason, fix),) = FAM.family_problems(g, "engine", "1.2", "NO_QUANT")
    assert field == "route" and "not served on the engine route" in reason and fix == "use route: llm_api."
    ((field, reason, fix),) = FAM.family_problems(g, "llm_api", "1.2", "FP8")
    assert field == "quantization.quant_algo" and "MXFP4 experts as shipped" in reason
    assert fix == "use one of: NO_QUANT, W4A16_MXFP4, W4A8_MXFP4_FP8, W4A8_MXFP4_MXFP8."
    assert FAM.family_problems(FAM.QWEN3_MOE, "engine", "1.2", "FP8") == []


@pytest.mark.parametrize("names,bad", [
    ({"model.layers.0.mlp.gate.weight": "BF16", "model.layers.0.mlp.experts.0.up_proj.weight": "F8_E4M3"}, []),
    ({"transformer.layers.1.mlp.router.weight": "F32"}, []),
    ({"model.layers.3.mlp.gate.weight": "F8_E4M3"}, ["model.layers.3.mlp.gate.weight"]),
    ({"model.layers.0.mlp.gate.weight": "BF16", "model.layers.0.mlp.gate.weight_scale": "F32"},
     ["model.layers.0.mlp.gate.weight_scale"]),
    ({"transformer.layers.0.mlp.router.weight": "U8", "transformer.layers.0.mlp.router.weights_scaling_factor": "U8"},
     ["transformer.layers.0.mlp.router.weight", "transformer.layers.0.mlp.router.weights_scaling_factor"]),
])
def test_a_quantized_router_is_found(names, bad):
    assert [n for n, _ in FAM.router_problems(FAM.QWEN3_MOE, names)] == bad
    assert FAM.router_problems(FAM.LLAMA, names) == []  # a dense family has no router


def test_gpt_oss_is_planned_from_config_and_refused_off_its_route(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_TINY))
    prof = _prof(quantization__quant_algo="W4A16_MXFP4", quantization__kv_cache_quant_algo="NONE",
                 quantization__exclude_modules=["lm_head", *FAM.GPT_OSS.moe.router_patterns])
    plan = evaluate(prof, tmp_path)
    # a pre-quantized HF folder is no quantize input; the fallback profile (engine route) cannot serve gpt-oss
    assert [p.rule for p in plan.problems] == ["model.unquantized", "deployment.fallback"]
    assert "bf16-h100" in plan.problems[1].reason
    engine = evaluate(_prof("fp8-h100", quantization__kv_cache_quant_algo="NONE"), tmp_path)
    found = {(p.rule, p.field): p for p in engine.problems}
    assert found[("model.family_serves", "route")].fix == "use route: llm_api."
    assert found[("model.family_serves", "quantization.quant_algo")].reason.startswith(
        "GptOssForCausalLM is served with NO_QUANT, W4A16_MXFP4, W4A8_MXFP4_FP8, W4A8_MXFP4_MXFP8 only")


def _trt_moe_checkpoint(d, router_dtype):
    import torch
    from safetensors.torch import save_file

    cfg = {"architecture": "MixtralForCausalLM", "dtype": "bfloat16", "num_hidden_layers": 1, "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
           "moe": {"num_experts": 4, "top_k": 2}, "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
           "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None}}
    (d / "config.json").write_text(json.dumps(cfg))
    tensors = {"transformer.layers.0.mlp.router.weight": torch.zeros(4, 64).to(router_dtype)}
    if router_dtype == torch.float8_e4m3fn:
        tensors["transformer.layers.0.mlp.router.weights_scaling_factor"] = torch.ones(1)
    save_file(tensors, str(d / "rank0.safetensors"))


def test_verify_refuses_a_quantized_router_in_a_tensorrt_llm_checkpoint(tmp_path):
    """Rule verify.router runs before the MoE layout refusal: the quantized router is named, tensor by tensor."""
    import torch

    from precision_pipeline.checkpoint.verify import verify_checkpoint
    from precision_pipeline.core.errors import UserError

    _trt_moe_checkpoint(tmp_path, torch.float8_e4m3fn)
    with pytest.raises(UserError) as e:
        verify_checkpoint(tmp_path)
    assert {(p.field, p.rule) for p in e.value.problems} == {
        ("transformer.layers.0.mlp.router.weight (rank0.safetensors)", "verify.router"),
        ("transformer.layers.0.mlp.router.weights_scaling_factor (rank0.safetensors)", "verify.router")}
    _trt_moe_checkpoint(tmp_path, torch.float32)  # an F32 router passes this rule; the MoE layout is refused next
    with pytest.raises(UserError) as e:
        verify_checkpoint(tmp_path)
    assert [p.rule for p in e.value.problems] == ["verify.known_tensors"]


@pytest.mark.parametrize("change, says", [
    ({"num_local_experts": 0}, "config.json gives MixtralForCausalLM (a mixture-of-experts family) no experts "
                               "(num_local_experts / num_experts is 0 or missing)."),
    ({"num_experts_per_tok": 16}, "num_experts_per_tok 16 is more than the 8 experts each token can be routed to."),
    ({"head_dim": 7}, "head_dim 7 has no attention kernel (TensorRT-LLM's are built for head sizes that are multiples "
                      "of 8, at least 16)."),
    ({"head_dim": 8}, "head_dim 8 has no attention kernel"),
])
def test_impossible_config_shapes_are_refused(change, says):
    """Hostile s12 F-A: a config-only Mixtral with 0 experts was planned as a dense 7B, top-16 of 8 experts and a
    head_dim of 7 were planned with numbers. Each is refused naming the field (exit 2 at check)."""
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.spec.model_arch import arch_from_config

    base = {"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 32, "hidden_size": 4096,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
            "num_local_experts": 8, "num_experts_per_tok": 2}
    assert arch_from_config(base).num_experts == 8 and arch_from_config({**base, "head_dim": 80}).head_dim == 80
    with pytest.raises(UserError) as ei:
        arch_from_config({**base, **change})
    assert ei.value.problems[0].field == "--model" and says in ei.value.problems[0].reason, ei.value.problems[0].reason
