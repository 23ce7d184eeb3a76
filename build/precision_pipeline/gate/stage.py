"""The accuracy gate as a stage: the checkpoint judged against the model on the golden set.

Keyed: the checkpoint (the quantize stage's key), the model's content fingerprint (so the same
checkpoint gated against another ``--model`` is not a cache hit), the thresholds, the golden
file's content and every ``GateOptions`` field (what is measured: prompts per category, held-out
tokens, greedy tokens, bootstrap, seed; the build's device, reference dtype and candidate dtype
when they are not the CPU defaults). ``GateRuntime`` (threads, progress) is never keyed. The
code key covers gate/, checkpoint/, spec/, core/.

A threshold-only change (same measurement key: everything above but the thresholds) changes the stage key
but is not measured again: the stored numbers (``metrics.json``, ``per_token.npz``) are judged against the
new thresholds (``checkpoint_gate.rejudge``) and the reports re-rendered; ``metrics.json`` says so
(``rejudged``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Mapping

from precision_pipeline.core.fingerprint import Fingerprint, fingerprint, model_fingerprint
from precision_pipeline.core.stage import Artifact, Done, Frozen, Stage
from precision_pipeline.gate.options import GateOptions
from precision_pipeline.spec.profile import GateThresholds


MEASUREMENT_FILE = "measurement.json"
"""``<out>/gate/measurement.json``: ``{"key": GateStage.measurement_key}`` of the numbers in metrics.json."""


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

    def measurement_key(self, inputs: GateInputs) -> str:
        """The key of what the gate *measures*: the stage key's parts without the thresholds (checkpoint, model,
        golden file, options, the gate's code). Two runs with the same measurement key measure the same numbers."""
        from precision_pipeline.core.stage import code_fingerprint
        from precision_pipeline.core.store import hash_obj

        return hash_obj({"stage": self.name, "version": self.version, "checkpoint": inputs.checkpoint, "model": inputs.model,
                         "golden": inputs.golden, "options": inputs.options, "code": code_fingerprint(self.code)})

    def run(self, inputs: GateInputs, workdir: Path) -> GateArtifact:
        from precision_pipeline.gate import checkpoint_gate

        mkey = self.measurement_key(inputs)
        res = self._rejudged(inputs, workdir, mkey)
        if res is None:
            options = inputs.options.model_copy(update={"golden_path": inputs.golden.path})
            res = checkpoint_gate.gate_checkpoint(inputs.checkpoint.path, inputs.model.path, inputs.thresholds, workdir,
                                                  options)
        (Path(workdir) / MEASUREMENT_FILE).write_text(json.dumps({"key": mkey}) + "\n")
        failed = tuple(res.failed_metrics())
        return GateArtifact(status="done" if res.passed else "failed",
                            reason="" if res.passed else "accuracy gate failed: " + ", ".join(failed),
                            passed=bool(res.passed), failed_metrics=failed, numbers=res.summary())

    def _rejudged(self, inputs: GateInputs, workdir: Path, mkey: str):
        """When the folder this run replaces (``<out>/gate``, beside the runner's temporary ``workdir``) holds a
        measurement with key ``mkey`` (only the thresholds changed), its numbers judged against the new
        thresholds (``checkpoint_gate.rejudge``), written into ``workdir`` with re-rendered reports; else None."""
        import numpy as np

        from precision_pipeline.core.store import read_json_safe
        from precision_pipeline.gate import checkpoint_gate

        prev = Path(workdir).parent / self.output
        mark, metrics = read_json_safe(prev / MEASUREMENT_FILE), read_json_safe(prev / "metrics.json")
        if not (isinstance(mark, dict) and mark.get("key") == mkey and isinstance(metrics, dict)
                and isinstance(metrics.get("metrics"), dict) and (prev / "per_token.npz").is_file()):
            return None
        try:
            with np.load(prev / "per_token.npz") as z:
                per_token = {k: z[k] for k in z.files}
        except (OSError, ValueError):
            return None
        judged = checkpoint_gate.rejudge(metrics, inputs.thresholds)
        judged["rejudged"] = {"from": "the stored measurements of the same checkpoint, model, golden set and options",
                              "previous_thresholds": metrics.get("thresholds"), "previous_passed": metrics.get("passed")}
        res = checkpoint_gate.GateResult(judged["passed"], judged["failures"], judged, Path(workdir), per_token)
        checkpoint_gate.write_gate_dir(res)
        print(f"[gate] only the thresholds changed: the stored measurements are judged again "
              f"({'passed' if res.passed else 'failed: ' + ', '.join(res.failures)}), not measured again.",
              file=sys.stderr, flush=True)
        return res


__all__ = ["GateInputs", "GateArtifact", "GateStage"]
