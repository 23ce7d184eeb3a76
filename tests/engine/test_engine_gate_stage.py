"""The engine gate as a stage (``engine/gate_stage.py``), with the GPU-only tools as test doubles
(``tests/engine/doubles.py``) and the TensorRT-LLM runner replaced by a stand-in verdict: what
runs, what is built, what is skipped and why. The product never writes an engine; the doubles do."""

from __future__ import annotations

from pathlib import Path

import pytest

from precision_pipeline.core.fingerprint import Fingerprint
from precision_pipeline.engine.gate_stage import EngineGateInputs, EngineGateStage
from precision_pipeline.engine.stage import EngineStage
from precision_pipeline.gate.options import GateOptions
from precision_pipeline.gate.stage import GateInputs
from precision_pipeline.spec.profile import GateThresholds
from tests.engine import doubles
from tests.engine.test_engine import PLAN


def _setup(tmp_path, monkeypatch, **kw):
    paths = doubles.install(tmp_path, monkeypatch, **kw)
    out, runner, up, req = doubles.stage_runner(tmp_path)
    eng = runner.run(EngineStage(), PLAN, req, up)
    return paths, out, runner, req, {**up, "engine": eng}


def _inputs(tmp_path, upstream, req) -> EngineGateInputs:
    e = upstream["engine"]
    golden = tmp_path / "golden.jsonl"
    golden.write_text("{}\n")
    gate = GateInputs(checkpoint=Fingerprint(sha256="1" * 64, path=tmp_path / "ckpt"),
                      model=Fingerprint(sha256="3" * 64, path=tmp_path / "model"), thresholds=GateThresholds(kl_p99_max=0.5),
                      golden=Fingerprint(sha256="4" * 64, path=golden), options=GateOptions(prompts_per_category=1))
    return EngineGateInputs(engine=Fingerprint(sha256=e.key, path=e.dir), engine_built=bool(e.artifact.built),
                            engine_reason=e.artifact.reason, engine_plan=EngineStage().inputs(PLAN, req, upstream), gate=gate)


class _Verdict:
    def __init__(self, passed: bool):
        self.passed = passed

    def failed_metrics(self):
        return [] if self.passed else ["kl_p99"]

    def summary(self):
        return {"kl_p99": 0.1 if self.passed else 0.9, "passed": self.passed}


def _runner_stand_in(monkeypatch, passed: bool) -> list[Path]:
    """engine_available says yes; run_engine_gate records which engine it was given and returns a verdict."""
    from precision_pipeline.gate import engine_gate

    seen: list[Path] = []

    def fake_gate(engine_dir, model_dir, thresholds, out_dir, options, *a, **k):
        seen.append(Path(engine_dir))
        assert (Path(engine_dir) / "config.json").is_file()
        return _Verdict(passed)

    monkeypatch.setattr(engine_gate, "engine_available", lambda: (True, ""))
    monkeypatch.setattr(engine_gate, "run_engine_gate", fake_gate)
    return seen


def test_no_engine_is_an_honest_skip(tmp_path, monkeypatch):
    paths, out, runner, req, up = _setup(tmp_path, monkeypatch, gpus=[])
    assert up["engine"].record.status == "skipped"
    art = EngineGateStage().run(_inputs(tmp_path, up, req), tmp_path / "w")
    assert art.status == "skipped" and art.passed is None
    assert art.reason == "no engine to gate: the engine stage was skipped"
    assert len(doubles.calls(paths)) == 0


def test_without_the_runner_it_says_why(tmp_path, monkeypatch):
    """An engine was built (stand-in) but no CUDA device is visible to torch: skipped with that reason."""
    paths, out, runner, req, up = _setup(tmp_path, monkeypatch)
    assert up["engine"].artifact.built
    art = EngineGateStage().run(_inputs(tmp_path, up, req), tmp_path / "w")
    assert art.status == "skipped" and "no CUDA device visible" in art.reason
    assert len(doubles.calls(paths)) == 1  # no gate-only build when nothing can run it


@pytest.mark.parametrize("passed", [True, False])
def test_gate_only_engine_with_context_logits_is_built_and_gated(tmp_path, monkeypatch, passed):
    paths, out, runner, req, up = _setup(tmp_path, monkeypatch)
    seen = _runner_stand_in(monkeypatch, passed)
    workdir = tmp_path / "w"
    workdir.mkdir()
    art = EngineGateStage().run(_inputs(tmp_path, up, req), workdir)
    served, gate_build = doubles.calls(paths)
    assert "--gather_context_logits" not in served and "--gather_context_logits" in gate_build
    assert gate_build[gate_build.index("--output_dir") + 1] == str((workdir / "engine").resolve())
    o = served.index("--output_dir") + 1  # the same argv otherwise (same checkpoint, limits, plugins)
    assert [a for a in gate_build if a != "--gather_context_logits"] == served[:o] + [gate_build[o]] + served[o + 1:]
    assert seen == [workdir / "engine"]  # the gate-only engine was gated, not the served one
    assert art.status == ("done" if passed else "failed") and art.passed is passed
    assert art.failed_metrics == (() if passed else ("kl_p99",))
    assert art.gated_engine == str(out / "engine_gate" / "engine")


def test_served_engine_that_gathers_logits_is_gated_directly(tmp_path, monkeypatch):
    paths, out, runner, req, up = _setup(tmp_path, monkeypatch)
    seen = _runner_stand_in(monkeypatch, True)
    inp = _inputs(tmp_path, up, req)
    plan = inp.engine_plan
    inp = inp.model_copy(update={"engine_plan": plan.model_copy(
        update={"effective": plan.effective.model_copy(update={"gather_context_logits": True})})})
    art = EngineGateStage().run(inp, tmp_path / "w")
    assert seen == [out / "engine"] and len(doubles.calls(paths)) == 1
    assert art.status == "done" and art.gated_engine == str(out / "engine")


def test_engine_gate_key_follows_the_engine_and_the_gate_inputs(tmp_path, monkeypatch):
    from precision_pipeline.core.stage import stage_key

    paths, out, runner, req, up = _setup(tmp_path, monkeypatch)
    inp = _inputs(tmp_path, up, req)
    k = stage_key(EngineGateStage(), inp, {})
    assert stage_key(EngineGateStage(), inp.model_copy(update={"engine": Fingerprint(sha256="9" * 64, path=out)}), {}) != k
    g = inp.gate.model_copy(update={"thresholds": GateThresholds(kl_p99_max=0.4)})
    assert stage_key(EngineGateStage(), inp.model_copy(update={"gate": g}), {}) != k
    strict = inp.engine_plan.model_copy(update={"strict": True})
    assert stage_key(EngineGateStage(), inp.model_copy(update={"engine_plan": strict}), {}) == k  # --strict is not keyed
