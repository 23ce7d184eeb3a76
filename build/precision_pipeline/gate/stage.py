"""The accuracy gate as a stage: the checkpoint judged against the model on the golden set.

Keyed: the checkpoint (the quantize stage's key), the model's content fingerprint (so the same
checkpoint gated against another ``--model`` is not a cache hit), the thresholds, the golden
file's content and every ``GateOptions`` field (what is measured: prompts per category, held-out
tokens, greedy tokens, bootstrap, seed; the build's device, reference dtype and candidate dtype
when they are not the CPU defaults). ``GateRuntime`` (threads, progress) is never keyed. The
code key covers gate/, checkpoint/, spec/, core/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from precision_pipeline.core.fingerprint import Fingerprint, fingerprint, model_fingerprint
from precision_pipeline.core.stage import Artifact, Done, Frozen, Stage
from precision_pipeline.gate.options import GateOptions
from precision_pipeline.spec.profile import GateThresholds


class GateInputs(Frozen):
    checkpoint: Fingerprint
    """The quantize stage's key and its folder."""
    model: Fingerprint
    thresholds: GateThresholds
    golden: Fingerprint
    """The golden prompts file, by content (its path is not keyed)."""
    options: GateOptions
    """What the gate measures (``golden_path`` left None here: the file is keyed by ``golden``)."""


class GateArtifact(Artifact):
    """The verdict and headline numbers (``<out>/gate``: metrics.json, report.md, report.html)."""

    passed: bool
    failed_metrics: tuple[str, ...] = ()
    numbers: dict[str, Any]

    def summary(self) -> dict[str, Any]:
        return dict(self.numbers)

    def present(self, out_dir: Path) -> bool:
        return (Path(out_dir) / "gate" / "metrics.json").is_file()


def golden_file() -> Path:
    """The golden set the gate reads (``gate.golden.GOLDEN_PATH``, looked up at call time)."""
    from precision_pipeline.gate import golden

    return golden.GOLDEN_PATH


class GateStage(Stage[GateInputs, GateArtifact]):
    name = "gate"
    version = 1
    code = ("gate", "checkpoint", "spec", "core")
    needs = ("quantize",)
    output = "gate"
    artifact_type = GateArtifact
    reuse_failed = True  # a failed verdict of unchanged inputs stands (exit 3 again, not re-measured)

    def inputs(self, plan, request, upstream: Mapping[str, Done]) -> GateInputs:
        q = upstream["quantize"]
        d = getattr(request, "device", None)
        compute = {} if d is None else {"device": d.device, "reference_dtype": d.reference_dtype,
                                        "candidate_dtype": d.compute_dtype(plan.profile.quantization.dtype)}
        return GateInputs(checkpoint=Fingerprint(sha256=q.key, path=q.dir), model=model_fingerprint(request.model_dir),
                          thresholds=plan.profile.gate.for_model(Path(request.model_dir).name),
                          golden=fingerprint(golden_file()),
                          options=GateOptions(prompts_per_category=request.golden_limit, **compute))

    def run(self, inputs: GateInputs, workdir: Path) -> GateArtifact:
        from precision_pipeline.gate import checkpoint_gate

        options = inputs.options.model_copy(update={"golden_path": inputs.golden.path})
        res = checkpoint_gate.gate_checkpoint(inputs.checkpoint.path, inputs.model.path, inputs.thresholds, workdir,
                                              options)
        failed = tuple(res.failed_metrics())
        return GateArtifact(status="done" if res.passed else "failed",
                            reason="" if res.passed else "accuracy gate failed: " + ", ".join(failed),
                            passed=bool(res.passed), failed_metrics=failed, numbers=res.summary())


__all__ = ["GateInputs", "GateArtifact", "GateStage"]
