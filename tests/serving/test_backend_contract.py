"""The packed engine unit against the real tensorrtllm backend's contract (serving/backend_contract.py,
facts from tensorrtllm_backend's source), and the CPU stand-in refusing what the real backend refuses."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

from precision_pipeline.core.paths import SOURCE_ROOT
from precision_pipeline.serving import backend_contract as BC
from precision_pipeline.serving import pack
from precision_pipeline.spec.profile import load_profile
from tests.serving.test_pack import MODEL_FILES, make_plan

GUIDED = ("tokenizer_dir", "xgrammar_tokenizer_info_path", "guided_decoding_backend")


@pytest.fixture(scope="module")
def unit(tmp_path_factory, default_model_dir):
    """The engine unit pack renders for fp8-h100 (no engine): (unit dir, parsed ModelConfig)."""
    root = tmp_path_factory.mktemp("contract")
    model = root / "model"
    model.mkdir()
    for name in MODEL_FILES:
        if (Path(default_model_dir) / name).is_file():
            (model / name).write_bytes((Path(default_model_dir) / name).read_bytes())
    ck = root / "checkpoint"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({"architecture": "LlamaForCausalLM", "dtype": "bfloat16"}))
    prof = load_profile("fp8-h100")
    out = root / "out"
    res = pack.pack_repository(make_plan(prof), prof, model, ck, out / "engine", False, out / "model_repository", str(out))
    d = out / "model_repository" / res.engine_unit
    return d, pack.parse_model_config((d / "config.pbtxt").read_text(), res.engine_unit)


def test_contract_table_cites_upstream():
    for name, p in {**BC.REQUIRED_PARAMETERS, **BC.DEFAULTED_PARAMETERS}.items():
        assert p.source.split(":")[0].endswith(".cc") and p.source.split(":")[1][0].isdigit(), name
        assert p.template > 0
    assert set(GUIDED) <= set(BC.REQUIRED_PARAMETERS)
    assert all(p.default is None for p in BC.REQUIRED_PARAMETERS.values())
    assert all(p.default is not None for p in BC.DEFAULTED_PARAMETERS.values())


def test_packed_unit_satisfies_the_backend_contract(unit):
    d, cfg = unit
    params = pack.config_params(cfg)
    assert {k: params.get(k) for k in GUIDED} == {k: "" for k in GUIDED}  # guided decoding off, as upstream's template
    assert BC.check_parameters(params, check_paths=False) == []
    assert set(BC.REQUIRED_PARAMETERS) <= set(params)
    assert BC.check_tensors(cfg) == []
    assert params["gpt_model_type"] == "inflight_fused_batching"


def test_contract_finds_what_the_backend_refuses(unit):
    _, cfg = unit
    params = pack.config_params(cfg)
    for k in BC.REQUIRED_PARAMETERS:
        got = BC.check_parameters({p: v for p, v in params.items() if p != k}, check_paths=False)
        assert got == [BC.MISSING.format(name=k) + f" ({BC.REQUIRED_PARAMETERS[k].source})"]
    assert "gpt_model_type 'static'" in BC.check_parameters({**params, "gpt_model_type": "static"}, check_paths=False)[0]
    bad = BC.check_parameters({**params, "guided_decoding_backend": "outlines", "xgrammar_tokenizer_info_path": "/x.json"})
    assert any("'outlines' is not 'xgrammar'" in m for m in bad) and any("/x.json" in m for m in bad)
    assert BC.check_parameters(params) == []  # the engine folder pack wrote exists
    assert BC.check_parameters({**params, "gpt_model_path": "/no/engine"}) == [
        f"gpt_model_path '/no/engine' does not exist ({BC.MIS}:747, 771)"]
    assert BC.check_parameters({**params, "enable_kv_cache_reuse": "yes"}, check_paths=False) == [
        f"enable_kv_cache_reuse 'yes' is not a boolean ({BC.MS}:310-326)"]
    renamed = type(cfg)()
    renamed.CopyFrom(cfg)
    renamed.input[0].name = "min_length"  # the pre-1.0 name
    assert any("'min_length' is not read" in m for m in BC.check_tensors(renamed))


@pytest.mark.parametrize("backend, info", [("xgrammar", ""), ("outlines", ""), ("", "/x.json"),
                                           ("${guided_decoding_backend}", "/x.json"),
                                           ("outlines", "${xgrammar_tokenizer_info_path}")])
def test_guided_decoding_is_off_unless_both_are_set(unit, backend, info):
    """An empty (or unfilled ``${...}``) backend or info path turns guided decoding off (MIS:424-428): neither the
    backend's name nor the info file is checked then."""
    _, cfg = unit
    params = {**pack.config_params(cfg), "guided_decoding_backend": backend, "xgrammar_tokenizer_info_path": info}
    assert BC.check_parameters(params) == []


def test_guided_decoding_on_checks_the_backend_and_the_file(unit, tmp_path):
    _, cfg = unit
    info = tmp_path / "info.json"
    info.write_text("{}")
    params = {**pack.config_params(cfg), "guided_decoding_backend": "xgrammar", "xgrammar_tokenizer_info_path": str(info)}
    assert BC.check_parameters(params) == []
    missing = {**params, "xgrammar_tokenizer_info_path": str(tmp_path / "no.json")}
    assert BC.check_parameters(missing) == [
        f"xgrammar_tokenizer_info_path {str(tmp_path / 'no.json')!r} does not exist ({BC.MIS}:430-431)"]
    assert BC.check_parameters(missing, check_paths=False) == []
    assert BC.check_parameters({**params, "guided_decoding_backend": "outlines"}) == [
        f"guided_decoding_backend 'outlines' is not 'xgrammar' ({BC.MIS}:440-448)"]


@pytest.mark.parametrize("name, dtype, refused", [("output_ids", "TYPE_FP32", True), ("output_ids", "TYPE_INT32", False),
                                                  ("context_logits", "TYPE_INT32", True), ("context_logits", "TYPE_BF16", False),
                                                  ("generation_logits", "TYPE_FP16", False)])
def test_output_dtypes(unit, name, dtype, refused):
    """An output's dtype is upstream's (``TPL``); the logits outputs take any of ``LOGITS_TYPES`` (the template's
    ``${logits_datatype}``) and nothing else."""
    from tritonclient.grpc import model_config_pb2

    _, cfg = unit
    c = type(cfg)()
    c.CopyFrom(cfg)
    (t,) = [o for o in c.output if o.name == name]
    t.data_type = model_config_pb2.DataType.Value(dtype)
    want, line = BC.OUTPUTS[name]
    assert BC.check_tensors(c) == ([f"output {name!r} is {dtype}; upstream declares {want} ({BC.TPL}:{line})"]
                                   if refused else [])


def test_defaulted_parameters_absent_or_empty_take_their_default(unit):
    """A defaulted parameter left out, or empty (upstream's template leaves an unfilled one as ""), is the backend's
    default: not refused, whatever its kind."""
    _, cfg = unit
    params = pack.config_params(cfg)
    required = {k: params[k] for k in BC.REQUIRED_PARAMETERS}
    assert BC.check_parameters(required) == []
    assert BC.check_parameters({**required, **{k: "" for k in BC.DEFAULTED_PARAMETERS}}) == []
    assert BC.check_parameters({**required, "max_beam_width": "two"}) == [
        f"max_beam_width 'two' is not a number ({BC.DEFAULTED_PARAMETERS['max_beam_width'].source})"]


# ---- the CPU stand-in (triton_repo/backends/tensorrtllm/model.py) refuses like the real backend


class _TritonModelException(Exception):
    pass


@pytest.fixture
def standin(monkeypatch):
    stub = types.ModuleType("triton_python_backend_utils")
    stub.TritonModelException = _TritonModelException
    stub.using_decoupled_model_transaction_policy = lambda cfg: False
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub)
    spec = importlib.util.spec_from_file_location("_standin_model", pack.BACKENDS_DIR / "tensorrtllm" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _args(cfg, engine: Path, drop: str | None = None) -> dict:
    from google.protobuf import json_format

    c = json_format.MessageToDict(cfg, preserving_proto_field_name=True)
    c["parameters"]["gpt_model_path"] = {"string_value": str(engine)}
    if drop:
        del c["parameters"][drop]
    return {"model_config": json.dumps(c), "model_name": cfg.name}


@pytest.fixture
def engine(tmp_path) -> Path:
    e = tmp_path / "engine"
    e.mkdir()
    (e / pack.CPU_REFERENCE_FILE).write_text(json.dumps({"hf_model_dir": str(tmp_path / "no-model"), "checkpoint_dir": None,
                                                          "project_root": str(SOURCE_ROOT)}))
    return e


@pytest.mark.parametrize("drop", GUIDED + ("gpt_model_type",))
def test_standin_refuses_a_config_without_a_required_parameter(standin, unit, engine, drop):
    _, cfg = unit
    with pytest.raises(_TritonModelException, match=f"Cannot find parameter with name: {drop}"):
        standin.TritonPythonModel().initialize(_args(cfg, engine, drop=drop))


def test_standin_loads_the_packed_config(standin, unit, engine, monkeypatch):
    _, cfg = unit
    monkeypatch.setattr(standin, "load_model", lambda d: (object(), "stub"))
    m = standin.TritonPythonModel()
    m.initialize(_args(cfg, engine))
    assert m.engine_dir == str(engine)
