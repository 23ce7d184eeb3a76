"""gate/stage.py without a gate run (issue 26: the module's fast tests scored 1/10; its paths ran only in the stage
builds): what a verdict records (``gate_record``) from a hand-made checkpoint config, when the stored measurements
are judged again (``GateStage._rejudged``), the artifact's presence and the stage's settings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from precision_pipeline.core.fingerprint import Fingerprint
from precision_pipeline.gate import stage as S
from precision_pipeline.gate.options import GateOptions
from precision_pipeline.spec.profile import GateBar, GateThresholds
from tests.gate.test_category_mutants import assemble

H = {c: c * 64 for c in "abcd"}


def inputs(ckpt: Path, thresholds=GateThresholds(kl_mean_max=1.0), **opt) -> S.GateInputs:
    return S.GateInputs(checkpoint=Fingerprint(sha256=H["a"], path=ckpt), model=Fingerprint(sha256=H["b"], path=ckpt),
                        thresholds=thresholds, layout={"tp_size": 2, "pp_size": 1, "moe_ep_size": 1},
                        golden=Fingerprint(sha256=H["c"], path=ckpt / "g.jsonl"), options=GateOptions(**opt))


def test_gate_record_from_the_checkpoint_config(tmp_path):
    from importlib import metadata

    (tmp_path / "config.json").write_text(json.dumps({"mapping": {"tp_size": 2, "pp_size": 3},
                                                      "producer": {"name": "modelopt", "version": "0.37.0"}}))
    rec = S.gate_record(inputs(tmp_path, prompts_per_category=2))
    assert rec == {
        "layout": {"tp_size": 2, "pp_size": 3, "moe_ep_size": 1},  # moe_ep_size absent: 1
        "planned_layout": {"tp_size": 2, "pp_size": 1, "moe_ep_size": 1},
        "runtime": {"measured_with": f"checkpoint dequantized in PyTorch {metadata.version('torch')} on cpu",
                    "tensorrt_llm": rec["runtime"]["tensorrt_llm"], "checkpoint_producer": "modelopt 0.37.0"},
        "model_fingerprint": H["b"], "golden": {"prompts_per_category": 2, "file_sha256": H["c"]}}
    (tmp_path / "config.json").write_text(json.dumps({"mapping": {"moe_ep_size": None}, "producer": {}}))
    rec = S.gate_record(inputs(tmp_path, device="cuda"))
    assert rec["layout"] == {"tp_size": 1, "pp_size": 1, "moe_ep_size": 1}
    assert rec["runtime"]["checkpoint_producer"] is None and rec["runtime"]["measured_with"].endswith(" on cuda")
    (tmp_path / "config.json").unlink()  # no config at all: the defaults
    assert S.gate_record(inputs(tmp_path))["layout"] == {"tp_size": 1, "pp_size": 1, "moe_ep_size": 1}


def test_a_plain_threshold_set_becomes_a_bar(tmp_path):
    i = inputs(tmp_path, thresholds=GateThresholds(kl_p99_max=0.2))
    assert type(i.thresholds) is GateBar
    assert (i.thresholds.kl_p99_max, i.thresholds.categories, i.thresholds.min_prompts) == (0.2, {}, None)
    bar = GateBar(top1_min=0.9, min_prompts=3)
    assert inputs(tmp_path, thresholds=bar).thresholds == bar


def test_artifact_present_only_with_metrics_json(tmp_path):
    art = S.GateArtifact(status="done", passed=True, numbers={"kl_p99": 0.1})
    assert art.present(tmp_path) is False
    (tmp_path / "gate").mkdir()
    assert art.present(tmp_path) is False
    (tmp_path / "gate" / "metrics.json").mkdir()  # a folder of that name is not the file
    assert art.present(tmp_path) is False
    (tmp_path / "gate" / "metrics.json").rmdir()
    (tmp_path / "gate" / "metrics.json").write_text("{}")
    assert art.present(tmp_path) is True
    assert art.summary() == {"kl_p99": 0.1} and art.blocking("x", None) is None


def test_stage_settings():
    assert (S.GateStage.name, S.GateStage.output, S.GateStage.needs) == ("gate", "gate", ("quantize",))
    assert S.GateStage.code == ("gate", "checkpoint", "spec", "core")
    assert S.GateStage.reuse_failed is True  # a failed verdict of unchanged inputs stands (exit 3), not re-measured


@pytest.fixture
def stored(tmp_path, monkeypatch):
    """``tmp/gate``: a stored measurement (the hand-made metrics of test_category_mutants, measured against
    kl_mean_max 1.0) with key "k1"; the runner's temporary folder beside it; write_gate_dir captured."""
    from precision_pipeline.gate import checkpoint_gate

    prev = tmp_path / "gate"
    prev.mkdir()
    metrics = assemble(GateBar(kl_mean_max=1.0), bootstrap=20)
    (prev / "metrics.json").write_text(json.dumps(metrics))
    (prev / S.MEASUREMENT_FILE).write_text(json.dumps({"key": "k1"}))
    np.savez_compressed(prev / "per_token.npz", kl=np.array([0.1, 0.2]))
    written = []
    monkeypatch.setattr(checkpoint_gate, "write_gate_dir", lambda res: written.append(res))
    work = tmp_path / ".gate-new"
    work.mkdir()
    return prev, work, metrics, written


def test_only_new_thresholds_are_judged_on_the_stored_numbers(stored):
    prev, work, metrics, written = stored
    assert metrics["passed"] is True
    st = S.GateStage()
    bar = GateBar(kl_mean_max=0.01)
    res = st._rejudged(inputs(prev, thresholds=bar), work, "k1", {"r": 1})
    assert res is not None and written == [res] and res.out_dir == work
    assert res.passed is False and "kl_mean" in res.failures
    assert res.metrics["rejudged"] == {"from": "the stored measurements of the same checkpoint, model, golden set and options",
                                       "previous_thresholds": metrics["thresholds"], "previous_passed": True}
    assert res.metrics["record"] == {"r": 1} and res.metrics["thresholds"]["kl_mean_max"] == 0.01
    assert res.metrics["metrics"]["kl_mean"]["value"] == metrics["metrics"]["kl_mean"]["value"]  # not measured again
    assert list(res.per_token) == ["kl"] and res.per_token["kl"].tolist() == [0.1, 0.2]


@pytest.mark.parametrize("spoil", ["other key", "no npz", "bad npz", "no metrics", "metrics not a dict"])
def test_anything_else_is_measured_again(stored, spoil):
    prev, work, _metrics, written = stored
    key = "k1"
    if spoil == "other key":
        key = "k2"
    elif spoil == "no npz":
        (prev / "per_token.npz").unlink()
    elif spoil == "bad npz":
        (prev / "per_token.npz").write_bytes(b"not a zip")
    elif spoil == "no metrics":
        (prev / "metrics.json").unlink()
    else:
        (prev / "metrics.json").write_text(json.dumps({"metrics": [1]}))
    assert S.GateStage()._rejudged(inputs(prev), work, key, {}) is None
    assert written == []


def test_run_on_stored_numbers_says_what_failed(stored):
    """``run`` with only the thresholds changed: the artifact names the failing metrics and the measurement key
    is written beside the new numbers."""
    prev, work, _metrics, _written = stored
    st = S.GateStage()
    inp = inputs(prev, thresholds=GateBar(kl_mean_max=0.01))
    mkey = st.measurement_key(inp)
    (prev / S.MEASUREMENT_FILE).write_text(json.dumps({"key": mkey}))
    art = st.run(inp, work)
    assert (art.status, art.passed, art.reason) == ("failed", False, "accuracy gate failed: " + ", ".join(art.failed_metrics))
    assert "kl_mean" in art.failed_metrics and art.reason.startswith("accuracy gate failed: kl_mean")
    assert json.loads((work / S.MEASUREMENT_FILE).read_text()) == {"key": mkey}
    ok = st.run(inputs(prev, thresholds=GateBar(kl_mean_max=1.0)), work)
    assert (ok.status, ok.passed, ok.reason, ok.failed_metrics) == ("done", True, "", ())


def test_inputs_record_the_planned_layout(tmp_path):
    from precision_pipeline.core.stage import Done
    from precision_pipeline.resolve import plan as P
    from precision_pipeline.spec.default_model import ensure_default_model
    from precision_pipeline.spec.profile import load_profile
    from tests.conftest import request

    prof = load_profile("fp8-h100")
    assert prof.parallel.moe_ep_size is None
    plan = P.evaluate(prof, ensure_default_model())
    up = {"quantize": Done(artifact=None, key="e" * 64, dir=tmp_path, record=None)}
    inp = S.GateStage().inputs(plan, request(prof, golden_limit=2), up)
    assert inp.layout == {"tp_size": 1, "pp_size": 1, "moe_ep_size": 1}  # no expert parallelism: 1
    assert (inp.checkpoint.sha256, inp.checkpoint.path) == ("e" * 64, tmp_path)
    assert inp.options == GateOptions(prompts_per_category=2)  # no device chosen: the CPU defaults
    assert inp.thresholds == prof.gate.for_model(inp.model.sha256)
