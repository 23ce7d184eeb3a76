"""The engine as a stage: ``trtllm-build`` run through the runner like every other stage.

Keyed: the checkpoint (quantize key; the gate's key is upstream too, so an engine is only ever
recorded for a gated checkpoint), the output folder (the args file records it), the target SM,
GPU and per-GPU bytes, the plan's mapping / limits / effective settings, and the probed
``Toolchain``. An engine that was built (``done``) with an unchanged key is not built again; a
``skipped`` engine is never reused, and because the toolchain is in the key, installing
TensorRT-LLM changes the key anyway.

Built elsewhere: on a node that cannot build (no toolchain), an engine folder already in place
whose ``provenance.json`` verifies and names this checkpoint key stands for the toolchain that
built it (its recorded ``Toolchain`` is used for the key). So an engine built by the Kubernetes
build Job into the same output folder is a cache hit for the CPU side's pack, not replaced by a
skip. ``strict`` (``--strict``) is not keyed: it only decides whether unknown flags are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.fingerprint import Fingerprint
from precision_pipeline.core.stage import Artifact, Done, Frozen, Stage
from precision_pipeline.engine import toolchain as toolchain_mod
from precision_pipeline.engine.preflight import plan_need_bytes, preflight
from precision_pipeline.engine.provenance import read_provenance, verify_engine_dir
from precision_pipeline.engine.toolchain import Toolchain
from precision_pipeline.engine.trtllm_build import ARGS_FILE, build_args, run_engine
from precision_pipeline.resolve.plan import Effective, Limits, Mapping as PlanMapping, ResolvedPlan
from precision_pipeline.resolve.stage import BuildRequest


class EngineInputs(Frozen):
    checkpoint: Fingerprint
    engine_dir: str
    """Absolute final folder of the engine (``--output_dir`` in the recorded command)."""
    sm: int
    gpu_name: str = ""
    need_bytes: int = 0
    """Per-GPU bytes the plan needs (weights + activation estimate), checked by preflight."""
    mapping: PlanMapping
    limits: Limits
    effective: Effective
    """Everything the argv's plugin flags are made of, gather_context_logits included."""
    toolchain: Toolchain
    strict: bool = False

    unkeyed = {"strict": "--strict decides only whether an unknown trtllm-build flag is refused (preflight), not what "
                         "is built: a refusal writes nothing, and the same argv builds the same engine either way"}


class EngineArtifact(Artifact):
    """``built``: an engine is in ``<out>/engine`` (status done); otherwise only the command line (skipped)."""

    built: bool
    argv: tuple[str, ...]
    args_file: str
    warnings: tuple[str, ...] = ()

    def summary(self) -> dict[str, Any]:
        return {"args": self.args_file}

    def present(self, out_dir: Path) -> bool:
        return Path(self.args_file).is_file()

    def manifest_facts(self) -> dict[str, Any]:
        return {"engine_present": bool(self.built)}


def built_elsewhere(engine_dir: Path, checkpoint_key: str):
    """The Toolchain recorded by a verified engine in ``engine_dir`` built from ``checkpoint_key``, else None."""
    rec = read_provenance(engine_dir)
    if rec is None or rec.get("checkpoint_key") != checkpoint_key or not isinstance(rec.get("toolchain"), dict):
        return None
    try:
        verify_engine_dir(engine_dir)
        return Toolchain.model_validate(rec["toolchain"])
    except (UserError, ValueError):
        return None


class EngineStage(Stage[EngineInputs, EngineArtifact]):
    name = "engine"
    version = 2
    code = ("engine", "core")
    needs = ("quantize", "gate")
    output = "engine"
    artifact_type = EngineArtifact

    def inputs(self, plan: ResolvedPlan, request: BuildRequest, upstream: Mapping[str, Done]) -> EngineInputs:
        q = upstream["quantize"]
        engine_dir = (Path(request.out_dir) / self.output).resolve()
        tc = toolchain_mod.detect_toolchain()
        if not tc.present():
            tc = built_elsewhere(engine_dir, q.key) or tc
        return EngineInputs(checkpoint=Fingerprint(sha256=q.key, path=q.dir), engine_dir=str(engine_dir), sm=plan.gpu.sm,
                            gpu_name=str(plan.gpu.name or ""), need_bytes=plan_need_bytes(plan),
                            mapping=plan.mapping, limits=plan.limits, effective=plan.effective, toolchain=tc,
                            strict=request.strict)

    def preflight(self, plan: ResolvedPlan, request: BuildRequest) -> None:
        """On a build node (a toolchain is there), the engine preflight before quantize: refusals cost no GPU time
        (``engine/preflight.py``; ``--strict`` refuses unknown flags)."""
        tc = toolchain_mod.detect_toolchain()
        if tc.present() and plan.gpu is not None:
            preflight(tc, sm=plan.gpu.sm, gpu_name=plan.gpu.name, need_bytes=plan_need_bytes(plan),
                      argv=build_args(plan, Path("checkpoint"), Path("engine")), strict=request.strict)

    def run(self, inputs: EngineInputs, workdir: Path) -> EngineArtifact:
        res = run_engine(inputs, inputs.checkpoint.path, Path(inputs.engine_dir), inputs.sm, inputs.toolchain, workdir=workdir,
                         checkpoint_key=inputs.checkpoint.sha256, gpu_name=inputs.gpu_name, need_bytes=inputs.need_bytes,
                         strict=inputs.strict)
        return EngineArtifact(status=res.status, reason=res.reason, built=res.status == "done", argv=tuple(res.argv),
                              args_file=str(Path(inputs.engine_dir) / ARGS_FILE), warnings=tuple(res.warnings))


__all__ = ["EngineInputs", "EngineArtifact", "EngineStage", "built_elsewhere"]
