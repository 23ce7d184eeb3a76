"""Roofline estimates (resolve/estimate.py): values from the memory plan and the catalog, arithmetic shown."""

from __future__ import annotations

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.resolve import estimate as E
from precision_pipeline.resolve.plan import evaluate
from precision_pipeline.spec.hardware import CATALOG, resolve_gpu
from precision_pipeline.spec.profile import load_profile


@pytest.fixture(scope="module")
def fp8_plan(default_model_dir):
    return evaluate(load_profile("fp8-h100"), default_model_dir)


def test_estimate_reuses_the_memory_plan_and_the_catalog(fp8_plan):
    e, mem, g = fp8_plan.estimate, fp8_plan.memory, fp8_plan.gpu
    assert fp8_plan.to_json()["estimate"] == e and e["kind"] == E.KIND
    L = fp8_plan.limits.max_seq_len
    assert e["context_tokens"] == L == 8192
    conc = mem.kv_tokens_capacity // L
    assert e["kv_concurrency_at_context"] == conc == mem.concurrent_seqs_at_max_seq_len
    B = min(fp8_plan.limits.max_batch_size, conc)
    assert e["batch"] == B == 64
    w = mem.weight_bytes_per_gpu - mem.weight_breakdown.embedding
    assert e["decode_weight_bytes_per_gpu"] == w
    step = w + B * L * mem.kv_bytes_per_token
    assert e["decode_step_bytes_per_gpu"] == step
    assert e["decode_tokens_per_s"] == pytest.approx(B * g.bandwidth_gbs * 1e9 / step, abs=0.1)
    assert e["decode_tokens_per_s_one_sequence"] == pytest.approx(
        g.bandwidth_gbs * 1e9 / (w + L * mem.kv_bytes_per_token), abs=0.1)
    # FP8 activations -> the FP8 Tensor Core peak of the catalog, with its source
    assert e["hardware"] == {"gpu": "h100-sxm", "bandwidth_gbs": 3350, "tensor_peak": 1978.9,
                             "tensor_peak_field": "fp8_tflops", "source": CATALOG["h100-sxm"].source}
    m = fp8_plan.model
    flops = 2 * E.gemm_params_per_gpu(m, 1, 1) + 2 * 4096 * m.num_heads * m.head_dim * m.num_layers
    assert e["prefill_flops_per_token_per_gpu"] == flops
    assert e["prefill_tokens_per_s"] == pytest.approx(1978.9e12 / flops, abs=0.1)
    assert any(line.startswith("decode step bytes/GPU = weights") and f"{step:,}" in line for line in e["arithmetic"])
    assert e["tp_communication"] == "none (tp_size 1)" and e["tp_allreduce_bytes_per_step"] == 0


def test_gemm_params_of_the_default_model(fp8_plan):
    # SmolLM2-135M: 30 layers x (576 x 960 qkv + 576 x 576 o + 3 x 576 x 1536 MLP)
    assert E.gemm_params_per_gpu(fp8_plan.model, 1, 1) == 30 * (576 * 960 + 576 * 576 + 3 * 576 * 1536)
    assert E.gemm_params_per_gpu(fp8_plan.model, 2, 1) == 30 * (576 * 960 + 576 * 576 + 3 * 576 * 1536) // 2


def test_gemm_math_picks_the_catalog_peak(default_model_dir):
    for name, field, value in (("int8-sq-l4", "int8_tops", 242.5), ("int4-awq-a100", "bf16_tflops", 312),
                               ("nvfp4-b200", "fp4_tflops", 9000), ("bf16-h100", "bf16_tflops", 989.4)):
        e = evaluate(load_profile(name), default_model_dir).estimate
        assert (e["hardware"]["tensor_peak_field"], e["hardware"]["tensor_peak"]) == (field, value), name


def test_no_int8_peak_in_the_catalog_says_so(fp8_plan):
    g = resolve_gpu("rtx-4090")
    assert g.int8_tops is None and g.tensor_peak("int8") == (None, "int8_tops")
    p = fp8_plan.profile.model_copy(update={"quantization": fp8_plan.profile.quantization.model_copy(
        update={"quant_algo": "W8A8_SQ_PER_CHANNEL"})})
    e = E.roofline(g, fp8_plan.model, p, fp8_plan.mapping.model_dump(), fp8_plan.limits.model_dump(),
                   fp8_plan.memory.model_dump())
    assert e["prefill_tokens_per_s"] is None
    assert "int8_tops is not catalogued for rtx-4090" in e["arithmetic"][-1]


def test_tensor_parallel_is_stated_not_modelled(fp8_plan):
    mapping = dict(fp8_plan.mapping.model_dump(), tp_size=2, world_size=2)
    e = E.roofline(fp8_plan.gpu, fp8_plan.model, fp8_plan.profile, mapping, fp8_plan.limits.model_dump(),
                   fp8_plan.memory.model_dump(), batch=8)
    m = fp8_plan.model
    assert e["tp_allreduce_bytes_per_step"] == 2 * m.num_layers * 8 * m.hidden_size * 2
    assert e["tp_communication"] == E.TP_NOT_MODELLED
    assert e["decode_tokens_per_s_per_gpu"] == pytest.approx(e["decode_tokens_per_s"] / 2, abs=0.1)


def test_context_and_batch_arguments(fp8_plan):
    e = E.of_plan(fp8_plan, batch=1, context=1024)
    assert (e["batch"], e["context_tokens"]) == (1, 1024)
    assert e["kv_concurrency_at_context"] == fp8_plan.memory.kv_tokens_capacity // 1024
    with pytest.raises(UserError) as ei:
        E.of_plan(fp8_plan, context=8193)
    assert ei.value.problems[0].field == "--context"
    with pytest.raises(UserError):
        E.of_plan(fp8_plan, batch=0)


def test_unknown_gpu_has_no_estimate(default_model_dir):
    p = load_profile("fp8-h100")
    plan = evaluate(p.model_copy(update={"target": p.target.model_copy(update={"gpu": "v100"})}), default_model_dir)
    assert plan.estimate is None and plan.to_json()["estimate"] == {}
