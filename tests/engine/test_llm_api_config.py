"""Issue 28: the LLM-API runtime configuration (engine/llm_api_config.py): every rendered key is a TorchLlmArgs field of
the targeted line, every rendered setting follows its profile field, and the stage writes both files."""

from __future__ import annotations


import pytest
import yaml

from precision_pipeline.core.errors import UserError
from precision_pipeline.engine.llm_api_config import (LlmApiConfigStage, render_llm_args, render_model_yaml)
from precision_pipeline.resolve.plan import resolve
from precision_pipeline.spec.default_model import model_dir
from precision_pipeline.spec.llm_args import RENDERED_FROM, args_list
from precision_pipeline.spec.profile import load_profile, validate_profile

MODEL = model_dir(None)


def _plan(**upd):
    data = load_profile("fp8-h100-llmapi").model_dump(mode="json", exclude_unset=True)
    for k, v in upd.items():
        cur = data
        *path, last = k.split("__")
        for p in path:
            cur = cur.setdefault(p, {})
        cur[last] = v
    return resolve(validate_profile(data), MODEL)


def _keys(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        out.add(prefix + k)
        if isinstance(v, dict) and k in ("kv_cache_config", "scheduler_config"):
            out |= _keys(v, prefix + k + ".")
    return out


@pytest.mark.parametrize("version", ["1.2.1", "1.3.0rc29"])
def test_contract_every_rendered_key_is_a_torchllmargs_field_of_that_line(version):
    plan = _plan(target__trtllm_version=version, deployment__otlp_endpoint="http://otel:4318", build__max_beam_width=2)
    args = render_llm_args(plan)
    al = args_list(version)
    assert set(args) <= al.fields
    for section in ("kv_cache_config", "scheduler_config"):
        assert set(args[section]) <= al.nested[section]
    # what we render is exactly what RENDERED_FROM documents (plus the profile's llm_api extras)
    assert _keys(args) - {"kv_cache_config", "scheduler_config", "cuda_graph_config"} == set(RENDERED_FROM)
    my = render_model_yaml(plan, "/models/ckpt")
    assert set(my) - {"model", "backend", "triton_config"} <= al.fields
    assert my["backend"] == "pytorch" and my["model"] == "/models/ckpt"
    assert my["triton_config"] == {"max_batch_size": 0, "decoupled": False}  # model.py reads both; 0: no Triton batching


def test_defaults_of_the_shipped_llm_api_profile():
    a = render_llm_args(_plan())
    assert a["kv_cache_config"] == {"dtype": "fp8", "free_gpu_memory_fraction": 0.9, "enable_block_reuse": True,
                                    "tokens_per_block": 32}
    assert (a["max_batch_size"], a["max_num_tokens"], a["max_seq_len"], a["max_input_len"]) == (64, 8192, 8192, 4096)
    assert a["return_perf_metrics"] is True and a["enable_chunked_prefill"] is True
    assert a["cuda_graph_config"] == {"enable_padding": True} and "otlp_traces_endpoint" not in a


@pytest.mark.parametrize("upd,path,want", [
    ({"build__max_batch_size": 7}, ("max_batch_size",), 7),
    ({"build__max_num_tokens": 5000}, ("max_num_tokens",), 5000),
    ({"build__max_seq_len": 2048, "build__max_input_len": 1000}, ("max_seq_len",), 2048),
    ({"build__max_input_len": 1000}, ("max_input_len",), 1000),
    ({"build__max_beam_width": 3}, ("max_beam_width",), 3),
    ({"runtime__kv_cache_free_gpu_mem_fraction": 0.55}, ("kv_cache_config", "free_gpu_memory_fraction"), 0.55),
    ({"runtime__enable_kv_cache_reuse": False}, ("kv_cache_config", "enable_block_reuse"), False),
    ({"build__tokens_per_block": 64}, ("kv_cache_config", "tokens_per_block"), 64),
    ({"quantization__kv_cache_quant_algo": "NONE"}, ("kv_cache_config", "dtype"), "auto"),
    ({"context_phase__enable_chunked_context": False, "build__max_num_tokens": 8192}, ("enable_chunked_prefill",), False),
    ({"runtime__batch_scheduler_policy": "guaranteed_no_evict"}, ("scheduler_config", "capacity_scheduler_policy"),
     "GUARANTEED_NO_EVICT"),
    ({"deployment__otlp_endpoint": "http://otel:4318"}, ("otlp_traces_endpoint",), "http://otel:4318/v1/traces"),
    ({"llm_api": {"cuda_graph_config": {"max_batch_size": 16}, "attn_backend": "FLASHINFER"}}, ("attn_backend",),
     "FLASHINFER"),
])
def test_every_rendered_setting_follows_its_profile_field(upd, path, want):
    my = render_model_yaml(_plan(**upd), "/m")
    cur = yaml.safe_load(yaml.safe_dump(my))  # what the file holds
    for p in path:
        cur = cur[p]
    assert cur == want


def test_parallel_sizes_follow_the_mapping():
    plan = _plan()
    plan = plan.model_copy(update={"mapping": plan.mapping.model_copy(update={"tp_size": 2, "pp_size": 2, "moe_tp_size": 1,
                                                                               "moe_ep_size": 2, "world_size": 4})})
    a = render_llm_args(plan)
    assert (a["tensor_parallel_size"], a["pipeline_parallel_size"], a["moe_tensor_parallel_size"],
            a["moe_expert_parallel_size"]) == (2, 2, 1, 2)


def test_decoupled_goes_to_triton_config():
    my = render_model_yaml(_plan(runtime__decoupled_mode=True, runtime__streaming=True), "/m")
    assert my["triton_config"]["decoupled"] is True and "decoupled" not in my


def test_render_refuses_a_key_the_line_does_not_know():
    plan = _plan()
    bad = plan.model_copy(update={"profile": plan.profile.model_copy(update={"llm_api": {"max_num_token": 1}})})
    with pytest.raises(UserError) as e:
        render_llm_args(bad)
    assert "max_num_tokens" in e.value.problems[0].fix


def test_the_stage_writes_both_files_keyed_on_what_it_renders(tmp_path):
    from types import SimpleNamespace

    plan = _plan()
    st = LlmApiConfigStage()
    q = SimpleNamespace(dir=tmp_path / "checkpoint", key="a" * 64)
    req = SimpleNamespace(out_dir=tmp_path)
    inp = st.inputs(plan, req, {"quantize": q})
    work = tmp_path / "work"
    work.mkdir()
    art = st.run(inp, work)
    serve = yaml.safe_load((work / "trtllm-serve.yaml").read_text())
    model = yaml.safe_load((work / "model.yaml").read_text())
    assert serve == render_llm_args(plan) and model["model"] == str(tmp_path / "checkpoint")
    assert (work / "model.yaml").read_text().startswith("# Rendered by precision-pipeline")
    assert art.trtllm_serve_yaml == str((tmp_path / "llm_api" / "trtllm-serve.yaml").resolve())
    assert art.plan_view()["llm_api"]["trtllm_version"] == "1.2.1"
    other = st.inputs(_plan(runtime__kv_cache_free_gpu_mem_fraction=0.5), req, {"quantize": q})
    assert other.llm_args != inp.llm_args  # a rendered change changes the stage's inputs (its key)


@pytest.mark.gpu
def test_the_field_list_matches_the_installed_tensorrt_llm():
    tl = pytest.importorskip("tensorrt_llm", reason="TensorRT-LLM is not installed here (GPU build node only)")
    from tensorrt_llm.llmapi import KvCacheConfig, TorchLlmArgs

    al = args_list(tl.__version__)
    assert set(render_llm_args(_plan(target__trtllm_version=tl.__version__))) <= set(TorchLlmArgs.model_fields)
    assert al.nested["kv_cache_config"] <= set(KvCacheConfig.model_fields)


def test_pipeline_route_llm_api_renders_then_packs_and_deploys():
    from precision_pipeline.pipeline import ROUTES, route_of

    assert route_of(load_profile("fp8-h100-llmapi")) is ROUTES["llm_api"]
    assert [s.name for s in ROUTES["llm_api"].stages] == ["resolve", "quantize", "verify", "gate", "llm_api_config",
                                                           "pack", "deploy"]
    assert [s.output for s in ROUTES["llm_api"].stages][4:] == ["llm_api", "model_repository", "k8s"]
