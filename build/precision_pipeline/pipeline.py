"""The main job: the profile's route (a tuple of stages, ``ROUTES``) run by the one loop (``core/route.py``).

``run_build`` is what ``invoke build`` calls. Each stage (``core/stage.py``) declares its typed inputs, needs
and code; ``StageRunner`` alone keys, reuses, commits and records it, so an unchanged build takes seconds and an
unchanged engine is not built again. Output layout (``artifacts/<profile>/`` by default)::

    plan.json  checkpoint/  gate/  engine/  model_repository/  k8s/  manifest.json  (.stages/: typed artifact records)
    .precision-build.json  (the marker: a build output)  .build.lock (+ .json: its holder; see core/outputs.py)

Order: every input is checked before the first write: ``build_request`` (profile, ``--model``, ``--out``,
``--checkpoint`` down to each tensor's byte range, ``--golden-limit``, ``--repo-root``, ``--image``, ``--device``),
then ``core.route.prepare`` (the resolve rules, and every stage's preflight: a dataset's token lengths, a build
node's GPUs and flags). Then the output is created and locked, interrupted stage swaps are rolled forward
(``core.store.clean_stale``), and the stages run (``core.route.run_stages``). ``plan.json`` is written after each
stage that ran and at the end, so a kill during a stage leaves the previous plan.json with the previous artifacts.

Errors: ``UserError`` (exit 2) before any write for bad input or refused checks; ``GateFailed`` (exit 3);
``StrictSkip`` (exit 4) when a stage was skipped under ``strict``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from precision_pipeline.checkpoint.stage import VerifyStage
from precision_pipeline.core.errors import UserError
from precision_pipeline.core.outputs import (check_serving_path, default_out_dir, output_lock, read_output_marker, say,
                                             refuse_out_inside_inputs, validate_out_dir, write_output_marker)
from precision_pipeline.core.route import Route, manifest_facts, prepare, run_stages
from precision_pipeline.core.stage import RECORDS_DIR, Done, Manifest, Stage, StageRecord, StageRunner
from precision_pipeline.core.store import atomic_write_json, clean_stale
from precision_pipeline.engine.job import JOB_STAGES
from precision_pipeline.engine.llm_api_config import LlmApiConfigStage
from precision_pipeline.gate.stage import GateStage
from precision_pipeline.quantize.job import EXPORT_FORMAT_OF_ROUTE as LAYOUT_OF_ROUTE  # the checkpoint each route loads
from precision_pipeline.quantize.stage import QuantizeStage
from precision_pipeline.resolve.plan import ResolvedPlan
from precision_pipeline.resolve.stage import BuildRequest, ResolveStage
from precision_pipeline.serving.stage import DeployStage, LlmApiDeployStage, LlmApiPackStage, PackStage

ROUTES: dict[str, Route] = {
    "engine": Route("engine", (ResolveStage(), QuantizeStage(), VerifyStage(), GateStage(), *JOB_STAGES, PackStage(),
                               DeployStage()),
                    doc="TensorRT-LLM engine (trtllm-build) served by Triton's tensorrtllm backend"),
    "llm_api": Route("llm_api", (ResolveStage(), QuantizeStage(), VerifyStage(), GateStage(), LlmApiConfigStage(),
                                 LlmApiPackStage(), LlmApiDeployStage()),
                     doc="the gated checkpoint served by TensorRT-LLM's LLM API (PyTorch backend): trtllm-serve --config "
                         "or Triton's LLM-API model.yaml"),
}
"""Serving route (the profile's ``route``) -> its stages in order. A new route is one entry here plus its new
stages (README, Architecture). ``engine``'s ``engine`` and ``engine_gate`` are the build Job's (``engine/job.py``)."""


def route_of(profile) -> Route:
    """The route a profile names (``Profile.route``; the schema admits only the routes above)."""
    return ROUTES[profile.route]


def stage_folders() -> tuple[str, ...]:
    """The folders any route's stages write under the output, and the records (interrupted swaps are recovered)."""
    return tuple(dict.fromkeys(f for r in ROUTES.values() for f in r.folders())) + (RECORDS_DIR,)


@dataclass
class BuildResult:
    """What ``run_build`` produced: the stage rows and the output directory."""

    out_dir: Path
    stages: list[StageRecord]
    manifest: dict


def _checked_out_dir(out_dir: Path, inputs: dict[str, Path | str | None]) -> Path:
    """``--out`` resolved and checked (UserError otherwise): a path Triton's stubs can start from, before any
    filesystem call on it (non-ASCII names included) and again resolved (a symlink may lead elsewhere), outside the
    input folders ``inputs`` ({flag: folder}), new, empty or a build output (``validate_out_dir``)."""
    check_serving_path(out_dir.absolute(), "--out")
    refuse_out_inside_inputs(out_dir, inputs)
    out_dir = validate_out_dir(out_dir, stage_folders())
    check_serving_path(out_dir, "--out")
    return out_dir


def build_request(profile_ref: str, model: str | None = None, out: str | None = None, strict: bool = False,
                  repo_root: str | None = None, golden_limit: int | None = None, checkpoint: str | None = None,
                  image: str | None = None, device: str = "auto", reference_dtype: str = "float32") -> BuildRequest:
    """The typed request of ``invoke build``'s flags (the one place they become one): the profile loaded and every
    path and option validated (folders, files, JSON, tensor byte ranges, limits, image, ``--device``). Profile and
    model rules run in resolve. Writes nothing; raises UserError."""
    from precision_pipeline.checkpoint.verify import check_checkpoint_dir
    from precision_pipeline.gate.options import check_golden_limit
    from precision_pipeline.gate.verdict import load_build_profile
    from precision_pipeline.serving.deploy import DEFAULT_IMAGE, check_image, check_repo_root
    from precision_pipeline.spec.default_model import model_dir
    from precision_pipeline.spec.device import choose_device

    profile = load_build_profile(profile_ref)
    model_path = model_dir(model)
    out_dir = _checked_out_dir(Path(out).expanduser() if out else default_out_dir(profile.name or "profile"),
                               {"--model": model_path, "--checkpoint": checkpoint})
    ck = check_checkpoint_dir(checkpoint, LAYOUT_OF_ROUTE[profile.route], profile.route) if checkpoint is not None else None
    check_golden_limit(golden_limit)
    if repo_root is not None:
        check_repo_root(repo_root)
        check_serving_path(repo_root, "--repo-root")
    if image is not None:
        check_image(image, "--image")
    return BuildRequest(profile=profile, profile_source=str(profile_ref), model_dir=model_path, out_dir=out_dir,
                        checkpoint=ck, golden_limit=golden_limit, repo_root=repo_root or str(out_dir),
                        image=image or DEFAULT_IMAGE, strict=strict, device=choose_device(device, reference_dtype))


def run_build(profile_ref: str, model: str | None = None, out: str | None = None, strict: bool = False,
              repo_root: str | None = None, golden_limit: int | None = None, checkpoint: str | None = None,
              image: str | None = None, on_stage: Callable[[StageRecord], None] | None = None, wait: bool = True,
              on_wait: Callable[[str], None] | None = None, device: str = "auto",
              reference_dtype: str = "float32") -> BuildResult:
    """Run the main job for a profile (see the module docstring for order and errors). The flags are those of
    ``invoke build`` (``build_request``); ``on_stage`` is called after each stage (live printing); ``wait``: when
    another build holds the output's lock, wait for it (``on_wait(message)`` every few seconds), False: refuse at
    once (UserError on ``--out`` naming the holder)."""
    req = build_request(profile_ref, model, out, strict, repo_root, golden_limit, checkpoint, image, device,
                        reference_dtype)
    say(f"[device] {req.device.short()}: {req.device.reason}")
    return run_prepared(req, prepare(route_of(req.profile).stages, req), on_stage, wait, on_wait)


def run_prepared(req: BuildRequest, prepared: tuple[ResolvedPlan, dict[str, Done]],
                 on_stage: Callable[[StageRecord], None] | None = None, wait: bool = True,
                 on_wait: Callable[[str], None] | None = None) -> BuildResult:
    """The writing half of ``run_build`` for a request whose route ``core.route.prepare`` checked (``prepared``: its
    plan and the stages it ran); ``invoke nightly`` calls it after checking every profile first."""
    plan, done = prepared
    route, out_dir = route_of(req.profile), req.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)  # the first write: every input was checked above
    with output_lock(out_dir, f"build of {req.profile.name}", wait, on_wait or say):
        validate_out_dir(out_dir, stage_folders())  # again, under the lock
        marker = read_output_marker(out_dir)
        if marker is None:
            write_output_marker(out_dir, req.profile.name)
        elif marker.get("profile") and marker["profile"] != req.profile.name:  # hostile s15b F22: replaced silently
            raise UserError("--out", f"{out_dir} holds the build of profile {marker['profile']!r} (its "
                            f".precision-build.json), not {req.profile.name!r}: this build would replace it.",
                            f"give another --out (the default is artifacts/{req.profile.name}), or delete that output "
                            "first if its build is no longer wanted.")
        left = clean_stale(out_dir, names=stage_folders())  # a killed build's staged copies (.checkpoint.tmp-*)
        if left:
            say(f"[build] removed what an interrupted build left: {', '.join(sorted(left))}")
        manifest = Manifest.open(out_dir / "manifest.json", profile=req.profile.name, profile_source=req.profile_source,
                                 model_dir=str(req.model_dir), out_dir=str(out_dir))
        runner = StageRunner(out_dir, manifest, on_stage)
        view: dict = {}

        def write_plan() -> None:  # the plan goes with the stages it describes (plan.json shows the checkpoint)
            atomic_write_json(out_dir / "plan.json", plan.to_json(**view))

        def on_done(stage: Stage, d: Done) -> None:
            view.update(d.artifact.plan_view())
            if d.record.status != "cached" and not stage.provides_plan:
                write_plan()
                runner.also_written[:] = ["plan.json"]

        def finish(all_done: dict[str, Done]) -> None:
            write_plan()
            manifest.finish(**manifest_facts(all_done))

        run_stages(route.stages, plan, req, runner, done, req.profile.name, on_done, finish)
    return BuildResult(out_dir, runner.records, manifest.render())


__all__ = ["ROUTES", "route_of", "stage_folders", "BuildResult", "build_request", "run_build", "run_prepared"]
