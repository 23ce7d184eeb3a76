"""A candidate profile's accuracy, in this order (analysis/choose.py's module doc): **measured** (the gate's
metrics.json of an existing build of the same quantization + calibration, model and whole golden set), else
**prior** (``ACCURACY_PRIOR``: the README's measured gate numbers of the shipped profile with the same
quantization + calibration), else **unknown**."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

from precision_pipeline.spec.algos import QuantAlgo
from precision_pipeline.spec.model_arch import ModelArch
from precision_pipeline.spec.profile import load_profile

SRC_PRIOR = "README.md 'Measured gate numbers' (SmolLM2-135M-Instruct, full golden set, vs FP32)"
PRIOR_MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Accuracy:
    """Gate numbers of a candidate: KL mean / P99 (nats), top-1 agreement; ``kind`` measured / prior / unknown."""

    kind: str
    kl_mean: Optional[float] = None
    kl_p99: Optional[float] = None
    top1: Optional[float] = None
    source: str = ""

    def to_json(self) -> dict:
        return dict(self.__dict__)


ACCURACY_PRIOR: dict[str, Accuracy] = {
    # shipped profile -> its measured gate numbers (SRC_PRIOR). A candidate gets one only when its resolved
    # quantization and calibration equal that profile's (``prior_for``): on the default model the FP8 KV
    # cache is where most of the FP8 profile's loss comes from (README), so a prior never carries over to
    # another KV format, and a tuned profile's exclusions are part of its quantization.
    "bf16-h100": Accuracy("prior", 0.0, 0.0, 1.0, f"{SRC_PRIOR}: bf16-h100"),
    "fp8-h100": Accuracy("prior", 0.0539, 0.424, 0.898, f"{SRC_PRIOR}: fp8-h100"),
    "int8-sq-l4": Accuracy("prior", 0.3696, 2.600, 0.737, f"{SRC_PRIOR}: int8-sq-l4"),
    "int8-sq-l4-smollm2": Accuracy("prior", 0.1841, 1.793, 0.817, f"{SRC_PRIOR}: int8-sq-l4-smollm2"),
    "int4-awq-a100": Accuracy("prior", 0.3392, 2.517, 0.745, f"{SRC_PRIOR}: int4-awq-a100"),
    "int4-awq-a100-smollm2": Accuracy("prior", 0.2353, 1.878, 0.792, f"{SRC_PRIOR}: int4-awq-a100-smollm2"),
    "nvfp4-b200": Accuracy("prior", 0.5905, 3.614, 0.653, f"{SRC_PRIOR}: nvfp4-b200"),
    "nvfp4-b200-smollm2": Accuracy("prior", 0.2368, 1.845, 0.790, f"{SRC_PRIOR}: nvfp4-b200-smollm2"),
    "mixed-fp8-int4-h100": Accuracy("prior", 0.1759, 1.342, 0.812, f"{SRC_PRIOR}: mixed-fp8-int4-h100, 6.0 bits"),
}
"""Per-profile accuracy priors (used only when no build of the candidate was measured)."""


@lru_cache(maxsize=None)
def shipped(name: str):
    """``load_profile(name)`` of a shipped profile, read once per process (candidates only read it)."""
    return load_profile(name)


@lru_cache(maxsize=None)
def shipped_quality(name: str) -> str:
    """``quality_key`` of a shipped profile as canonical JSON (cached)."""
    return json.dumps(quality_key(shipped(name)), sort_keys=True)


def shipped_algo(name: str) -> QuantAlgo:
    """The GEMM format of a shipped profile."""
    return shipped(name).quantization.quant_algo


def prior_for(profile) -> Optional[Accuracy]:
    """The ``ACCURACY_PRIOR`` of the shipped profile whose quantization + calibration equal ``profile``'s, or None."""
    want = json.dumps(quality_key(profile), sort_keys=True)
    return next((a for n, a in ACCURACY_PRIOR.items() if shipped_quality(n) == want), None)


def quality_key(p) -> dict:
    """What the gate's numbers depend on: the resolved quantization and calibration sections."""
    return {"quantization": p.quantization.model_dump(mode="json"), "calibration": p.calibration.model_dump(mode="json")}


def full_golden_prompts() -> int:
    """Prompts in the whole shipped golden set."""
    from precision_pipeline.gate.golden import load_golden

    return len(load_golden())


def measured_accuracy(profile, artifacts: Path, model: Optional[ModelArch] = None) -> Optional[Accuracy]:
    """Gate numbers of an existing build of the same quantization + calibration (``artifacts/*/gate/metrics.json``)
    **of the same model** (plan.json's ``model`` equals ``model``'s config: measurements are keyed by the model
    they were made on) over the **whole golden set** (a ``--golden-limit`` build is a quick check, not a
    measurement: its prompts are fewer than ``load_golden()``'s)."""
    if not artifacts.is_dir():
        return None
    want = quality_key(profile)
    want_model = model.model_dump(mode="json") if model is not None else None
    for gate in sorted(artifacts.glob("*/gate/metrics.json")):
        out = gate.parent.parent
        try:
            plan = json.loads((out / "plan.json").read_text())
            doc = json.loads(gate.read_text())
            metrics = doc.get("metrics") or {}
        except (OSError, ValueError):
            continue
        pr = plan.get("profile_resolved") or {}
        if {"quantization": pr.get("quantization"), "calibration": pr.get("calibration")} != want:
            continue
        if want_model is not None and plan.get("model") != want_model:
            continue
        prompts = (doc.get("golden") or {}).get("prompts")
        if isinstance(prompts, int) and prompts < full_golden_prompts():
            continue

        def val(k):
            v = metrics.get(k)
            return v.get("value") if isinstance(v, dict) else None

        return Accuracy("measured", val("kl_mean"), val("kl_p99"), val("top1"), f"{gate} (build of {plan.get('profile')})")
    return None


def accuracy_of(profile, model: ModelArch, artifacts: Path) -> Accuracy:
    """measured, else prior (labelled with the model it was measured on), else unknown."""
    got = measured_accuracy(profile, artifacts, model)
    if got is not None:
        return got
    q = profile.quantization
    prior = prior_for(profile)
    if prior is None:
        return Accuracy("unknown", source=f"no build measured and no prior for {q.quant_algo.value} GEMMs with a "
                                          f"{q.kv_cache_quant_algo.value} KV cache")
    other = "" if model.name == PRIOR_MODEL else f"; measured on {PRIOR_MODEL}, not this model"
    return Accuracy("prior", prior.kl_mean, prior.kl_p99, prior.top1, prior.source + other)


__all__ = ["SRC_PRIOR", "PRIOR_MODEL", "Accuracy", "ACCURACY_PRIOR", "shipped", "shipped_quality", "shipped_algo", "prior_for",
           "quality_key", "full_golden_prompts", "measured_accuracy", "accuracy_of"]
