"""The engine as a stage: ``trtllm-build`` run through the runner like every other stage.

Keyed: the checkpoint (quantize key; the gate's key is upstream too, so an engine is only ever
recorded for a gated checkpoint), the output folder (the args file records it), the target SM,
the plan's mapping / limits / effective settings, and the probed ``Toolchain``. An engine that
was built (``done``) with an unchanged key is not built again; a ``skipped`` engine is never
reused, and because the toolchain is in the key, installing TensorRT-LLM changes the key anyway.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from precision_pipeline.core.fingerprint import Fingerprint
from precision_pipeline.core.stage import Artifact, Done, Frozen, Stage
from precision_pipeline.engine import toolchain as toolchain_mod
from precision_pipeline.engine.toolchain import Toolchain
from precision_pipeline.engine.trtllm_build import ARGS_FILE, run_engine
from precision_pipeline.resolve.plan import Effective, Limits, Mapping as PlanMapping


class EngineInputs(Frozen):
    checkpoint: Fingerprint
    engine_dir: str
    """Absolute final folder of the engine (``--output_dir`` in the recorded command)."""
    sm: int
    mapping: PlanMapping
    limits: Limits
    effective: Effective
    """Everything the argv's plugin flags are made of, gather_context_logits included."""
    toolchain: Toolchain


class EngineArtifact(Artifact):
    """``built``: an engine is in ``<out>/engine`` (status done); otherwise only the command line (skipped)."""

    built: bool
    argv: tuple[str, ...]
    args_file: str

    def summary(self) -> dict[str, Any]:
        return {"args": self.args_file}

    def present(self, out_dir: Path) -> bool:
        return Path(self.args_file).is_file()


class EngineStage(Stage[EngineInputs, EngineArtifact]):
    name = "engine"
    version = 1
    code = ("engine", "core")
    needs = ("quantize", "gate")
    output = "engine"
    artifact_type = EngineArtifact

    def inputs(self, plan, request, upstream: Mapping[str, Done]) -> EngineInputs:
        q = upstream["quantize"]
        return EngineInputs(checkpoint=Fingerprint(sha256=q.key, path=q.dir),
                            engine_dir=str((Path(request.out_dir) / self.output).resolve()), sm=plan.gpu.sm,
                            mapping=plan.mapping, limits=plan.limits, effective=plan.effective,
                            toolchain=toolchain_mod.detect_toolchain())

    def run(self, inputs: EngineInputs, workdir: Path) -> EngineArtifact:
        res = run_engine(inputs, inputs.checkpoint.path, Path(inputs.engine_dir), inputs.sm, inputs.toolchain, workdir=workdir)
        return EngineArtifact(status=res.status, reason=res.reason, built=res.status == "done", argv=tuple(res.argv),
                              args_file=str(Path(inputs.engine_dir) / ARGS_FILE))


__all__ = ["EngineInputs", "EngineArtifact", "EngineStage"]
