"""The one loop (``core/route.py``): preflights before any write, blocking verdicts of any stage (no names), the
plan stage committed through the runner, refusals that say what was written, and --strict at the end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest

from precision_pipeline.core.errors import GateFailed, PipelineError, StrictSkip, UserError
from precision_pipeline.core.route import prepare, run_stages
from precision_pipeline.core.stage import RECORDS_DIR, Artifact, Frozen, Manifest, Stage, StageRunner


class In(Frozen):
    name: str


class PlanArt(Artifact):
    plan: dict


class Art(Artifact):
    block: bool = False

    def blocking(self, subject: str, folder: Optional[Path]) -> Optional[PipelineError]:
        return GateFailed(f"verdict of {subject}") if self.block else None


class Req(Frozen):
    strict: bool = False


def _stage(name: str, calls: list, *, output: Optional[str] = None, status: str = "done", block: bool = False,
           refuse_in: str = "", plan: bool = False):
    class S(Stage):
        artifact_type = PlanArt if plan else Art
        provides_plan = plan

        def inputs(self, p, request, upstream):
            return In(name=self.name)

        def preflight(self, p, request):
            calls.append(("preflight", self.name))
            if refuse_in == "preflight":
                raise UserError(self.name, "refused in preflight.")

        def run(self, inputs, workdir):
            calls.append(("run", self.name))
            if refuse_in == "run":
                raise UserError(self.name, "refused while running.")
            if workdir is not None:
                (workdir / "x").write_text("1")
            if plan:
                return PlanArt(plan={"p": 1})
            return Art(status=status, reason="not here" if status == "skipped" else "", block=block)

    S.name, S.output = name, output
    return S()


def _runner(out: Path) -> StageRunner:
    out.mkdir(parents=True, exist_ok=True)
    return StageRunner(out, Manifest.open(out / "manifest.json", profile="p", profile_source="p", model_dir="m",
                                          out_dir=str(out)))


def test_every_preflight_runs_before_any_stage_and_a_refusal_there_writes_nothing(tmp_path):
    calls: list = []
    stages = (_stage("plan", calls, plan=True), _stage("a", calls, output="a"), _stage("b", calls, refuse_in="preflight"))
    with pytest.raises(UserError, match="refused in preflight"):
        prepare(stages, Req())
    assert calls == [("run", "plan"), ("preflight", "plan"), ("preflight", "a"), ("preflight", "b")]
    assert list(tmp_path.iterdir()) == []


def test_the_plan_stage_is_committed_by_the_runner_and_any_blocking_artifact_stops_the_rest(tmp_path):
    calls: list = []
    stages = (_stage("plan", calls, plan=True), _stage("first", calls, output="f"),
              _stage("judge", calls, output="j", block=True), _stage("after", calls, output="z"))
    plan, done = prepare(stages, Req())
    assert plan == {"p": 1} and list(done) == ["plan"]
    runner = _runner(tmp_path / "out")
    with pytest.raises(GateFailed, match="verdict of prof"):
        run_stages(stages, plan, Req(), runner, done, "prof")
    assert [c for c in calls if c[0] == "run"] == [("run", "plan"), ("run", "first"), ("run", "judge")]
    rec = json.loads((tmp_path / "out" / RECORDS_DIR / "plan.json").read_text())
    assert rec["stage"] == "plan" and rec["artifact"]["plan"] == {"p": 1}  # written by the runner, not by hand
    assert [r.name for r in runner.records] == ["plan", "first", "judge"] and not (tmp_path / "out" / "z").exists()


def test_a_refusal_after_writes_names_the_stage_and_what_was_written(tmp_path):
    calls: list = []
    stages = (_stage("plan", calls, plan=True), _stage("first", calls, output="f"), _stage("second", calls, refuse_in="run"))
    plan, done = prepare(stages, Req())
    with pytest.raises(UserError) as e:
        run_stages(stages, plan, Req(), _runner(tmp_path / "out"), done, "prof")
    assert e.value.stage == "second" and e.value.written == ("manifest.json", "f/", ".stages/")


@pytest.mark.parametrize("strict", [False, True])
def test_a_skipped_stage_is_exit_4_only_under_strict_after_finish(tmp_path, strict):
    calls: list = []
    stages = (_stage("plan", calls, plan=True), _stage("maybe", calls, status="skipped"), _stage("last", calls))
    plan, done = prepare(stages, Req(strict=strict))
    finished = []
    run = lambda: run_stages(stages, plan, Req(strict=strict), _runner(tmp_path / "out"), done, "prof",  # noqa: E731
                             finish=lambda d: finished.append(sorted(d)))
    if strict:
        with pytest.raises(StrictSkip, match=r"--strict: stage\(s\) skipped: maybe \(not here\)"):
            run()
    else:
        assert sorted(run()) == ["last", "maybe", "plan"]
    assert finished == [["last", "maybe", "plan"]]  # the manifest is finished first, either way
