"""Rules and memory-plan facts pinned down by mutation testing (tests/mutate.py survivors).

Each test names the behaviour a surviving mutant changed; the values are computed by hand from the
formulas in resolve/rules.py's docstrings on the default model (SmolLM2-135M: 30 layers, hidden
576, 9 heads x 64, 3 KV heads, MLP 1536, vocab 49152).
"""

from __future__ import annotations

import json

import pytest

from precision_pipeline.resolve import plan as P
from precision_pipeline.resolve import rules as R
from precision_pipeline.resolve import derive as DER
from precision_pipeline.resolve import memory as MEM
from precision_pipeline.resolve import reuse as REUSE
from precision_pipeline.spec import formats as F
from precision_pipeline.spec.default_model import ensure_default_model
from tests.conftest import prof


@pytest.fixture(scope="module")
def arch():
    return P._model(ensure_default_model())


def _wb(arch, p, tp=1):
    return MEM.weight_bytes(arch, p, DER.derive_mapping(p.model_copy(update={"parallel": p.parallel.model_copy(update={"tp_size": tp})})))


def test_excluding_a_linear_keeps_it_in_bf16(arch):
    base = _wb(arch, prof("fp8-h100", quantization__exclude_modules=["lm_head"]))["decoder"]
    fc = _wb(arch, prof("fp8-h100", quantization__exclude_modules=["lm_head", "*mlp.fc"]))["decoder"]
    fp8_fc = F.GEMM[F.QuantAlgo.FP8].linear_bytes(576, 1536, None, 2, None)
    # mlp.fc (gate_proj) and mlp.gate (up_proj) are fused: the export keeps both, and so does the plan
    assert fc - base == 2 * 30 * (576 * 1536 * 2 - fp8_fc)
    assert fp8_fc == 576 * 1536 + 2 * F.SCALE_F32


def test_each_kept_layer_costs_the_same(arch):
    def dec(**q):
        return _wb(arch, prof("fp8-h100", quantization={"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                                         "exclude_modules": [], **q}))["decoder"]
    d0, d1, d2, d30 = dec(), dec(keep_first_layers=1), dec(keep_first_layers=2), dec(keep_first_layers=30)
    one = d1 - d0
    assert one > 0 and d2 - d1 == one and d30 - d0 == 30 * one
    assert dec(keep_last_layers=1) - d0 == one


def test_activation_bytes_by_hand(arch):
    p = prof("fp8-h100")
    lim = {"max_num_tokens": 8192, "max_batch_size": 64, "max_beam_width": 1}
    for tp in (1, 3):
        width = 2 * 576 + 960 / tp + 9 * 64 / tp + 2 * 1536 / tp
        want = 2 * 8192 * width * 2 + 64 * 49152 * 4
        got = MEM.activation_bytes(arch, p, {"tp_size": tp}, lim)
        assert got == int(want), tp


def test_max_num_tokens_warning_starts_above_the_advised_value():
    def warned(n):
        p = P.evaluate(prof("fp8-h100", build__max_num_tokens=n, build__max_seq_len=max(n, 8192)), ensure_default_model())
        return any("build.max_num_tokens" in w for w in p.warnings)
    assert not warned(F.MAX_NUM_TOKENS_ADVISED) and warned(F.MAX_NUM_TOKENS_ADVISED + 1)


# the rules that need no GPU: a profile with a misspelt GPU still hears about everything else
GPU_FREE = {"build.logits_dtype", "calibration.dataset", "calibration.seq_len", "deployment.fallback", "model.unquantized", "format.group_size", "format.trtllm_buildable",
            "layout.attention_heads", "layout.checkpoint_mapping", "layout.kv_heads", "layout.moe", "layout.nodes", "layout.pipeline",
            "layout.world_size", "limits.derived", "limits.input_within_seq", "limits.num_tokens_large",
            "limits.num_tokens_vs_input", "limits.seq_within_positions", "memory.build_fit", "model.gate_reads", "model.family_serves", "plugins.gemm_plugin",
            "quantize.modelopt_inputs", "quantize.search_budget", "runtime.chunked_context", "runtime.kv_cache_reuse",
            "runtime.streaming", "route.trtllm_version", "model.sliding_window", "llm_api.args", "routing",
            "deployment.server"}
LLM_API_ONLY_GPU_FREE = {"llm_api.kv_dtype", "llm_api.engine_settings", "llm_api.chunked_prefill"}  # route llm_api only


def test_gpu_free_rules_run_when_the_gpu_is_unknown():
    assert {r.name for r in R.RULES if not r.needs_gpu} == GPU_FREE | LLM_API_ONLY_GPU_FREE
    p = P.evaluate(prof("fp8-h100", target__gpu="no-such-gpu"), ensure_default_model(), for_build=True)
    ran = {c["rule"] for c in p.checks} - {"gpu.known"}
    assert ran == GPU_FREE


def test_a_refused_format_keeps_the_context_rules_quiet():
    p = P.evaluate(prof("fp8-h100", quantization__quant_algo="W4A16_NVFP4", quantization__kv_cache_quant_algo="FP8",
                        context_phase__use_fp8_context_fmha=True), ensure_default_model())
    fields = {x.field for x in p.problems}
    assert "quantization.quant_algo" in fields
    assert not [f for f in fields if f.startswith("context_phase.")], fields


@pytest.mark.parametrize("parallel, warned", [({"moe_ep_size": 2}, True), ({"moe_ep_size": 1}, False),
                                              ({"moe_tp_size": 1}, False), ({"moe_tp_size": 2}, True), ({}, False)])
def test_moe_settings_on_a_dense_model_warn(parallel, warned):
    p = P.evaluate(prof("fp8-h100", parallel=parallel), ensure_default_model())
    assert any("dense model" in w for w in p.warnings) is warned


@pytest.mark.parametrize("fallback, warned", [("bf16-h100", False), ("int4-awq-a100", True)])
def test_fallback_on_another_sm_warns(fallback, warned):
    p = P.evaluate(prof("fp8-h100", deployment={"fallback": fallback, "warm_fallback": False}), ensure_default_model())
    assert any(w.startswith("deployment.fallback:") and "engines are built per SM" in w for w in p.warnings) is warned


def test_memory_refusal_adds_up_its_parts(arch):
    big = arch.model_copy(update={"num_layers": 6000})
    p = P.evaluate(prof("bf16-h100", target__gpu="l4", deployment={"fallback": None}), big)
    (pr,) = [x for x in p.problems if x.rule == "memory.fit"]
    m = p.memory
    need = m.weight_bytes_per_gpu + m.activation_bytes_estimate + m.fallback_bytes + m.runtime_reserve_bytes
    assert f"= {MEM.gib(need)} per GPU" in pr.reason
    assert "tp_size" not in pr.fix  # 9 heads: no tp in 2, 4, 8, 16 divides them


def test_tp_hint_names_the_smallest_tp_that_fits(arch):
    big = arch.model_copy(update={"num_layers": 6000, "num_heads": 16, "num_kv_heads": 4, "head_dim": 36})
    p = P.evaluate(prof("bf16-h100", target__gpu="l4", deployment={"fallback": None}), big)
    (pr,) = [x for x in p.problems if x.rule == "memory.fit"]
    assert "tp_size 4 (weights 9.81 GiB per GPU), " in pr.fix, pr.fix  # tp 2 still does not fit


def test_reused_mixed_checkpoint_with_other_formats_is_refused(tmp_path):
    p = prof("mixed-fp8-int4-h100")
    (tmp_path / "quant_cfg.json").write_text(json.dumps({"quantized_layers": {
        "transformer.layers.0.mlp.fc": {"quant_algo": "NVFP4"}, "transformer.layers.0.mlp.gate": {"quant_algo": "FP8"}}}))
    found = REUSE._mixed_reuse_findings(p, tmp_path)
    assert found and "NVFP4" in found[0].message
    (tmp_path / "quant_cfg.json").write_text(json.dumps({"quantized_layers": {
        "transformer.layers.0.mlp.fc": {"quant_algo": "FP8"}}}))
    assert not [f for f in REUSE._mixed_reuse_findings(p, tmp_path) if "NVFP4" in f.message]


def test_moe_layer_bytes_by_hand(arch):
    moe = arch.model_copy(update={"architecture": "MixtralForCausalLM", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                                  "shared_expert_intermediate_size": 512})
    p = prof("fp8-h100", quantization__exclude_modules=["lm_head"])
    lb = F.GEMM[F.QuantAlgo.FP8].linear_bytes
    layer = (lb(576, 960, None, 2, None) + lb(576, 576, None, 2, None)
             + 4 * (2 * lb(576, 256, None, 2, None) + lb(256, 576, None, 2, None))  # experts
             + 576 * 4 * 4                                                          # router, F32
             + 2 * lb(576, 512, None, 2, None) + lb(512, 576, None, 2, None)        # shared expert
             + 2 * 576 * 2 + 3 * F.SCALE_F32)                                       # norms + KV scales
    assert MEM.weight_bytes(moe, p, DER.derive_mapping(p))["decoder"] == 30 * layer
