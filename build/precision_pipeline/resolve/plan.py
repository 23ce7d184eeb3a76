"""Resolve stage: profile + model + GPU -> a checked plan (plan.json), in milliseconds, no GPU.

``resolve(profile, model_dir, checkpoint_dir=None)`` runs every rule of ``build/precision_pipeline/resolve/rules.py`` (and ``rules_fit.py``)
and raises one ``UserError`` (exit 2) listing **all** refused problems, each with its rule
name and source. When nothing is refused it returns a frozen, typed ``ResolvedPlan``; ``to_json()`` is what
the build writes as ``artifacts/<profile>/plan.json``:

* ``gpu``: the catalog entry (SM, driver-reported MiB, datasheet GB, bandwidth, TFLOPS).
* ``model``: the ModelArch read from config.json.
* ``mapping``: world_size, tp_size, pp_size, moe_tp_size, moe_ep_size.
* ``limits``: the effective build limits, ``derived`` says why for each value TensorRT-LLM
  derives or clamps (max_seq_len from max_position_embeddings x rope factor, ...).
* ``effective``: the per-phase settings after trtllm-build's own overrides (paged/FP8 context
  FMHA), the resolved ``--gemm_plugin``, logits dtype and its Triton type (``TYPE_FP32``).
* ``memory``: bytes per GPU (weights, activation estimate, warm fallback, KV per token, KV
  cache, token capacity, concurrent sequences at max_seq_len, fits).
* ``estimate``: roofline ceilings with their arithmetic (``resolve/estimate.py``: decode bytes per
  step, decode tokens/s from the bandwidth, prefill tokens/s from the Tensor Core peak, KV-limited
  concurrency at max_seq_len; every hardware number with its catalog source).
* ``warnings`` and ``checks`` (one entry per rule: pass / warn / refused, message, source).

``check_all(model_dir)`` checks every shipped profile (``invoke check --all``);
``profiles_for_gpu(gpu, model_dir)`` evaluates each shipped profile with ``target.gpu``
replaced (``invoke profiles --gpu h100``). Nothing here imports torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from precision_pipeline.spec import formats as F
from precision_pipeline.resolve import estimate as E
from precision_pipeline.resolve import rules as R  # registers RULES (rules.py, then rules_fit.py)
from precision_pipeline.resolve.build_memory import build_memory_plan
from precision_pipeline.resolve.derive import derive_effective, derive_limits, derive_mapping
from precision_pipeline.resolve.memory import memory_plan
from precision_pipeline.resolve.registry import Context
from precision_pipeline.core.errors import Problem, UserError
from precision_pipeline.spec.device import DeviceChoice
from precision_pipeline.spec.hardware import GPUSpec, resolve_gpu
from precision_pipeline.spec.model_arch import ModelArch, read_model_arch
from precision_pipeline.spec.profile import Profile, load_profile, shipped_profiles


class _Section(BaseModel):
    """A frozen, closed section of the resolved plan (unknown or missing fields are errors)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Mapping(_Section):
    """TensorRT-LLM ``Mapping`` of one engine (tensorrt_llm/mapping.py): GPU counts."""

    world_size: int
    tp_size: int
    pp_size: int
    moe_tp_size: int
    moe_ep_size: int


class Limits(_Section):
    """Effective trtllm-build limits (tokens / sequences); ``derived``: field -> why it has this value."""

    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    max_beam_width: int
    derived: dict[str, str] = Field(default_factory=dict)


class OverrideRecord(_Section):
    """A setting trtllm-build changes on its own (tensorrt_llm/builder.py build())."""

    field: str
    asked: Union[bool, int, str, None]
    effective: Union[bool, int, str, None]
    reason: str


class Effective(_Section):
    """Per-phase engine settings after the builder's own overrides (see derive.derive_effective)."""

    context_fmha: bool
    use_paged_context_fmha: bool
    use_fp8_context_fmha: bool
    enable_kv_cache_reuse: bool
    enable_chunked_context: bool
    kv_cache_type: str
    tokens_per_block: int
    gemm_plugin: Optional[str]
    gemm_plugin_reason: str
    gpt_attention_plugin: str
    logits_dtype: str
    multi_block_mode: bool
    triton_logits_datatype: str
    strongly_typed: bool
    use_fused_mlp: bool
    gather_context_logits: bool
    """``--gather_context_logits``: the engine returns every prompt position's logits (the engine gate needs it)."""
    overrides: tuple[OverrideRecord, ...] = ()


class WeightBreakdown(_Section):
    """Weight bytes on the heaviest GPU of one engine (memory.weight_bytes)."""

    total: int
    decoder: int
    embedding: int
    lm_head: int
    pp_rank: int


class FallbackMemory(_Section):
    """Bytes a warm fallback engine holds on each GPU."""

    weights: int
    activations: int
    total: int


class MemoryPlan(_Section):
    """Per-GPU memory plan in bytes (memory.memory_plan; activations and reserve are estimates)."""

    gpu_memory_bytes: int
    weight_bytes_per_gpu: int
    weight_gib_per_gpu: float
    weight_breakdown: WeightBreakdown
    kv_bytes_per_token: Union[int, float]
    kv_bytes_per_seq_at_max_seq_len: int
    activation_bytes_estimate: int
    fallback_bytes: int
    fallback_breakdown: Optional[FallbackMemory] = None
    runtime_reserve_bytes: int
    usable_bytes: int
    kv_cache_free_gpu_mem_fraction: float
    kv_cache_bytes: int
    kv_tokens_capacity: int
    concurrent_seqs_at_max_seq_len: int
    fits: bool
    notes: str

    def to_json(self) -> dict:
        d = self.model_dump(mode="json")
        d["fallback_breakdown"] = d["fallback_breakdown"] or {}
        return d


class FallbackInfo(_Section):
    """deployment.fallback as resolved on this GPU (``ok`` None: the GPU is unknown)."""

    profile: str
    ok: Optional[bool] = None
    target_gpu: Optional[str] = None
    warm: Optional[bool] = None
    memory: Optional[FallbackMemory] = None


class ResolvedPlan(BaseModel):
    """The resolve stage's artifact: a frozen, typed plan. ``problems``: every refusal (empty when it builds).

    Downstream stages read typed fields (``plan.limits.max_seq_len``); a missing field is a
    validation error here, never a silent default later. ``memory`` is None when the GPU is
    unknown or unsupported. ``to_json()`` renders plan.json (layout documented in the README);
    plan.json is a view, never read back as an input.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    profile: Profile
    model: ModelArch
    gpu: Optional[GPUSpec]
    route: str = "engine"
    """The serving route (``profile.route``; ``pipeline.ROUTES`` maps it to its stages)."""
    trtllm_version: str = "1.2.1"
    """The TensorRT-LLM line targeted (``profile.target.trtllm_version``)."""
    mapping: Mapping
    limits: Limits
    effective: Effective
    memory: Optional[MemoryPlan]
    checks: tuple[dict, ...]
    problems: tuple[Problem, ...]
    warnings: tuple[str, ...]
    fallback: Optional[FallbackInfo] = None
    estimate: Optional[dict] = None
    """Roofline estimate on the target GPU (``resolve.estimate.roofline``; None without a memory plan)."""
    build_memory: Optional[dict] = None
    """What quantize and the gate need on the chosen device and in host memory (``build_memory.build_memory_plan``;
    None unless a build's device was given)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def gather_context_logits(self) -> bool:
        """``--gather_context_logits`` as the engine is built (``effective``; from build.gather_context_logits)."""
        return self.effective.gather_context_logits

    def to_json(self, layers: Optional[dict] = None, llm_api: Optional[dict] = None) -> dict:
        """The plan.json mapping (JSON-serialisable). ``layers``: the checkpoint artifact's per-layer
        table (``checkpoint.reader.layer_table``), shown after quantize; ``llm_api``: the rendered LLM-API
        configuration files (the ``llm_api_config`` stage's view), on that route."""
        out = {
            "profile": self.profile.name,
            "profile_resolved": self.profile.model_dump(mode="json"),
            "route": self.route,
            "trtllm_version": self.trtllm_version,
            "gpu": self.gpu.to_json() if self.gpu else {"id": None, "asked": self.profile.target.gpu},
            "model": self.model.model_dump(mode="json"),
            "mapping": self.mapping.model_dump(mode="json"),
            "limits": self.limits.model_dump(mode="json"),
            "effective": self.effective.model_dump(mode="json"),
            "memory": self.memory.to_json() if self.memory else {},
            "estimate": self.estimate or {},
            "fallback": self.fallback.model_dump(mode="json", exclude_none=True) if self.fallback else None,
            "warnings": list(self.warnings),
            "checks": [dict(c) for c in self.checks],
            "ok": self.ok,
        }
        if self.build_memory is not None:
            out["build_memory"] = self.build_memory
        if layers is not None:
            out["layers"] = layers
        if llm_api is not None:
            out["llm_api"] = llm_api
        return out

    def canonical(self) -> dict:
        """What a stage key sees of the plan: its plan.json view (see core.store.canonical) without
        ``build_memory``, which describes the machine the build ran on (free host memory, visible
        GPUs), not what it makes: the device and dtypes that change numbers are keyed by the quantize
        and gate stages themselves. (With it, every build re-packed: free memory moves between runs.)"""
        out = self.to_json()
        out.pop("build_memory", None)
        return out

    def summary(self) -> str:
        """One line: formats, GPU, layout, weights/KV numbers, warning count (or the first refusal)."""
        if not self.ok:
            first = self.problems[0]
            more = f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
            return f"{one_line(first)}{more}"
        q = self.profile.quantization
        m = self.memory
        mp = self.mapping
        n = len(self.warnings)
        return (f"{q.quant_algo.value} GEMMs, {q.kv_cache_quant_algo.value} KV on {self.gpu.id} (SM {self.gpu.sm}), "
                f"tp {mp.tp_size} x pp {mp.pp_size}: weights {m.weight_gib_per_gpu:.3f} GiB/GPU, "
                f"KV {m.kv_bytes_per_token:,} B/token, {m.kv_tokens_capacity:,} tokens "
                f"({m.concurrent_seqs_at_max_seq_len:,} seqs at {self.limits.max_seq_len:,})"
                + (f"; {n} warning{'s' if n != 1 else ''}" if n else ""))


def one_line(pr: Problem) -> str:
    """A Problem on one line without square brackets (safe for rich console markup)."""
    text = f"{pr.field}: {pr.reason}"
    if pr.fix:
        text += f" Fix: {pr.fix}"
    if pr.rule:
        text += f" (rule {pr.rule})"
    return text


def _model(model: Union[Path, str, ModelArch]) -> ModelArch:
    return model if isinstance(model, ModelArch) else read_model_arch(Path(model))


def _fallback_part(ctx: Context, model: ModelArch, given: Optional[Profile] = None) -> Optional[dict]:
    """Load deployment.fallback (or take ``given``, the fallback profile as it would be deployed), check it
    on this GPU, and (if warm) count its weights + activations."""
    d = ctx.profile.deployment
    if not d.fallback:
        return None
    try:
        fb = given if given is not None else load_profile(d.fallback)
    except UserError as e:
        ctx.fallback_problem = e.problems[0]
        return {"profile": d.fallback, "ok": False}
    ctx.fallback = fb
    info: dict = {"profile": d.fallback, "target_gpu": fb.target.gpu, "warm": d.warm_fallback}
    if ctx.gpu is not None:
        fb_here = fb.model_copy(update={"target": fb.target.model_copy(update={"gpu": ctx.gpu.id}),
                                        "deployment": fb.deployment.model_copy(update={"fallback": None, "warm_fallback": False})})
        sub = evaluate(fb_here, model, _with_fallback=False)
        info["ok"] = sub.ok
        if not sub.ok:
            pr = sub.problems[0]
            ctx.fallback_problem = Problem(pr.field, f"on {ctx.gpu.id}: {pr.reason}", pr.fix, pr.rule, pr.source)
        elif d.warm_fallback:
            w = sub.memory.weight_bytes_per_gpu
            a = sub.memory.activation_bytes_estimate
            ctx.fallback_memory = {"weights": w, "activations": a, "total": w + a}
            info["memory"] = ctx.fallback_memory
    return info


def _memory(d: dict) -> Optional[MemoryPlan]:
    if not d:
        return None
    return MemoryPlan(**{**d, "fallback_breakdown": d.get("fallback_breakdown") or None})


def evaluate(profile: Profile, model: Union[Path, str, ModelArch], checkpoint_dir: Optional[Path] = None,
             _with_fallback: bool = True, for_build: bool = False, device: Optional[DeviceChoice] = None,
             fallback_profile: Optional[Profile] = None) -> ResolvedPlan:
    """Run every rule; return the Plan with all problems (never raises for a refused check).

    ``fallback_profile``: the deployment.fallback profile itself (``invoke recommend`` deploys the fallback
    at the candidate's tp without writing a file first); None loads it by name.

    ``for_build``: the whole build will run (``invoke build`` and ``invoke check``), so the rules
    about what the later stages need (``model.gate_reads``) apply too. ``device``: where that
    build's quantize and gate run (``spec.device.select_device``); with ``for_build`` the build's
    memory is planned on it and checked (``memory.build_fit``).
    Raises UserError only for an unreadable model (``--model``).
    """
    m = _model(model)
    problems: list[Problem] = []
    checks: list[dict] = []
    gpu: Optional[GPUSpec] = None
    try:
        gpu = resolve_gpu(profile.target.gpu)
        checks.append({"rule": "gpu.known", "status": "pass", "message": f"{gpu.id}: {gpu.name}, SM {gpu.sm}",
                       "source": "build/precision_pipeline/spec/hardware.py"})
    except UserError as e:
        for pr in e.problems:
            problems.append(pr)
            checks.append({"rule": "gpu.known", "status": "refused", "message": pr.render(), "source": "build/precision_pipeline/spec/hardware.py"})
    ctx = Context(profile=profile, model=m, gpu=gpu, checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir else None,
                    for_build=for_build, device=device if for_build else None)
    ctx.mapping = derive_mapping(profile)
    ctx.limits, ctx.limit_notes = derive_limits(profile, m)
    ctx.effective, ctx.overrides = derive_effective(profile, gpu.sm if gpu else 0)
    # a GPU TensorRT-LLM does not support at all: only gpu.supported speaks for it
    usable_gpu = gpu is not None and gpu.sm >= F.MIN_TRTLLM_SM
    fallback = _fallback_part(ctx, m, fallback_profile) if _with_fallback and (gpu is None or usable_gpu) else None
    if usable_gpu:
        ctx.memory = memory_plan(ctx)
    if ctx.device is not None:
        ctx.build_memory = build_memory_plan(ctx)
    warnings: list[str] = []
    for r in R.RULES:
        if profile.route not in r.routes:
            continue  # an engine-only rule (trtllm-build's behaviour) on the llm_api route
        if r.needs_gpu and gpu is None:
            continue
        if gpu is not None and not usable_gpu and r.needs_gpu and r.name != "gpu.supported":
            continue
        found = r.func(ctx)
        if not found:
            checks.append({"rule": r.name, "status": "pass", "message": r.summary, "source": r.source})
            continue
        for f in found:
            pr = Problem(f.field, f.message, f.fix, r.name, r.source)
            checks.append({"rule": r.name, "status": f.status, "message": pr.render(), "source": r.source})
            if f.status == "refused":
                problems.append(pr)
            else:
                warnings.append(pr.render())
    return ResolvedPlan(profile=profile, model=m, gpu=gpu, route=profile.route,
                        trtllm_version=profile.target.trtllm_version, mapping=Mapping(**ctx.mapping), limits=Limits(**ctx.limits),
                        effective=Effective(**ctx.effective), memory=_memory(ctx.memory),
                        checks=tuple(checks), problems=tuple(problems), warnings=tuple(warnings),
                        fallback=FallbackInfo(**fallback) if fallback else None,
                        estimate=E.roofline(gpu, m, profile, ctx.mapping, ctx.limits, ctx.memory) if ctx.memory else None,
                        build_memory=ctx.build_memory or None)


def resolve(profile: Profile, model_dir: Union[Path, str, ModelArch], checkpoint_dir: Optional[Path] = None,
            for_build: bool = False, device: Optional[DeviceChoice] = None) -> ResolvedPlan:
    """Check ``profile`` against the model (and a reused checkpoint); return the Plan.

    Raises UserError (exit 2) carrying every refused Problem (with rule names) if any.
    """
    plan = evaluate(profile, model_dir, checkpoint_dir, for_build=for_build, device=device)
    if plan.problems:
        raise UserError(plan.problems)
    return plan


def check_all(model_dir: Union[Path, str, ModelArch], for_build: bool = False) -> list[tuple[str, bool, str]]:
    """(name, ok, one-line summary) for every shipped profile, against the model."""
    m = _model(model_dir)
    out = []
    for name in shipped_profiles():
        try:
            plan = evaluate(load_profile(name), m, for_build=for_build)
        except UserError as e:
            out.append((name, False, one_line(e.problems[0]) + (f" (+{len(e.problems) - 1} more)" if len(e.problems) > 1 else "")))
            continue
        out.append((name, plan.ok, plan.summary()))
    return out


def profiles_for_gpu(gpu: str, model_dir: Union[Path, str, ModelArch]) -> list[tuple[str, bool, str]]:
    """Which shipped profiles run on ``gpu`` (each evaluated with target.gpu replaced) and why not.

    Raises UserError on ``target.gpu`` for an unknown GPU.
    """
    spec = resolve_gpu(gpu)
    m = _model(model_dir)
    out = []
    for name in shipped_profiles():
        try:
            p = load_profile(name)
        except UserError as e:
            out.append((name, False, one_line(e.problems[0])))
            continue
        p = p.model_copy(update={"target": p.target.model_copy(update={"gpu": spec.id})})
        plan = evaluate(p, m)
        if plan.ok:
            out.append((name, True, plan.summary()))
        else:
            out.append((name, False, "; ".join(f"{pr.field}: {pr.reason} (rule {pr.rule})" for pr in plan.problems)))
    return out


__all__ = ["ResolvedPlan", "Mapping", "Limits", "Effective", "OverrideRecord", "MemoryPlan", "WeightBreakdown",
           "FallbackMemory", "FallbackInfo", "evaluate", "resolve", "check_all", "profiles_for_gpu", "one_line"]
