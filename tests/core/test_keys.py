"""Stage keys hold exactly what each stage reads (issue 24): every keyed field of every stage's inputs changes the
key when it changes, a declared ``unkeyed`` field does not, pack keys only what pack reads (editing
``deployment.replicas`` re-renders the manifests and leaves the packed repository cached), and the route loop is
the one the build and the engine Job share."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

import pytest
from pydantic import BaseModel

from precision_pipeline.core.fingerprint import Fingerprint
from precision_pipeline.core.stage import Done, Frozen, StageRecord, stage_key
from precision_pipeline.core.store import canonical, hash_dir
from precision_pipeline.spec.profile import deep_merge, load_raw, validate_profile
from tests.conftest import request


def _alter(value, where: str):
    """A value whose canonical form differs from ``value``'s (a model: its first field that can differ)."""
    if isinstance(value, Fingerprint):
        return Fingerprint(sha256="f" * 64 if value.sha256 != "f" * 64 else "e" * 64, path=value.path)
    if isinstance(value, bool):
        return not value
    if isinstance(value, Enum):
        return next(m for m in type(value) if m != value)
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 1.0
    if isinstance(value, str):
        return value + "x"
    if value is None:
        return "x"
    if isinstance(value, (tuple, list)):
        return type(value)([*value, "x"])
    if isinstance(value, dict):
        return {**value, "x-added": 1}
    if isinstance(value, BaseModel):
        before = canonical(value)
        for name in type(value).model_fields:
            try:
                other = value.model_copy(update={name: _alter(getattr(value, name), f"{where}.{name}")})
            except AssertionError:
                continue
            if canonical(other) != before:
                return other
    raise AssertionError(f"{where}: no way to change {type(value).__name__} {value!r}")


def _leaves(model: BaseModel, prefix: str = ""):
    """(dotted field path, value) of every field, recursing into nested stage-input models (``Frozen``)."""
    for name in type(model).model_fields:
        value = getattr(model, name)
        yield prefix + name, value, name in (type(model).unkeyed or {})
        if isinstance(value, Frozen) and not (type(model).unkeyed or {}).get(name):
            yield from _leaves(value, prefix + name + ".")


def _replace(model: BaseModel, dotted: str, value) -> BaseModel:
    head, _, rest = dotted.partition(".")
    if not rest:
        return model.model_copy(update={head: value})
    return model.model_copy(update={head: _replace(getattr(model, head), rest, value)})


@pytest.fixture(scope="module")
def route_inputs(tmp_path_factory, default_model_dir):
    """{stage name: (stage, inputs)} for every stage of the engine route, made by the stages' own ``inputs`` from a
    real plan and request (stand-in upstream artifacts)."""
    from precision_pipeline.engine.stage import EngineArtifact
    from precision_pipeline.gate.stage import GateArtifact
    from precision_pipeline.pipeline import ROUTES
    from precision_pipeline.quantize.stage import CheckpointArtifact
    from precision_pipeline.resolve import plan as P
    from precision_pipeline.serving.stage import RepositoryArtifact
    from precision_pipeline.spec.profile import load_profile

    tmp = tmp_path_factory.mktemp("keys")
    plan = P.evaluate(load_profile("fp8-h100"), default_model_dir)
    req = request(plan.profile, tmp / "out", model_dir=Path(default_model_dir))
    arts = {"quantize": CheckpointArtifact(quant_algo="FP8", kv_cache_quant_algo="FP8", logits_dtype=None,
                                           checkpoint_bytes=1, layers={}),
            "gate": GateArtifact(passed=True, numbers={}),
            "engine": EngineArtifact(built=False, argv=(), args_file=str(tmp / "out" / "engine" / "args")),
            "pack": RepositoryArtifact(models=(), engine_present=False, engine_unit="u", engine_hash="0" * 64)}
    done = {n: Done(artifact=a, key=str(i) * 64, dir=tmp / "out" / n, record=StageRecord(n, "done"))
            for i, (n, a) in enumerate(arts.items(), start=1)}
    out = {}
    for st in ROUTES["engine"].stages:
        out[st.name] = (st, st.inputs(None if st.provides_plan else plan, req, {n: done[n] for n in st.needs}))
    return out


STAGE_NAMES = ("resolve", "quantize", "verify", "gate", "engine", "engine_gate", "pack", "deploy")


@pytest.mark.parametrize("name", STAGE_NAMES)
def test_every_keyed_field_changes_the_key_and_no_unkeyed_one_does(route_inputs, name):
    stage, inputs = route_inputs[name]
    key = stage_key(stage, inputs, {})
    checked = 0
    for dotted, value, unkeyed in _leaves(inputs):
        other = stage_key(stage, _replace(inputs, dotted, _alter(value, f"{name}.{dotted}")), {})
        if unkeyed:
            assert other == key, f"{name}: {dotted} is declared unkeyed but changes the key"
        else:
            assert other != key, f"{name}: changing {dotted} does not change the key"
        checked += 1
    assert checked >= 2


def test_the_route_covers_every_stage_checked_here(route_inputs):
    assert tuple(route_inputs) == STAGE_NAMES


def test_unkeyed_fields_are_declared_with_their_reason():
    from precision_pipeline.engine.stage import EngineInputs
    from precision_pipeline.serving.stage import PackInputs

    assert set(EngineInputs.unkeyed) == {"strict"} and "preflight" in EngineInputs.unkeyed["strict"]
    assert set(PackInputs.unkeyed) == {"plan"} and "view" in PackInputs.unkeyed["plan"]


def _plan(**sections):
    from precision_pipeline.resolve import plan as P
    from precision_pipeline.spec.default_model import default_model_dir

    return P.evaluate(validate_profile(deep_merge(load_raw("fp8-h100"), sections)), default_model_dir())


def _keys(plan, tmp_path):
    from precision_pipeline.serving.stage import DeployStage, PackStage

    req = request(plan.profile, tmp_path / "out")
    up = {n: Done(artifact=None, key=c * 64, dir=tmp_path / n, record=StageRecord(n, "done"))
          for n, c in (("quantize", "1"), ("engine", "2"), ("pack", "3"))}
    up["engine"] = Done(artifact=type("E", (), {"built": False})(), key="2" * 64, dir=tmp_path / "engine",
                        record=StageRecord("engine", "done"))
    return {st.name: stage_key(st, st.inputs(plan, req, {n: up[n] for n in st.needs}), {}) for st in (PackStage(), DeployStage())}


def test_editing_replicas_re_renders_the_manifests_and_keeps_the_packed_repository(tmp_path):
    """Issue 24: pack keyed the whole plan, so editing ``deployment.replicas`` re-packed. Pack keys ``PackView``."""
    base = _keys(_plan(), tmp_path)
    for what in ({"deployment": {"replicas": 3}}, {"deployment": {"canary_pause_s": 60}},
                 {"deployment": {"workload": "argo-rollout"}}, {"description": "edited"}):
        k = _keys(_plan(**what), tmp_path)
        assert k["pack"] == base["pack"], what  # pack cached
        assert k["deploy"] != base["deploy"], what  # deploy renders it: runs again
    for what in ({"runtime": {"instance_count": 2}}, {"deployment": {"otlp_endpoint": "http://otel:4318"}},
                 {"build": {"max_batch_size": 7}}):
        assert _keys(_plan(**what), tmp_path)["pack"] != base["pack"], what  # what pack reads re-packs


def test_pack_reads_nothing_of_the_plan_outside_its_view(tmp_path, default_model_dir):
    """The guard of ``PackInputs.unkeyed["plan"]``: two plans with the same ``PackView`` and different everything
    else (replicas, gate bar, calibration, description, canary) pack byte-identical repositories."""
    from precision_pipeline.serving import pack
    from precision_pipeline.serving.stage import PackView

    a = _plan()
    b = _plan(description="other", deployment={"replicas": 5, "canary_pause_s": 7, "keep_releases": 4},
              gate={"kl_p99_max": 0.9, "top1_min": 0.5}, calibration={"num_samples": 8})
    assert PackView.of(a) == PackView.of(b) and a.canonical() != b.canonical()
    model = tmp_path / "model"
    model.mkdir()
    for f in Path(default_model_dir).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            (model / f.name).write_bytes(f.read_bytes())
    ck = tmp_path / "checkpoint"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({"architecture": "LlamaForCausalLM"}))
    repos = []
    out = tmp_path / "out" / "model_repository"
    for plan in (a, b):  # the same folder (pack.json records it), replaced atomically
        pack.pack_repository(plan, plan.profile, model, ck, tmp_path / "out" / "engine", False, out, "/srv/llm")
        repos.append(hash_dir(out))
    assert repos[0] == repos[1]
