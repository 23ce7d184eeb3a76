"""The LLM-API unit against the facts of its real consumer (serving/llmapi_contract.py, which cites the upstream
files): the rendered config.pbtxt, the checks of model.yaml, and the packed unit's layout and content key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.store import hash_file
from precision_pipeline.serving import llmapi_contract as C
from precision_pipeline.serving import llmapi_unit as U
from precision_pipeline.serving import pack

MODEL_YAML = {"model": "placeholder", "backend": "pytorch", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
              "max_batch_size": 8, "max_num_tokens": 4096, "kv_cache_config": {"dtype": "fp8"},
              "triton_config": {"max_batch_size": 0, "decoupled": False}}
"""Stands for spec28's render_model_yaml(plan, model_path) until the llm_api_config stage lands (the merge wires it)."""


def _cfg_dict(name="llm_api_0123456789ab"):
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(pack.parse_model_config(U.render_config(name), "x"), preserving_proto_field_name=True)


def test_rendered_config_is_what_the_llmapi_model_expects():
    cfg = pack.parse_model_config(U.render_config("llm_api_0123456789ab"), "x")
    assert cfg.name == "llm_api_0123456789ab" and cfg.backend == "python"  # CONFIG: backend "python"
    assert cfg.max_batch_size == 0 and not cfg.HasField("model_transaction_policy")  # fact 2: model.yaml owns them
    from tritonclient.grpc import model_config_pb2 as M

    assert [(g.count, M.ModelInstanceGroup.Kind.Name(g.kind)) for g in cfg.instance_group] == [(1, "KIND_CPU")]

    got_in = {i.name: (M.DataType.Name(i.data_type), tuple(i.dims), i.optional) for i in cfg.input}
    got_out = {o.name: (M.DataType.Name(o.data_type), tuple(o.dims)) for o in cfg.output}
    assert got_in == C.INPUTS and got_out == C.OUTPUTS
    assert C.REQUIRED_INPUTS == ("text_input",)
    assert C.check_unit_config(cfg) == []


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.update(backend="tensorrtllm"), "backend: is 'tensorrtllm'"),
    (lambda d: d.update(max_batch_size=8), "max_batch_size: is set in config.pbtxt"),
    (lambda d: d["instance_group"][0].update(count=2), "instance_group.count: is 2 but parameter gpu_device_ids names 0"),
    (lambda d: d["input"][0].update(dims=["1"]), "input text_input: is TYPE_STRING [1], the LLM-API model has TYPE_STRING [-1]"),
    (lambda d: d.update(input=d["input"][1:]), "input text_input: is missing"),
    (lambda d: d["output"][0].update(data_type="TYPE_INT32"), "output text_output: is TYPE_INT32 [-1]"),
])
def test_config_refusals(mutate, needle):
    d = _cfg_dict()
    mutate(d)
    refused = C.check_unit_config(d)
    assert len(refused) == 1 and refused[0].startswith(needle), refused


def test_two_instances_with_gpu_sets_pass():
    d = _cfg_dict()
    d["instance_group"][0]["count"] = 2
    d["parameters"] = {"gpu_device_ids": {"string_value": "0,1;2,3"}}
    assert C.check_unit_config(d) == []


def test_model_yaml_checks():
    assert C.check_model_yaml(MODEL_YAML) == []
    assert C.check_model_yaml([1]) == ["model.yaml: must be a mapping, not list"]
    assert C.check_model_yaml({k: v for k, v in MODEL_YAML.items() if k != "triton_config"}) == [
        "triton_config: is missing (model.py reads triton_config['decoupled'] and ['max_batch_size'])"]
    assert C.check_model_yaml({**MODEL_YAML, "triton_config": {"max_batch_size": 0}}) == [
        "triton_config.decoupled: is missing (model.py indexes it without a default)"]
    assert C.check_model_yaml({**MODEL_YAML, "triton_config": {"decoupled": True}}) == [  # said once, not twice
        "triton_config.max_batch_size: is missing (model.py indexes it without a default)"]
    got = C.check_model_yaml({**MODEL_YAML, "triton_config": {"max_batch_size": 4, "decoupled": "no", "x": 1}})
    assert got == ["triton_config.x: is not read by model.py",
                   "triton_config.max_batch_size: is 4; must be 0 (the LLM-API model refuses a batched text_input: "
                   "'only supports text_input being a 1D tensor')",
                   "triton_config.decoupled: is 'no'; must be true or false"]
    got = C.check_model_yaml({**MODEL_YAML, "backend": "trt", "max_num_tokenz": 1, "model": ""})
    assert got == ["model: must be the checkpoint folder's path (a non-empty string)",
                   "backend: is 'trt'; the LLM-API model serves backend: pytorch (model.yaml)",
                   "model.yaml.max_num_tokenz: is not a TorchLlmArgs key on TensorRT-LLM 1.2 (tensorrt_llm/llmapi/llm_args.py)."]
    tc = {"max_batch_size": 0, "decoupled": True, "cancellation_check_period_ms": 0}
    assert C.check_model_yaml({**MODEL_YAML, "triton_config": tc}) == [
        "triton_config.cancellation_check_period_ms: is 0; must be a positive int"]


def test_overlay_command_names_the_image_folders():
    """The init step's argv: sh -c OVERLAY_SCRIPT, the read-only repository, the overlay, then the image's candidate
    LLM-API model folders (fact 8: tensorrtllm_backend's Dockerfile, TensorRT-LLM's tritonrelease stage)."""
    argv = U.overlay_command("/srv/out/model_repository")
    assert argv == ["/bin/sh", "-c", U.OVERLAY_SCRIPT, "llm-api-overlay", "/srv/out/model_repository",
                    "/serving/model_repository", "/app/all_models/llmapi/tensorrt_llm/1",
                    "/app/tensorrt_llm/triton_backend/all_models/llmapi/tensorrt_llm/1"]
    assert U.SERVING_SIDE_FILES == ("1/model.py", "1/helpers.py")


@pytest.fixture
def hf_ckpt(tmp_path) -> Path:
    """A stand-in for an HF unified checkpoint's files (pack reads none of them but config.json)."""
    d = tmp_path / "checkpoint"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}))
    (d / "model.safetensors").write_bytes(b"\0" * 1000)
    return d


def _pack(tmp_path, ckpt, model_yaml=MODEL_YAML, where=""):
    repo_dir = tmp_path / where / "model_repository"
    repo_dir.mkdir(parents=True, exist_ok=True)
    return repo_dir, U.pack_llm_api_unit(repo_dir, model_yaml, ckpt, tmp_path, "/srv/out", {"profile": "p", "gemm": "FP8"},
                                         version="1.2.1")


def test_pack_writes_a_content_keyed_unit(tmp_path, hf_ckpt):
    repo_dir, u = _pack(tmp_path, hf_ckpt)
    assert U.is_llm_api_unit(u.name) and u.name == "llm_api_" + u.key[:12]
    d = repo_dir / u.name
    assert sorted(u.unit_files) == ["1/model.yaml", "checkpoint/config.json", "checkpoint/hf_quant_config.json",
                                    "checkpoint/model.safetensors", "config.pbtxt", "cpu_reference.json",
                                    "precision_path.json"]
    for rel, (size, sha) in u.unit_files.items():
        assert (d / rel).stat().st_size == size and hash_file(d / rel) == sha
    yml = yaml.safe_load((d / "1" / "model.yaml").read_text())
    assert yml == {**MODEL_YAML, "model": f"/srv/out/model_repository/{u.name}/checkpoint"} == u.model_yaml
    assert pack.parse_model_config((d / "config.pbtxt").read_text(), "x").name == u.name
    assert json.loads((d / "precision_path.json").read_text()) == {"profile": "p", "gemm": "FP8", "unit": u.name,
                                                                    "serving_route": "llm_api"}
    assert json.loads((d / "cpu_reference.json").read_text())["trtllm_version"] == "1.2.1"
    assert not (d / "1" / "model.py").exists() and not (repo_dir / U.PLACEHOLDER).exists()
    # the same inputs give the same name (the repository's name is in model.yaml's path, its place is not);
    # a changed checkpoint or model.yaml another one
    _, again = _pack(tmp_path, hf_ckpt, where="again")
    assert again.name == u.name
    _, other = _pack(tmp_path, hf_ckpt, {**MODEL_YAML, "max_num_tokens": 2048}, where="other")
    (hf_ckpt / "model.safetensors").write_bytes(b"\1" * 1000)
    _, other2 = _pack(tmp_path, hf_ckpt, where="other2")
    assert len({u.name, other.name, other2.name}) == 3


def test_pack_refuses_what_the_llmapi_model_refuses(tmp_path, hf_ckpt):
    with pytest.raises(UserError) as e:
        _pack(tmp_path, hf_ckpt, {**MODEL_YAML, "triton_config": {"max_batch_size": 8, "decoupled": False}})
    assert "triton_config.max_batch_size: is 8; must be 0" in str(e.value)
    assert list((tmp_path / "model_repository").iterdir()) == []
    with pytest.raises(UserError, match="has no config.json"):
        _pack(tmp_path, tmp_path / "nothing")
    with pytest.raises(UserError, match="is not an absolute path"):
        U.pack_llm_api_unit(tmp_path, MODEL_YAML, hf_ckpt, tmp_path, "rel/path", {}, version="1.2.1")


def test_stand_in_is_named_as_one_and_installs_as_model_py(tmp_path, hf_ckpt):
    repo_dir, u = _pack(tmp_path, hf_ckpt)
    text = U.STAND_IN.read_text()
    assert text.startswith('"""CPU STAND-IN for TensorRT-LLM\'s Triton LLM-API model (NOT TensorRT-LLM')
    assert "load_gate_model" in text and "check_model_yaml" in text and "check_unit_config" in text
    p = U.install_stand_in(repo_dir / u.name)
    assert p == repo_dir / u.name / "1" / "model.py" and p.read_text() == text


def test_bls_knows_the_llm_api_prefix():
    import re

    text = (pack.TEMPLATES_DIR / "tensorrt_llm_bls" / "1" / "model.py").read_text()
    assert re.search(r'^LLM_API_PREFIX = "([a-z_]+)"', text, re.M).group(1) == U.PREFIX


def test_pack_llm_api_repository(tmp_path, hf_ckpt, default_model_dir):
    from precision_pipeline.serving import release_units
    from precision_pipeline.spec.profile import load_profile
    from tests.serving.test_pack import make_plan

    prof = load_profile("fp8-h100")
    plan = make_plan(prof)
    out = tmp_path / "out" / "model_repository"
    rec = U.pack_llm_api_repository(plan, Path(default_model_dir), hf_ckpt, MODEL_YAML, out, "/srv/out",
                                    version="1.2.1")
    unit = rec["engine_unit"]
    assert U.is_llm_api_unit(unit) and rec["route"] == "llm_api" and rec["trtllm_version"] == "1.2.1"
    assert sorted(p.name for p in out.iterdir()) == sorted([*U.REPO_MODELS, unit, "pack.json"])
    cfgs = pack.check_repository(out)  # every config parses; the BLS names a model of the repository
    assert pack.config_params(cfgs["tensorrt_llm_bls"])["tensorrt_llm_model_name"] == unit
    assert rec["model_yaml"]["model"] == f"/srv/out/model_repository/{unit}/checkpoint"  # the final name, not the staging dir's
    assert json.loads((out / unit / "precision_path.json").read_text()) == {
        "model": plan.model.name, "profile": "fp8-h100", "gemm": "FP8", "kv": "FP8", "dtype": plan.profile.quantization.dtype,
        "unit": unit, "serving_route": "llm_api"}
    assert release_units.unit_record(out / unit) == rec["unit_files"]  # what a verified install reads
    assert (out / "preprocessing" / "tokenizer" / "tokenizer.json").is_file()


def test_a_routed_profile_packs_its_routing_table_into_the_llm_api_unit(tmp_path, hf_ckpt, default_model_dir):
    """Issue 31 (b): the llm_api route's pack writes the profile's routing table as the unit's routing.json (what the
    BLS reads from the current release), keyed with the unit; a profile without a ``routing`` section writes none."""
    from precision_pipeline.spec.profile import load_profile
    from precision_pipeline.spec.routing import routing_table
    from tests.conftest import prof
    from tests.serving.test_pack import make_plan

    routing = load_profile("fp8-h100-routed").routing.model_dump(exclude_none=True)
    routed = prof("fp8-h100-llmapi", routing=routing, deployment__fallback="bf16-h100", deployment__warm_fallback=True)
    rec = U.pack_llm_api_repository(make_plan(routed), Path(default_model_dir), hf_ckpt, MODEL_YAML,
                                    tmp_path / "a" / "model_repository", "/srv/out", version="1.2.1")
    unit = tmp_path / "a" / "model_repository" / rec["engine_unit"]
    assert json.loads((unit / "routing.json").read_text()) == routing_table(routed.routing)
    assert rec["unit_files"]["routing.json"][1] == hash_file(unit / "routing.json")
    plain = U.pack_llm_api_repository(make_plan(load_profile("fp8-h100-llmapi")), Path(default_model_dir), hf_ckpt,
                                      MODEL_YAML, tmp_path / "b" / "model_repository", "/srv/out", version="1.2.1")
    assert "routing.json" not in plain["unit_files"] and plain["engine_unit"] != rec["engine_unit"]


def test_install_and_verify_treat_an_llm_api_unit_as_an_engine_unit(tmp_path, hf_ckpt, default_model_dir):
    """release_units.install_unit: a verified copy; the one rewrite is 1/model.yaml's model (the served checkpoint);
    the record verify_kept checks holds the installed model.yaml; a re-install of the same unit changes nothing;
    a damaged kept file or a build edited after its pack is refused."""
    from precision_pipeline.serving import release_units
    from precision_pipeline.spec.profile import load_profile
    from tests.serving.test_pack import make_plan

    prof = load_profile("fp8-h100")
    build = tmp_path / "build" / "model_repository"
    rec = U.pack_llm_api_repository(make_plan(prof), Path(default_model_dir), hf_ckpt, MODEL_YAML, build, "/srv/b",
                                    version="1.2.1")
    serving = tmp_path / "serving" / "model_repository"
    serving.mkdir(parents=True)
    state: dict = {}
    name = release_units.install_unit(serving, build, record=state)
    assert name == rec["engine_unit"]
    dst = serving / name
    yml = yaml.safe_load((dst / "1" / "model.yaml").read_text())
    assert yml == {**MODEL_YAML, "model": f"{tmp_path.resolve()}/serving/model_repository/{name}/checkpoint"}
    files = state["unit_files"][name]
    assert sorted(files) == sorted(rec["unit_files"])
    assert files["1/model.yaml"] == [(dst / "1/model.yaml").stat().st_size, hash_file(dst / "1/model.yaml")]
    assert files["1/model.yaml"] != rec["unit_files"]["1/model.yaml"]  # the rewritten file's row
    assert {k: v for k, v in files.items() if k != "1/model.yaml"} == {
        k: v for k, v in rec["unit_files"].items() if k != "1/model.yaml"}
    inode = (dst / "checkpoint" / "model.safetensors").stat().st_ino
    assert inode != (build / name / "checkpoint" / "model.safetensors").stat().st_ino  # a copy, never a link
    assert release_units.install_unit(serving, build, record=state) == name  # the same unit: kept as it is
    assert (dst / "checkpoint" / "model.safetensors").stat().st_ino == inode
    assert release_units.verify_kept(serving, name, state, "rollback", "x") is True
    (dst / "checkpoint" / "model.safetensors").write_bytes(b"\1" * 1000)
    with pytest.raises(UserError, match="checkpoint/model.safetensors has the recorded size"):
        release_units.verify_kept(serving, name, state, "rollback", "x")
    (build / name / "1" / "model.yaml").write_text("model: x\n")  # the build edited after its pack
    with pytest.raises(UserError, match="1/model.yaml: is 9 bytes, but pack recorded"):  # as for engine units
        release_units.install_unit(tmp_path / "serving" / "model_repository", build, protect=())
