"""A refusal raised by a stage after the build wrote plan.json, manifest.json and stage folders says what
was written, never "nothing was changed" (issue 27); a refusal before any write still says nothing changed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tasks():
    spec = importlib.util.spec_from_file_location("tasks_under_test", ROOT / "tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    return tasks


def _refusing_gate(monkeypatch):
    """quantize writes checkpoint/, then the gate refuses the checkpoint (as the reader does)."""
    from precision_pipeline import pipeline
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.core.stage import Artifact, Frozen, Stage

    class In(Frozen):
        profile: str

    class Art(Artifact):
        layers: dict = {}

    class Quantize(Stage):
        name, output, artifact_type = "quantize", "checkpoint", Art

        def inputs(self, plan, request, upstream):
            return In(profile=plan.profile.name)

        def run(self, inputs, workdir):
            (workdir / "config.json").write_text("{}\n")
            return Art()

    class Gate(Quantize):
        name, output = "gate", "gate"

        def run(self, inputs, workdir):
            raise UserError("checkpoint", "transformer.layers.0.attention.qkv has 7 rows; expected 960.", "re-export it.")

    from precision_pipeline.core.route import Route

    monkeypatch.setitem(pipeline.ROUTES, "engine", Route("engine", (pipeline.ROUTES["engine"].stages[0], Quantize(), Gate())))


def test_stage_refusal_after_writes_names_what_was_written(monkeypatch, tmp_path, capsys):
    from invoke import Exit

    from precision_pipeline.core.errors import UserError
    from precision_pipeline.pipeline import run_build

    _refusing_gate(monkeypatch)
    out = tmp_path / "out"
    with pytest.raises(UserError) as e:
        run_build("fp8-h100", out=str(out))
    assert e.value.stage == "gate"
    assert e.value.written == ("plan.json", "manifest.json", "checkpoint/", ".stages/")
    assert all((out / w).exists() for w in e.value.written)

    @_tasks().guarded
    def job():
        raise e.value

    with pytest.raises(Exit) as ei:
        job()
    said = "".join(capsys.readouterr())
    assert ei.value.code == 2
    assert "nothing was changed" not in said
    assert "the gate stage refused the input after this build wrote plan.json, manifest.json, checkpoint/, .stages/" in said
    assert "qkv has 7 rows" in said


def test_refusal_before_any_write_still_says_nothing_changed(capsys):
    from invoke import Exit

    from precision_pipeline.core.errors import UserError

    @_tasks().guarded
    def job():
        raise UserError("--golden-limit", "'0' is not a whole number >= 1.", "pass e.g. --golden-limit 1.")

    with pytest.raises(Exit):
        job()
    assert "the input was refused; nothing was changed." in "".join(capsys.readouterr())
