"""Each rule of build/precision_pipeline/resolve/rules.py: its table data, and the exact error it gives.

Models are ModelArch objects made from HF config dicts (no files needed).
"""

from __future__ import annotations

import json


import pytest

from precision_pipeline.spec import formats as F
from precision_pipeline.resolve import plan as P
from precision_pipeline.resolve import rules as R
from precision_pipeline.resolve import reuse as REUSE
from precision_pipeline.spec.hardware import CATALOG
from precision_pipeline.spec.model_arch import arch_from_config
from precision_pipeline.spec.profile import validate_profile
from tests.conftest import prof  # noqa: E402  (shared with test_plan / test_rules)

SMOL = arch_from_config({
    "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "rope_scaling": None,
}, name="SmolLM2-135M-Instruct")




def run(profile, model=SMOL):
    return P.evaluate(profile, model)


def only(plan, rule, status="refused"):
    found = [c for c in plan.checks if c["rule"] == rule and c["status"] == status]
    assert found, [c for c in plan.checks if c["status"] != "pass"]
    if status == "refused":
        return next(p for p in plan.problems if p.rule == rule)
    return found[0]


def gemm(algo: str, gpu: str, kv: str = "NONE", **extra):
    q = {"quant_algo": algo, "kv_cache_quant_algo": kv, "exclude_modules": ["lm_head"]}
    if algo in F.AWQ_ALGOS:
        q["group_size"] = 64
    return prof("bf16-h100", target={"gpu": gpu}, quantization=q,
                context_phase={"use_fp8_context_fmha": False, "use_paged_context_fmha": True, "enable_chunked_context": True},
                **extra)


# ---------------------------------------------------------------------------------------------
# tables


def test_every_rule_has_a_source_and_unique_name():
    names = [r.name for r in R.RULES]
    assert len(names) == len(set(names))
    for r in R.RULES:
        assert r.source and r.summary


def test_format_tables_have_sources():
    for e in list(F.GEMM.values()) + list(F.KV.values()):
        assert e.source and e.needs


# (format, SM, runs?) from docs/source/features/quantization.md and builder.py
MATRIX = [
    ("NO_QUANT", 80, True), ("NO_QUANT", 75, False),
    ("FP8", 80, False), ("FP8", 86, False), ("FP8", 89, True), ("FP8", 90, True), ("FP8", 100, True), ("FP8", 120, True),
    ("NVFP4", 89, False), ("NVFP4", 90, False), ("NVFP4", 100, True), ("NVFP4", 103, True), ("NVFP4", 120, True),
    ("W4A8_AWQ", 80, False), ("W4A8_AWQ", 89, True), ("W4A8_AWQ", 90, True), ("W4A8_AWQ", 100, False),
    ("W4A8_AWQ", 120, False),
    ("W4A16_AWQ", 80, True), ("W4A16_AWQ", 90, True), ("W4A16_AWQ", 100, False), ("W4A16_AWQ", 103, False),
    ("W4A16_AWQ", 120, True),
    ("W8A16", 86, True), ("W8A16", 100, False),
    ("W8A8_SQ_PER_CHANNEL", 80, True), ("W8A8_SQ_PER_CHANNEL", 89, True), ("W8A8_SQ_PER_CHANNEL", 100, False),
    ("W4A16_NVFP4", 100, False), ("W4A16_NVFP4", 90, False),
]


@pytest.mark.parametrize("algo,sm,ok", MATRIX)
def test_gemm_matrix(algo, sm, ok):
    assert F.GEMM[algo].supports(sm) is ok


@pytest.mark.parametrize("kv,sm,ok", [("FP8", 80, True), ("FP8", 86, True), ("FP8", 100, True), ("INT8", 80, True),
                                      ("INT8", 100, False), ("INT8", 103, False), ("NVFP4", 90, False), ("NVFP4", 100, True),
                                      ("NONE", 80, True)])
def test_kv_matrix(kv, sm, ok):
    assert F.KV[kv].supports(sm) is ok


def test_linear_weight_bytes():
    assert F.linear_weight_bytes("FP8", 576, 960, None) == 576 * 960 + 8
    assert F.linear_weight_bytes("NVFP4", 576, 960, None) == 576 * 960 / 2 + 576 * 960 / 16 + 8
    # measured AWQ group 64: qkv weight I8 [480, 576], scales F32 [960, 9], prequant BF16 [576]
    assert F.linear_weight_bytes("W4A16_AWQ", 576, 960, 64) == 480 * 576 + 960 * 9 * 4 + 576 * 2
    assert F.linear_weight_bytes("W8A8_SQ_PER_CHANNEL", 576, 960, None) == 576 * 960 + 960 * 4 + 4 + 576 * 2
    assert F.linear_weight_bytes("W8A16", 576, 960, None) == 576 * 960 + 960 * 4
    assert F.linear_weight_bytes("NO_QUANT", 576, 960, None) == 576 * 960 * 2


# ---------------------------------------------------------------------------------------------
# gpu.*


def test_an_alias_of_several_memory_sizes_is_warned_and_recorded(default_model_dir):
    """Issue 25 item 15: ``gpu: a100`` silently meant the 80 GB card."""
    plan = run(gemm("W4A16_AWQ", "a100"))
    assert plan.gpu.id == "a100-80gb" and not plan.problems
    w = [c for c in plan.checks if c["rule"] == "gpu.variant"]
    assert len(w) == 1 and w[0]["status"] == "warn"
    assert "'a100' is read as a100-80gb (80 GB, 2,039 GB/s); it also names a100-40gb (40 GB, 1,555 GB/s)" in w[0]["message"]
    assert any("a100-40gb" in x for x in plan.warnings) and "gpu.variant" in json.dumps(plan.to_json())
    exact = run(gemm("W4A16_AWQ", "a100-80gb"))
    assert [c["status"] for c in exact.checks if c["rule"] == "gpu.variant"] == ["pass"]
    assert not any("a100-40gb" in x for x in exact.warnings)


def test_gpu_supported_refuses_v100_and_t4():
    for gpu, sm, arch in (("v100", 70, "Volta"), ("t4", 75, "Turing")):
        pr = only(run(prof(target={"gpu": gpu})), "gpu.supported")
        g = CATALOG[gpu]
        assert pr.reason == (f"{gpu} ({g.name}) is SM {sm} ({arch}); TensorRT-LLM 1.x supports SM >= 80 only "
                             "(Ampere, Ada, Hopper, Blackwell).")
        # the format and memory rules do not pile on for an unsupported GPU
        assert [p.rule for p in run(prof("fp8-h100", target={"gpu": gpu})).problems] == ["gpu.supported"]


# ---------------------------------------------------------------------------------------------
# format.*


def test_fp8_on_a100_suggests_int8_int4_bf16():
    pr = only(run(gemm("FP8", "a100", kv="FP8")), "format.gemm_sm")
    assert pr.fix.startswith("use int8-sq, int4-awq or bf16 on SM 80, or a GPU of SM >= 89 (")


def test_fp8_on_a10_sm86():
    pr = only(run(gemm("FP8", "a10")), "format.gemm_sm")
    assert pr.reason == "FP8: FP8 GEMMs need SM >= 89 (Ada, Hopper, Blackwell); a10 (NVIDIA A10) is SM 86."


def test_nvfp4_on_rtx_6000_ada_is_sm89_not_blackwell():
    pr = only(run(gemm("NVFP4", "RTX 6000 Ada")), "format.gemm_sm")
    assert pr.reason.endswith("rtx-6000-ada (NVIDIA RTX 6000 Ada Generation) is SM 89.")


def test_nvfp4_runs_on_rtx_pro_6000_blackwell_and_gb200_b300():
    for gpu in ("rtx-pro-6000-blackwell", "gb200", "b300", "rtx-5090"):
        assert run(gemm("NVFP4", gpu, kv="FP8")).ok, gpu


def test_w4a8_awq_on_b200():
    pr = only(run(gemm("W4A8_AWQ", "b200")), "format.gemm_sm")
    assert pr.reason == "W4A8_AWQ: W4A8 AWQ needs Ada or Hopper: SM 89 or 90; b200 (NVIDIA B200) is SM 100."
    assert pr.fix == "w4a8-awq runs on SM 89-90 (l4, l40s, rtx-4090, rtx-6000-ada, l40, l20, rtx-5000-ada, rtx-4500-ada and 10 more); " \
                     "on SM 100 use fp8, nvfp4 or bf16."
    assert run(gemm("W4A8_AWQ", "h100")).ok and run(gemm("W4A8_AWQ", "l4")).ok


def test_smoothquant_on_b200():
    pr = only(run(gemm("W8A8_SQ_PER_CHANNEL", "b200")), "format.gemm_sm")
    assert pr.reason == ("W8A8_SQ_PER_CHANNEL: INT8 SmoothQuant is refused by trtllm-build on SM 100-119 "
                         "('SmoothQuant is not supported on SM>=100'); b200 (NVIDIA B200) is SM 100.")


def test_int4_awq_on_gb200():
    pr = only(run(gemm("W4A16_AWQ", "gb200")), "format.gemm_sm")
    assert "INT4 weight-only (AWQ) is refused by trtllm-build on SM 100-119" in pr.reason


def test_int4_awq_on_sm120_warns():
    plan = run(gemm("W4A16_AWQ", "rtx-5090"))
    assert plan.ok
    c = only(plan, "format.gemm_sm", "warn")
    assert "does not list it" in c["message"]


def test_w4a16_nvfp4_refused_everywhere():
    for gpu in ("b200", "h100"):
        pr = only(run(gemm("W4A16_NVFP4", gpu)), "format.trtllm_buildable")
        assert pr.reason.startswith("W4A16_NVFP4 is written by ModelOpt (W4A16_NVFP4_CFG) but is not in TensorRT-LLM 1.2's "
                                    "QUANT_ALGO_LIST")


def test_fp8_kv_on_ampere_is_allowed():
    # BF16 GEMMs + FP8 KV on A100: the format is fine, but paged context FMHA is lost (see overrides)
    plan = run(gemm("NO_QUANT", "a100", kv="FP8", runtime={"enable_kv_cache_reuse": False},
                    ))
    assert not [p for p in plan.problems if p.rule == "format.kv_sm"]


def test_int8_kv_on_b200():
    pr = only(run(gemm("NO_QUANT", "b200", kv="INT8", runtime={"enable_kv_cache_reuse": False})), "format.kv_sm")
    assert pr.reason == ("INT8: an INT8 KV cache is refused by trtllm-build on SM 100-119 ('INT8/INT4 quantization is not "
                         "supported on SM>=100'); b200 (NVIDIA B200) is SM 100.")
    assert pr.fix == "use kv_cache_quant_algo NONE, FP8 or NVFP4 on SM 100."


def test_nvfp4_kv_on_h100():
    pr = only(run(gemm("FP8", "h100", kv="NVFP4")), "format.kv_sm")
    assert pr.fix == "use kv_cache_quant_algo NONE, FP8 or INT8 on SM 90."


def test_mixed_precision_needs_budget_and_supported_candidates():
    pr = only(run(gemm("MIXED_PRECISION", "h100")), "format.gemm_sm")
    assert pr.field == "quantization.auto_quantize_bits"
    p = gemm("MIXED_PRECISION", "a100")
    p = validate_profile({**p.model_dump(mode="json"), "quantization": {
        "quant_algo": "MIXED_PRECISION", "auto_quantize_bits": 6.0, "auto_quantize_formats": ["FP8", "W4A16_AWQ"],
        "group_size": 64}})
    pr = only(run(p), "format.gemm_sm")
    assert pr.field == "quantization.auto_quantize_formats" and pr.reason.startswith("candidate FP8: FP8 GEMMs need SM >= 89")


# ---------------------------------------------------------------------------------------------
# format.group_size


def test_awq_group_size_required():
    p = gemm("W4A16_AWQ", "a100")
    p = validate_profile({**p.model_dump(mode="json"), "quantization": {"quant_algo": "W4A16_AWQ"}})
    pr = only(run(p), "format.group_size")
    assert pr.reason == "W4A16_AWQ needs a group size (scales per group of input channels)."
    assert pr.fix == "set quantization.group_size to a divisor of 576, 576, 1536, e.g. 64."


def test_awq_group_128_does_not_divide_576():
    p = gemm("W4A16_AWQ", "a100")
    p = validate_profile({**p.model_dump(mode="json"), "quantization": {"quant_algo": "W4A16_AWQ", "group_size": 128}})
    pr = only(run(p), "format.group_size")
    assert pr.reason == ("group_size 128 does not divide the input width of every tensor-parallel slice: "
                         "hidden (qkv/fc/gate input) 576, attention dense input 576/tp 1 576.")


def test_awq_group_vs_tp_slices():
    big = arch_from_config({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "hidden_size": 4096,
                            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 11008,
                            "vocab_size": 32000, "max_position_embeddings": 4096})
    base = gemm("W4A16_AWQ", "a100").model_dump(mode="json")
    base["quantization"]["group_size"] = 256
    ok = validate_profile(base)
    assert run(ok, big).ok  # 11008 = 43 x 256
    base["parallel"] = {"tp_size": 2}
    base["deployment"]["gpus_per_replica"] = 2
    pr = only(run(validate_profile(base), big), "format.group_size")
    assert pr.reason == ("group_size 256 does not divide the input width of every tensor-parallel slice: "
                         "mlp proj input 11008/tp 2 5504.")  # 5504 = 21.5 x 256
    assert pr.fix.startswith("use a group size dividing 4096, 2048, 5504, e.g. 128;")


def test_nvfp4_block_16_with_tp3_ok():
    p = prof("nvfp4-b200", parallel={"tp_size": 3}, deployment={"gpus_per_replica": 3, "fallback": None})
    assert run(p).ok


# ---------------------------------------------------------------------------------------------
# layout.*


def test_pp_more_than_layers():
    p = prof(parallel={"pp_size": 31}, deployment={"gpus_per_replica": 31})
    pr = only(run(p), "layout.pipeline")
    assert pr.reason == "31 is more than the model's 30 layers."


def test_pp_uneven_warns():
    p = prof(parallel={"pp_size": 4}, deployment={"gpus_per_replica": 4})
    plan = run(p)
    # planned like any layout; only the quantize stage cannot export it (it writes tp rank files only)
    assert [(x.rule, x.field) for x in plan.problems] == [("quantize.modelopt_inputs", "parallel.pp_size")]
    assert only(plan, "layout.pipeline", "warn")["message"].startswith("parallel.pp_size: 30 layers over 4 pipeline ranks")
    # heaviest rank: 8 layers
    assert plan.memory.kv_bytes_per_token == 2 * 8 * 3 * 64 * 2


def test_kv_head_replication_warns():
    p = prof(parallel={"tp_size": 9}, deployment={"gpus_per_replica": 9})
    plan = run(p)
    assert only(plan, "layout.kv_heads", "warn")
    assert plan.memory.kv_bytes_per_token == 2 * 30 * 1 * 64 * 2
    # ... and tp 9 is refused anyway: the MLP's 1536 columns do not split over 9 ranks
    assert [x.rule for x in plan.problems] == ["quantize.modelopt_inputs"]
    pr = only(plan, "quantize.modelopt_inputs")
    assert pr.field == "parallel.tp_size" and "1536" in pr.reason and pr.fix.endswith(": 1, 3.")


@pytest.mark.parametrize("quant, kv, keep, want_field, words", [
    ({"quant_algo": "MIXED_PRECISION", "auto_quantize_bits": 3.0, "auto_quantize_formats": ["FP8", "W4A16_AWQ"],
      "group_size": 64}, "FP8", 0, "quantization.auto_quantize_bits", "below the cheapest candidate (4 bits: W4A16_AWQ)"),
    ({"quant_algo": "MIXED_PRECISION", "auto_quantize_bits": 6.0, "auto_quantize_formats": ["FP8", "W8A8_SQ_PER_CHANNEL"]},
     "FP8", 0, "quantization.auto_quantize_formats", "W8A8_SQ_PER_CHANNEL cannot be a per-layer search candidate"),
    ({"quant_algo": "FP8"}, "INT8", 0, "quantization.kv_cache_quant_algo", "no INT8 KV-cache config"),
    ({"quant_algo": "FP8"}, "FP8", 999, "quantization.keep_first_layers", "nothing would be quantized"),
])
def test_quantize_stage_limits_refused_at_check(quant, kv, keep, want_field, words):
    p = prof(target={"gpu": "h100-sxm"}, quantization={**quant, "kv_cache_quant_algo": kv, "keep_first_layers": keep})
    plan = run(p)
    pr = only(plan, "quantize.modelopt_inputs")
    assert pr.field == want_field and words in pr.reason, pr.reason


def test_search_formats_without_mixed_warn():
    p = prof(target={"gpu": "h100-sxm"}, quantization={"quant_algo": "FP8", "auto_quantize_formats": ["FP8"]})
    w = only(run(p), "quantize.modelopt_inputs", "warn")
    assert "ignored for FP8" in w["message"]


def test_default_gpus_per_replica_equals_world():
    p = prof(parallel={"tp_size": 3}, deployment={"gpus_per_replica": None})
    assert run(p).ok


# ---------------------------------------------------------------------------------------------
# limits.*


def test_limits_derived_with_reasons():
    p = prof(build={"max_batch_size": 64, "max_input_len": None, "max_seq_len": None, "max_num_tokens": None})
    lim = run(p).limits
    assert (lim.max_seq_len, lim.max_input_len, lim.max_num_tokens) == (8192, 1024, 8192)
    assert lim.derived["max_input_len"] == "not set: BuildConfig default 1,024 (tensorrt_llm/builder.py BuildConfig (defaults))"
    assert lim.derived["max_num_tokens"] == "not set: BuildConfig default 8,192 (tensorrt_llm/builder.py BuildConfig (defaults))"


def test_rope_factor_scales_derived_max_seq_len():
    m = arch_from_config({"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 256,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000,
                          "max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    p = prof(build={"max_input_len": None, "max_seq_len": None, "max_num_tokens": None})
    lim = run(p, m).limits
    assert lim.max_seq_len == 131072
    assert "x rope scaling factor 4 = 131,072 tokens" in lim.derived["max_seq_len"]


def test_derived_input_len_clipped_to_short_seq():
    p = prof(build={"max_input_len": None, "max_seq_len": 512, "max_num_tokens": 512})
    lim = run(p).limits
    assert lim.max_input_len == 512 and "clipped to max_seq_len 512" in lim.derived["max_input_len"]


def test_seq_over_positions_warns():
    plan = run(prof(build={"max_seq_len": 16384, "max_input_len": 4096}))
    assert plan.ok
    c = only(plan, "limits.seq_within_positions", "warn")
    assert "16,384 is more than the model's max_position_embeddings 8,192 without rope scaling" in c["message"]


def test_num_tokens_clamped_and_reported():
    plan = run(prof(build={"max_batch_size": 1, "max_seq_len": 4096, "max_input_len": 2048, "max_num_tokens": 8192}))
    assert plan.limits.max_num_tokens == 4096
    assert "clamped to 4,096" in plan.limits.derived["max_num_tokens"]
    c = only(plan, "limits.derived", "warn")
    assert "trtllm-build clamps it to 4,096" in c["message"]


def test_num_tokens_below_input_needs_chunked_context():
    p = prof(build={"max_input_len": 4096, "max_num_tokens": 2048},
             context_phase={"enable_chunked_context": False}, runtime={"enable_kv_cache_reuse": True})
    pr = only(run(p), "limits.num_tokens_vs_input")
    assert pr.reason == ("2,048 is less than max_input_len 4,096: a prompt that long only fits if it is processed in chunks.")
    assert pr.fix == "set context_phase.enable_chunked_context: true, or raise max_num_tokens to >= 4,096."
    assert run(prof(build={"max_input_len": 4096, "max_num_tokens": 2048})).ok  # chunked on in bf16-h100


def test_num_tokens_large_warns():
    plan = run(prof(build={"max_num_tokens": 32768}))
    assert only(plan, "limits.num_tokens_large", "warn")


# ---------------------------------------------------------------------------------------------
# context.* / builder overrides


def test_builder_turns_paged_fmha_off_for_bf16_with_fp8_kv():
    p = gemm("NO_QUANT", "h100", kv="FP8")  # reuse + chunked asked
    plan = run(p)
    pr = only(plan, "context.builder_overrides")
    assert pr.reason == ("trtllm-build would turn paged context FMHA off (with an FP8 KV cache, paged context FMHA needs FP8 "
                         "context FMHA, which quant_algo NO_QUANT does not have), which disables "
                         "runtime.enable_kv_cache_reuse and context_phase.enable_chunked_context that the profile asks for.")
    assert plan.effective.use_paged_context_fmha is False


@pytest.mark.parametrize("algo", ["W4A16_AWQ", "W8A8_SQ_PER_CHANNEL"])
def test_override_warns_when_features_not_asked(algo):
    p = gemm(algo, "h100", kv="FP8", runtime={"enable_kv_cache_reuse": False})
    p = validate_profile({**p.model_dump(mode="json"), "context_phase": {"use_paged_context_fmha": True, "enable_chunked_context": False,
                                                                         "use_fp8_context_fmha": False}})
    plan = run(p)
    assert plan.ok
    assert plan.effective.use_paged_context_fmha is False
    assert plan.effective.overrides[0].field == "context_phase.use_paged_context_fmha"
    assert only(plan, "context.builder_overrides", "warn")


def test_int8_kv_turns_paged_fmha_off_and_refuses_reuse():
    plan = run(gemm("NO_QUANT", "h100", kv="INT8"))
    rules = {p.rule for p in plan.problems}
    assert {"runtime.kv_cache_reuse", "context.builder_overrides"} <= rules
    x = next(p for p in plan.problems if p.rule == "runtime.kv_cache_reuse")
    assert x.reason.startswith("is not possible with an INT8 KV cache")


def test_fp8_kv_paged_turns_fp8_context_fmha_on():
    p = prof("fp8-h100", context_phase={"use_fp8_context_fmha": False})
    plan = run(p)
    assert plan.ok and plan.effective.use_fp8_context_fmha is True
    assert "trtllm-build sets it to True" in only(plan, "context.builder_overrides", "warn")["message"]


def test_fp8_context_fmha_with_bf16_refused():
    p = prof(context_phase={"use_fp8_context_fmha": True})
    pr = only(run(p), "context.fp8_context_fmha")
    assert pr.reason == ("trtllm-build would turn it off: FP8 context FMHA needs the FP8 quantization workflow "
                         "(quant_algo FP8 or W4A8_AWQ or NVFP4); quant_algo is NO_QUANT.")
    assert pr.fix == "set use_fp8_context_fmha: false, or use quant_algo FP8, W4A8_AWQ or NVFP4."


def test_context_fmha_off():
    p = prof(context_phase={"context_fmha": False, "use_paged_context_fmha": True, "enable_chunked_context": False},
             runtime={"enable_kv_cache_reuse": True})
    pr = only(run(p), "context.builder_overrides")
    assert "context_fmha is off" in pr.reason and pr.fix.startswith("turn context_fmha on")


# ---------------------------------------------------------------------------------------------
# runtime.* / build.* / plugins.*


def test_chunked_context_needs_paged_fmha():
    p = prof(context_phase={"use_paged_context_fmha": False, "enable_chunked_context": True},
             runtime={"enable_kv_cache_reuse": False})
    pr = only(run(p), "runtime.chunked_context")
    assert pr.reason == "needs context_phase.use_paged_context_fmha."


def test_reuse_needs_paged_kv_cache():
    p = prof(build={"kv_cache_type": "continuous"}, context_phase={"enable_chunked_context": False})
    pr = only(run(p), "runtime.kv_cache_reuse")
    assert pr.reason == "needs build.kv_cache_type paged (is continuous)."


def test_logits_bfloat16_refused_and_fp32_recorded():
    pr = only(run(prof(build={"logits_dtype": "bfloat16"})), "build.logits_dtype")
    assert pr.reason == "'bfloat16' is not a trtllm-build --logits_dtype choice (float16, float32)."
    plan = run(prof())
    assert plan.effective.logits_dtype == "float32" and plan.effective.triton_logits_datatype == "TYPE_FP32"
    plan16 = run(prof(build={"logits_dtype": "float16"}))
    assert plan16.ok and plan16.effective.triton_logits_datatype == "TYPE_FP16"


def test_gemm_plugin_resolution():
    assert run(prof()).effective.gemm_plugin == "auto"
    assert run(prof("fp8-h100")).effective.gemm_plugin == "disable"
    assert run(prof("nvfp4-b200")).effective.gemm_plugin == "nvfp4"
    assert run(prof("int4-awq-a100")).effective.gemm_plugin == "auto"
    pr = only(run(prof(generation_phase={"gemm_plugin": "fp8"})), "plugins.gemm_plugin")
    assert pr.reason == "'fp8' is the FP8 GEMM plugin; quant_algo is NO_QUANT."
    assert run(prof("fp8-h100", generation_phase={"gemm_plugin": "fp8"})).effective.gemm_plugin == "fp8"


# ---------------------------------------------------------------------------------------------
# deployment.fallback


def test_warm_fallback_without_fallback():
    pr = only(run(prof(deployment={"warm_fallback": True, "fallback": None})), "deployment.fallback")
    assert pr.field == "deployment.warm_fallback"


def test_unknown_fallback_profile():
    pr = only(run(prof(deployment={"fallback": "bf16-h10"})), "deployment.fallback")
    assert pr.reason.startswith("profile 'bf16-h10' cannot be used: --profile: no shipped profile named 'bf16-h10'.")
    assert "did you mean 'bf16-h100'?" in pr.fix


def test_fallback_on_other_sm_warns_and_is_checked_on_this_gpu():
    plan = run(prof("nvfp4-b200"))
    assert plan.ok
    c = only(plan, "deployment.fallback", "warn")
    assert "targets h100-sxm (SM 90)" in c["message"] and "built for b200 (SM 100)" in c["message"]
    # an FP8 fallback cannot run on an A100 deployment
    p = prof("int4-awq-a100", deployment={"fallback": "fp8-h100", "warm_fallback": True})
    pr = only(run(p), "deployment.fallback")
    assert pr.reason.startswith("profile 'fp8-h100' cannot be used: quantization.quant_algo: on a100-80gb: FP8: FP8 GEMMs need SM >= 89")


def test_checkpoint_mapping_function(tmp_path):
    (tmp_path / "config.json").write_text('{"mapping": {"tp_size": 1, "pp_size": 2}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}')
    f = REUSE.checkpoint_mapping_findings(prof("fp8-h100"), tmp_path)
    assert len(f) == 1 and f[0].message.endswith("was exported with pp_size 2 (profile 1).")
    (tmp_path / "config.json").write_text('{"mapping": {"tp_size": 1, "pp_size": 1}, "quantization": {"quant_algo": "W4A16_AWQ"}}')
    f = REUSE.checkpoint_mapping_findings(prof("fp8-h100"), tmp_path)
    assert len(f) == 1 and "holds quant_algo W4A16_AWQ / kv_cache_quant_algo NONE" in f[0].message
    (tmp_path / "config.json").write_text("{not json")
    assert REUSE.checkpoint_mapping_findings(prof("fp8-h100"), tmp_path)[0].field == "--checkpoint"


def test_unknown_rope_type_is_refused_at_resolve_with_the_supported_list():
    """Previously accepted here and a KeyError traceback in quantize (transformers ROPE_INIT_FUNCTIONS)."""
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.spec.model_arch import ROPE_TYPES

    base = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 4096}
    with pytest.raises(UserError) as e:
        arch_from_config({**base, "rope_scaling": {"rope_type": "banana", "factor": 2.0}}, path="m/config.json")
    p = e.value.problems[0]
    assert p.field == "--model" and "rope_scaling type 'banana' is not supported" in p.reason
    assert "default, linear, dynamic, llama3, longrope, yarn" in p.reason and p.fix
    for t in ROPE_TYPES:  # every listed type is accepted (type or rope_type key)
        arch_from_config({**base, "rope_scaling": {"type": t, "factor": 2.0, "original_max_position_embeddings": 1024,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0}})


def test_rope_types_are_what_transformers_and_trtllm_both_read():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from precision_pipeline.spec.model_arch import ROPE_TYPES

    assert set(ROPE_TYPES) == set(ROPE_INIT_FUNCTIONS)
