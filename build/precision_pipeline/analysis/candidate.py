"""A candidate of ``invoke recommend`` / ``invoke compare`` (analysis/choose.py): a profile with its plan, estimate
and accuracy, and the two axes it is ranked on (output tokens/s per GPU, KL P99) with their Pareto frontier."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from precision_pipeline.analysis.accuracy import Accuracy


@dataclass
class Candidate:
    """One evaluated candidate: its profile (None when the profile itself is invalid), plan, estimate,
    accuracy, and why it is out (``refused``: the rules; ``violations``: the constraints)."""

    label: str
    base: str
    overrides: dict
    profile: Any = None
    plan: Any = None
    estimate: Optional[dict] = None
    perf: Optional[dict] = None
    fallback: dict = field(default_factory=dict)  # where the fallback lives, its GPUs, rollback time
    accuracy: Accuracy = field(default_factory=lambda: Accuracy("unknown"))
    refused: list[dict] = field(default_factory=list)  # {"rule", "field", "reason"}
    violations: list[dict] = field(default_factory=list)  # {"constraint", "limit", "value", "by", "text"}

    @property
    def ok(self) -> bool:
        return not self.refused and not self.violations

    @property
    def world_size(self) -> int:
        return self.plan.mapping.world_size if self.plan is not None else self.overrides["parallel"]["tp_size"]

    def to_json(self) -> dict:
        return {"label": self.label, "base": self.base, "overrides": self.overrides, "ok": self.ok,
                "refused": self.refused, "violations": self.violations, "accuracy": self.accuracy.to_json(),
                "estimate": self.estimate, "perf": self.perf, "fallback": self.fallback,
                "memory": self.plan.memory.to_json() if self.plan is not None and self.plan.memory else None}


def tokens_per_gpu(c: Candidate) -> float:
    """The ranking's throughput: output tokens/s per GPU of the deployment (``perf``)."""
    return c.perf["deployed_tokens_per_s_per_gpu"] if c.perf else 0.0


def pareto(cands: list[Candidate]) -> list[Candidate]:
    """Runnable candidates with a known KL P99 that no other one beats on both axes (higher decode
    tokens/s per GPU and lower KL P99, at least one strictly)."""
    pts = [c for c in cands if not c.refused and c.accuracy.kl_p99 is not None]

    def dominated(a: Candidate) -> bool:
        ta, la = tokens_per_gpu(a), a.accuracy.kl_p99
        return any((tokens_per_gpu(b) >= ta and b.accuracy.kl_p99 <= la)
                   and (tokens_per_gpu(b) > ta or b.accuracy.kl_p99 < la) for b in pts if b is not a)

    return [c for c in pts if not dominated(c)]


__all__ = ["Candidate", "tokens_per_gpu", "pareto"]
