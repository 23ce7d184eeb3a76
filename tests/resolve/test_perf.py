"""resolve/perf.py: the workload performance model. Numbers pinned for fixed configs (Llama-3.1-8B and -70B
config.json in tests/data/models), the terms recomputed by hand, the workload's validation, and the
model held against the published table of benchmarks/planner.py (medians, spread, format and tp order)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.resolve import perf as PF
from precision_pipeline.resolve import plan as P
from precision_pipeline.spec.hardware import interconnect, resolve_gpu
from precision_pipeline.spec.model_arch import read_model_arch
from precision_pipeline.spec.profile import deep_merge, load_raw, validate_profile

ROOT = Path(__file__).resolve().parents[2]
M8 = read_model_arch(ROOT / "tests" / "data" / "models" / "Llama-3.1-8B")
M70 = read_model_arch(ROOT / "tests" / "data" / "models" / "Llama-3.1-70B")
COMMON = {"deployment": {"fallback": None, "warm_fallback": False},
          "build": {"max_batch_size": 2048, "max_seq_len": 4096, "max_input_len": 2048}}


def _plan(base: str, model, **over):
    raw = load_raw(base)
    raw.pop("gate", None)
    return P.evaluate(validate_profile(deep_merge(raw, deep_merge(COMMON, over)), "test"), model)


@pytest.fixture(scope="module")
def fp8_8b():
    return _plan("fp8-h100", M8)


def test_8b_fp8_h100_pinned_and_recomputed(fp8_8b):
    e = PF.of_plan(fp8_8b, PF.Workload(1000, 1000))
    mem, t = fp8_8b.memory, PF.of_plan(fp8_8b, PF.Workload(1000, 1000))["terms"]
    # the runtime's batch: KV capacity over the tokens max_utilization reserves (input + output/2, whole blocks)
    assert e["reserved_tokens_per_sequence"] == 1504 and e["batch"] == e["kv_limited_batch"] == mem.kv_tokens_capacity // 1504 == 664
    g = resolve_gpu("h100")
    w = mem.weight_bytes_per_gpu - mem.weight_breakdown.embedding
    kv = 664 * 1500 * mem.kv_bytes_per_token
    assert t["step_memory_s"] == pytest.approx(w / (g.bandwidth_gbs * 1e9 * PF.BW_EFF["Hopper"])
                                               + kv / (g.bandwidth_gbs * 1e9 * PF.KV_BW_EFF))
    assert t["step_overhead_s"] == pytest.approx(PF.STEP_OVERHEAD_S + 32 * PF.STEP_OVERHEAD_PER_LAYER_S + 664 * PF.STEP_OVERHEAD_PER_SEQ_S)
    assert t["step_s"] == pytest.approx(max(t["step_memory_s"], t["step_compute_s"]) + t["step_overhead_s"])
    assert t["step_allreduce_s"] == 0 and t["step_dequant_s"] == 0 and e["decode_bound"] == "memory"
    per = 664 * 1000 / (664 * t["prefill_s"] + 1000 * t["step_s"])
    assert e["output_tokens_per_s_per_replica"] == pytest.approx(per, abs=0.1)
    assert (e["output_tokens_per_s_per_gpu"], e["ttft_s"], e["ttft_p99_s"], e["tpot_s"]) == (13526.1, 0.0539, 0.0827, 0.04909)
    assert e["ranges"]["output_tokens_per_s_per_gpu"] == [9468.3, 22994.4]
    assert e["ranges"]["tpot_s"] == [0.02888, 0.07013]


def test_concurrency_request_rate_and_tp_allreduce(fp8_8b):
    rate = PF.of_plan(fp8_8b, PF.Workload(1000, 1000, request_rate=50))
    assert rate["requests_per_s_per_replica"] == 13.526 and rate["replicas_needed"] == math.ceil(50 / 13.526) == 4
    tp2 = _plan("fp8-h100", M70, parallel={"tp_size": 2}, deployment={"gpus_per_replica": 2})
    e = PF.of_plan(tp2, PF.Workload(1000, 1000, concurrency=64))
    link = interconnect(resolve_gpu("h100"))
    assert (link.kind, link.gbs, e["interconnect"]["gbs"]) == ("NVLink 4", 450.0, 450.0)
    ring = 2 * 80 * (link.latency_us * 1e-6 + 2 * 1 / 2 * 64 * 8192 * 2 / (450e9 * PF.ALLREDUCE_EFF))
    assert e["terms"]["step_allreduce_s"] == pytest.approx(ring) == pytest.approx(0.0020257, rel=1e-4)
    assert (e["batch"], e["output_tokens_per_s_per_gpu"], e["ttft_s"], e["tpot_s"]) == (64, 1152.9, 0.1052, 0.02776)


def test_weight_only_formats_pay_for_dequantization():
    awq = _plan("int4-awq-a100", M8, target={"gpu": "h100"})
    e = PF.of_plan(awq, PF.Workload(1000, 1000, concurrency=8))
    assert PF.dequantizes(awq.profile) and e["factors"]["gemm_eff"] == pytest.approx(PF.GEMM_EFF["bf16"] * PF.DEQUANT_EFF)
    from precision_pipeline.resolve.estimate import gemm_params_per_gpu

    assert e["terms"]["step_dequant_s"] == pytest.approx(8 * gemm_params_per_gpu(M8, 1, 1) / PF.DEQUANT_ELEMS_PER_S)
    assert e["output_tokens_per_s_per_gpu"] == 1114.4
    assert not PF.dequantizes(_plan("fp8-h100", M8).profile)


def test_workload_refusals(fp8_8b):
    for kw, flag in (({"input_len": 0}, "--input-len"), ({"output_len": True}, "--output-len"),
                     ({"concurrency": 4, "request_rate": 1.0}, "--concurrency"), ({"request_rate": float("nan")}, "--request-rate"),
                     ({"concurrency": 0}, "--concurrency")):
        with pytest.raises(UserError) as ei:
            PF.Workload(**kw)
        assert ei.value.problems[0].field == flag
    with pytest.raises(UserError, match="max_seq_len"):
        PF.of_plan(fp8_8b, PF.Workload(3000, 2000))
    assert PF.Workload().describe().startswith("input 1,000 / output 1,000 tokens, as many sequences")


def _planner():
    spec = importlib.util.spec_from_file_location("planner", ROOT / "benchmarks" / "planner.py")
    mod = importlib.util.module_from_spec(spec)
    import sys

    sys.modules["planner"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def planner_results():
    pl = _planner()
    return pl, pl.evaluate()


def test_planner_table_has_its_sources_and_the_medians_meet_the_bar(planner_results):
    pl, res = planner_results
    assert len(res) == 162 and all(r.source and r.measured > 0 for r, _, _ in res)
    med, lo, hi = pl._geo_spread([q for _, _, q in res])
    assert 0.8 <= med <= 1.3 and med == pytest.approx(0.941, abs=0.005)
    groups = pl.groups(res)
    assert len(groups) == 11 and all(0.6 <= g[0] <= 1.6 for g in groups.values())
    # RANGE is honest: every row's measurement (estimate / ratio) lies within [estimate x 0.6, estimate x 1.7]
    assert PF.RANGE[0] <= 1 / hi and 1 / lo <= PF.RANGE[1]


def test_planner_format_and_tp_order_as_measured(planner_results):
    pl, res = planner_results
    orders = pl.order_checks(res)
    # BF16 / FP8 / INT4 AWQ / W4A8 AWQ per GPU at each batch, as measured on H200
    assert orders["formats"] == (28, 28, [])
    # per-GPU throughput across tp 1/2/4/8 of Llama 3.1 70B at each workload, H100 and H200
    assert orders["tp"] == (83, 83, [])
