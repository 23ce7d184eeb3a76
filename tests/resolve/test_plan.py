"""Resolve stage: the spec's cases, the memory planner, plan.json keys, shipped profiles, speed.

Models are synthetic HF config.json files written to tmp dirs (plus the converted default
model). Each refusal test asserts the rule name and the exact reason (or its key numbers).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from precision_pipeline.resolve import plan as P
from precision_pipeline.resolve import derive as DER
from precision_pipeline.resolve import memory as MEM
from precision_pipeline.resolve import reuse as REUSE
from precision_pipeline.core.errors import UserError
from precision_pipeline.spec.hardware import CATALOG, GIB
from precision_pipeline.spec.model_arch import arch_from_config
from precision_pipeline.spec.profile import shipped_profiles
from tests.conftest import prof  # noqa: E402  (shared with test_plan / test_rules)

# ----------------------------------------------------------------------------------------------
# helpers

LLAMA70B = {
    "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 80, "hidden_size": 8192,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 28672,
    "vocab_size": 128256, "max_position_embeddings": 8192, "tie_word_embeddings": False,
    "rope_scaling": None,
}
LLAMA13B = {
    "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 40, "hidden_size": 5120,
    "num_attention_heads": 40, "num_key_value_heads": 40, "intermediate_size": 13824,
    "vocab_size": 32000, "max_position_embeddings": 4096, "tie_word_embeddings": False,
}
LLAMA8B_128K = {
    "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32, "hidden_size": 4096,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "num_hidden_layers": 32, "hidden_size": 4096,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "vocab_size": 32000, "max_position_embeddings": 32768, "num_local_experts": 8, "num_experts_per_tok": 2,
}


def write_model(tmp_path: Path, cfg: dict, name: str = "model") -> Path:
    d = tmp_path / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d




def refusals(profile, model, checkpoint_dir=None) -> list:
    with pytest.raises(UserError) as ei:
        P.resolve(profile, model, checkpoint_dir)
    return ei.value.problems


def by_rule(problems, rule):
    found = [p for p in problems if p.rule == rule]
    assert found, f"no problem from rule {rule}: {[p.render() for p in problems]}"
    return found[0]


@pytest.fixture()
def m70(tmp_path):
    return write_model(tmp_path, LLAMA70B, "llama70b")


# ----------------------------------------------------------------------------------------------
# shipped profiles, plan.json, check_all, profiles_for_gpu


def test_all_shipped_profiles_resolve(default_model_dir):
    for name in shipped_profiles():
        plan = P.resolve(prof(name), default_model_dir)
        assert plan.ok and plan.memory.fits, name


def test_plan_json_keys(default_model_dir):
    j = P.resolve(prof("fp8-h100"), default_model_dir).to_json()
    json.dumps(j)  # serialisable
    for k in ("profile", "profile_resolved", "gpu", "model", "mapping", "limits", "effective", "memory", "warnings", "checks"):
        assert k in j
    assert j["profile"] == "fp8-h100"
    assert {"id", "name", "sm", "memory_mib"} <= set(j["gpu"])
    assert j["gpu"]["id"] == "h100-sxm" and j["gpu"]["sm"] == 90 and j["gpu"]["memory_mib"] == 81559
    assert set(j["mapping"]) == {"world_size", "tp_size", "pp_size", "moe_tp_size", "moe_ep_size"}
    assert {"max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "max_beam_width", "derived"} <= set(j["limits"])
    eff_keys = {"context_fmha", "use_paged_context_fmha", "use_fp8_context_fmha", "enable_kv_cache_reuse",
                "enable_chunked_context", "kv_cache_type", "tokens_per_block", "gemm_plugin", "gpt_attention_plugin",
                "logits_dtype", "multi_block_mode", "triton_logits_datatype"}
    assert eff_keys <= set(j["effective"])
    assert j["effective"]["triton_logits_datatype"] == "TYPE_FP32"
    assert j["effective"]["logits_dtype"] == "float32"
    assert j["effective"]["gemm_plugin"] == "disable"  # FP8: GEMM plugin off (perf-best-practices)
    mem_keys = {"weight_bytes_per_gpu", "weight_gib_per_gpu", "kv_bytes_per_token", "activation_bytes_estimate",
                "fallback_bytes", "usable_bytes", "kv_cache_bytes", "kv_tokens_capacity",
                "concurrent_seqs_at_max_seq_len", "fits"}
    assert mem_keys <= set(j["memory"])
    assert j["memory"]["fallback_bytes"] > 0  # warm bf16-h100 fallback counted
    for c in j["checks"]:
        assert set(c) == {"rule", "status", "message", "source"} and c["status"] in ("pass", "warn", "refused")
        assert c["source"]
    assert j["profile_resolved"]["target"]["gpu"] == "h100-sxm"


def test_fp8_checkpoint_size_prediction_within_2pct(default_model_dir):
    """ModelOpt 0.47 export of the default model, FP8 + FP8 KV: 219,555,793 bytes (measured)."""
    plan = P.resolve(prof("fp8-h100"), default_model_dir)
    pred = plan.memory.weight_bytes_per_gpu
    measured = 219_555_793
    assert abs(pred - measured) / measured < 0.02, pred
    # the checkpoint stores lm_head separately even though the HF model ties it
    bd = plan.memory.weight_breakdown
    assert bd.embedding == 49152 * 576 * 2
    assert bd.lm_head >= 49152 * 576 * 2


def test_check_all_ok_and_one_line_each(default_model_dir):
    res = P.check_all(default_model_dir)
    assert [r[0] for r in res] == shipped_profiles()
    for name, ok, line in res:
        assert ok, (name, line)
        assert "\n" not in line and "GiB/GPU" in line


def test_profiles_for_gpu_h100(default_model_dir):
    res = {n: (ok, why) for n, ok, why in P.profiles_for_gpu("h100", default_model_dir)}
    assert res["fp8-h100"][0] and res["bf16-h100"][0] and res["int4-awq-a100"][0]
    ok, why = res["nvfp4-b200"]
    assert not ok and "NVFP4 needs Blackwell: SM 100, 103, 120 or 121" in why and "(rule format.gemm_sm)" in why
    assert "[" not in why  # printed through rich: no markup brackets


def test_profiles_for_gpu_a100_and_b200(default_model_dir):
    a100 = {n: ok for n, ok, _ in P.profiles_for_gpu("a100", default_model_dir)}
    assert a100 == {"bf16-h100": True, "fp8-h100": False, "fp8-h100-routed": False, "fp8-h200": False, "int4-awq-a100": True,
                    "int4-awq-a100-smollm2": True, "int8-sq-l4": True, "int8-sq-l4-smollm2": True, "nvfp4-b200": False,
                    "nvfp4-b200-smollm2": False, "mixed-fp8-int4-h100": False, "fp8-h100-llmapi": False}
    why = {n: w for n, _, w in P.profiles_for_gpu("a100", default_model_dir)}["mixed-fp8-int4-h100"]
    assert "candidate FP8" in why  # the per-layer search's FP8 candidate needs SM >= 89
    b200 = {n: (ok, why) for n, ok, why in P.profiles_for_gpu("b200", default_model_dir)}
    assert not b200["mixed-fp8-int4-h100"][0] and "candidate W4A16_AWQ" in b200["mixed-fp8-int4-h100"][1]
    assert b200["nvfp4-b200"][0] and b200["fp8-h100"][0] and b200["fp8-h100-llmapi"][0]  # trtllm_version kept
    assert not b200["int4-awq-a100"][0] and "SM 100-119" in b200["int4-awq-a100"][1]
    assert not b200["int8-sq-l4"][0] and "SmoothQuant" in b200["int8-sq-l4"][1]


def test_profiles_for_unknown_gpu():
    with pytest.raises(UserError) as ei:
        P.profiles_for_gpu("h1000", "unused")
    assert ei.value.problems[0].field == "target.gpu"


def test_no_torch_imported():
    import subprocess
    import sys

    code = ("import sys; import precision_pipeline.resolve.plan, precision_pipeline.resolve.rules, precision_pipeline.spec.hardware, precision_pipeline.spec.formats, precision_pipeline.spec.model_arch; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2] / "build", check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------------------------
# the spec's cases


def test_case1_fp8_on_a100(default_model_dir):
    pr = refusals(prof("fp8-h100", target={"gpu": "a100"}), default_model_dir)
    p = by_rule(pr, "format.gemm_sm")
    assert p.field == "quantization.quant_algo"
    assert p.reason == ("FP8: FP8 GEMMs need SM >= 89 (Ada, Hopper, Blackwell); a100-80gb (NVIDIA A100-SXM4-80GB) is SM 80.")
    assert p.fix.startswith("use int8-sq, int4-awq or bf16 on SM 80")
    # the format refusal is not repeated by the context-FMHA consequences
    assert [x.rule for x in pr] == ["format.gemm_sm"]


def test_case2_nvfp4_on_h100(default_model_dir):
    pr = refusals(prof("nvfp4-b200", target={"gpu": "h100"}), default_model_dir)
    p = by_rule(pr, "format.gemm_sm")
    assert p.reason == "NVFP4: NVFP4 needs Blackwell: SM 100, 103, 120 or 121; h100-sxm (NVIDIA H100 80GB HBM3) is SM 90."
    assert p.fix == ("nvfp4 runs on SM 100, 103 or 120-121 (b200, gb200, b300, rtx-5090, rtx-pro-6000-blackwell, gb10); "
                     "on SM 90 use fp8, w4a8-awq, int8-sq, int4-awq or bf16.")


def test_case3_tp2_with_one_gpu_per_replica(m70):
    pr = refusals(prof("fp8-h100", parallel={"tp_size": 2}, deployment={"gpus_per_replica": 1}), m70)
    p = by_rule(pr, "layout.world_size")
    assert p.field == "deployment.gpus_per_replica"
    assert p.reason == "is 1, but tp_size 2 x pp_size 1 = 2 GPUs per engine."
    assert [x.rule for x in pr] == ["layout.world_size"]


def test_case4_reused_checkpoint_mapping(m70, tmp_path):
    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({
        "architecture": "LlamaForCausalLM", "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}))
    p = prof("fp8-h100", parallel={"tp_size": 4}, deployment={"gpus_per_replica": 4})
    pr = refusals(p, m70, ck)
    x = by_rule(pr, "layout.checkpoint_mapping")
    assert x.reason == f"the reused checkpoint {ck} was exported with tp_size 1 (profile 4)."
    assert x.fix.startswith("re-quantize")
    # same mapping: passes
    (ck / "config.json").write_text(json.dumps({
        "mapping": {"world_size": 4, "tp_size": 4, "pp_size": 1, "moe_tp_size": 4, "moe_ep_size": 1},
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}))
    assert P.resolve(p, m70, ck).ok
    # function form, no checkpoint
    assert REUSE.checkpoint_mapping_findings(p, None) == []


def test_case5_kv_reuse_without_paged_context_fmha(default_model_dir):
    p = prof("bf16-h100", context_phase={"use_paged_context_fmha": False, "enable_chunked_context": False},
             runtime={"enable_kv_cache_reuse": True})
    pr = refusals(p, default_model_dir)
    x = by_rule(pr, "runtime.kv_cache_reuse")
    assert x.field == "runtime.enable_kv_cache_reuse"
    assert x.reason == "needs context_phase.use_paged_context_fmha (reused blocks are read by the context-phase attention)."
    assert [y.rule for y in pr] == ["runtime.kv_cache_reuse"]


def test_case6_fp8_context_fmha_paged_without_fp8_kv(default_model_dir):
    p = prof("fp8-h100", quantization={"quant_algo": "FP8", "kv_cache_quant_algo": "NONE", "exclude_modules": ["lm_head"]})
    pr = refusals(p, default_model_dir)
    x = by_rule(pr, "context.fp8_context_fmha")
    assert x.field == "context_phase.use_fp8_context_fmha"
    assert x.reason == ("trtllm-build would turn it off: FP8 context FMHA with paged context FMHA reads the KV cache, "
                        "so it needs an FP8 KV cache.")
    assert x.fix == "set kv_cache_quant_algo: FP8, or use_fp8_context_fmha: false."
    assert [y.rule for y in pr] == ["context.fp8_context_fmha"]


def test_case7_moe_layout(tmp_path):
    mx = write_model(tmp_path, MIXTRAL, "mixtral")
    p = prof("fp8-h100", parallel={"tp_size": 4, "moe_ep_size": 8}, deployment={"gpus_per_replica": 4, "fallback": None,
                                                                             "warm_fallback": False})
    pr = refusals(p, mx)
    x = by_rule(pr, "layout.moe")
    assert x.field == "parallel.moe_ep_size"
    assert x.reason == ("moe_tp_size 1 x moe_ep_size 8 = 8, but it must equal tp_size 4 "
                        "(MoE layers are split over the same GPUs).")
    six = write_model(tmp_path, dict(MIXTRAL, num_local_experts=6), "mixtral6")
    p = prof("fp8-h100", parallel={"tp_size": 4, "moe_ep_size": 4}, deployment={"gpus_per_replica": 4, "fallback": None,
                                                                             "warm_fallback": False})
    pr = refusals(p, six)
    x = by_rule(pr, "layout.moe")
    assert x.reason == "4 does not divide the model's 6 experts."
    # 8 experts, ep 4 x moe_tp 1 = tp 4: fine
    assert P.resolve(p, mx).ok


def test_case8_derived_max_seq_len_131072(tmp_path):
    md = write_model(tmp_path, LLAMA8B_128K, "llama31-8b")
    p = prof("bf16-h100", build={"max_batch_size": 8}, deployment={"gpus_per_replica": 1})
    plan = P.resolve(p, md)
    lim = plan.limits
    assert lim.max_seq_len == 131072
    assert lim.derived["max_seq_len"].startswith("not set: max_position_embeddings 131,072 x rope scaling factor 1 = 131,072 tokens")
    assert lim.max_input_len == 1024 and lim.max_num_tokens == 8192
    assert set(lim.derived) == {"max_seq_len", "max_input_len", "max_num_tokens"}
    mem = plan.memory
    assert mem.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert mem.kv_bytes_per_seq_at_max_seq_len == 131072 * 131072  # 16 GiB per full sequence
    assert mem.concurrent_seqs_at_max_seq_len == mem.kv_tokens_capacity // 131072
    assert 1 <= mem.concurrent_seqs_at_max_seq_len < 8
    assert any("max_batch_size" in w for w in plan.warnings)  # capacity < 8 x 131,072
    # the memory check uses the derived length: on a 24 GB L4 one sequence no longer fits
    pr = refusals(prof("bf16-h100", target={"gpu": "l4"}, build={"max_batch_size": 8}), md)
    x = by_rule(pr, "memory.fit")
    assert x.field == "build.max_seq_len" and "less than one sequence of max_seq_len 131,072" in x.reason


def test_case9_streaming_needs_decoupled(default_model_dir):
    pr = refusals(prof("bf16-h100", runtime={"streaming": True, "decoupled_mode": False}), default_model_dir)
    x = by_rule(pr, "runtime.streaming")
    assert x.reason == "needs runtime.decoupled_mode: true (Triton streams tokens only from a decoupled model)."
    assert P.resolve(prof("bf16-h100", runtime={"streaming": True, "decoupled_mode": True}), default_model_dir).ok


def test_case10_13b_bf16_on_24gb(tmp_path):
    md = write_model(tmp_path, LLAMA13B, "llama13b")
    p = prof("bf16-h100", target={"gpu": "rtx-4090"},
             build={"max_batch_size": 8, "max_input_len": 4096, "max_seq_len": 4096, "max_num_tokens": 16384})
    pr = refusals(p, md)
    x = by_rule(pr, "memory.fit")
    assert x.field == "target.gpu"
    plan = P.evaluate(p, md)
    w = plan.memory.weight_bytes_per_gpu
    assert 25.5e9 < w < 26.5e9  # ~13B x 2 bytes
    assert x.reason.startswith(f"does not fit on rtx-4090 (24,564 MiB = 23.99 GiB per GPU): weights {w / GIB:,.2f} GiB + activations ~")
    assert "(max_num_tokens 16,384)" in x.reason and "too much, before any KV cache" in x.reason
    assert "tp_size 2" in x.fix


def test_tp2_with_nine_heads(default_model_dir):
    pr = refusals(prof("bf16-h100", parallel={"tp_size": 2}, deployment={"gpus_per_replica": 2}), default_model_dir)
    x = by_rule(pr, "layout.attention_heads")
    assert x.field == "parallel.tp_size"
    assert x.reason == "2 does not divide the model's 9 attention heads (SmolLM2-135M-Instruct)."
    assert x.fix == "use tp_size 1, 3 or 9."
    y = by_rule(pr, "layout.kv_heads")
    assert y.reason == "2 neither divides the 3 KV heads nor is a multiple of them (SmolLM2-135M-Instruct)."


def test_tp3_ok_with_nine_heads(default_model_dir):
    plan = P.resolve(prof("fp8-h100", parallel={"tp_size": 3}, deployment={"gpus_per_replica": 3}), default_model_dir)
    assert plan.mapping.model_dump() == {"world_size": 3, "tp_size": 3, "pp_size": 1, "moe_tp_size": 3, "moe_ep_size": 1}
    assert plan.memory.kv_bytes_per_token == 2 * 30 * 1 * 64 * 1


def test_max_input_len_over_max_seq_len(default_model_dir):
    pr = refusals(prof("bf16-h100", build={"max_input_len": 9000, "max_seq_len": 8192}), default_model_dir)
    x = by_rule(pr, "limits.input_within_seq")
    assert x.field == "build.max_input_len"
    assert x.reason == "9,000 is more than max_seq_len 8,192; a prompt cannot be longer than the whole sequence."


def test_all_problems_reported_together(default_model_dir):
    p = prof("fp8-h100", target={"gpu": "a100"}, runtime={"streaming": True},
             parallel={"tp_size": 2}, build={"max_input_len": 9000})
    rules = {x.rule for x in refusals(p, default_model_dir)}
    assert {"format.gemm_sm", "layout.world_size", "layout.attention_heads", "limits.input_within_seq",
            "runtime.streaming"} <= rules


def test_unknown_gpu_still_checks_the_rest(default_model_dir):
    pr = refusals(prof("bf16-h100", target={"gpu": "h1OO"}, runtime={"streaming": True}), default_model_dir)
    assert pr[0].rule == "gpu.known" and pr[0].field == "target.gpu"
    assert "closest known GPU is 'h100-sxm'" in pr[0].fix
    assert any(x.rule == "runtime.streaming" for x in pr)


# ----------------------------------------------------------------------------------------------
# memory planner


def test_llama70b_kv_bytes_per_token(m70):
    a = arch_from_config(LLAMA70B)
    assert MEM.kv_bytes_per_token(a, prof("bf16-h100"), DER.derive_mapping(prof("bf16-h100"))) == 327_680
    assert MEM.kv_bytes_per_token(a, prof("fp8-h100"), DER.derive_mapping(prof("fp8-h100"))) == 163_840


def test_llama70b_fp8_fits_one_h100(m70):
    p = prof("fp8-h100", build={"max_batch_size": 64, "max_input_len": 4096, "max_seq_len": 8192, "max_num_tokens": 8192},
             deployment={"fallback": None, "warm_fallback": False, "gpus_per_replica": 1})
    plan = P.resolve(p, m70)
    mem = plan.memory
    w = mem.weight_bytes_per_gpu
    assert abs(w - 72.6e9) / 72.6e9 < 0.01, w
    # FP8 linears + BF16 embedding + BF16 lm_head
    linears = 80 * (8192 * (64 + 16) * 128 + 8192 * 8192 + 3 * 8192 * 28672)
    assert w > linears + 2 * 128256 * 8192 * 2
    # the KV capacity, computed here by hand from the plan's terms
    total = CATALOG["h100-sxm"].memory_mib * 2**20
    assert total == 85_520_809_984
    usable = total - w - mem.activation_bytes_estimate - mem.runtime_reserve_bytes
    assert mem.usable_bytes == usable
    kv = int(usable * 0.9)
    cap = kv // (163_840 * 32) * 32
    assert mem.kv_cache_bytes == kv and mem.kv_tokens_capacity == cap
    assert 40_000 < cap < 60_000  # ~8 GB of FP8 KV cache
    assert mem.concurrent_seqs_at_max_seq_len == cap // 8192
    assert mem.fits
    assert any("max_batch_size" in x for x in plan.warnings)  # 64 x 8192 tokens do not fit


def test_llama70b_bf16_needs_tp2_on_h100(m70):
    base = dict(build={"max_batch_size": 64, "max_input_len": 4096, "max_seq_len": 8192, "max_num_tokens": 8192},
                deployment={"fallback": None, "warm_fallback": False})
    p1 = prof("bf16-h100", **base)
    plan1 = P.evaluate(p1, m70)
    assert abs(plan1.memory.weight_bytes_per_gpu - 141e9) / 141e9 < 0.01
    x = by_rule(plan1.problems, "memory.fit")
    assert "tp_size 2" in x.fix
    p2 = prof("bf16-h100", parallel={"tp_size": 2}, build=base["build"],
              deployment={"fallback": None, "warm_fallback": False, "gpus_per_replica": 2})
    plan2 = P.resolve(p2, m70)
    w2 = plan2.memory.weight_bytes_per_gpu
    # decoder and lm_head halve; the embedding is replicated on both ranks
    assert 70e9 < w2 < 73e9
    assert plan2.memory.weight_breakdown.embedding == 128256 * 8192 * 2
    p3 = prof("bf16-h100", parallel={"tp_size": 2, "use_parallel_embedding": True}, build=base["build"],
              deployment={"fallback": None, "warm_fallback": False, "gpus_per_replica": 2})
    assert P.resolve(p3, m70).memory.weight_breakdown.embedding == 128256 * 8192


def test_warm_fallback_counted(default_model_dir):
    warm = P.resolve(prof("fp8-h100"), default_model_dir).memory
    cold = P.resolve(prof("fp8-h100", deployment={"warm_fallback": False, "gpus_per_replica": 1, "fallback": "bf16-h100"}),
                     default_model_dir).memory
    assert cold.fallback_bytes == 0
    bf16 = P.resolve(prof("bf16-h100"), default_model_dir).memory
    assert warm.fallback_bytes == bf16.weight_bytes_per_gpu + bf16.activation_bytes_estimate
    assert warm.usable_bytes == cold.usable_bytes - warm.fallback_bytes


def test_bf16_weights_of_default_model(default_model_dir):
    """BF16 checkpoint: 134.5 M params x 2 bytes + a separate lm_head (tied in HF)."""
    mem = P.resolve(prof("bf16-h100"), default_model_dir).memory
    assert mem.weight_bytes_per_gpu == 2 * (134_515_008 + 49152 * 576)


# ----------------------------------------------------------------------------------------------
# model_info


def test_read_default_model_arch(default_model_dir):
    from precision_pipeline.spec.model_arch import read_model_arch

    a = read_model_arch(default_model_dir)
    assert (a.architecture, a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim) == \
        ("LlamaForCausalLM", 30, 576, 9, 3, 64)
    assert (a.intermediate_size, a.vocab_size, a.max_position_embeddings, a.tied_embeddings) == (1536, 49152, 8192, True)
    assert a.rope_scaling_factor == 1.0 and a.num_experts == 0
    assert a.num_params == 134_515_008  # 134.5 M


def test_model_info_errors_name_model(tmp_path):
    from precision_pipeline.spec.model_arch import read_model_arch

    with pytest.raises(UserError) as ei:
        read_model_arch(tmp_path / "nowhere")
    assert ei.value.problems[0].field == "--model" and "no config.json" in ei.value.problems[0].reason
    d = tmp_path / "bad"
    d.mkdir()
    (d / "config.json").write_text("{oops")
    with pytest.raises(UserError) as ei:
        read_model_arch(d)
    assert "is not valid JSON" in ei.value.problems[0].reason
    for cfg, text in ((dict(LLAMA70B, architectures=["GPT2LMHeadModel"]), "architecture 'GPT2LMHeadModel' is not supported"),
                      (dict(LLAMA70B, num_hidden_layers=0), "num_hidden_layers must be a positive integer"),
                      (dict(LLAMA70B, num_hidden_layers=10**9), "implausibly large"),
                      (dict(LLAMA70B, num_key_value_heads=7), "not a multiple of num_key_value_heads 7"),
                      ({k: v for k, v in LLAMA70B.items() if k != "vocab_size"}, "has no 'vocab_size'"),
                      ([], "does not hold a JSON object")):
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(UserError) as ei:
            read_model_arch(d)
        assert ei.value.problems[0].field == "--model" and text in ei.value.problems[0].reason, text


def test_model_info_architectures():
    mx = arch_from_config(MIXTRAL)
    assert mx.num_experts == 8 and mx.moe_intermediate_size == 14336 and mx.num_experts_per_tok == 2
    qwen = arch_from_config({"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 24, "hidden_size": 896,
                             "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
                             "vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True})
    assert qwen.attention_bias and qwen.head_dim == 64
    assert 490e6 < qwen.num_params < 500e6  # Qwen2-0.5B: 494 M
    mis = arch_from_config({"architectures": ["MistralForCausalLM"], "num_hidden_layers": 32, "hidden_size": 4096,
                            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                            "vocab_size": 32000, "max_position_embeddings": 32768})
    assert 7.2e9 < mis.num_params < 7.3e9  # Mistral-7B: 7.24 B
    l3 = arch_from_config(LLAMA70B)
    assert 70.4e9 < l3.num_params < 70.8e9  # Llama-3-70B: 70.6 B
