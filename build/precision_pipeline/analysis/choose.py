"""Choosing a profile: ``invoke recommend`` (candidates under constraints) and ``invoke compare``
(table + Pareto chart of accuracy loss vs estimated throughput).

Throughput and memory come from the resolve stage only: every candidate is a real ``Profile``
evaluated by ``resolve.plan.evaluate`` (all rules; a refused candidate is reported with the rule
that refuses it) and estimated at a workload by ``resolve.perf.performance`` (output tokens/s per GPU
and per replica, TTFT, TPOT with ranges; one home for the arithmetic; ``resolve.estimate.roofline``'s
ceilings stay in ``estimate``).

Accuracy per candidate, in this order:

1. **measured**: ``<artifacts>/<profile>/gate/metrics.json`` of an existing build whose resolved
   ``quantization`` and ``calibration`` sections equal the candidate's (the gate does not depend on
   the target GPU or the parallel layout: it reads the dequantized checkpoint), made on the same model
   (plan.json's ``model``) over the whole golden set (not ``--golden-limit``), labelled with the
   build folder;
2. **prior**: ``ACCURACY_PRIOR``, the README's measured gate numbers of the shipped profile whose
   quantization + calibration equal the candidate's (same GEMM *and* KV format and exclusions;
   SmolLM2-135M-Instruct, full golden set, vs FP32), labelled ``prior`` with the profile; another
   model will differ (the label says so);
3. **unknown** (no build, no prior: W4A8_AWQ, W8A16, any other GEMM/KV pair): a ``--max-kl-p99``
   constraint rules it out, saying so.

Candidates (``enumerate_candidates``): every GEMM format TensorRT-LLM 1.2 can build x every KV
format x tp in (1, 2, 4, 8), each starting from a shipped profile of that GEMM format (its
calibration, exclusions, per-phase settings and gate; the BF16 profile for a format without one;
every shipped profile of the format with other exclusions too, labelled ``...+<profile>``),
with ``target.gpu``, ``kv_cache_quant_algo``, ``tp_size`` (and ``deployment.gpus_per_replica``),
``build.max_seq_len`` = the context (``--context``, default ``DEFAULT_CONTEXT``; ``max_input_len``
clipped to it) and ``max_batch_size`` raised to ``--min-concurrency`` replaced. Context-phase
kernels: each candidate gets the paged / FP8 context FMHA settings trtllm-build would keep for its
formats on that GPU (``context_settings``, from ``rules.derive_effective``); without paged context
FMHA, KV-cache reuse and chunked context are turned off, and the written profile says so.

Each candidate is built with max_batch_size = the workload's concurrency, else TensorRT-LLM's default
(``RUNTIME_MAX_BATCH``), so the runtime sizes the batch by KV memory; when its base names a fallback, each
placement in ``FALLBACK_CHOICES`` is a candidate of its own (label ``.../fb-<placement>``), its memory or
GPUs counted for that placement.

Objective: the highest estimated output tokens/s **per GPU of the deployment** at the workload (cost
per token; a fallback's own replica counts), ties broken by lower KL P99, then fewer GPUs, then the
faster rollback. Constraints: ``max_kl_p99`` (KL P99 of the measured or prior numbers, nats),
``min_concurrency`` (KV-limited sequences at the context), ``max_gpus`` (world size), and the SLA
triangle: ``max_ttft_p99_s`` / ``max_tpot_s`` (latency), ``min_tokens_per_s`` (throughput of the
service: replicas added), ``max_cold_start_s`` (replica start or cold rollback).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional, Union

import yaml

from precision_pipeline.analysis.accuracy import (ACCURACY_PRIOR, Accuracy, accuracy_of, measured_accuracy, prior_for,
                                                  quality_key, shipped_algo, shipped_quality)
from precision_pipeline.analysis.candidate import Candidate, pareto, tokens_per_gpu
from precision_pipeline.analysis.compare_report import pareto_png, render_html, table_rows, write_compare
from precision_pipeline.core.errors import UserError
from precision_pipeline.resolve import perf as PF
from precision_pipeline.resolve import plan as P
from precision_pipeline.spec import formats as F
from precision_pipeline.spec.algos import KVCacheQuantAlgo, QuantAlgo
from precision_pipeline.spec.hardware import resolve_gpu
from precision_pipeline.spec.model_arch import ModelArch, read_model_arch
from precision_pipeline.spec.profile import (check_profile_target, deep_merge, load_profile, load_raw, save_profile, shipped_profiles,
                                             validate_profile)

TP_SIZES = (1, 2, 4, 8)
DEFAULT_MAX_GPUS = 8
DEFAULT_CONTEXT = 4096
"""Tokens per sequence every candidate is built for and estimated at when ``--context`` is not given
(capped at the model's max_position_embeddings), so that candidates are compared at one context."""
FALLBACK_CHOICES = ("same-gpus", "own-replica", "none")
"""Where a profile's fallback engine lives: warm on the replica's own GPUs (its memory taken from the KV
cache), warm on a replica of its own (its GPUs added to the cost), or none warm (a rollback loads it
cold on the replica's GPUs: the cold-start time says how long)."""
LOAD_GBS = 2.0
"""GB/s per GPU an engine's weights load at (local NVMe; an assumption, not measured): cold-start times."""
RUNTIME_START_S = 30.0
"""Seconds a replica needs before loading weights (container, Triton, TensorRT-LLM runtime; an assumption)."""


@dataclass(frozen=True)
class Constraints:
    """``recommend``'s limits: KL P99 (nats), KV-limited concurrency (sequences), GPUs per engine, and the
    SLA triangle: P99 latency (TTFT P99 and TPOT, seconds), throughput (output tokens/s of the service),
    cold start (seconds to start a replica or roll back to the fallback)."""

    max_kl_p99: Optional[float] = None
    min_concurrency: Optional[int] = None
    max_gpus: int = DEFAULT_MAX_GPUS
    max_ttft_p99_s: Optional[float] = None
    max_tpot_s: Optional[float] = None
    min_tokens_per_s: Optional[float] = None
    max_cold_start_s: Optional[float] = None


def _model(model: Union[Path, str, ModelArch]) -> ModelArch:
    return model if isinstance(model, ModelArch) else read_model_arch(Path(model))


def base_profiles_for(algo: QuantAlgo) -> list[str]:
    """Every shipped profile a candidate of GEMM format ``algo`` can start from: ``base_profile_for``
    first, then the other shipped profiles of that quant_algo whose quantization + calibration differ
    (a tuned variant such as ``nvfp4-b200-smollm2``; same-quality copies such as ``fp8-h200`` add nothing)."""
    first = base_profile_for(algo)
    out, seen = [first], {shipped_quality(first)}
    for n in shipped_profiles():
        if n != first and shipped_algo(n) == algo and shipped_quality(n) not in seen:
            seen.add(shipped_quality(n))
            out.append(n)
    return out


def base_profile_for(algo: QuantAlgo) -> str:
    """The shipped profile a candidate of GEMM format ``algo`` starts from: the first shipped profile
    with that quant_algo, else one whose format groups its scales the same way (``GemmFormat.grouping``
    per_group / fixed_block: its group_size), else the unquantized one."""
    loaded = [(n, shipped_algo(n)) for n in shipped_profiles()]
    same = [n for n, a in loaded if a == algo]
    grouping = F.GEMM[algo].grouping
    alike = [n for n, a in loaded if grouping != "none" and F.GEMM[a].grouping == grouping]
    plain = [n for n, a in loaded if a == QuantAlgo.NO_QUANT]
    return (same or alike or plain)[0]


def context_settings(profile, sm: int) -> dict:
    """The context-phase (and dependent runtime) overrides that make ``profile`` what trtllm-build
    would build on SM ``sm`` (``rules.derive_effective``): paged / FP8 context FMHA as the builder
    sets them; without paged context FMHA, KV-cache reuse and chunked context off (they need it)."""
    from precision_pipeline.resolve.derive import derive_effective

    eff, _ = derive_effective(profile, sm)
    c = profile.context_phase
    out: dict = {}
    ctx = {k: eff[k] for k in ("use_paged_context_fmha", "use_fp8_context_fmha") if getattr(c, k) != eff[k]}
    if not eff["use_paged_context_fmha"]:
        if c.enable_chunked_context:
            ctx["enable_chunked_context"] = False
        if profile.runtime.enable_kv_cache_reuse:
            out["runtime"] = {"enable_kv_cache_reuse": False}
    if ctx:
        out["context_phase"] = ctx
    return out




def _refusals(plan) -> list[dict]:
    return [{"rule": pr.rule, "field": pr.field, "reason": pr.reason} for pr in plan.problems]


@lru_cache(maxsize=64)
def _raw(base: str) -> str:
    """``load_raw(base)`` as JSON text, read once per process (candidates merge over copies of it)."""
    return json.dumps(load_raw(base))


def _merged(base: str, overrides: dict, label: str):
    return validate_profile(deep_merge(json.loads(_raw(base)), overrides), f"candidate {label}")


@lru_cache(maxsize=64)
def _fallback_at(name: str, gpu_id: str, tp: int, pp: int = 1):
    """The fallback profile ``name`` deployed at ``tp`` x ``pp`` on ``gpu_id`` (no fallback of its own)."""
    fb = load_profile(name)
    return fb.model_copy(update={
        "target": fb.target.model_copy(update={"gpu": gpu_id}),
        "parallel": fb.parallel.model_copy(update={"tp_size": tp, "pp_size": pp}),
        "deployment": fb.deployment.model_copy(update={"fallback": None, "warm_fallback": False,
                                                       "gpus_per_replica": tp * pp})})


_OWN_TP: dict = {}


def _own_replica_tp(name: str, gpu_id: str, model: ModelArch) -> Optional[int]:
    """The fewest GPUs (tp in TP_SIZES) the fallback ``name`` runs on by itself, or None (memoised per model)."""
    key = (name, gpu_id, json.dumps(model.model_dump(mode="json"), sort_keys=True))
    if key not in _OWN_TP:
        _OWN_TP[key] = next((tp for tp in TP_SIZES if P.evaluate(_fallback_at(name, gpu_id, tp), model).ok), None)
    return _OWN_TP[key]


_COLD: dict = {}


def _cold_weights(fb_profile, model: ModelArch) -> Optional[int]:
    """Weight bytes per GPU of the fallback as deployed (memoised per profile and model)."""
    key = (json.dumps(fb_profile.model_dump(mode="json"), sort_keys=True), json.dumps(model.model_dump(mode="json")))
    if key not in _COLD:
        sub = P.evaluate(fb_profile, model, _with_fallback=False)
        _COLD[key] = sub.memory.weight_bytes_per_gpu if sub.memory else None
    return _COLD[key]


def _load_s(weight_bytes_per_gpu: float) -> float:
    return weight_bytes_per_gpu / (LOAD_GBS * 1e9)


@dataclass(frozen=True)
class EvalSettings:
    """How a candidate is estimated: ``context`` (tokens per sequence of the estimate; None: the plan's),
    ``fit_context_kernels`` (first add ``context_settings``: the per-phase kernels the builder keeps) and
    ``workload`` (the performance model's input; None: ``PF.Workload()``)."""

    context: Optional[int] = None
    fit_context_kernels: bool = False
    workload: Optional[PF.Workload] = None


def evaluate_candidate(label: str, base: str, overrides: dict, model: ModelArch, artifacts: Path,
                       settings: EvalSettings = EvalSettings(), fallback_choice: Optional[str] = None) -> Candidate:
    """Merge ``overrides`` over ``base`` (as ``extends`` does), validate, resolve, estimate at ``settings``.
    ``fallback_choice``: one of ``FALLBACK_CHOICES`` for the profile's deployment.fallback (None: as the
    profile says); the fallback is deployed at the candidate's tp x pp (same-gpus, none) or at the fewest
    GPUs it runs on (own-replica)."""
    wl, context = settings.workload or PF.Workload(), settings.context
    c = Candidate(label, base, overrides)
    try:
        c.profile = _merged(base, overrides, label)
        if settings.fit_context_kernels:
            extra = context_settings(c.profile, resolve_gpu(c.profile.target.gpu).sm)
            if extra:
                c.overrides = overrides = deep_merge(overrides, extra)
                c.profile = _merged(base, overrides, label)
        fb_name = c.profile.deployment.fallback
        fb_profile = None
        if fallback_choice is not None and fb_name:
            warm = fallback_choice == "same-gpus"
            dep = {"fallback": None if fallback_choice == "own-replica" else fb_name, "warm_fallback": warm}
            c.overrides = overrides = deep_merge(overrides, {"deployment": dep})
            c.profile = _merged(base, overrides, label)
            gid, tp, pp = resolve_gpu(c.profile.target.gpu).id, c.profile.parallel.tp_size, c.profile.parallel.pp_size
            if fallback_choice == "own-replica":
                fb_tp = _own_replica_tp(fb_name, gid, model)
                if fb_tp is None:
                    c.refused = [{"rule": "deployment.fallback", "field": "deployment.fallback",
                                  "reason": f"{fb_name} runs on no tp in {TP_SIZES} of {gid} by itself"}]
                    return c
                c.fallback = {"where": "own-replica", "profile": fb_name, "tp_size": fb_tp, "gpus": fb_tp, "rollback_s": 0.0}
            else:
                fb_profile = _fallback_at(fb_name, gid, tp, pp)
                c.fallback = {"where": fallback_choice, "profile": fb_name, "tp_size": tp, "gpus": 0}
        elif fb_name:
            c.fallback = {"where": "same-gpus" if c.profile.deployment.warm_fallback else "none", "profile": fb_name,
                          "tp_size": None, "gpus": 0}
        else:
            c.fallback = {"where": "none", "profile": None, "gpus": 0, "rollback_s": None}
    except UserError as e:
        c.refused = [{"rule": pr.rule or "profile.schema", "field": pr.field, "reason": pr.reason} for pr in e.problems]
        return c
    c.plan = P.evaluate(c.profile, model, fallback_profile=fb_profile)
    c.refused = _refusals(c.plan)
    if c.plan.ok:
        c.estimate = c.plan.estimate if context is None else P.E.of_plan(c.plan, context=context)
        try:
            c.perf = PF.of_plan(c.plan, wl)
        except UserError as e:
            c.refused = [{"rule": "workload", "field": pr.field, "reason": pr.reason} for pr in e.problems]
            return c
        mem = c.plan.memory
        c.perf["replica_start_s"] = round(RUNTIME_START_S + _load_s(mem.weight_bytes_per_gpu
                                                                    + (mem.fallback_breakdown.weights if mem.fallback_breakdown else 0)), 1)
        if c.fallback.get("where") == "none" and fb_profile is not None:
            w = _cold_weights(fb_profile, model)  # what a rollback loads, cold
            c.fallback["rollback_s"] = round(_load_s(w), 1) if w is not None else None
        elif c.fallback.get("where") == "same-gpus":
            c.fallback["rollback_s"] = 0.0
        _deployed_rate(c, wl)
        c.accuracy = accuracy_of(c.profile, model, artifacts)
    return c


def _deployed_rate(c: Candidate, wl: PF.Workload, min_tokens_per_s: Optional[float] = None) -> None:
    """``perf['deployed_tokens_per_s_per_gpu']``: output tokens/s per GPU of the whole deployment, the
    fallback's own replica (if any) shared by the replicas the workload needs."""
    per = c.perf["output_tokens_per_s_per_replica"]
    reps = c.perf.get("replicas_needed") or 1
    if min_tokens_per_s and per > 0:
        reps = max(reps, math.ceil(min_tokens_per_s / per))
    gpus = reps * c.world_size + int(c.fallback.get("gpus") or 0)
    c.perf["replicas"] = reps
    c.perf["deployment_gpus"] = gpus
    c.perf["deployed_tokens_per_s_per_gpu"] = round(per * reps / gpus, 1) if gpus else 0.0





@lru_cache(maxsize=1)
def _max_batch_limit() -> int:
    from precision_pipeline.spec.profile import BuildLimits

    return int(BuildLimits.model_json_schema()["properties"]["max_batch_size"].get("maximum", 2**31 - 1))


RUNTIME_MAX_BATCH = 2048
"""max_batch_size a candidate is built with when the workload gives no concurrency: TensorRT-LLM's own default
(tensorrt_llm/llmapi/llm_args.py ``max_batch_size: Optional[int] = Field(default=2048``; trtllm-build
--max_batch_size 2048), so the runtime, not the base profile's 64, sizes the batch by KV memory."""


def _overrides(gpu_id: str, algo: QuantAlgo, kv: KVCacheQuantAlgo, tp: int, base_raw: dict,
               context: Optional[int], min_conc: Optional[int], workload: Optional[PF.Workload] = None) -> dict:
    o: dict = {"target": {"gpu": gpu_id}, "quantization": {"quant_algo": algo.value, "kv_cache_quant_algo": kv.value},
               "parallel": {"tp_size": tp}, "deployment": {"gpus_per_replica": tp}}
    b = base_raw.get("build") or {}
    build: dict = {}
    if context is not None:
        build["max_seq_len"] = int(context)
        if (b.get("max_input_len") or F.DEFAULT_MAX_INPUT_LEN) > context:
            build["max_input_len"] = int(context)
    if workload is not None:
        if workload.input_len > (build.get("max_input_len") or b.get("max_input_len") or F.DEFAULT_MAX_INPUT_LEN):
            build["max_input_len"] = min(workload.input_len, build.get("max_seq_len") or workload.input_len)
        want = workload.concurrency if workload.concurrency is not None else RUNTIME_MAX_BATCH
        build["max_batch_size"] = int(min(max(want, min_conc or 0), _max_batch_limit()))
    elif min_conc is not None and min_conc > (b.get("max_batch_size") or 0):
        build["max_batch_size"] = int(min(min_conc, _max_batch_limit()))
    if build:
        o["build"] = build
    return o


def enumerate_candidates(gpu: str, model: Union[Path, str, ModelArch], artifacts: Path,
                         context: Optional[int] = None, min_concurrency: Optional[int] = None,
                         tp_sizes: tuple[int, ...] = TP_SIZES, workload: Optional[PF.Workload] = None,
                         fallback_choices: tuple[str, ...] = FALLBACK_CHOICES) -> list[Candidate]:
    """Every buildable GEMM format x KV format x tp x fallback placement on ``gpu``, evaluated (refused ones
    included). Labels end in ``/fb-<placement>`` when the base profile names a fallback."""
    spec = resolve_gpu(gpu)
    m = _model(model)
    out = []
    for fmt in F.GEMM.values():
        if fmt.refusal:
            continue
        for i, base in enumerate(base_profiles_for(fmt.algo)):
            raw = json.loads(_raw(base))
            has_fb = bool((raw.get("deployment") or {}).get("fallback"))
            for kv in F.KV.values():
                for tp in tp_sizes:
                    label = f"{fmt.short}/kv-{kv.short}/tp{tp}" + (f"+{base}" if i else "")
                    o = _overrides(spec.id, fmt.algo, kv.algo, tp, raw, context, min_concurrency, workload)
                    for choice in (fallback_choices if has_fb else (None,)):
                        out.append(evaluate_candidate(label + (f"/fb-{choice}" if choice else ""), base, o, m,
                                                      artifacts, EvalSettings(context, True, workload), choice))
    return out


def apply_constraints(c: Candidate, k: Constraints) -> None:
    """Fill ``c.violations``: each constraint it misses, with the limit, its value and by how much."""
    c.violations = []
    if c.refused:
        return
    if c.world_size > k.max_gpus:
        c.violations.append({"constraint": "max_gpus", "limit": k.max_gpus, "value": c.world_size,
                             "by": c.world_size - k.max_gpus,
                             "text": f"needs {c.world_size} GPUs, {c.world_size - k.max_gpus} more than --max-gpus {k.max_gpus}"})
    if k.max_kl_p99 is not None:
        v = c.accuracy.kl_p99
        if v is None:
            c.violations.append({"constraint": "max_kl_p99", "limit": k.max_kl_p99, "value": None, "by": None,
                                 "text": f"KL P99 unknown ({c.accuracy.source}); --max-kl-p99 {k.max_kl_p99:g} needs a number"})
        elif v > k.max_kl_p99:
            c.violations.append({"constraint": "max_kl_p99", "limit": k.max_kl_p99, "value": v,
                                 "by": round(v - k.max_kl_p99, 6),
                                 "text": f"KL P99 {v:g} ({c.accuracy.kind}) is {v - k.max_kl_p99:.4g} over --max-kl-p99 "
                                         f"{k.max_kl_p99:g}"})
    if k.min_tokens_per_s is not None and c.perf:
        _deployed_rate(c, PF.Workload(**{x: c.perf["workload"][x] for x in ("input_len", "output_len", "concurrency",
                                                                             "request_rate")}), k.min_tokens_per_s)
    sla = (("max_ttft_p99_s", k.max_ttft_p99_s, (c.perf or {}).get("ttft_p99_s"), "TTFT P99", "s"),
           ("max_tpot_s", k.max_tpot_s, (c.perf or {}).get("tpot_s"), "TPOT", "s"),
           ("max_cold_start_s", k.max_cold_start_s, _cold_start(c), "cold start (replica start or rollback)", "s"))
    for name, limit, v, what, unit in sla:
        if limit is None:
            continue
        if v is None or v > limit:
            c.violations.append({"constraint": name, "limit": limit, "value": v, "by": None if v is None else round(v - limit, 4),
                                 "text": f"{what} {'unknown' if v is None else f'{v:.4g} {unit}'} is over --{name.replace('_', '-')} "
                                         f"{limit:g}"})
    if c.perf is not None and not c.perf.get("fits_workload", True):
        c.violations.append({"constraint": "workload", "limit": None, "value": 0, "by": None,
                             "text": "not one sequence of the workload fits in the KV cache"})
    if k.min_concurrency is not None:
        v = c.estimate["kv_concurrency_at_context"]
        if v < k.min_concurrency:
            c.violations.append({"constraint": "min_concurrency", "limit": k.min_concurrency, "value": v,
                                 "by": k.min_concurrency - v,
                                 "text": f"the KV cache holds {v:,} sequences of {c.estimate['context_tokens']:,} tokens, "
                                         f"{k.min_concurrency - v:,} short of --min-concurrency {k.min_concurrency:,}"})


def _cold_start(c: Candidate) -> Optional[float]:
    """Seconds to start a replica (``perf['replica_start_s']``) or to roll back to a cold fallback, the larger."""
    if not c.perf:
        return None
    return max(c.perf.get("replica_start_s") or 0.0, c.fallback.get("rollback_s") or 0.0)


def rank_key(c: Candidate) -> tuple:
    """Sort key, best first: output tokens/s per GPU of the deployment at the workload (desc; ``perf``),
    KL P99 (asc, unknown last), GPUs of the deployment (asc), rollback time (asc: a warm fallback that costs
    no throughput beats a cold one)."""
    kl = c.accuracy.kl_p99
    gpus = c.perf.get("deployment_gpus", c.world_size) if c.perf else c.world_size
    rb = c.fallback.get("rollback_s")
    return (-tokens_per_gpu(c), kl if kl is not None else float("inf"), gpus, rb if rb is not None else float("inf"), c.label)


@dataclass
class Recommendation:
    """``recommend``'s answer: ``best`` (None when nothing meets every constraint) and every candidate."""

    gpu: str
    constraints: Constraints
    best: Optional[Candidate]
    candidates: list[Candidate]
    workload: dict = field(default_factory=dict)

    @property
    def feasible(self) -> list[Candidate]:
        return sorted((c for c in self.candidates if c.ok), key=rank_key)

    def to_json(self) -> dict:
        return {"gpu": self.gpu, "constraints": self.constraints.__dict__,
                "objective": "highest estimated output tokens/s per GPU of the deployment at the workload (resolve/perf.py), "
                             "then lower KL P99, then fewer GPUs", "workload": self.workload,
                "best": self.best.to_json() if self.best else None,
                "candidates": [c.to_json() for c in self.candidates]}


def recommend(gpu: str, model: Union[Path, str, ModelArch], artifacts: Path, constraints: Constraints = Constraints(),
              context: Optional[int] = None, workload: Optional[PF.Workload] = None) -> Recommendation:
    """Enumerate, drop what the rules refuse, estimate at ``workload`` (default ``PF.Workload()``), apply
    ``constraints``, pick the best (module doc). Candidates are built for max(context, input + output) tokens."""
    if constraints.max_gpus < 1:
        raise UserError("--max-gpus", f"{constraints.max_gpus} is not a positive number of GPUs.", "pass e.g. --max-gpus 1.")
    if constraints.max_kl_p99 is not None and not constraints.max_kl_p99 >= 0:
        raise UserError("--max-kl-p99", f"{constraints.max_kl_p99} is not a KL bound >= 0 (nats).", "pass e.g. --max-kl-p99 0.5.")
    if context is not None and context < 1:
        raise UserError("--context", f"{context} is not a positive number of tokens.", "pass e.g. --context 4096.")
    spec = resolve_gpu(gpu)
    m = _model(model)
    for flag, v in (("--max-ttft-p99", constraints.max_ttft_p99_s), ("--max-tpot", constraints.max_tpot_s),
                    ("--min-tokens-per-s", constraints.min_tokens_per_s), ("--max-cold-start", constraints.max_cold_start_s)):
        if v is not None and not v > 0:
            raise UserError(flag, f"{v} is not a positive number.", f"pass e.g. {flag} 1.")
    wl = workload or PF.Workload()
    if context is None:
        context = max(min(DEFAULT_CONTEXT, m.max_position_embeddings or DEFAULT_CONTEXT), wl.context)
    elif context < wl.context:
        raise UserError("--context", f"{context:,} tokens is shorter than the workload's input + output {wl.context:,}.",
                        f"pass --context {wl.context} or more, or shorten --input-len / --output-len.")
    cands = enumerate_candidates(spec.id, m, artifacts, context, constraints.min_concurrency, workload=wl)
    for c in cands:
        apply_constraints(c, constraints)
    ok = sorted((c for c in cands if c.ok), key=rank_key)
    return Recommendation(spec.id, constraints, ok[0] if ok else None, cands, wl.to_json())


def profile_yaml(c: Candidate, command: str = "", fallback_ref: Optional[str] = None) -> str:
    """The candidate as a profile file: ``extends`` its base, overriding only what the candidate changed.
    ``fallback_ref``: the fallback profile file to name in ``deployment.fallback`` (``write_profile``)."""
    pf = c.perf or {}
    head = ("# Written by `invoke recommend`" + (f" ({command})" if command else "") + ".\n"
            f"# Estimated {tokens_per_gpu(c):,.0f} output tokens/s per GPU at {pf.get('workload', {}).get('described', '?')} "
            f"(resolve/perf.py); accuracy ({c.accuracy.kind}): KL P99 {c.accuracy.kl_p99}; source: {c.accuracy.source}.\n"
            + (f"# Fallback: {fallback_text(c)}.\n" if c.fallback.get("profile") else ""))
    body = {"extends": c.base, "description": f"recommended: {c.label} on {c.overrides['target']['gpu']} "
                                             f"(from {c.base})", **c.overrides}
    if fallback_ref is not None and (body.get("deployment") or {}).get("fallback"):
        body["deployment"] = {**body["deployment"], "fallback": fallback_ref}
    return head + yaml.safe_dump(body, sort_keys=False)


def fallback_yaml(c: Candidate, command: str = "") -> Optional[str]:
    """The candidate's fallback as deployed (its own profile file: ``extends`` the named fallback with the
    candidate's GPU and the placement's tp), or None when the named profile already is that."""
    fb = c.fallback
    if not fb.get("profile") or not fb.get("tp_size"):
        return None
    named = load_profile(fb["profile"])
    gpu = c.overrides["target"]["gpu"]
    if named.parallel.tp_size == fb["tp_size"] and named.parallel.pp_size == 1 and resolve_gpu(named.target.gpu).id == gpu:
        return None
    body = {"extends": fb["profile"], "description": f"fallback of {c.label} on {gpu}: {fb['profile']} at tp {fb['tp_size']} "
                                                     f"({fb['where']})",
            "target": {"gpu": gpu}, "parallel": {"tp_size": fb["tp_size"], "pp_size": 1},
            "deployment": {"gpus_per_replica": fb["tp_size"]}}
    return ("# Written by `invoke recommend`" + (f" ({command})" if command else "") + ": the fallback engine as deployed.\n"
            + yaml.safe_dump(body, sort_keys=False))


def fallback_text(c: Candidate) -> str:
    """Where the candidate's fallback lives, in words."""
    fb = c.fallback
    if not fb.get("profile"):
        return "none (the base profile names no fallback; a rollback goes to the previous release)"
    if fb["where"] == "same-gpus":
        return (f"{fb['profile']} at tp {fb['tp_size']}, warm on the replica's own GPUs (its memory counted against the "
                f"KV cache; rollback instant)")
    if fb["where"] == "own-replica":
        return (f"{fb['profile']} at tp {fb['tp_size']}, warm on a replica of its own ({fb['gpus']} GPU"
                f"{'s' if fb['gpus'] != 1 else ''} added to the deployment; rollback = a routing switch)")
    return (f"{fb['profile']} at tp {fb['tp_size']}, not loaded: a rollback loads it cold on the replica's GPUs "
            f"(~{fb.get('rollback_s')} s at {LOAD_GBS:g} GB/s per GPU)")


def write_profile(c: Candidate, path: Path, command: str = "") -> Path:
    """Write ``profile_yaml(c)`` atomically once the strict loader accepts it (``spec.profile.save_profile``;
    UserError and nothing written if not). Returns the resolved path. When the fallback is deployed at
    another tp or GPU than its named profile (``fallback_yaml``), that is written first as
    ``<stem>-fallback.yaml`` beside it and named (absolute path) in ``deployment.fallback``."""
    path = check_profile_target(path)  # before the sibling: a refused --write writes nothing (hostile s8 #84)
    fb_text = fallback_yaml(c, command)
    ref = fb_path = None
    if fb_text is not None:
        fb_path = path.with_name(f"{path.stem}-fallback{path.suffix or '.yaml'}")
        fb_new = not fb_path.exists()
        save_profile(fb_path, fb_text)
        ref = str(fb_path)
    try:
        save_profile(path, profile_yaml(c, command, ref))
    except BaseException:
        if fb_path is not None and fb_new:
            fb_path.unlink(missing_ok=True)
        raise
    return path


# ---------------------------------------------------------------------------------------------
# measure: build and gate candidates for real (recommend --measure, compare --build)


BuildFn = Callable[[Path], Optional[str]]
"""Builds the profile file it is given through the gate (``invoke build``) and returns None, or a
one-line reason when the build did not produce gate numbers (a failed gate still does: it is
measured, just over the thresholds)."""


def _unmeasured_by_quality(cands: list[Candidate]) -> list[Candidate]:
    """The first candidate of each distinct quantization + calibration that has no measured accuracy
    (the gate's numbers depend on nothing else, so one build measures every tp size and GPU of it)."""
    seen, out = [], []
    for c in cands:
        if c.profile is None or c.refused or c.accuracy.kind == "measured":
            continue
        q = quality_key(c.profile)
        if q not in seen:
            seen.append(q)
            out.append(c)
    return out


def measure_top(rec: Recommendation, top: int, folder: Path, build: BuildFn, command: str = "") -> list[dict]:
    """Build and gate, for real, the best ``top`` candidates that meet every constraint except the
    accuracy one (``max_kl_p99``) and have no measured numbers yet, one build per distinct
    quantization + calibration; each is written first as ``folder/<label>.yaml`` (``write_profile``),
    so its build lands in ``artifacts/<that name>/`` where ``measured_accuracy`` finds it. Returns one
    record per build: label, profile path, reason (None = measured). Re-run ``recommend`` afterwards
    to rank by the measured numbers. Raises UserError for ``top`` < 1."""
    if top < 1:
        raise UserError("--top", f"{top} is not a positive number of candidates.", "pass e.g. --top 2.")
    near = sorted((c for c in rec.candidates if not c.refused
                   and all(v["constraint"] == "max_kl_p99" for v in c.violations)), key=rank_key)
    out = []
    for c in _unmeasured_by_quality(near)[:top]:
        path = write_profile(c, Path(folder) / f"{profile_file_stem(rec.gpu, c.label)}.yaml", command=command)
        out.append({"label": c.label, "profile": str(path), "reason": build(path)})
    return out


def build_unmeasured(cands: list[Candidate], build: BuildFn) -> list[dict]:
    """``compare --build``: build every compared profile that runs but has no measured numbers (one per
    distinct quantization + calibration; ``profile_ref`` is the compared profile's own file)."""
    from precision_pipeline.spec.profile import resolve_profile_path

    out = []
    for c in _unmeasured_by_quality(cands):
        path = resolve_profile_path(c.base)
        out.append({"label": c.label, "profile": str(path), "reason": build(path)})
    return out


def profile_file_stem(gpu: str, label: str) -> str:
    """A profile name for a candidate: ``rec-<gpu>-<label>`` with the label's ``/`` as ``-``
    (``rec-h100-sxm-fp8-kv-fp8-tp1``), a valid profile name (lower-case letters, digits, ``.-_``)."""
    return f"rec-{gpu}-{label}".replace("/", "-").replace("+", "-").lower()


# ---------------------------------------------------------------------------------------------
# compare: table + Pareto chart


def compare(profiles: list[str], model: Union[Path, str, ModelArch], artifacts: Path,
            gpu: Optional[str] = None, workload: Optional[PF.Workload] = None) -> list[Candidate]:
    """Evaluate each profile (``target.gpu`` replaced by ``gpu`` when given): estimate, accuracy, refusals.
    Raises UserError (field ``--profiles``) for an empty list or one naming a profile file twice."""
    from precision_pipeline.spec.profile import resolve_profile_path

    if not profiles:
        raise UserError("--profiles", "lists no profile.", "pass e.g. --profiles fp8-h100,bf16-h100, or all.")
    seen: dict[Path, str] = {}
    for name in profiles:
        f = resolve_profile_path(name, field="--profiles").resolve()
        if f in seen:
            raise UserError("--profiles", f"{name!r} and {seen[f]!r} are the same profile ({f}).",
                            "name each profile once.")
        seen[f] = name
    m = _model(model)
    spec = resolve_gpu(gpu) if gpu else None
    out = []
    for name in profiles:
        base = load_profile(name)  # UserError for an unknown profile name
        over = {"target": {"gpu": spec.id}} if spec else {}
        label = base.name + (f"@{spec.id}" if spec else "")
        out.append(evaluate_candidate(label, name, over, m, artifacts, EvalSettings(workload=workload)))
    return out


__all__ = ["Constraints", "EvalSettings", "evaluate_candidate", "Recommendation", "enumerate_candidates", "recommend", "compare", "profile_yaml",
           "write_profile", "fallback_yaml", "fallback_text", "FALLBACK_CHOICES", "measure_top", "build_unmeasured",
           "profile_file_stem", "base_profile_for", "base_profiles_for",
           # homes: analysis/accuracy.py, candidate.py, compare_report.py; here for callers not moved yet (tasks.py)
           "ACCURACY_PRIOR", "Accuracy", "prior_for", "accuracy_of", "measured_accuracy", "Candidate", "tokens_per_gpu",
           "pareto", "pareto_png", "render_html", "table_rows", "write_compare"]
