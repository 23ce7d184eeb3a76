"""Resolve as a stage: the build request, and the plan artifact every later stage is given.

``BuildRequest`` is what ``invoke build`` asked for (paths already validated by the pipeline).
The resolve stage always runs (milliseconds; it refuses bad input before anything heavy); later
stages copy the plan fields they read into their own inputs, so the plan itself is never an
upstream key (a change of ``deployment.replicas`` re-renders manifests, it does not re-quantize).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from pydantic import ConfigDict

from precision_pipeline.core.fingerprint import Fingerprint, model_fingerprint
from precision_pipeline.core.stage import Artifact, Done, Frozen, Stage
from precision_pipeline.resolve import plan as plan_mod
from precision_pipeline.resolve.plan import ResolvedPlan
from precision_pipeline.spec.device import DeviceChoice
from precision_pipeline.spec.profile import Profile


class BuildRequest(Frozen):
    """One ``invoke build``: the loaded profile and the validated paths and options."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    profile: Profile
    profile_source: str
    model_dir: Path
    out_dir: Path
    checkpoint: Optional[Path] = None
    golden_limit: Optional[int] = None
    repo_root: str
    image: str = ""
    """The serving image (``--image``; ``pipeline.build_request`` fills the default); "": none asked (the engine
    Job, which packs nothing)."""
    strict: bool = False
    device: Optional[DeviceChoice] = None
    """Where quantize and the gate run (``spec.device.select_device``); None: the CPU, unplanned (library callers)."""


class ResolveInputs(Frozen):
    profile: Profile
    model: Fingerprint
    checkpoint: Optional[Fingerprint] = None
    device: Optional[DeviceChoice] = None


class PlanArtifact(Artifact):
    """The resolved plan (``plan.json`` is rendered from it)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    plan: ResolvedPlan

    def summary(self) -> dict[str, Any]:
        mem = self.plan.memory
        return {
            "weight_gib_per_gpu": round(float(mem.weight_gib_per_gpu), 3) if mem else 0.0,
            "kv_bytes_per_token": mem.kv_bytes_per_token if mem else None,
            "kv_tokens_capacity": mem.kv_tokens_capacity if mem else None,
            "warnings": len(self.plan.warnings),
            **({"device": bm["device"]["device"], "device_reason": bm["device"]["reason"],
                "reference_dtype": bm["reference_dtype"]} if (bm := self.plan.build_memory) else {}),
        }


class ResolveStage(Stage[ResolveInputs, PlanArtifact]):
    name = "resolve"
    version = 1
    code = ("resolve", "spec", "core")
    needs = ()
    output = None
    artifact_type = PlanArtifact
    cacheable = False  # always re-checked: it is what refuses bad input
    provides_plan = True  # runs before the first write (core.route.prepare); later stages are given its plan

    def inputs(self, plan: None, request: BuildRequest, upstream: Mapping[str, Done]) -> ResolveInputs:
        return ResolveInputs(profile=request.profile, model=model_fingerprint(request.model_dir),
                             checkpoint=model_fingerprint(request.checkpoint) if request.checkpoint else None,
                             device=request.device)

    def run(self, inputs: ResolveInputs, workdir: None) -> PlanArtifact:
        ck = inputs.checkpoint.path if inputs.checkpoint else None
        return PlanArtifact(plan=plan_mod.resolve(inputs.profile, inputs.model.path, checkpoint_dir=ck, for_build=True,
                                                  device=inputs.device))


__all__ = ["BuildRequest", "ResolveInputs", "PlanArtifact", "ResolveStage"]
