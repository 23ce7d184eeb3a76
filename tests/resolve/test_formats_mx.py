"""Issue 29, the MX formats at resolve: which route, TensorRT-LLM line and SM take W4A16_MXFP4, W4A8_MXFP4_FP8,
W4A8_MXFP4_MXFP8 and MXFP8 (spec/capability.py), the refusals naming where each is supported, and the quantize
stage's own refusal (it exports no MX format; a given checkpoint passes)."""

from __future__ import annotations

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.resolve.plan import evaluate
from precision_pipeline.spec import capability as C
from tests.resolve.test_route_llm_api import MODEL, _prof


def _mx(algo, route="llm_api", gpu="h100-sxm", version="1.2.1", **upd):
    return _prof(quantization__quant_algo=algo, quantization__kv_cache_quant_algo="NONE", route=route,
                 target__gpu=gpu, target__trtllm_version=version, **upd)


def _problems(plan):
    return {(p.rule, p.field): p for p in plan.problems}


def test_capability_rows_of_the_mx_formats():
    assert C.runnable("llm_api", "1.2.1", "gemm", 90)[-2:] == ["W4A16_MXFP4", "MIXED_PRECISION"]
    assert [a for a in C.runnable("llm_api", "1.2.1", "gemm", 100) if "MX" in a] == ["W4A8_MXFP4_FP8", "W4A8_MXFP4_MXFP8"]
    assert [a for a in C.runnable("llm_api", "1.2.1", "gemm", 120) if "MX" in a] == ["W4A8_MXFP4_MXFP8"]
    assert [a for a in C.runnable("llm_api", "1.3.0rc29", "gemm", 103) if "MX" in a] == [
        "W4A8_MXFP4_FP8", "W4A8_MXFP4_MXFP8", "MXFP8"]
    assert not [a for sm in (90, 100, 120) for a in C.runnable("engine", "1.2.1", "gemm", sm) if "MX" in a]
    assert C.where_supported("gemm", "W4A16_MXFP4") == "route llm_api (TensorRT-LLM 1.2, 1.3) on SM 90"
    assert C.where_supported("gemm", "MXFP8") == "route llm_api (TensorRT-LLM 1.3) on SM 100 or 103"


def test_engine_route_refuses_mxfp4_naming_the_llm_api_route():
    pr = _problems(evaluate(_mx("W4A16_MXFP4", route="engine"), MODEL))[
        ("format.trtllm_buildable", "quantization.quant_algo")]
    assert "PyTorch backend only" in pr.reason
    assert pr.fix.startswith("W4A16_MXFP4 runs on route llm_api (TensorRT-LLM 1.2, 1.3) on SM 90")


@pytest.mark.parametrize("algo,gpu,ok", [
    ("W4A16_MXFP4", "h100-sxm", True), ("W4A16_MXFP4", "b200", False), ("W4A16_MXFP4", "a100-80gb", False),
    ("W4A8_MXFP4_FP8", "b200", True), ("W4A8_MXFP4_FP8", "h100-sxm", False),
    ("W4A8_MXFP4_MXFP8", "b200", True), ("W4A8_MXFP4_MXFP8", "h100-sxm", False),
])
def test_llm_api_sm_of_each_mxfp4_algo(algo, gpu, ok):
    found = _problems(evaluate(_mx(algo, gpu=gpu), MODEL))
    if ok:
        assert found == {}
        return
    pr = found[("format.gemm_sm", "quantization.quant_algo")]
    assert "llm_api route" in pr.reason and f"{algo} itself runs on route llm_api" in pr.fix, pr.render()


def test_mxfp8_needs_the_1_3_line():
    pr = _problems(evaluate(_mx("MXFP8", gpu="b200"), MODEL))[("format.trtllm_buildable", "quantization.quant_algo")]
    assert "not taken by the llm_api route with TensorRT-LLM 1.2.1" in pr.reason
    assert pr.fix.startswith("MXFP8 runs on route llm_api (TensorRT-LLM 1.3) on SM 100 or 103")
    assert _problems(evaluate(_mx("MXFP8", gpu="b200", version="1.3.0rc29"), MODEL)) == {}


def test_a_build_needs_a_given_mx_checkpoint(tmp_path):
    plan = evaluate(_mx("W4A16_MXFP4"), MODEL, for_build=True)
    pr = _problems(plan)[("quantize.modelopt_inputs", "quantization.quant_algo")]
    assert "does not produce MX formats" in pr.reason and "--checkpoint" in pr.fix
    assert evaluate(_mx("W4A16_MXFP4"), MODEL).ok  # planning (profiles, compare) needs no export


def test_mx_block_is_fixed_at_32():
    pr = _problems(evaluate(_mx("W4A8_MXFP4_MXFP8", gpu="b200", quantization__group_size=16), MODEL))[
        ("format.group_size", "quantization.group_size")]
    assert pr.reason == "W4A8_MXFP4_MXFP8 uses a fixed block of 32 elements; got 16."


def test_modelopt_w4a4_mxfp4_name_is_refused_with_the_trtllm_names():
    with pytest.raises(UserError) as e:
        _mx("MXFP4_DEFAULT_CFG")
    pr = e.value.problems[0]
    assert pr.field == "quantization.quant_algo" and "not a TensorRT-LLM QuantAlgo" in pr.reason
    assert "W4A16_MXFP4 (SM 90)" in pr.fix
