"""Model family x route x line x format (issue 29): spec/capability.py FAMILY_TABLE, made from the registry's
Family.routes, and rule model.family_serves refusing at `invoke check` what TensorRT-LLM does not run, naming where
it runs (Qwen3: QK-norm, llm_api route only)."""

from __future__ import annotations

import json

from precision_pipeline.spec import capability as C
from precision_pipeline.spec import families as FAM

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128, "hidden_act": "silu",
            "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960, "model_type": "qwen3",
            "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
            "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936}
"""Qwen/Qwen3-8B config.json (the fields the planner reads)."""


def test_family_rows_and_where_each_runs():
    rows = {(r.architecture, r.route): r.lines for r in C.FAMILY_TABLE}
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
        assert rows[(arch, "engine")] == ("1.2",) and rows[(arch, "llm_api")] == ("1.2", "1.3")
    assert ("Qwen3ForCausalLM", "engine") not in rows and rows[("Qwen3ForCausalLM", "llm_api")] == ("1.2", "1.3")
    assert C.family_row("Qwen3ForCausalLM", "engine", "1.2.1", "FP8") is None
    assert C.family_row("Qwen3ForCausalLM", "llm_api", "1.3.0rc5", "FP8").route == "llm_api"
    assert C.family_support("Qwen3ForCausalLM", "FP8") == ["route llm_api (TensorRT-LLM 1.2, 1.3)"]
    q3 = FAM.FAMILIES["Qwen3ForCausalLM"]
    assert q3.norms["self_attn.q_norm"] == "attention.q_layernorm" and q3.trtllm_config["qwen_type"] == "qwen3"
    assert "modeling_qwen3.py" in q3.sources["routes"] and not q3.attention_bias


def test_qwen3_on_the_engine_route_is_refused_at_check_naming_llm_api(tmp_path, invoke_here):
    d = tmp_path / "Qwen3-8B"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN3_8B))
    r = invoke_here("check", "--profile", "fp8-h100", "--model", str(d))
    assert r.returncode == 2
    assert "Qwen3ForCausalLM is not served on the engine route; it runs on route llm_api (TensorRT-LLM 1.2, 1.3)" in r.stdout + r.stderr
    assert "rule: model.family_serves" in r.stdout + r.stderr and "use route: llm_api" in r.stdout + r.stderr
    # on llm_api the model runs; what is refused is the profile's fallback (bf16-h100, an engine-route profile)
    llm = invoke_here("check", "--profile", "fp8-h100-llmapi", "--model", str(d))
    out = llm.stdout + llm.stderr
    assert out.count("Qwen3ForCausalLM is not served") == 1  # only inside the fallback's refusal: the primary runs
    assert "deployment.fallback: profile 'bf16-h100' cannot be used: route: on h100-sxm: Qwen3ForCausalLM is not served on the engine route" in out
