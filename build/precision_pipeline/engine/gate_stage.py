"""The engine gate as a stage: the golden set against the engine itself, after it was built.

Runs after ``engine`` and before ``pack``, so an engine that fails is never packed (exit 3, like
the checkpoint gate). Where there is nothing to gate or nothing to gate it with, the stage is
``skipped`` and says why (no engine was built here; no ``tensorrt_llm`` runner or no CUDA device);
``--strict`` turns that into exit 4, like every skipped stage.

**Where its logits come from.** The metrics need every answer position's full distribution
(KL, top-1), which an engine returns only when built with ``--gather_context_logits``. Shipped
profiles leave it off (the logits buffer is ``max_num_tokens x vocab x 4`` bytes per GPU in
production). So when the served engine does not gather them, this stage builds a second,
gate-only engine from the same checkpoint with the same argv plus ``--gather_context_logits``
into ``<out>/engine_gate/engine`` (never packed) and gates that one: same weights, same kernels,
same plugins, one flag apart, at the cost of one more ``trtllm-build`` on the build node. When the
served engine already gathers context logits, it is gated directly. Generation log-probs were not
used: they carry only the sampled token's probability, not the distribution.

Keyed: the engine stage's key (so the served engine and the checkpoint), plus everything the
checkpoint gate's key has (model, thresholds, golden file, ``GateOptions``). Written to
``<out>/engine_gate/`` (``metrics.json``, reports; the gate-only engine in ``engine/``), recorded in
the manifest next to the checkpoint gate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from precision_pipeline.core.fingerprint import Fingerprint
from precision_pipeline.core.errors import PipelineError
from precision_pipeline.core.stage import Artifact, Done, Frozen, Stage, gate_failure
from precision_pipeline.engine.stage import EngineInputs
from precision_pipeline.gate.stage import GateInputs, GateStage
from precision_pipeline.resolve.plan import ResolvedPlan
from precision_pipeline.resolve.stage import BuildRequest

OUTPUT = "engine_gate"
GATE_ENGINE = "engine"
"""The gate-only engine's folder inside ``<out>/engine_gate``."""


class EngineGateInputs(Frozen):
    engine: Fingerprint
    """The engine stage's key and the served engine's folder."""
    engine_built: bool
    engine_reason: str = ""
    engine_plan: EngineInputs
    """What the served engine was built from (the gate-only build changes one flag of it)."""
    gate: GateInputs
    """The checkpoint gate's inputs: the same model, thresholds, golden prompts and options."""


class EngineGateArtifact(Artifact):
    """The engine gate's verdict (``passed`` None when skipped) and headline numbers."""

    passed: bool | None = None
    gated_engine: str = ""
    """The folder that was gated: the served engine, or the gate-only build with context logits."""
    failed_metrics: tuple[str, ...] = ()
    numbers: dict[str, Any] = {}

    def summary(self) -> dict[str, Any]:
        return dict(self.numbers)

    def present(self, out_dir: Path) -> bool:
        return (Path(out_dir) / OUTPUT / "metrics.json").is_file()

    def blocking(self, subject: str, folder: Optional[Path]) -> Optional[PipelineError]:
        """``GateFailed`` (exit 3) when the engine failed its gate: it is not packed."""
        if self.status != "failed":
            return None
        return gate_failure("engine gate", subject, self.failed_metrics, folder, note="the engine is not packed")


def _skipped(reason: str, workdir: Path) -> EngineGateArtifact:
    from precision_pipeline.core.store import atomic_write_json

    atomic_write_json(Path(workdir) / "metrics.json", {"status": "skipped", "reason": reason, "passed": None})
    return EngineGateArtifact(status="skipped", reason=reason)


class EngineGateStage(Stage[EngineGateInputs, EngineGateArtifact]):
    name = "engine_gate"
    version = 1
    code = ("engine", "gate", "checkpoint", "spec", "core")
    needs = ("quantize", "gate", "engine")
    output = OUTPUT
    artifact_type = EngineGateArtifact
    reuse_failed = True  # a failed verdict of unchanged inputs stands (exit 3 again, not re-measured)

    def inputs(self, plan: ResolvedPlan, request: BuildRequest, upstream: Mapping[str, Done]) -> EngineGateInputs:
        from precision_pipeline.engine.stage import EngineStage

        e = upstream["engine"]
        engine_plan = EngineStage().inputs(plan, request, upstream)
        return EngineGateInputs(engine=Fingerprint(sha256=e.key, path=e.dir or Path(request.out_dir) / "engine"),
                                engine_built=bool(e.artifact.built), engine_reason=e.artifact.reason,
                                engine_plan=engine_plan, gate=GateStage().inputs(plan, request, upstream))

    def run(self, inputs: EngineGateInputs, workdir: Path) -> EngineGateArtifact:
        from precision_pipeline.gate.engine_gate import EngineGateSkipped, engine_available, run_engine_gate

        if not inputs.engine_built:
            return _skipped("no engine to gate: the engine stage was skipped", workdir)
        ok, why = engine_available()
        if not ok:
            return _skipped(why, workdir)
        served = Path(inputs.engine.path)
        gated = served
        if not inputs.engine_plan.effective.gather_context_logits:
            gated = self._gate_only_engine(inputs, Path(workdir))
        g = inputs.gate
        options = g.options.model_copy(update={"golden_path": g.golden.path})
        res = run_engine_gate(gated, g.model.path, g.thresholds, Path(workdir), options)
        final = str(Path(inputs.engine.path).parent / OUTPUT / GATE_ENGINE) if gated != served else str(served)
        if isinstance(res, EngineGateSkipped):
            return EngineGateArtifact(status="skipped", reason=res.reason, gated_engine=final)
        failed = tuple(res.failed_metrics())
        return EngineGateArtifact(status="done" if res.passed else "failed",
                                  reason="" if res.passed else "engine gate failed: " + ", ".join(failed),
                                  passed=bool(res.passed), gated_engine=final, failed_metrics=failed,
                                  numbers={**res.summary(), "gated_engine": final})

    @staticmethod
    def _gate_only_engine(inputs: EngineGateInputs, workdir: Path) -> Path:
        """Build the served argv plus ``--gather_context_logits`` into ``workdir/engine`` (never packed)."""
        from precision_pipeline.engine.trtllm_build import run_engine

        p = inputs.engine_plan
        plan = p.model_copy(update={"effective": p.effective.model_copy(update={"gather_context_logits": True})})
        target = workdir / GATE_ENGINE
        target.mkdir(parents=True, exist_ok=True)
        run_engine(plan, p.checkpoint.path, target, p.sm, p.toolchain, workdir=target, checkpoint_key=p.checkpoint.sha256,
                   gpu_name=p.gpu_name, need_bytes=p.need_bytes, strict=p.strict)
        return target


__all__ = ["EngineGateInputs", "EngineGateArtifact", "EngineGateStage", "OUTPUT", "GATE_ENGINE"]
