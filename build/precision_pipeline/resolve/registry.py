"""The rule registry of resolve: ``Finding`` (a warn or refused result), ``Rule`` (a named check with its source),
``RULES`` (in registration order = evaluation order), the ``rule`` decorator, ``refuse`` / ``warn``, ``Override``
and ``Context`` (everything a rule may read). The rules themselves register from ``resolve/rules.py`` and
``resolve/rules_fit.py``; ``resolve/plan.py`` runs them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from precision_pipeline.core.errors import Problem
from precision_pipeline.spec import formats as F
from precision_pipeline.spec.device import DeviceChoice
from precision_pipeline.spec.hardware import GPUSpec
from precision_pipeline.spec.model_arch import ModelArch
from precision_pipeline.spec.profile import Profile


# ---------------------------------------------------------------------------------------------
# Findings and the registry


@dataclass
class Finding:
    """One rule result that is not a plain pass."""

    status: str  # "warn" | "refused"
    field: str
    message: str
    fix: str = ""


@dataclass(frozen=True)
class Rule:
    """A named check. ``needs_gpu``: skipped when target.gpu did not resolve; ``routes``: the serving routes it applies
    to (an engine-only rule models trtllm-build and is not run for an ``llm_api`` profile)."""

    name: str
    summary: str
    source: str
    func: Callable[["Context"], list[Finding]]
    needs_gpu: bool = True
    routes: tuple[str, ...] = ("engine", "llm_api")


RULES: list[Rule] = []


def rule(name: str, summary: str, source: str, needs_gpu: bool = True, routes: tuple[str, ...] = ("engine", "llm_api")):
    """Register ``func`` as a rule (order of registration = order of evaluation); ``routes``: where it applies."""

    def deco(func):
        RULES.append(Rule(name, summary, source, func, needs_gpu, routes))
        return func

    return deco


def refuse(field: str, message: str, fix: str = "") -> Finding:
    return Finding("refused", field, message, fix)


def warn(field: str, message: str, fix: str = "") -> Finding:
    return Finding("warn", field, message, fix)


@dataclass
class Override:
    """A setting trtllm-build would change on its own (asked -> effective, and why)."""

    field: str
    asked: Any
    effective: Any
    reason: str


@dataclass
class Context:
    """Everything a rule may read. ``gpu`` is None when target.gpu is unknown."""

    profile: Profile
    model: ModelArch
    gpu: Optional[GPUSpec]
    checkpoint_dir: Optional[Path] = None
    mapping: dict = field(default_factory=dict)
    limits: dict = field(default_factory=dict)
    limit_notes: list[Finding] = field(default_factory=list)
    effective: dict = field(default_factory=dict)
    overrides: list[Override] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    fallback: Optional[Profile] = None
    fallback_problem: Optional[Problem] = None
    fallback_memory: dict = field(default_factory=dict)
    for_build: bool = False  # the whole build will run (quantize + gate): rules about what the gate reads apply
    device: Optional[DeviceChoice] = None  # where quantize and the gate run (``invoke build --device``); None: not planned
    build_memory: dict = field(default_factory=dict)  # build_memory_plan(ctx) when ``device`` is set

    @property
    def sm(self) -> int:
        return self.gpu.sm if self.gpu else 0

    @property
    def route(self) -> str:
        """The profile's serving route (``engine`` / ``llm_api``)."""
        return self.profile.route

    @property
    def trtllm_version(self) -> str:
        return self.profile.target.trtllm_version

    def runs(self, fmt) -> bool:
        """Whether the registry entry ``fmt`` (GEMM or KV) runs on the target SM on this route and TensorRT-LLM line
        (``spec/capability.py``, the one table; for the engine route its rows are the registry's own SM ranges)."""
        from precision_pipeline.spec.capability import supports

        return supports(self.route, self.trtllm_version, fmt.kind, fmt.algo, self.sm)

    @property
    def quant(self) -> str:
        return self.profile.quantization.quant_algo.value

    @property
    def kv(self) -> str:
        return self.profile.quantization.kv_cache_quant_algo.value

    @property
    def fmt(self) -> F.GemmFormat:
        """The registry entry of ``quantization.quant_algo``."""
        return F.GEMM[self.profile.quantization.quant_algo]

    @property
    def kv_fmt(self) -> F.KvFormat:
        """The registry entry of ``quantization.kv_cache_quant_algo``."""
        return F.KV[self.profile.quantization.kv_cache_quant_algo]

    def refusal_of(self, fmt: F.GemmFormat) -> str:
        """Why ``fmt`` runs on no GPU on this route and TensorRT-LLM line ('' when some SM runs it;
        ``spec/capability.py`` ``refusal_on_route``)."""
        from precision_pipeline.spec.capability import refusal_on_route

        return refusal_on_route(self.route, self.trtllm_version, fmt)

    @property
    def fmt_refusal(self) -> str:
        """``refusal_of`` the profile's GEMM format."""
        return self.refusal_of(self.fmt)

    @property
    def gemm_format_ok(self) -> bool:
        """The GEMM format runs on the target SM (context rules stay quiet when it does not:
        format.gemm_sm already refuses, and the consequences would only repeat it)."""
        e = self.fmt
        if self.fmt_refusal or self.gpu is None:
            return not self.fmt_refusal
        if e.per_layer:
            return True
        return self.runs(e)

    def gpu_text(self) -> str:
        g = self.gpu
        return f"{g.id} ({g.name}) is SM {g.sm}" if g else "the GPU is unknown"
