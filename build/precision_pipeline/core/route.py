"""A route (a serving path: which stages make its artifacts, in order) and the one loop that runs a tuple of stages.

``invoke build`` (``pipeline.run_build``), the Kubernetes engine-build Job (``engine/job.py``) and
``invoke nightly``'s checks (``nightly._check``) all go through the two functions here, so the
order of checks, the blocking verdicts and ``--strict`` mean the same everywhere:

1. ``prepare(stages, request)``: before anything is written. The stage that ``provides_plan``
   (resolve) is executed without an output folder (it writes nothing), then every stage's
   ``preflight(plan, request)`` runs (a dataset's token lengths, a build node's GPUs and flags).
   Any refusal is a ``UserError`` (exit 2) with nothing written.
2. ``run_stages(stages, plan, request, runner, done, subject)``: each stage in order through the
   ``StageRunner`` (keyed, cached, committed atomically, recorded). A stage ``prepare`` already
   executed is committed (its record and manifest row), not run again. After each stage its
   artifact's ``blocking`` verdict is raised (a failed gate: ``GateFailed``, exit 3), so nothing
   after it runs. A ``UserError`` a stage raises is annotated with the stage and what the run had
   written (``UserError.stage`` / ``.written``). At the end, ``finish(done)`` (the manifest), then
   ``StrictSkip`` (exit 4) under ``request.strict`` when any stage was skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from precision_pipeline.core.errors import StrictSkip, UserError
from precision_pipeline.core.stage import Done, Stage, StageRecord, StageRunner, execute

if TYPE_CHECKING:  # annotations only (higher layer)
    from precision_pipeline.resolve.plan import ResolvedPlan
    from precision_pipeline.resolve.stage import BuildRequest


@dataclass(frozen=True)
class Route:
    """A serving route: its name (the profile's ``route``) and the stages that build it, in order (each stage's
    ``needs`` come earlier in the tuple). ``doc``: one line for the README and ``invoke`` help."""

    name: str
    stages: tuple[Stage, ...]
    doc: str = ""

    def folders(self) -> tuple[str, ...]:
        """The folders its stages write under a build output."""
        return tuple(s.output for s in self.stages if s.output)


def prepare(stages: tuple[Stage, ...], request: "BuildRequest", plan: Optional["ResolvedPlan"] = None,
            ) -> tuple["ResolvedPlan", dict[str, Done]]:
    """Step 1 (module docstring): the plan (from the stage that ``provides_plan``, or ``plan`` as given) and every
    stage's preflight; writes nothing. Returns (plan, {name: Done} of the stages executed here). Raises UserError."""
    done: dict[str, Done] = {}
    for stage in stages:
        if stage.provides_plan:
            if stage.output is not None:
                raise TypeError(f"stage {stage.name} provides the plan and so runs before the first write: it may "
                                "not write a folder")
            d = done[stage.name] = execute(stage, plan, request, done)  # no out_dir: writes nothing
            plan = d.artifact.plan
    if plan is None:
        raise TypeError("no plan: give one, or a stage that provides it (resolve)")
    for stage in stages:
        stage.preflight(plan, request)
    return plan, done


def _strict_check(records: list[StageRecord], strict: bool) -> None:
    skipped = [r for r in records if r.status == "skipped"]
    if strict and skipped:
        raise StrictSkip("--strict: stage(s) skipped: " + "; ".join(f"{r.name} ({r.reason})" for r in skipped))


def run_stages(stages: tuple[Stage, ...], plan: "ResolvedPlan", request: "BuildRequest", runner: StageRunner,
               done: Mapping[str, Done], subject: str, on_done: Optional[Callable[[Stage, Done], None]] = None,
               finish: Optional[Callable[[dict[str, Done]], None]] = None) -> dict[str, Done]:
    """Step 2 (module docstring). ``done``: the stages ``prepare`` executed (committed here) and upstream results
    from elsewhere (the Job's recorded quantize and gate). ``subject``: the profile's name, for the verdicts.
    ``on_done(stage, d)`` after each stage (``plan.json``); ``finish(done)`` after the last. Returns every Done."""
    done = dict(done)
    for stage in stages:
        try:
            if stage.name in done and stage.provides_plan:
                d = runner.commit(stage, done[stage.name])
            else:
                d = done[stage.name] = runner.run(stage, plan, request, done)
        except UserError as e:  # refused after writes: say what was written (tasks.py prints it)
            e.stage = stage.name
            e.written = runner.written()
            raise
        if on_done is not None:
            on_done(stage, d)
        err = d.artifact.blocking(subject, d.dir)
        if err is not None:
            raise err
    if finish is not None:
        finish(done)
    _strict_check(runner.records, request.strict)
    return done


def manifest_facts(done: Mapping[str, Done]) -> dict[str, Any]:
    """The manifest's top-level facts decided by these stages' artifacts (``Artifact.manifest_facts``)."""
    out: dict[str, Any] = {}
    for d in done.values():
        out.update(d.artifact.manifest_facts())
    return out


__all__ = ["Route", "prepare", "run_stages", "manifest_facts"]
