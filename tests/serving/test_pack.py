"""Pack: templates render completely, parse with the Triton 2.51 schema, and cross-check an engine config."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from precision_pipeline.serving import pack, templates
from precision_pipeline.core.errors import UserError
from precision_pipeline.spec.profile import load_profile, shipped_profiles
from precision_pipeline.spec.routing import routing_table

MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja")


def make_plan(profile, **over):
    """A typed ResolvedPlan of ``profile`` on the default model, with the limits the profile states
    (1024 / 8192 / 8192 where it leaves them out) and a KV capacity of 262144 tokens.
    ``over``: plan fields replaced as given (e.g. ``limits=...``)."""
    from precision_pipeline.resolve import plan as P
    from precision_pipeline.spec.default_model import ensure_default_model

    b = profile.build
    base = P.evaluate(profile, ensure_default_model())
    plan = base.model_copy(update={
        "limits": base.limits.model_copy(update={
            "max_batch_size": b.max_batch_size, "max_input_len": b.max_input_len or 1024,
            "max_seq_len": b.max_seq_len or 8192, "max_num_tokens": b.max_num_tokens or 8192,
            "max_beam_width": b.max_beam_width}),
        "memory": base.memory.model_copy(update={"kv_tokens_capacity": 262144}),
    })
    return plan.model_copy(update=over)


def with_limits(plan, **limits):
    """``plan`` with some limits replaced (the plan is frozen)."""
    return plan.model_copy(update={"limits": plan.limits.model_copy(update=limits)})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir) -> Path:
    """The tokenizer/config files of the default model (no weights: pack never reads them)."""
    d = tmp_path_factory.mktemp("model")
    for name in MODEL_FILES:
        src = Path(default_model_dir) / name
        if src.is_file():
            (d / name).write_bytes(src.read_bytes())
    return d


@pytest.fixture
def ckpt(tmp_path) -> Path:
    d = tmp_path / "checkpoint"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architecture": "LlamaForCausalLM", "dtype": "bfloat16"}))
    return d


def do_pack(tmp_path, model_dir, ckpt, profile_name="fp8-h100", plan=None, repo_root=None, engine_built=False,
            engine_dir=None):
    prof = load_profile(profile_name)
    out = tmp_path / "out"
    return pack.pack_repository(plan or make_plan(prof), prof, model_dir, ckpt, engine_dir or (out / "engine"), engine_built,
                                out / "model_repository", repo_root or str(out)), out


def test_pack_renders_and_parses(tmp_path, model_dir, ckpt):
    res, out = do_pack(tmp_path, model_dir, ckpt, repo_root="/srv/llm")
    repo = out / "model_repository"
    assert res.engine_present is False and any("engine absent" in n for n in res.notes)
    assert res.engine_unit == pack.unit_name(res.unit_key) and pack.is_unit(res.engine_unit)
    assert sorted(res.models) == sorted([*pack.FIXED_MODELS, res.engine_unit])
    cfgs = pack.check_repository(repo)
    assert set(cfgs) == set(res.models)
    for m in res.models:
        text = (repo / m / "config.pbtxt").read_text()
        assert "${" not in text
    trt = pack.config_params(cfgs[res.engine_unit])
    assert cfgs[res.engine_unit].backend == "tensorrtllm"
    assert trt["gpt_model_path"] == f"/srv/llm/model_repository/{res.engine_unit}/engine"
    assert trt["gpt_model_type"] == "inflight_fused_batching"
    assert trt["kv_cache_free_gpu_mem_fraction"] == "0.9"
    assert trt["max_tokens_in_paged_kv_cache"] == "262144"
    assert trt["enable_kv_cache_reuse"] == "true" and trt["enable_chunked_context"] == "true"
    assert trt["batch_scheduler_policy"] == "max_utilization"
    assert trt["exclude_input_in_output"] == "true" and trt["gpu_device_ids"] == "0"
    assert trt["cpu_reference"] == "true"
    assert cfgs[res.engine_unit].max_batch_size == 64
    assert cfgs[res.engine_unit].model_transaction_policy.decoupled is False
    pre = pack.config_params(cfgs["preprocessing"])
    assert pre["tokenizer_dir"] == "/srv/llm/model_repository/preprocessing/tokenizer"
    # SmolLM2: end/pad from generation_config (<|im_end|> = 2), not the tokenizer's eos (<|im_start|>).
    assert (pre["end_id"], pre["pad_id"]) == ("2", "2")
    assert pre["apply_chat_template"] == "true" and pre["add_special_tokens"] == "false"
    assert json.loads(pre["stop_words"]) == []
    assert res.chat_template_applied_by == "preprocessing"
    ens = cfgs["ensemble"]
    assert [s.model_name for s in ens.ensemble_scheduling.step] == ["preprocessing", res.engine_unit, "postprocessing"]
    assert pack.config_params(cfgs["tensorrt_llm_bls"])["tensorrt_llm_model_name"] == res.engine_unit
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        assert (repo / "preprocessing" / "tokenizer" / name).is_file()
    ref = json.loads((repo / res.engine_unit / "engine" / pack.CPU_REFERENCE_FILE).read_text())
    assert ref["engine_present"] is False and ref["checkpoint_dir"] == "checkpoint"
    assert (repo / res.engine_unit / "engine" / "checkpoint" / "config.json").is_file()
    assert json.loads((repo / pack.PACK_FILE).read_text())["engine_unit"] == res.engine_unit


@pytest.mark.parametrize("name", shipped_profiles())
def test_every_shipped_profile_packs(tmp_path, model_dir, ckpt, name):
    res, out = do_pack(tmp_path, model_dir, ckpt, profile_name=name)
    cfgs = pack.check_repository(out / "model_repository")
    prof = load_profile(name)
    assert cfgs[res.engine_unit].max_batch_size == prof.build.max_batch_size
    assert pack.config_params(cfgs[res.engine_unit])["gpu_device_ids"] == ",".join(map(str, range(prof.world_size)))
    table = out / "model_repository" / res.engine_unit / pack.ROUTING_FILE  # the routing table travels with the unit
    assert (json.loads(table.read_text()) if table.exists() else None) == (
        routing_table(prof.routing) if prof.routing else None)
    assert (pack.ROUTING_FILE in res.unit_files) == (prof.routing is not None)


def test_misspelt_parameter_is_an_error():
    tmpl = 'name: "x"\nparameters { key: "a" value: { string_value: "${tokenizer_dir}" } }\n'
    with pytest.raises(UserError) as e:
        pack.render_template(tmpl, {"tokenizer_dri": "/t"}, "x/config.pbtxt")
    msg = str(e.value)
    assert "parameter 'tokenizer_dri': is not in the template" in msg and "did you mean 'tokenizer_dir'" in msg
    assert "${tokenizer_dir}: is not filled" in msg


def test_unfilled_placeholder_in_real_template_is_an_error(model_dir):
    prof = load_profile("bf16-h100")
    params, _ = pack.compute_params(make_plan(prof), prof, model_dir, "ab" * 32, "/r")
    del params["tensorrt_llm"]["kv_cache_free_gpu_mem_fraction"]
    with pytest.raises(UserError, match=r"kv_cache_free_gpu_mem_fraction\}: is not filled"):
        pack.render_all(params)
    params, _ = pack.compute_params(make_plan(prof), prof, model_dir, "ab" * 32, "/r")
    params["preprocessing"]["max_queue_dealy_microseconds"] = 5
    with pytest.raises(UserError, match="did you mean 'max_queue_delay_microseconds'"):
        pack.render_all(params)


def test_config_that_does_not_parse_is_an_error(model_dir):
    prof = load_profile("bf16-h100")
    params, _ = pack.compute_params(make_plan(prof), prof, model_dir, "ab" * 32, "/r")
    params["tensorrt_llm"]["logits_datatype"] = "TYPE_FP33"
    with pytest.raises(UserError) as e:
        pack.render_all(params)
    assert "does not parse as a Triton 2.51 ModelConfig" in str(e.value) and "TYPE_FP33" in str(e.value)
    with pytest.raises(UserError, match="does not parse"):
        pack.parse_model_config('name: "x"\nmodel_metrics {}\n', "x")  # a 2.73-only field: not in the 2.51 schema


def test_quotes_in_values_are_escaped(model_dir):
    text = pack.render_template('parameters { key: "s" value: { string_value: "${stop_words}" } }\n',
                                {"stop_words": json.dumps(["</s>", 'a"b\\c'])}, "x")
    cfg = pack.parse_model_config(text, "x")
    assert json.loads(pack.config_params(cfg)["s"]) == ["</s>", 'a"b\\c']


def test_streaming_needs_decoupled(tmp_path, model_dir, ckpt):
    prof = load_profile("bf16-h100")
    prof.runtime.streaming = True
    with pytest.raises(UserError, match="decoupled_mode"):
        pack.pack_repository(make_plan(prof), prof, model_dir, ckpt, tmp_path / "e", False, tmp_path / "r", str(tmp_path))
    prof.runtime.decoupled_mode = True
    res = pack.pack_repository(make_plan(prof), prof, model_dir, ckpt, tmp_path / "e", False, tmp_path / "r", str(tmp_path))
    cfgs = pack.check_repository(tmp_path / "r")
    assert cfgs[res.engine_unit].model_transaction_policy.decoupled is True
    assert cfgs["tensorrt_llm_bls"].model_transaction_policy.decoupled is True


def test_relative_repo_root_refused(tmp_path, model_dir, ckpt):
    with pytest.raises(UserError, match="absolute"):
        do_pack(tmp_path, model_dir, ckpt, repo_root="srv/llm")


def test_engine_hash_follows_checkpoint_and_plan(tmp_path, model_dir, ckpt):
    prof = load_profile("fp8-h100")
    h1 = pack.engine_hash_of(make_plan(prof), ckpt, tmp_path / "e", False)
    assert h1 == pack.engine_hash_of(make_plan(prof), ckpt, tmp_path / "e", False)
    plan2 = with_limits(make_plan(prof), max_batch_size=8)
    assert pack.engine_hash_of(plan2, ckpt, tmp_path / "e", False) != h1
    (ckpt / "rank0.safetensors").write_bytes(b"x")
    assert pack.engine_hash_of(make_plan(prof), ckpt, tmp_path / "e", False) != h1


# ---- cross-check against a synthetic engine config.json (never a fake engine file)


def engine_config(world=1, paged_ctx=True, kv_type="PAGED", logits="float32", max_batch=64, beam=1) -> dict:
    return {
        "version": "1.2.0",
        "pretrained_config": {"architecture": "LlamaForCausalLM", "dtype": "bfloat16", "logits_dtype": logits,
                              "mapping": {"world_size": world, "tp_size": world, "pp_size": 1}},
        "build_config": {"max_batch_size": max_batch, "max_input_len": 4096, "max_seq_len": 8192, "max_num_tokens": 8192,
                         "max_beam_width": beam, "kv_cache_type": kv_type,
                         "plugin_config": {"use_paged_context_fmha": paged_ctx, "paged_kv_cache": kv_type == "PAGED"}},
    }


@pytest.fixture
def trt_params(model_dir):
    prof = load_profile("fp8-h100")
    params, _ = pack.compute_params(make_plan(prof), prof, model_dir, "cd" * 32, "/r")
    return {k: templates.pbtxt_text(v) for k, v in params["tensorrt_llm"].items()}


def test_cross_check_consistent(trt_params):
    assert pack.cross_check_engine(engine_config(), trt_params) == []


@pytest.mark.parametrize("cfg,rule", [
    (engine_config(world=2), "pack.world_size"),
    (engine_config(paged_ctx=False), "pack.enable_kv_cache_reuse"),
    (engine_config(kv_type="CONTINUOUS"), "pack.enable_kv_cache_reuse"),
    (engine_config(logits="float16"), "pack.logits_dtype"),
    (engine_config(max_batch=8), "pack.max_batch_size"),
])
def test_cross_check_finds(cfg, rule, trt_params):
    rules = [p.rule for p in pack.cross_check_engine(cfg, trt_params)]
    assert rule in rules


def test_cross_check_plan_limits():
    prof = load_profile("fp8-h100")
    cfg = engine_config()
    cfg["build_config"]["max_seq_len"] = 4096
    probs = pack.cross_check_plan(cfg, make_plan(prof))
    assert [p.field for p in probs] == ["engine/config.json: build_config.max_seq_len"]


def test_pack_with_contradicting_engine_fails_and_keeps_old_output(tmp_path, model_dir, ckpt):
    res, out = do_pack(tmp_path, model_dir, ckpt)
    before = (out / "model_repository" / "ensemble" / "config.pbtxt").read_text()
    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "config.json").write_text(json.dumps(engine_config(world=2, logits="float16")))
    with pytest.raises(UserError) as e:
        do_pack(tmp_path, model_dir, ckpt, engine_built=True, engine_dir=eng)
    assert "world_size" in str(e.value) and "logits_dtype" in str(e.value)
    assert (out / "model_repository" / "ensemble" / "config.pbtxt").read_text() == before
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]


def test_pack_with_engine_config_but_no_rank_file_fails(tmp_path, model_dir, ckpt):
    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "config.json").write_text(json.dumps(engine_config()))
    with pytest.raises(UserError, match="rank0.engine"):
        do_pack(tmp_path, model_dir, ckpt, engine_built=True, engine_dir=eng)


# ---- which side applies the chat template: preprocessing (server), same text as transformers


@pytest.fixture(scope="module")
def preprocessing_module():
    stub = types.ModuleType("triton_python_backend_utils")
    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = stub
    import importlib.util

    spec = importlib.util.spec_from_file_location("_pre_model", pack.TEMPLATES_DIR / "preprocessing" / "1" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    yield mod
    if saved is None:
        sys.modules.pop("triton_python_backend_utils", None)
    else:
        sys.modules["triton_python_backend_utils"] = saved


def test_preprocessing_chat_template_matches_transformers(preprocessing_module, model_dir):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special = {k: v for k, v in json.loads((model_dir / "tokenizer_config.json").read_text()).items()
               if k.endswith("_token") and isinstance(v, str)}
    tmpl = (model_dir / "chat_template.jinja").read_text()
    for messages in ([{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, n't ' x ."}]):
        want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        text = preprocessing_module.render_chat(tmpl, messages, special)
        assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert tok.encode(text, add_special_tokens=False).ids == list(want)


def test_otlp_endpoint_is_rendered_into_the_bls_config(model_dir, default_model_dir):
    prof = load_profile("bf16-h100")
    params, _ = pack.compute_params(make_plan(prof), prof, model_dir, "ab" * 32, "/r")
    cfg = pack.parse_model_config(pack.render_all(params)["tensorrt_llm_bls"], "bls")
    got = pack.config_params(cfg)
    assert (got["otlp_traces_url"], got["gen_ai_operation_name"]) == ("", "chat")  # default: no spans; chat template
    traced = prof.model_copy(update={"deployment": prof.deployment.model_copy(update={"otlp_endpoint": "http://c.obs:4318"})})
    params, _ = pack.compute_params(make_plan(traced), traced, model_dir, "ab" * 32, "/r")
    cfg = pack.parse_model_config(pack.render_all(params)["tensorrt_llm_bls"], "bls")
    assert pack.config_params(cfg)["otlp_traces_url"] == "http://c.obs:4318/v1/traces"
    path = pack.precision_path(make_plan(traced), "ab" * 32)  # the facts the span's attributes come from
    assert path["model"] == Path(default_model_dir).name and path["unit"] == "tensorrt_llm_abababababab"


def test_packed_repository_is_readable_by_another_user(tmp_path, model_dir, ckpt):
    """A Triton container running as another user must read every file and list every folder (umask 022);
    files that arrive with 0600 (a checkpoint written by mkstemp, linked into engine/checkpoint) get read bits."""
    import os
    import stat

    (ckpt / "rank0.safetensors").write_bytes(b"\0" * 8)
    os.chmod(ckpt / "rank0.safetensors", 0o600)
    old = os.umask(0o022)
    try:
        _, out = do_pack(tmp_path, model_dir, ckpt)
    finally:
        os.umask(old)
    repo = out / "model_repository"
    unreadable = [str(p.relative_to(repo)) for p in [repo, *repo.rglob("*")]
                  if (stat.S_IMODE(p.stat().st_mode) & (0o005 if p.is_dir() else 0o004)) != (0o005 if p.is_dir() else 0o004)]
    assert unreadable == []


def test_a_pack_cache_hit_checks_the_checkpoint_it_links(tmp_path, model_dir):
    """Pack hard-links the build's own checkpoint into its unit; a cache hit of pack checks its folder against
    the stage record (sizes and content samples, core/stage.py), so a checkpoint truncated in place after the
    build re-packs (and pack.json's unit_files then records what is there now) instead of saying cached."""
    import os
    import types

    from precision_pipeline.core.stage import Done, Manifest, StageRecord, StageRunner
    from precision_pipeline.serving.stage import PackStage

    out = tmp_path / "out"
    ck = out / "checkpoint"
    ck.mkdir(parents=True)
    (ck / "config.json").write_text('{"architecture": "LlamaForCausalLM"}')
    (ck / "rank0.safetensors").write_bytes(os.urandom(200_000))
    prof = load_profile("bf16-h100")
    done = {"quantize": Done(artifact=types.SimpleNamespace(), key="a" * 64, dir=ck, record=StageRecord("quantize")),
            "engine": Done(artifact=types.SimpleNamespace(built=False), key="b" * 64, dir=out / "engine",
                           record=StageRecord("engine"))}
    request = types.SimpleNamespace(model_dir=model_dir, repo_root=str(out), out_dir=out, image="")

    def run():
        r = StageRunner(out, Manifest(out / "manifest.json", profile=prof.name, profile_source="", model_dir="", out_dir=str(out)))
        return r, r.run(PackStage(), make_plan(prof), request, done)

    assert run()[1].record.status == "done"
    assert run()[1].record.status == "cached"
    os.truncate(ck / "rank0.safetensors", 1000)
    r, d = run()
    assert d.record.status == "done" and "rank0.safetensors is 1,000 bytes" in r.not_reused["pack"]
    pj = json.loads((out / "model_repository" / pack.PACK_FILE).read_text())
    assert pj["unit_files"]["engine/checkpoint/rank0.safetensors"][0] == 1000
