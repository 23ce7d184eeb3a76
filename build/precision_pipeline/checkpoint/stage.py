"""Verification as a stage, between quantize and the gate (``checkpoint/verify.py``).

Keyed: the checkpoint (the quantize stage's key, so a reused ``--checkpoint`` is verified too) and
the formats the plan assumes (``quantization.quant_algo`` / ``kv_cache_quant_algo``). It writes no
folder, only its typed record (``.stages/verify.json``: counts and the seconds it took). A refusal is
a ``UserError`` (exit 2) naming the tensor or file, the rule and the fix; the gate does not run.
"""

from __future__ import annotations

from typing import Any, Mapping

from precision_pipeline.core.fingerprint import Fingerprint
from precision_pipeline.core.stage import Artifact, Done, Frozen, Stage
from precision_pipeline.resolve.plan import ResolvedPlan
from precision_pipeline.resolve.stage import BuildRequest


class VerifyInputs(Frozen):
    checkpoint: Fingerprint
    """The quantize stage's key and its folder."""
    quant_algo: str
    kv_cache_quant_algo: str


class VerifyArtifact(Artifact):
    """What was verified (``verify.verify_checkpoint``'s counts)."""

    tensors: int
    scale_tensors: int
    linears: int
    scale_bytes: int
    verify_s: float

    def summary(self) -> dict[str, Any]:
        return {"tensors": self.tensors, "scale_tensors": self.scale_tensors, "linears": self.linears,
                "scale_bytes": self.scale_bytes, "verify_s": self.verify_s}


class VerifyStage(Stage[VerifyInputs, VerifyArtifact]):
    name = "verify"
    version = 1
    code = ("checkpoint", "spec", "core")
    needs = ("quantize",)
    output = None
    artifact_type = VerifyArtifact

    def inputs(self, plan: ResolvedPlan, request: BuildRequest, upstream: Mapping[str, Done]) -> VerifyInputs:
        q = upstream["quantize"]
        quant = plan.profile.quantization
        return VerifyInputs(checkpoint=Fingerprint(sha256=q.key, path=q.dir), quant_algo=quant.quant_algo.value,
                            kv_cache_quant_algo=quant.kv_cache_quant_algo.value)

    def run(self, inputs: VerifyInputs, workdir) -> VerifyArtifact:
        from precision_pipeline.checkpoint.verify import verify_checkpoint

        r = verify_checkpoint(inputs.checkpoint.path, {"quant_algo": inputs.quant_algo,
                                                       "kv_cache_quant_algo": inputs.kv_cache_quant_algo})
        return VerifyArtifact(tensors=r["tensors"], scale_tensors=r["scale_tensors"], linears=r["linears"],
                              scale_bytes=r["scale_bytes"], verify_s=r["seconds"])


__all__ = ["VerifyInputs", "VerifyArtifact", "VerifyStage"]
