"""Issue 28, the LLM-API route at resolve: the TorchLlmArgs field list, the route x TensorRT-LLM line x SM x format
table (spec/capability.py), the refusals and their alternatives, the runtime KV dtype, engine-only settings."""

from __future__ import annotations

import time

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.resolve.plan import evaluate
from precision_pipeline.spec import capability as C
from precision_pipeline.spec.default_model import model_dir
from precision_pipeline.spec.llm_args import LINES, check_llm_args, llm_args_problems, trtllm_line
from precision_pipeline.spec.profile import load_profile, validate_profile

MODEL = model_dir(None)


def _prof(name="fp8-h100-llmapi", **upd):
    data = load_profile(name).model_dump(mode="json", exclude_unset=True)
    for k, v in upd.items():
        cur = data
        *path, last = k.split("__")
        for p in path:
            cur = cur.setdefault(p, {})
        cur[last] = v
    return validate_profile(data)


def _problems(plan):
    return {(p.field, p.rule): p for p in plan.problems}


def test_versions_map_to_lines_and_unknown_versions_are_refused():
    assert trtllm_line("1.2.1") == "1.2" and trtllm_line("1.3.0rc29") == "1.3"
    for bad in ("1.4.0", "1.3.0", "2.0", "latest", "1.2"):
        with pytest.raises(ValueError):
            trtllm_line(bad)
    with pytest.raises(UserError) as e:
        _prof(target__trtllm_version="1.4.0rc4")
    assert e.value.problems[0].field == "target.trtllm_version" and "1.3.0rc" in e.value.problems[0].fix


def test_check_llm_args_did_you_mean_and_legacy_replacements():
    with pytest.raises(UserError) as e:
        check_llm_args({"max_num_token": 1}, "1.2.1")
    assert e.value.problems[0].field == "llm_api.max_num_token" and "'max_num_tokens'" in e.value.problems[0].fix
    cases = {"kv_cache_free_gpu_mem_fraction": "kv_cache_config.free_gpu_memory_fraction",
             "enable_kv_cache_reuse": "kv_cache_config.enable_block_reuse",
             "enable_chunked_context": "enable_chunked_prefill", "tp_size": "tensor_parallel_size"}
    for old, new in cases.items():
        (pr,) = llm_args_problems({old: 1}, "1.3.0rc29")
        assert pr.fix == f"use {new}.", (old, pr)
    (pr,) = llm_args_problems({"use_paged_context_fmha": True}, "1.2.1")
    assert "runtime chooses" in pr.reason and pr.fix == "remove it."
    (pr,) = llm_args_problems({"kv_cache_config": {"free_gpu_mem_fraction": 0.5}}, "1.2.1")
    assert pr.field == "llm_api.kv_cache_config.free_gpu_mem_fraction" and "free_gpu_memory_fraction" in pr.fix
    (pr,) = llm_args_problems({"kv_cache_config": {"dtype": "int8"}}, "1.2.1")
    assert "no INT8 KV cache" in pr.reason
    assert llm_args_problems({"cuda_graph_config": {"enable_padding": True}, "max_input_len": 8}, "1.2.1") == []
    (pr,) = llm_args_problems({"cuda_graph_config": {"enable_paddin": True}}, "1.2.1")  # hostile s9 F3
    assert pr.field == "llm_api.cuda_graph_config.enable_paddin" and pr.fix == "did you mean 'enable_padding'?"
    assert llm_args_problems({"cuda_graph_config": {"batch_sizes": [1, 8], "max_batch_size": 8}}, "1.3.0rc29") == []


def test_the_profile_llm_api_section_is_checked_at_resolve():
    plan = evaluate(_prof(llm_api={"enable_kv_cache_reuse": False}), MODEL)
    pr = _problems(plan)[("llm_api.enable_kv_cache_reuse", "llm_api.args")]
    assert pr.fix == "use kv_cache_config.enable_block_reuse."
    plan = evaluate(_prof(llm_api={"max_batch_size": 8}), MODEL)  # one home: build.max_batch_size
    assert _problems(plan)[("llm_api.max_batch_size", "llm_api.args")].fix == "set build.max_batch_size instead."
    plan = evaluate(_prof("fp8-h100", llm_api={"cuda_graph_config": {}}), MODEL)
    assert ("llm_api", "llm_api.args") in _problems(plan)  # engine route: the section would be ignored


def test_llm_api_keys_that_serve_something_ungated_are_refused():
    """Hostile s9 F1: ``llm_api: {backend: tensorrt}`` replaced model.yaml's ``backend: pytorch``; model, tokenizer,
    env_overrides (LD_PRELOAD) and the like passed ``invoke check`` too."""
    from precision_pipeline.spec.llm_args import NOT_GATED

    extra = {"backend": "tensorrt", "model": "/etc/passwd", "tokenizer": "/etc", "env_overrides": {"LD_PRELOAD": "/x.so"},
             "dtype": "float16", "trust_remote_code": True, "cuda_graph_config": {"enable_padding": True}}
    found = {f: p for (f, r), p in _problems(evaluate(_prof(llm_api=extra), MODEL)).items() if r == "llm_api.args"}
    assert set(found) == {f"llm_api.{k}" for k in extra if k != "cuda_graph_config"}
    pr = found["llm_api.backend"]
    assert pr.reason == ("would serve something other than what the gate measured: route llm_api serves on the PyTorch "
                         "backend (model.yaml's backend: pytorch); another backend is another route.")
    assert pr.fix.startswith("remove it; to serve another model or checkpoint, build a profile for it")
    assert {"model", "backend", "tokenizer", "env_overrides", "revision", "load_format", "lora_config"} <= set(NOT_GATED)


def test_trtllm_serve_on_the_engine_route_is_refused():
    """Hostile s9 F4: ``deployment.server: trtllm-serve`` on route engine passed check; the build rendered Triton."""
    pr = _problems(evaluate(_prof("fp8-h100", deployment__server="trtllm-serve"), MODEL))[
        ("deployment.server", "deployment.server")]
    assert pr.reason.startswith("trtllm-serve serves the llm_api route only") and "route: llm_api" in pr.fix
    assert ("deployment.server", "deployment.server") not in _problems(evaluate(_prof(), MODEL))  # llm_api: served


@pytest.mark.parametrize("name,field,alt", [
    ("int8-sq-l4", "quantization.quant_algo", "FP8"),
    ("fp8-h100", "quantization.kv_cache_quant_algo", "FP8"),
])
def test_int8_smoothquant_and_int8_kv_are_refused_on_llm_api_with_the_alternatives_in_under_a_second(name, field, alt):
    upd = {"route": "llm_api"}
    if field.endswith("kv_cache_quant_algo"):
        upd["quantization__kv_cache_quant_algo"] = "INT8"
    prof = _prof(name, **upd)
    t0 = time.perf_counter()
    plan = evaluate(prof, MODEL, for_build=True)
    took = time.perf_counter() - t0
    pr = next(p for p in plan.problems if p.field == field and p.rule in ("format.gemm_sm", "format.kv_sm"))
    assert "llm_api route" in pr.reason and alt in pr.fix and "route: engine" in pr.fix, pr.render()
    assert took < 1.0, took
    # the same profile on the engine route: SmoothQuant on SM 89 passes the format rule
    if name == "int8-sq-l4":
        assert not [p for p in evaluate(_prof(name), MODEL).problems if p.rule == "format.gemm_sm"]


def test_capability_table_rows_have_sources_and_the_engine_rows_are_the_registry():
    from precision_pipeline.spec import formats as F

    assert all(r.source for r in C.TABLE)
    for f in F.GEMM.values():
        assert C.row("engine", "1.2.1", "gemm", f.algo).sm == f.builds_on
    assert C.supports("llm_api", "1.2.1", "gemm", "FP8", 90) and not C.supports("llm_api", "1.2.1", "gemm", "FP8", 80)
    assert not C.supports("llm_api", "1.3.0rc29", "gemm", "W8A8_SQ_PER_CHANNEL", 89)
    assert C.supports("engine", "1.2.1", "gemm", "W8A8_SQ_PER_CHANNEL", 89)
    assert not C.supports("llm_api", "1.2.1", "gemm", "W4A16_AWQ", 100)  # not listed for Blackwell
    assert not C.supports("engine", "1.3.0rc29", "gemm", "FP8", 90)  # no trtllm-build on 1.3
    assert C.runnable("llm_api", "1.2.1", "kv", 80) == ["NONE", "FP8"]


def test_engine_route_on_1_3_is_refused_and_llm_api_on_1_3_resolves():
    plan = evaluate(_prof("fp8-h100", target__trtllm_version="1.3.0rc29"), MODEL)
    # the one reason (hostile s9 F2: "FP8 GEMMs need SM >= 89; h100-sxm is SM 90" came first, from no table row)
    assert [(p.field, p.rule) for p in plan.problems] == [("target.trtllm_version", "route.trtllm_version")]
    plan = evaluate(_prof(target__trtllm_version="1.3.0rc29"), MODEL)
    assert plan.ok and plan.trtllm_version == "1.3.0rc29" and plan.route == "llm_api"
    assert plan.to_json()["route"] == "llm_api"


@pytest.mark.parametrize("dtype,ok", [("auto", True), ("fp8", True), ("nvfp4", False)])
def test_a_runtime_kv_dtype_must_equal_the_checkpoints(dtype, ok):
    plan = evaluate(_prof(llm_api={"kv_cache_config": {"dtype": dtype}}), MODEL)
    assert (("llm_api.kv_cache_config.dtype", "llm_api.kv_dtype") not in _problems(plan)) is ok
    if not ok:
        assert "FP8" in _problems(plan)[("llm_api.kv_cache_config.dtype", "llm_api.kv_dtype")].reason
    bf16_kv = _prof(quantization__kv_cache_quant_algo="NONE", llm_api={"kv_cache_config": {"dtype": "fp8"}})
    assert ("llm_api.kv_cache_config.dtype", "llm_api.kv_dtype") in _problems(evaluate(bf16_kv, MODEL))


def test_engine_only_settings_runtime_chosen_are_recorded_and_the_rest_refused():
    plan = evaluate(_prof(), MODEL)
    (w,) = [c for c in plan.checks if c["rule"] == "llm_api.engine_settings"]
    assert w["status"] == "warn" and "context_phase.use_fp8_context_fmha: True" in w["message"]
    plan = evaluate(_prof(build__gather_context_logits=True, build__kv_cache_type="continuous"), MODEL)
    got = _problems(plan)
    assert ("build.gather_context_logits", "llm_api.engine_settings") in got
    assert ("build.kv_cache_type", "llm_api.engine_settings") in got
    # the engine-only builder rules do not run on llm_api (they model trtllm-build)
    assert not [c for c in plan.checks if c["rule"] in ("context.builder_overrides", "plugins.gemm_plugin")]


def test_chunked_prefill_rule_on_llm_api():
    plan = evaluate(_prof(build__max_num_tokens=1024, context_phase__enable_chunked_context=False), MODEL)
    assert ("build.max_num_tokens", "llm_api.chunked_prefill") in _problems(plan)


def test_every_line_lists_the_fields_the_issue_names():
    for al in LINES.values():
        assert {"max_batch_size", "max_num_tokens", "max_seq_len", "tensor_parallel_size", "pipeline_parallel_size",
                "moe_expert_parallel_size", "kv_cache_config", "enable_chunked_prefill", "return_perf_metrics",
                "otlp_traces_endpoint"} <= al.fields
        assert {"dtype", "free_gpu_memory_fraction", "enable_block_reuse"} <= al.nested["kv_cache_config"]
        assert "build_config" not in al.fields and "TrtLlmArgs" in al.source
