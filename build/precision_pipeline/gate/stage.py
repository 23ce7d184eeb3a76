"""The accuracy gate as a stage: the checkpoint judged against the model on the golden set.

Keyed: the checkpoint (the quantize stage's key), the model's content fingerprint (so the same
checkpoint gated against another ``--model`` is not a cache hit), the thresholds, the golden
file's content and every ``GateOptions`` field (what is measured: prompts per category, held-out
tokens, greedy tokens, bootstrap, seed; the build's device, reference dtype and candidate dtype
when they are not the CPU defaults). ``GateRuntime`` (threads, progress) is never keyed. The
code key covers gate/, checkpoint/, spec/, core/.

A threshold-only change (same measurement key: everything above but the thresholds) changes the stage key
but is not measured again: the stored numbers (``metrics.json``, ``per_token.npz``) are judged against the
new thresholds (``gate.verdict.rejudge``) and the reports re-rendered; ``metrics.json`` says so
(``rejudged``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Mapping, Optional

from pydantic import field_validator

from precision_pipeline.core.fingerprint import Fingerprint, fingerprint, model_fingerprint
from precision_pipeline.core.errors import PipelineError
from precision_pipeline.core.stage import Artifact, Done, Frozen, Stage, gate_failure
from precision_pipeline.gate.options import GateOptions
from precision_pipeline.resolve.plan import ResolvedPlan
from precision_pipeline.resolve.stage import BuildRequest
from precision_pipeline.spec.profile import GateBar, GateThresholds


MEASUREMENT_FILE = "measurement.json"
"""``<out>/gate/measurement.json``: ``{"key": GateStage.measurement_key}`` of the numbers in metrics.json."""


class GateInputs(Frozen):
    checkpoint: Fingerprint
    """The quantize stage's key and its folder."""
    model: Fingerprint
    thresholds: GateBar
    """The profile's bar for this model (``Gate.for_model`` of the model's content fingerprint); a plain
    ``GateThresholds`` is taken as a bar without category bars."""
    layout: dict[str, int] = {}
    """What the release will serve: the plan's tp_size / pp_size / moe_ep_size (recorded, promote compares)."""
    golden: Fingerprint
    """The golden prompts file, by content (its path is not keyed)."""
    options: GateOptions
    """What the gate measures (``golden_path`` left None here: the file is keyed by ``golden``)."""


    @field_validator("thresholds", mode="before")
    @classmethod
    def _as_bar(cls, v: Any) -> Any:
        if isinstance(v, GateThresholds):
            from precision_pipeline.gate.verdict import as_bar  # one home: the verdict's rule

            return as_bar(v)
        return v


class GateArtifact(Artifact):
    """The verdict and headline numbers (``<out>/gate``: metrics.json, report.md, report.html)."""

    passed: bool
    failed_metrics: tuple[str, ...] = ()
    """Failing overall metrics and ``category C: metric`` for failing categories."""
    numbers: dict[str, Any]
    promotable: bool = True
    """False when the verdict covers fewer prompts than the bar's ``min_prompts`` (``--golden-limit``)."""
    not_promotable: str = ""
    record: dict[str, Any] = {}
    """What the verdict holds for (``gate_record``): layout, runtime, model fingerprint, golden-set size."""

    def summary(self) -> dict[str, Any]:
        return dict(self.numbers)

    def present(self, out_dir: Path) -> bool:
        return (Path(out_dir) / "gate" / "metrics.json").is_file()

    def blocking(self, subject: str, folder: Optional[Path]) -> Optional[PipelineError]:
        """``GateFailed`` (exit 3) when the checkpoint did not pass: nothing is built from it."""
        return None if self.passed else gate_failure("accuracy gate", subject, self.failed_metrics, folder)


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

    def inputs(self, plan: ResolvedPlan, request: BuildRequest, upstream: Mapping[str, Done]) -> GateInputs:
        q = upstream["quantize"]
        d = request.device
        compute = {} if d is None else {"device": d.device, "reference_dtype": d.reference_dtype,
                                        "candidate_dtype": d.compute_dtype(plan.profile.quantization.dtype)}
        model = model_fingerprint(request.model_dir)
        par = plan.profile.parallel
        return GateInputs(checkpoint=Fingerprint(sha256=q.key, path=q.dir), model=model,
                          thresholds=plan.profile.gate.for_model(model.sha256),
                          layout={"tp_size": par.tp_size, "pp_size": par.pp_size, "moe_ep_size": par.moe_ep_size or 1},
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
        record = gate_record(inputs)
        res = self._rejudged(inputs, workdir, mkey, record)
        if res is None:
            options = inputs.options.model_copy(update={"golden_path": inputs.golden.path})
            res = checkpoint_gate.gate_checkpoint(inputs.checkpoint.path, inputs.model.path, inputs.thresholds, workdir,
                                                  options, extra={"record": record})
        (Path(workdir) / MEASUREMENT_FILE).write_text(json.dumps({"key": mkey}) + "\n")
        failed = tuple(res.failed_metrics())
        return GateArtifact(status="done" if res.passed else "failed",
                            reason="" if res.passed else "accuracy gate failed: " + ", ".join(failed),
                            passed=bool(res.passed), failed_metrics=failed, numbers=res.summary(),
                            promotable=bool(res.metrics.get("promotable", True)),
                            not_promotable=str(res.metrics.get("not_promotable", "")), record=record)

    def _rejudged(self, inputs: GateInputs, workdir: Path, mkey: str, record: dict[str, Any]):
        """When the folder this run replaces (``<out>/gate``, beside the runner's temporary ``workdir``) holds a
        measurement with key ``mkey`` (only the thresholds changed), its numbers judged against the new
        thresholds (``verdict.rejudge``), written into ``workdir`` with re-rendered reports; else None."""
        import numpy as np

        from precision_pipeline.core.store import read_json_safe
        from precision_pipeline.gate import checkpoint_gate, verdict

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
        judged = verdict.rejudge(metrics, inputs.thresholds)
        judged["record"] = record  # what the release will serve may differ (the planned layout is not measured)
        judged["rejudged"] = {"from": "the stored measurements of the same checkpoint, model, golden set and options",
                              "previous_thresholds": metrics.get("thresholds"), "previous_passed": metrics.get("passed")}
        res = verdict.GateResult(judged["passed"], verdict.verdict_failures(judged), judged, Path(workdir), per_token)
        checkpoint_gate.write_gate_dir(res)
        print(f"[gate] only the thresholds changed: the stored measurements are judged again "
              f"({'passed' if res.passed else 'failed: ' + ', '.join(res.failures)}), not measured again.",
              file=sys.stderr, flush=True)
        return res


def gate_record(inputs: GateInputs) -> dict[str, Any]:
    """What a checkpoint verdict holds for (metrics.json ``record``; promote and rollout compare it with
    what the release will serve, ``serving/acceptance.py``):

    * ``layout``: tp_size / pp_size / moe_ep_size of the checkpoint the gate read (its config.json
      ``mapping``; ``moe_ep_size`` 1 when absent), and ``planned``: the plan's (what the build serves);
    * ``runtime``: what measured it (the checkpoint dequantized in PyTorch, ``torch`` version) and
      the TensorRT-LLM installed where it ran (None: none installed) and the checkpoint's producer;
    * ``model_fingerprint``: the model's content fingerprint (the key of ``gate.overrides``);
    * ``golden``: prompts per category asked (None: all) and the golden file's fingerprint.
    """
    from importlib import metadata

    from precision_pipeline.core.store import read_json
    from precision_pipeline.core.versions import dist_version

    cfg = read_json(Path(inputs.checkpoint.path) / "config.json", {}) or {}
    m = cfg.get("mapping") or {}
    prod = cfg.get("producer") or {}
    try:
        torch_v = metadata.version("torch")
    except metadata.PackageNotFoundError:  # pragma: no cover - the gate needs torch
        torch_v = None
    return {
        "layout": {"tp_size": int(m.get("tp_size", 1)), "pp_size": int(m.get("pp_size", 1)),
                   "moe_ep_size": int(m.get("moe_ep_size", 1) or 1)},
        "planned_layout": dict(inputs.layout),
        "runtime": {"measured_with": f"checkpoint dequantized in PyTorch {torch_v} on {inputs.options.device}",
                    "tensorrt_llm": dist_version("tensorrt_llm", "tensorrt-llm"),
                    "checkpoint_producer": f"{prod.get('name', '?')} {prod.get('version', '?')}" if prod else None},
        "model_fingerprint": inputs.model.sha256,
        "golden": {"prompts_per_category": inputs.options.prompts_per_category, "file_sha256": inputs.golden.sha256},
    }


__all__ = ["GateInputs", "GateArtifact", "GateStage", "gate_record"]
