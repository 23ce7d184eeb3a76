"""Named, data-driven checks that refuse bad profiles before any GPU time.

Each rule has a name (``format.gemm_sm``), a source (the TensorRT-LLM 1.2 file or document
it encodes, see ``build/precision_pipeline/spec/formats.py``), and a function from a ``Context`` to ``Finding``s with
status ``warn`` or ``refused`` (no finding = ``pass``). ``build/precision_pipeline/resolve/plan.py`` runs ``RULES`` in
order, collects every refusal into one ``UserError`` and writes all results to plan.json.

Before the rules run, two derivations mirror what ``trtllm-build`` would do on its own:

* ``derive_limits``: the BuildConfig values used when a limit is left out (``max_seq_len`` =
  max_position_embeddings x rope factor, ``max_input_len`` 1024, ``max_num_tokens`` 8192), and
  the clamps of ``check_max_num_tokens`` -- each with its reason.
* ``derive_effective``: the plugin values after ``tensorrt_llm/builder.py build()`` silently
  overrides them (e.g. BF16/INT4-AWQ/SmoothQuant weights with an FP8 KV cache turn paged
  context FMHA off; an INT8 KV cache turns it off; FP8 KV + paged context FMHA turns FP8
  context FMHA on), plus the resolved ``--gemm_plugin``.

The memory plan (``memory_plan``) is computed here too, so the fit rule can read it.
Units: bytes unless a name says GiB; token counts are tokens.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from precision_pipeline.spec import formats as F
from precision_pipeline.core.errors import Problem, UserError
from precision_pipeline.spec.device import DeviceChoice
from precision_pipeline.spec.hardware import GIB, GPUSpec, resolve_gpu
from precision_pipeline.spec.families import COLUMN, EXPERT, GATE_ARCHITECTURES, family, kept_linears
from precision_pipeline.spec.model_arch import ModelArch
from precision_pipeline.spec.profile import KVCacheQuantAlgo, Profile, QuantAlgo


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
    """A named check. ``needs_gpu``: skipped when target.gpu did not resolve."""

    name: str
    summary: str
    source: str
    func: Callable[["Context"], list[Finding]]
    needs_gpu: bool = True


RULES: list[Rule] = []


def rule(name: str, summary: str, source: str, needs_gpu: bool = True):
    """Register ``func`` as a rule (order of registration = order of evaluation)."""

    def deco(func):
        RULES.append(Rule(name, summary, source, func, needs_gpu))
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

    @property
    def gemm_format_ok(self) -> bool:
        """The GEMM format runs on the target SM (context rules stay quiet when it does not:
        format.gemm_sm already refuses, and the consequences would only repeat it)."""
        e = self.fmt
        if e.refusal or self.gpu is None:
            return not e.refusal
        if e.per_layer:
            return True
        return e.supports(self.gpu.sm)

    def gpu_text(self) -> str:
        g = self.gpu
        return f"{g.id} ({g.name}) is SM {g.sm}" if g else "the GPU is unknown"


# ---------------------------------------------------------------------------------------------
# Derivations (what trtllm-build does by itself)


def derive_mapping(p: Profile) -> dict:
    """TRT-LLM Mapping of one engine: world_size = tp x pp; moe_ep default 1, moe_tp = tp / moe_ep."""
    par = p.parallel
    tp, pp = par.tp_size, par.pp_size
    ep = par.moe_ep_size if par.moe_ep_size is not None else (1 if par.moe_tp_size is None else max(1, tp // par.moe_tp_size))
    mtp = par.moe_tp_size if par.moe_tp_size is not None else max(1, tp // ep)
    return {"world_size": tp * pp, "tp_size": tp, "pp_size": pp, "moe_tp_size": mtp, "moe_ep_size": ep}


def derive_limits(p: Profile, m: ModelArch) -> tuple[dict, list[Finding]]:
    """Effective build limits and the reason for each value trtllm-build derives or clamps.

    Mirrors tensorrt_llm/builder.py ``_init_max_seq_len`` and _common.py ``check_max_num_tokens``.
    Returns (limits dict with a "derived" {field: reason} entry, notes as warn Findings).
    """
    b = p.build
    derived: dict[str, str] = {}
    notes: list[Finding] = []
    factor = m.rope_scaling_factor
    if b.max_seq_len is None:
        if m.max_position_embeddings is None:
            msl = F.DEFAULT_MAX_SEQ_LEN_NO_POSITIONS
            derived["max_seq_len"] = (f"not set and the model has no max_position_embeddings: {msl} "
                                      f"({F.SRC_INIT_SEQ})")
        else:
            msl = m.max_position_embeddings if factor == 1 else int(math.ceil(m.max_position_embeddings * factor))
            derived["max_seq_len"] = (f"not set: max_position_embeddings {m.max_position_embeddings:,} x rope scaling "
                                      f"factor {factor:g} = {msl:,} tokens ({F.SRC_INIT_SEQ})")
    else:
        msl = b.max_seq_len
    if b.max_input_len is None:
        mil = F.DEFAULT_MAX_INPUT_LEN
        reason = f"not set: BuildConfig default {mil:,} ({F.SRC_BUILDCONFIG})"
        if mil > msl:
            reason += f", clipped to max_seq_len {msl:,} as the builder does ({F.SRC_INIT_SEQ})"
            mil = msl
        derived["max_input_len"] = reason
    else:
        mil = b.max_input_len
    if b.max_num_tokens is None:
        mnt = F.DEFAULT_MAX_NUM_TOKENS
        derived["max_num_tokens"] = f"not set: BuildConfig default {mnt:,} ({F.SRC_BUILDCONFIG})"
    else:
        mnt = b.max_num_tokens
    cap = b.max_batch_size * msl
    if mnt > cap:
        derived["max_num_tokens"] = (f"{mnt:,} > max_batch_size {b.max_batch_size} x max_seq_len {msl:,}: "
                                     f"clamped to {cap:,} ({F.SRC_COMMON})")
        notes.append(warn("build.max_num_tokens",
                          f"{mnt:,} is more than max_batch_size x max_seq_len = {cap:,}; trtllm-build clamps it to {cap:,}.",
                          f"set max_num_tokens <= {cap:,} (or raise max_batch_size)."))
        mnt = cap
    if p.context_phase.context_fmha and mnt < b.tokens_per_block:
        derived["max_num_tokens"] = (f"{mnt:,} < tokens_per_block {b.tokens_per_block}: raised to "
                                     f"{b.tokens_per_block} ({F.SRC_COMMON})")
        notes.append(warn("build.max_num_tokens",
                          f"{mnt:,} is less than tokens_per_block {b.tokens_per_block}; trtllm-build raises it to {b.tokens_per_block}.",
                          f"set max_num_tokens >= {b.tokens_per_block}."))
        mnt = b.tokens_per_block
    limits = {
        "max_batch_size": b.max_batch_size,
        "max_input_len": mil,
        "max_seq_len": msl,
        "max_num_tokens": mnt,
        "max_beam_width": b.max_beam_width,
        "derived": derived,
    }
    return limits, notes


def resolve_gemm_plugin(p: Profile) -> tuple[Optional[str], str]:
    """The ``--gemm_plugin`` value for trtllm-build and why.

    * ``auto`` with NVFP4 -> ``nvfp4``: builder.py enables the NVFP4 GEMM plugin for NVFP4
      checkpoints unless gemm_plugin is explicitly ``disable``.
    * ``auto`` with FP8 -> ``disable``: FP8 GEMMs come from TensorRT's Q/DQ fusion; NVIDIA's
      perf guide (docs/source/performance/perf-best-practices.md, "GEMM Plugin") recommends the
      cuBLASLt GEMM plugin for FP16/BF16 and disabling it for FP8 (the ``fp8`` plugin helps only
      small batches). The BF16 lm_head then uses TensorRT's own GEMM.
    * ``auto`` otherwise -> ``auto`` (= model dtype): BF16 GEMMs through cuBLASLt; INT4/INT8
      weight-only and SmoothQuant linears get their own plugins from the builder.
    * an explicit value is passed through.
    """
    asked = p.generation_phase.gemm_plugin
    if asked != "auto":
        return asked, "set in the profile"
    auto = F.GEMM[p.quantization.quant_algo].auto_gemm_plugin
    if auto is not None:
        return auto
    return "auto", f"cuBLASLt GEMM plugin in the model dtype ({p.quantization.dtype}) for the unquantized GEMMs"


def derive_effective(p: Profile, sm: int) -> tuple[dict, list[Override]]:
    """Effective per-phase settings after tensorrt_llm/builder.py ``build()`` overrides.

    ``sm`` is the target GPU's SM (0 if unknown: the SM-dependent branch is then skipped).
    """
    c = p.context_phase
    q = p.quantization.quant_algo.value
    fmt, kvf = F.GEMM[p.quantization.quant_algo], F.KV[p.quantization.kv_cache_quant_algo]
    fmha, paged, fp8 = c.context_fmha, c.use_paged_context_fmha, c.use_fp8_context_fmha
    ov: list[Override] = []

    def set_(name: str, new: bool, reason: str):
        nonlocal paged, fp8
        old = paged if name == "use_paged_context_fmha" else fp8
        if old != new:
            ov.append(Override(f"context_phase.{name}", old, new, reason))
            if name == "use_paged_context_fmha":
                paged = new
            else:
                fp8 = new

    fam = " or ".join(F.FP8_CONTEXT_FMHA_ALGOS)
    if not fmha:
        set_("use_fp8_context_fmha", False, "context_fmha is off, so FP8 context FMHA is off")
        set_("use_paged_context_fmha", False, "context_fmha is off, so paged context FMHA is off")
    elif not fmt.fp8_context_fmha:
        set_("use_fp8_context_fmha", False,
             f"FP8 context FMHA needs the FP8 quantization workflow (quant_algo {fam}); quant_algo is {q}")
        if kvf.fp8_context_fmha:
            set_("use_paged_context_fmha", False,
                 f"with an FP8 KV cache, paged context FMHA needs FP8 context FMHA, which quant_algo {q} does not have")
    elif sm and sm < F.FP8_CONTEXT_FMHA_MIN_SM:
        set_("use_fp8_context_fmha", False, f"FP8 context FMHA needs SM >= {F.FP8_CONTEXT_FMHA_MIN_SM} (Ada, Hopper); the GPU is SM {sm}")
        if kvf.fp8_context_fmha:
            set_("use_paged_context_fmha", False,
                 f"with an FP8 KV cache, paged context FMHA needs FP8 context FMHA, which SM {sm} lacks")
    elif paged:
        if not kvf.fp8_context_fmha and fp8:
            set_("use_fp8_context_fmha", False,
                 "FP8 context FMHA with paged context FMHA reads the KV cache, so it needs an FP8 KV cache")
        elif kvf.fp8_context_fmha and not fp8:
            set_("use_fp8_context_fmha", True, "FP8 paged context FMHA over the FP8 KV cache needs FP8 context FMHA")
    if paged and not kvf.paged_context_fmha:
        set_("use_paged_context_fmha", False, "paged context FMHA does not work with an INT8 KV cache")
    gemm, gemm_reason = resolve_gemm_plugin(p)
    logits = p.build.logits_dtype
    eff = {
        "context_fmha": fmha,
        "use_paged_context_fmha": paged,
        "use_fp8_context_fmha": fp8,
        "enable_kv_cache_reuse": p.runtime.enable_kv_cache_reuse,
        "enable_chunked_context": p.context_phase.enable_chunked_context,
        "kv_cache_type": p.build.kv_cache_type,
        "tokens_per_block": p.build.tokens_per_block,
        "gemm_plugin": gemm,
        "gemm_plugin_reason": gemm_reason,
        "gpt_attention_plugin": p.generation_phase.gpt_attention_plugin,
        "logits_dtype": logits,
        "multi_block_mode": p.generation_phase.multi_block_mode,
        "triton_logits_datatype": F.TRITON_DTYPE.get(logits, "TYPE_FP32"),
        "strongly_typed": True,
        "use_fused_mlp": fmt.fused_mlp,
        "gather_context_logits": p.build.gather_context_logits,
        "overrides": [o.__dict__ for o in ov],
    }
    return eff, ov


# ---------------------------------------------------------------------------------------------
# Memory math (bytes per GPU)


def kept_in_high_precision(m: ModelArch, q) -> tuple[tuple[frozenset[str], ...], bool]:
    """Per decoder layer: the HF linears (relative names, ``Family.layer_linears``) the export keeps in high
    precision, and whether it keeps ``lm_head``: ``spec.families.kept_linears``, i.e. the export's own
    matching (``resolve_exclusions``: patterns on HF, TensorRT-LLM and short names, keep_first/last layers,
    fused groups kept whole), memoised."""
    return kept_linears(m.architecture, tuple(q.exclude_modules), q.keep_first_layers, q.keep_last_layers,
                        m.num_layers)


def _decoder_linears_kept(m: ModelArch, q) -> tuple[int, int]:
    """(decoder linears kept in high precision, decoder linears) of ``m`` under ``q`` (``kept_in_high_precision``)."""
    per_layer, _ = kept_in_high_precision(m, q)
    return sum(len(k) for k in per_layer), m.num_layers * len(family(m.architecture).layer_linears())


def kv_heads_per_rank(m: ModelArch, tp: int) -> int:
    """KV heads held by one tensor-parallel rank: kv/tp, or 1 when heads are replicated (tp >= kv)."""
    return max(1, -(-m.num_kv_heads // tp))


def layers_per_rank(num_layers: int, pp: int) -> list[int]:
    """Layer indices of each pipeline rank (earlier ranks take the remainder)."""
    base, rem = divmod(num_layers, pp)
    out, start = [], 0
    for r in range(pp):
        n = base + (1 if r < rem else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def kv_bytes_per_token(m: ModelArch, p: Profile, mapping: dict) -> float:
    """KV-cache bytes per token on one GPU: 2 (K,V) x layers/pp x max(1, kv_heads/tp) x head_dim x bytes.

    Bytes per element: BF16 2, FP8/INT8 1, NVFP4 0.5 + 1/16 (FP8 scale per 16 values).
    """
    layers = max(len(r) for r in layers_per_rank(m.num_layers, mapping["pp_size"])) if m.num_layers >= mapping["pp_size"] else 1
    per_el = F.KV_BYTES[p.quantization.kv_cache_quant_algo.value]
    return 2 * layers * kv_heads_per_rank(m, mapping["tp_size"]) * m.head_dim * per_el


def weight_bytes(m: ModelArch, p: Profile, mapping: dict) -> dict:
    """Checkpoint weight bytes on the heaviest GPU of one engine, with a breakdown.

    Linears are quantized per ``quant_algo`` (``formats.linear_weight_bytes``) unless matched by
    ``exclude_modules`` or in keep_first/last_layers (then the model dtype). Embeddings and
    norms stay in the model dtype; the embedding is replicated on every tp rank unless
    ``use_parallel_embedding``. The TRT-LLM checkpoint stores ``lm_head`` separately even for
    tied embeddings (ModelOpt export), so both are counted; lm_head is split over tp.
    """
    q = p.quantization
    fmt = F.GEMM[q.quant_algo]
    db = F.DTYPE_BYTES[q.dtype]
    tp, pp = mapping["tp_size"], mapping["pp_size"]
    mtp, ep = mapping["moe_tp_size"], mapping["moe_ep_size"]
    h, hd = m.hidden_size, m.head_dim
    heads_r = -(-m.num_heads // tp)
    kvh_r = kv_heads_per_rank(m, tp)
    kv_scale = 3 * F.SCALE_F32 if F.KV[q.kv_cache_quant_algo].is_quantized else 0

    def lin(n_in: int, n_out: int, keep: bool) -> float:
        if keep or not fmt.is_quantized:
            return n_in * n_out * db
        return fmt.linear_bytes(n_in, n_out, q.group_size, db, q.auto_quantize_bits)

    fam = family(m.architecture)
    per_layer_kept, head_kept = kept_in_high_precision(m, q)

    def layer_bytes(kept: frozenset[str]) -> float:
        """One decoder layer whose HF linears ``kept`` stay in high precision (a fused group is kept whole)."""
        gemm_kept = {lin.trt for lin in fam.linears if lin.hf in kept}
        b = lin(h, (heads_r + 2 * kvh_r) * hd, "attention.qkv" in gemm_kept)
        b += lin(heads_r * hd, h, "attention.dense" in gemm_kept)
        if m.attention_bias:
            b += (heads_r + 2 * kvh_r) * hd * db
        if m.is_moe:
            e_r = -(-m.num_experts // ep)
            mi = -(-m.moe_intermediate_size // mtp)
            b += e_r * sum(lin(h, mi, x.hf.replace(EXPERT, "0") in kept) if x.parallel == COLUMN
                           else lin(mi, h, x.hf.replace(EXPERT, "0") in kept) for x in fam.moe.experts)
            b += h * m.num_experts * 4  # router weight, F32, replicated (never quantized)
            if m.shared_expert_intermediate_size:
                si = -(-m.shared_expert_intermediate_size // tp)
                b += 2 * lin(h, si, False) + lin(si, h, False)
        else:
            it = -(-m.intermediate_size // tp)
            b += lin(h, it, "mlp.fc" in gemm_kept)
            b += lin(h, it, "mlp.gate" in gemm_kept)
            b += lin(it, h, "mlp.proj" in gemm_kept)
        b += 2 * h * db + kv_scale  # input/post layernorm + KV-cache scales
        return b

    per_layer_cache: dict[tuple, float] = {}
    ranks = layers_per_rank(m.num_layers, min(pp, m.num_layers) if m.num_layers else 1)
    emb = m.vocab_size * h * db
    if p.parallel.use_parallel_embedding:
        emb = -(-m.vocab_size // tp) * h * db
    lm_head = lin(h, -(-m.vocab_size // tp), head_kept or not fmt.is_quantized)
    best = None
    for r, idx in enumerate(ranks):
        dec = 0.0
        for i in idx:
            key = per_layer_kept[i]  # layers kept alike weigh alike
            if key not in per_layer_cache:
                per_layer_cache[key] = layer_bytes(key)
            dec += per_layer_cache[key]
        e = emb if r == 0 else 0.0
        lmh = lm_head + h * db if r == len(ranks) - 1 else 0.0  # + final norm
        total = dec + e + lmh
        if best is None or total > best["total"]:
            best = {"total": total, "decoder": dec, "embedding": e, "lm_head": lmh, "pp_rank": r}
    best = {k: (int(round(v)) if isinstance(v, float) else v) for k, v in best.items()}
    return best


def activation_bytes(m: ModelArch, p: Profile, mapping: dict, limits: dict, gather_context_logits: bool | None = None) -> int:
    """Estimate of the engine's activation memory per GPU (bytes; an estimate, not a measurement).

    max_num_tokens x (2 x hidden + qkv/tp + attention output/tp + 2 x MLP width/tp) x 2 bytes
    (live BF16 activation buffers of one layer, twice for TensorRT's double buffering), plus the
    logits buffer: max_batch_size x beam x vocab x logits bytes (x max_num_tokens rows when
    gather_context_logits). trtllm-build prints the exact engine device memory.
    ``gather_context_logits``: the engine's effective value (``derive_effective``); None reads
    ``p.build.gather_context_logits``.
    """
    tp = mapping["tp_size"]
    t = limits["max_num_tokens"]
    mlp = (m.moe_intermediate_size * max(1, m.num_experts_per_tok)) if m.is_moe else m.intermediate_size
    width = 2 * m.hidden_size + m.qkv_out / tp + m.num_heads * m.head_dim / tp + 2 * mlp / tp
    act = 2 * t * width * 2
    lb = F.DTYPE_BYTES.get(p.build.logits_dtype, 4)
    gather = p.build.gather_context_logits if gather_context_logits is None else gather_context_logits
    rows = t if gather else limits["max_batch_size"] * limits["max_beam_width"]
    act += rows * m.vocab_size * lb
    return int(act)


def memory_plan(ctx: Context) -> dict:
    """Per-GPU memory plan (bytes): weights, activations, warm fallback, KV cache and its capacity.

    usable = driver memory - weights - activations - warm fallback (weights + activations)
             - runtime reserve (CUDA context, workspaces; ~1 GiB estimate)
    kv_cache_bytes = usable x runtime.kv_cache_free_gpu_mem_fraction (KvCacheConfig semantics:
    a fraction of what is free after the engine is loaded); capacity in whole blocks of
    tokens_per_block tokens.
    """
    m, p, g = ctx.model, ctx.profile, ctx.gpu
    w = weight_bytes(m, p, ctx.mapping)
    kvt = kv_bytes_per_token(m, p, ctx.mapping)
    act = activation_bytes(m, p, ctx.mapping, ctx.limits, ctx.effective["gather_context_logits"])
    fb = int(ctx.fallback_memory.get("total", 0)) if ctx.fallback_memory else 0
    total = g.memory_bytes if g else 0
    reserve = F.RUNTIME_RESERVE_BYTES
    usable = total - w["total"] - act - fb - reserve
    frac = p.runtime.kv_cache_free_gpu_mem_fraction
    kv_cache = int(max(0, usable) * frac)
    tpb = p.build.tokens_per_block
    kv_enabled = p.build.kv_cache_type != "disabled"
    capacity = int(kv_cache // (kvt * tpb)) * tpb if kv_enabled and kvt > 0 else 0
    msl = ctx.limits["max_seq_len"]
    return {
        "gpu_memory_bytes": total,
        "weight_bytes_per_gpu": w["total"],
        "weight_gib_per_gpu": round(w["total"] / GIB, 4),
        "weight_breakdown": w,
        "kv_bytes_per_token": round(kvt, 4) if kvt != int(kvt) else int(kvt),
        "kv_bytes_per_seq_at_max_seq_len": int(kvt * msl),
        "activation_bytes_estimate": act,
        "fallback_bytes": fb,
        "fallback_breakdown": ctx.fallback_memory or {},
        "runtime_reserve_bytes": reserve,
        "usable_bytes": usable,
        "kv_cache_free_gpu_mem_fraction": frac,
        "kv_cache_bytes": kv_cache,
        "kv_tokens_capacity": capacity,
        "concurrent_seqs_at_max_seq_len": capacity // msl if msl else 0,
        "fits": usable > 0 and (not kv_enabled or capacity >= msl),
        "notes": ("activation_bytes_estimate and runtime_reserve_bytes are estimates; weights follow the "
                  "ModelOpt checkpoint layout (" + F.SRC_CKPT + ")"),
    }


def gib(x: float) -> str:
    return f"{x / GIB:,.2f} GiB"


# ---------------------------------------------------------------------------------------------
# What the build itself needs (quantize and the gate, on the chosen device and in host memory)

GATE_TOKENS_PER_FORWARD = 1024
"""Tokens of the gate's longest forward, for its activation estimate: every golden prompt is under
1,024 tokens (build/precision_pipeline/gate/data/golden_prompts.jsonl) and held-out windows are 512."""
GATE_DECODE_BATCH = 8
"""Prompts whose KV caches the gate keeps at once per model (``GateOptions.greedy_batch`` default)."""
PLANNING_GPU = "h100-sxm"
"""The GPU a CPU refusal prices its ``--device cuda`` alternative in (spec/hardware.py)."""


def _bytes_of(dtype: str) -> int:
    return F.DTYPE_BYTES[dtype]


def build_memory_plan(ctx: Context) -> dict:
    """Peak bytes of the quantize stage and of the gate on ``ctx.device`` and in host memory.

    Estimates from config.json alone (``ModelArch.num_params`` = ``spec.model_arch.count_params``,
    layers, hidden size, vocabulary), nothing loaded. P parameters; c = the compute dtype's bytes
    (``DeviceChoice.compute_dtype``: FP32 = 4 on the CPU, the profile's dtype = 2 on CUDA); r = the
    reference dtype's bytes (4 FP32, 2 BF16); K = one copy of the exported checkpoint
    (``weight_bytes`` at tp 1):

    * quantize: weights P x c + calibration activations batch_size x seq_len x (4 hidden + 3 MLP
      width + vocab) x c (one layer's live buffers and the logits; SDPA attention keeps no
      seq_len^2 scores); the per-layer search (MIXED_PRECISION, gradient scores with gradient
      checkpointing) adds each layer's input (layers x batch x seq x hidden x c), the FP32 logits
      and their gradient (2 x batch x seq x vocab x 4) and twice the layer buffers. Host: on the
      CPU everything plus the export's copy K; on CUDA the export's copy K (``from_pretrained``
      with a device map reads the safetensors shards straight to the GPUs).
    * gate: reference P x r + its BF16 copy P x 2 (the noise floor, only with an FP32 reference)
      + the candidate P x c, all held at once on a first gate of the model (the candidate is
      loaded before the reference is computed), plus per model a forward of
      ``GATE_TOKENS_PER_FORWARD`` tokens and ``GATE_DECODE_BATCH`` KV caches. Host: on the CPU all
      of it plus K (the reader reads the checkpoint); on CUDA the reader's FP32 dequantized tensors
      P x 4 plus the candidate built on the host, P x c, before it moves to the GPUs.
    * device capacity on CUDA: sum over visible GPUs of (free - ``RUNTIME_RESERVE_BYTES``), less
      (GPUs - 1) x the largest whole decoder layer (a device map never splits a layer).
    Returns {} when ``ctx.device`` is None.
    """
    d = ctx.device
    if d is None:
        return {}
    m, p = ctx.model, ctx.profile
    q, cal = p.quantization, p.calibration
    P = int(m.num_params)
    cdt = d.compute_dtype(q.dtype)
    c, r = _bytes_of(cdt), _bytes_of(d.reference_dtype)
    mlp = (m.moe_intermediate_size * max(1, m.num_experts_per_tok)) if m.is_moe else m.intermediate_size
    width = 4 * m.hidden_size + 3 * mlp
    one = dict(ctx.mapping, tp_size=1, pp_size=1, world_size=1, moe_tp_size=1, moe_ep_size=1)
    ckpt = int(weight_bytes(m, p, one)["total"])
    b, s = cal.batch_size, cal.seq_len
    calib = b * s * (width + m.vocab_size) * c
    search = 0
    if ctx.fmt.per_layer:
        search = m.num_layers * b * s * m.hidden_size * c + 2 * b * s * m.vocab_size * 4 + 2 * b * s * width * c
    q_dev = P * c + calib + search
    floor = 2 * P if d.reference_dtype == "float32" else 0
    t = GATE_TOKENS_PER_FORWARD
    kv = GATE_DECODE_BATCH * t * 2 * m.num_layers * m.num_kv_heads * m.head_dim

    def act(nbytes: int) -> int:
        return t * width * nbytes + 2 * t * m.vocab_size * 4 + kv * nbytes

    g_act = act(r) + (act(2) if floor else 0) + act(c)
    g_dev = P * r + floor + P * c + g_act
    if d.is_cuda:
        q_host, g_host = ckpt, P * 4 + P * c
    else:
        q_host, g_host = q_dev + ckpt, g_dev + ckpt
    emb = m.vocab_size * m.hidden_size
    layer = (P - emb * (1 if m.tied_embeddings else 2)) // max(1, m.num_layers)
    block = max(layer, emb) * max(c, r)
    n = len(d.gpus)
    usable = sum(g.free_bytes - F.RUNTIME_RESERVE_BYTES for g in d.gpus) - max(0, n - 1) * block if d.is_cuda else 0
    q_need = q_dev if d.is_cuda else q_host
    g_need = g_dev if d.is_cuda else g_host
    return {
        "device": d.to_json(),
        "compute_dtype": cdt,
        "reference_dtype": d.reference_dtype,
        "noise_floor": bool(floor),
        "num_params": P,
        "checkpoint_bytes_estimate": ckpt,
        "quantize": {"weights": P * c, "calibration_activations": calib, "search": search,
                     "device_bytes": q_dev if d.is_cuda else 0, "host_bytes": q_host},
        "gate": {"reference": P * r, "floor": floor, "candidate": P * c, "activations": g_act,
                 "device_bytes": g_dev if d.is_cuda else 0, "host_bytes": g_host},
        "device_usable_bytes": usable,
        "largest_block_bytes": block,
        "host_available_bytes": d.host_available_bytes,
        "fits_device": (not d.is_cuda) or max(q_dev, g_dev) <= usable,
        "fits_host": max(q_host, g_host) <= d.host_available_bytes,
        "peak_bytes": max(q_need, g_need),
        "notes": "estimates from config.json (parameters, dtype, layers, vocabulary); nothing was loaded",
    }


# ---------------------------------------------------------------------------------------------
# Rules: GPU


@rule("gpu.variant", "target.gpu names one memory size (a100 is read as a100-80gb: warned, with the choices)",
      "build/precision_pipeline/spec/hardware.py (_VARIANTS)")
def _gpu_variant(ctx: Context) -> list[Finding]:
    from precision_pipeline.spec.hardware import variant_note  # local: avoid a cycle at import time

    note = variant_note(ctx.profile.target.gpu)
    if note:
        return [warn("target.gpu", note + ".", f"write the id ({ctx.gpu.id} or another of the choices) to say which.")]
    return []


@rule("gpu.supported", "target GPU is SM >= 80 (TensorRT-LLM 1.x)", F.SRC_SUPPORT)
def _gpu_supported(ctx: Context) -> list[Finding]:
    g = ctx.gpu
    if g.sm < F.MIN_TRTLLM_SM:
        return [refuse("target.gpu", f"{g.id} ({g.name}) is SM {g.sm} ({g.arch}); TensorRT-LLM 1.x supports SM >= 80 only "
                                     "(Ampere, Ada, Hopper, Blackwell).",
                       "use an Ampere or newer GPU, e.g. a100-80gb, l4, h100-sxm.")]
    return []


# ---------------------------------------------------------------------------------------------
# Rules: formats vs SM


def _format_fix(ctx: Context, entry: F.GemmFormat) -> str:
    alts = F.supported_alternatives(ctx.sm, exclude=entry.algo)
    alt_txt = F.join_or([a.short for a in alts])
    gpus = [gid for gid in entry.gpu_ids() if gid != ctx.gpu.id]

    def some(ids: list[str], n: int) -> str:  # the catalog grows: name a few, count the rest
        return ", ".join(ids[:n]) + (f" and {len(ids) - n} more" if len(ids) > n else "")

    if entry.fix_gpus_first:
        return (f"{entry.short} runs on {entry.sm_text()} ({some(gpus, 8)}); "
                f"on SM {ctx.sm} use {alt_txt}.")
    return f"use {alt_txt} on SM {ctx.sm}" + (f", or a GPU of {entry.sm_text()} ({some(gpus, 6)})." if gpus else ".")


@rule("format.trtllm_buildable", "quant_algo is a TensorRT-LLM 1.2 QuantAlgo", F.SRC_MODE, needs_gpu=False)
def _buildable(ctx: Context) -> list[Finding]:
    e = ctx.fmt
    if e.refusal:
        return [refuse("quantization.quant_algo", e.refusal, "use NVFP4 (W4A4, Blackwell) or W4A16_AWQ (INT4 weight-only) instead.")]
    return []


@rule("format.gemm_sm", "GEMM format runs on the target SM", f"{F.SRC_QUANT_MD}; {F.SRC_BUILDER}")
def _gemm_sm(ctx: Context) -> list[Finding]:
    e = ctx.fmt
    if e.refusal:
        return []  # format.trtllm_buildable reports it
    out = []
    if e.per_layer:
        q = ctx.profile.quantization
        if q.auto_quantize_bits is None:
            out.append(refuse("quantization.auto_quantize_bits", "MIXED_PRECISION needs an effective-bits budget.",
                              "set quantization.auto_quantize_bits, e.g. 6.0 with auto_quantize_formats [FP8, W4A16_AWQ]."))
        if not q.auto_quantize_formats:
            out.append(refuse("quantization.auto_quantize_formats", "MIXED_PRECISION needs candidate formats for the search.",
                              "set quantization.auto_quantize_formats, e.g. [FP8, W4A16_AWQ]."))
        for cand in q.auto_quantize_formats:
            ce = F.GEMM[cand]
            if ce.per_layer or not ce.is_quantized:
                continue
            if ce.refusal or not ce.supports(ctx.sm):
                out.append(refuse("quantization.auto_quantize_formats",
                                  f"candidate {cand.value}: {ce.needs}; {ctx.gpu_text()}.", _format_fix(ctx, ce)))
        return out
    if not e.supports(ctx.sm):
        out.append(refuse("quantization.quant_algo", f"{e.value}: {e.needs}; {ctx.gpu_text()}.",
                          _format_fix(ctx, e)))
    elif e.untested(ctx.sm):
        out.append(warn("quantization.quant_algo",
                        f"{e.value} on SM {ctx.sm}: the builder accepts it but the hardware support matrix does not list it.",
                        "validate accuracy and speed on this GPU before shipping."))
    return out


def _short_list(items: list[str], n: int = 4) -> str:
    shown = ", ".join(repr(s[:40]) for s in items[:n])
    return f"[{shown}{', ...' if len(items) > n else ''}]"


@rule("quantize.modelopt_inputs", "the quantize stage (ModelOpt 0.47) can produce what the profile asks",
      "modelopt/torch/quantization/config.py (KV configs); build/precision_pipeline/spec/formats.py (search candidates: "
      "normalize_candidates, check_search_bits); build/precision_pipeline/quantize/ptq.py (what the export writes)", needs_gpu=False)
def _modelopt_inputs(ctx: Context) -> list[Finding]:
    """Refusals the quantize stage would otherwise raise after the build started writing."""
    from precision_pipeline.core.errors import UserError

    q, m, par = ctx.profile.quantization, ctx.model, ctx.profile.parallel
    out = []
    if ctx.fmt.per_layer:
        if q.auto_quantize_formats:  # empty: format.gemm_sm refuses it
            try:  # the search's own input checks (spec/formats.py); the machine it runs on is not known here
                fmts = F.normalize_candidates(q.auto_quantize_formats, cuda_available=True)
                if q.auto_quantize_bits is not None:
                    F.check_search_bits(q.auto_quantize_bits, fmts)
            except UserError as e:
                out.extend(refuse(p.field, p.reason, p.fix) for p in e.problems)
    elif q.auto_quantize_formats:
        out.append(warn("quantization.auto_quantize_formats",
                        f"candidate formats are only used by quant_algo MIXED_PRECISION; ignored for {ctx.quant}.",
                        "remove auto_quantize_formats, or set quant_algo: MIXED_PRECISION."))
    if ctx.kv_fmt.not_exported:
        out.append(refuse("quantization.kv_cache_quant_algo", *ctx.kv_fmt.not_exported))
    if ctx.fmt.is_quantized and q.keep_first_layers + q.keep_last_layers >= m.num_layers > 0:
        out.append(refuse("quantization.keep_first_layers",
                          f"keep_first_layers {q.keep_first_layers} + keep_last_layers {q.keep_last_layers} keep all "
                          f"{m.num_layers} decoder layers of {m.name} in high precision: nothing would be quantized.",
                          f"keep fewer layers (together < {m.num_layers}), or use quant_algo NO_QUANT."))
    elif ctx.fmt.is_quantized and not m.is_moe and m.num_layers > 0 and q.exclude_modules:
        # the same matching the export applies (spec/families.py): patterns on HF, TensorRT-LLM and short names
        kept, n_decoder = _decoder_linears_kept(m, q)
        if kept == n_decoder:
            out.append(refuse("quantization.exclude_modules",
                              f"the patterns {_short_list(q.exclude_modules)} keep every one of the {n_decoder} "
                              f"decoder linears of {m.name} in high precision: nothing would be quantized.",
                              "exclude fewer modules (e.g. lm_head, *router*), or use quant_algo NO_QUANT."))
    if par.pp_size != 1 and ctx.checkpoint_dir is None:
        out.append(refuse("parallel.pp_size", f"pipeline parallel {par.pp_size} is not exported by the quantize stage "
                          "(it writes tensor-parallel rank files only).",
                          "use pp_size: 1 (tensor parallel covers the supported models), or reuse a checkpoint "
                          "exported with that mapping (--checkpoint)."))
    tp = par.tp_size
    if not m.is_moe and m.intermediate_size and m.intermediate_size % tp:
        ok_tp = [d for d in range(1, m.num_heads + 1) if m.num_heads % d == 0 and m.intermediate_size % d == 0]
        out.append(refuse("parallel.tp_size", f"tp_size {tp} does not split the MLP intermediate size "
                          f"{m.intermediate_size} of {m.name} evenly (each rank holds intermediate_size/tp columns).",
                          f"use a tp_size dividing both the heads and {m.intermediate_size}: {', '.join(map(str, ok_tp))}."))
    return out


@rule("model.unquantized", "--model holds unquantized weights (the quantize stage's input and the gate's reference)",
      "Hugging Face config.json quantization_config (transformers quantizers)", needs_gpu=False)
def _unquantized(ctx: Context) -> list[Finding]:
    m = ctx.model
    if not m.quantized_as:
        return []
    return [refuse("--model", f"{m.name}'s config.json has a quantization_config (quant_method {m.quantized_as!r}): "
                   "it is a pre-quantized checkpoint, so quantizing it again and gating against it would measure the "
                   "wrong reference.", "give the original BF16/FP16 model folder.")]


@rule("calibration.seq_len", "calibration samples fit in the model's positions",
      "config.json max_position_embeddings (and rope_scaling factor); modelopt calibration forward passes",
      needs_gpu=False)
def _calib_seq_len(ctx: Context) -> list[Finding]:
    m, c = ctx.model, ctx.profile.calibration
    if not ctx.fmt.is_quantized or ctx.checkpoint_dir is not None or not m.max_position_embeddings:
        return []
    positions = int(m.max_position_embeddings * (m.rope_scaling_factor or 1.0))
    if c.seq_len <= positions:
        return []
    return [refuse("calibration.seq_len", f"{c.seq_len:,} tokens per sample is more than {m.name}'s "
                   f"{positions:,} positions; the calibration forward passes would run past them.",
                   f"use seq_len <= {positions:,} (256-2048 is typical).")]


@rule("format.kv_sm", "KV-cache format runs on the target SM", f"{F.SRC_QUANT_MD}; {F.SRC_BUILDER}")
def _kv_sm(ctx: Context) -> list[Finding]:
    e = ctx.kv_fmt
    if not e.supports(ctx.sm):
        ok = [v.value for v in F.KV.runnable_on(ctx.sm)]
        return [refuse("quantization.kv_cache_quant_algo", f"{e.value}: {e.needs}; {ctx.gpu_text()}.",
                       f"use kv_cache_quant_algo {F.join_or(ok)} on SM {ctx.sm}.")]
    return []


@rule("format.group_size", "AWQ/NVFP4 block size divides every tensor-parallel slice it applies to",
      F.SRC_CKPT + "; shared/reference/models-and-data.md (INT4 groups per tp slice)", needs_gpu=False)
def _group_size(ctx: Context) -> list[Finding]:
    q, m, mp = ctx.profile.quantization, ctx.model, ctx.mapping
    algo, fmt = ctx.quant, ctx.fmt
    out = []
    if fmt.grouping == "per_group":
        if q.group_size is None:
            return [refuse("quantization.group_size", f"{algo} needs a group size (scales per group of input channels).",
                           f"set quantization.group_size to a divisor of {_slice_text(m, mp)}, e.g. {_suggest_group(m, mp)}.")]
        g, what = q.group_size, "group_size"
    elif fmt.per_layer and any(F.GEMM[c].grouping == "per_group" for c in q.auto_quantize_formats):
        if q.group_size is None:  # the search picks the largest of 128/64/32/16 that divides (autoquant.py)
            return []
        g, what = q.group_size, "group_size (AWQ search candidate)"
    elif fmt.grouping == "fixed_block":
        g, what = F.NVFP4_BLOCK, "the NVFP4 block (16)"
        if q.group_size not in (None, F.NVFP4_BLOCK):
            out.append(refuse("quantization.group_size", f"{algo} uses a fixed block of {F.NVFP4_BLOCK} elements; "
                              f"got {q.group_size}.", f"remove quantization.group_size (or set it to {F.NVFP4_BLOCK})."))
    else:
        if q.group_size is not None:
            out.append(refuse("quantization.group_size", f"{algo} has no per-group scales; group_size {q.group_size} "
                              "would be ignored.", "remove quantization.group_size (it applies to AWQ, NVFP4 and a "
                              "per-layer search with an AWQ candidate)."))
        return out
    bad = [(name, n) for name, n in _input_slices(m, mp, q) if n % g]
    if bad:
        listed = ", ".join(f"{name} {n}" for name, n in bad)
        out.append(refuse("quantization.group_size",
                          f"{what} {g} does not divide the input width of every tensor-parallel slice: {listed}.",
                          f"use a group size dividing {_slice_text(m, mp)}, e.g. {_suggest_group(m, mp)}; or change tp_size."))
    return out


def _input_slices(m: ModelArch, mp: dict, q=None) -> list[tuple[str, float]]:
    """(name, input width) of each quantized linear slice on one rank (groups run along inputs).

    Column-parallel linears (qkv, fc, gate) keep the full hidden input; row-parallel ones
    (attention dense, mlp proj) see their input split over tp (experts: over moe_tp). A width that
    is not a whole number is returned as a float (never divisible).
    """
    tp, mtp = mp["tp_size"], mp["moe_tp_size"]

    def div(a: int, b: int):
        return a // b if a % b == 0 else a / b

    attn = m.num_heads * m.head_dim
    s = [("hidden (qkv/fc/gate input)", m.hidden_size),
         (f"attention dense input {attn}/tp {tp}", div(attn, tp))]
    if m.is_moe:
        s.append((f"expert proj input {m.moe_intermediate_size}/moe_tp {mtp}", div(m.moe_intermediate_size, mtp)))
    else:
        s.append((f"mlp proj input {m.intermediate_size}/tp {tp}", div(m.intermediate_size, tp)))
    return s


def _slice_text(m: ModelArch, mp: dict) -> str:
    return ", ".join(str(n if isinstance(n, int) else round(n, 2)) for _, n in _input_slices(m, mp, None))


def _suggest_group(m: ModelArch, mp: dict) -> str:
    widths = [n for _, n in _input_slices(m, mp, None)]
    if any(not isinstance(w, int) for w in widths):
        return "none (the slices are not whole numbers; change tp_size)"
    gcd = 0
    for w in widths:
        gcd = math.gcd(gcd, w)
    for g in (128, 64, 32, 16):
        if gcd % g == 0:
            return str(g)
    return str(gcd)


# ---------------------------------------------------------------------------------------------
# Rules: layout


@rule("layout.world_size", "tp_size x pp_size = GPUs per engine = deployment.gpus_per_replica", F.SRC_MAPPING, needs_gpu=False)
def _world(ctx: Context) -> list[Finding]:
    p = ctx.profile
    ws = p.parallel.tp_size * p.parallel.pp_size
    gpr = p.deployment.gpus_per_replica
    if gpr is not None and gpr != ws:
        return [refuse("deployment.gpus_per_replica",
                       f"is {gpr}, but tp_size {p.parallel.tp_size} x pp_size {p.parallel.pp_size} = {ws} GPUs per engine.",
                       f"set gpus_per_replica to {ws} (or leave it out), or change tp_size/pp_size to multiply to {gpr}.")]
    return []


def lws_group(world: int, gpus_per_node: Optional[int], workload: str = "deployment") -> int:
    """Pods per engine: 1 when the engine fits a node (or ``gpus_per_node`` is unset), else
    ``ceil(world / gpus_per_node)`` pods with ``world / group`` GPUs each (a LeaderWorkerSet group).

    Raises UserError when the world does not split evenly over those pods (every pod of a group has the
    same GPU count: one worker template) or with ``workload: argo-rollout`` (see below). The one home of
    the multi-node layout: ``serving.deploy`` renders the LeaderWorkerSet from it and the rule
    ``layout.nodes`` refuses the same profiles at ``invoke check``."""
    if gpus_per_node is None or world <= gpus_per_node:
        return 1
    group = -(-world // gpus_per_node)
    if world % group:
        raise UserError("deployment.gpus_per_node", f"is {gpus_per_node}: tp_size x pp_size = {world} GPUs need {group} pods, "
                        f"but {world} ranks do not split evenly over {group} pods (every pod of a LeaderWorkerSet group has "
                        "the same GPUs).", f"use a world size that is a multiple of {group}, or nodes with more GPUs.")
    if workload == "argo-rollout":
        # a Rollout's workloadRef names a Deployment (pods of one template); a LeaderWorkerSet's unit is a pod group
        raise UserError("deployment.workload", f"argo-rollout cannot own a multi-node engine ({world} GPUs over {group} "
                        "pods): Argo Rollouts manages ReplicaSets of single pods, while a LeaderWorkerSet creates and "
                        "rolls groups of pods that form one MPI world.",
                        "use workload: deployment (the LeaderWorkerSet's rolling update replaces whole groups) and "
                        "`invoke rollout` / the probe alerts for the accuracy check.")
    return group


@rule("layout.nodes", "a multi-node engine (tp_size x pp_size > deployment.gpus_per_node) splits evenly over pods "
      "and is owned by a plain Deployment's LeaderWorkerSet", "LeaderWorkerSet API leaderworkerset.x-k8s.io/v1 "
      "(one worker template per group); build/precision_pipeline/resolve/rules.py lws_group", needs_gpu=False)
def _nodes(ctx: Context) -> list[Finding]:
    p = ctx.profile
    try:
        lws_group(p.parallel.tp_size * p.parallel.pp_size, p.deployment.gpus_per_node, p.deployment.workload)
    except UserError as e:
        return [refuse(pr.field, pr.reason, pr.fix) for pr in e.problems]
    return []


@rule("layout.attention_heads", "attention heads divisible by tp_size", "tensorrt_llm/models/llama/model.py (Attention: num_heads / tp_size)",
      needs_gpu=False)
def _heads(ctx: Context) -> list[Finding]:
    m, tp = ctx.model, ctx.profile.parallel.tp_size
    if m.num_heads % tp:
        ok = [d for d in range(1, m.num_heads + 1) if m.num_heads % d == 0]
        return [refuse("parallel.tp_size", f"{tp} does not divide the model's {m.num_heads} attention heads ({m.name}).",
                       f"use tp_size {F.join_or([str(d) for d in ok])}.")]
    return []


@rule("layout.kv_heads", "KV heads divisible by tp_size, or tp_size divisible by KV heads (replicated)",
      "tensorrt_llm/models/llama/model.py (num_kv_heads split or replicated over tp)", needs_gpu=False)
def _kv_heads(ctx: Context) -> list[Finding]:
    m, tp = ctx.model, ctx.profile.parallel.tp_size
    kv = m.num_kv_heads
    if kv % tp and tp % kv:
        return [refuse("parallel.tp_size", f"{tp} neither divides the {kv} KV heads nor is a multiple of them ({m.name}).",
                       f"use a tp_size that divides {kv} or is a multiple of {kv}.")]
    if tp > kv:
        return [warn("parallel.tp_size", f"{tp} > {kv} KV heads: each KV head is replicated on {tp // kv} ranks (KV cache per GPU does not shrink further).")]
    return []


@rule("layout.moe", "moe_tp_size x moe_ep_size = tp_size; experts divisible by moe_ep_size", F.SRC_MAPPING, needs_gpu=False)
def _moe(ctx: Context) -> list[Finding]:
    par, m, mp = ctx.profile.parallel, ctx.model, ctx.mapping
    out = []
    if mp["moe_tp_size"] * mp["moe_ep_size"] != par.tp_size:
        out.append(refuse("parallel.moe_ep_size" if par.moe_ep_size is not None else "parallel.moe_tp_size",
                          f"moe_tp_size {mp['moe_tp_size']} x moe_ep_size {mp['moe_ep_size']} = {mp['moe_tp_size'] * mp['moe_ep_size']}, "
                          f"but it must equal tp_size {par.tp_size} (MoE layers are split over the same GPUs).",
                          f"choose moe_tp_size x moe_ep_size = {par.tp_size}, e.g. moe_ep_size {par.tp_size} with moe_tp_size 1."))
    if m.is_moe and m.num_experts % mp["moe_ep_size"]:
        out.append(refuse("parallel.moe_ep_size", f"{mp['moe_ep_size']} does not divide the model's {m.num_experts} experts.",
                          f"use a moe_ep_size dividing {m.num_experts}."))
    if not m.is_moe and (par.moe_ep_size not in (None, 1) or (par.moe_tp_size not in (None, par.tp_size))):
        out.append(warn("parallel.moe_ep_size", f"{m.name} is a dense model; moe_tp_size/moe_ep_size are ignored."))
    return out


@rule("layout.pipeline", "pp_size <= number of layers", F.SRC_MAPPING, needs_gpu=False)
def _pp(ctx: Context) -> list[Finding]:
    pp, L = ctx.profile.parallel.pp_size, ctx.model.num_layers
    if pp > L:
        return [refuse("parallel.pp_size", f"{pp} is more than the model's {L} layers.", f"use pp_size <= {L}.")]
    if L % pp:
        return [warn("parallel.pp_size", f"{L} layers over {pp} pipeline ranks are uneven; the busiest rank sets the pace.")]
    return []


def checkpoint_mapping_findings(p: Profile, checkpoint_dir: Optional[Path]) -> list[Finding]:
    """Compare a reused TRT-LLM checkpoint's config.json ``mapping`` (and quantization) with the profile.

    ``checkpoint_dir`` None or without config.json -> nothing to compare.
    """
    if checkpoint_dir is None:
        return []
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        return []
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return [refuse("--checkpoint", f"{path} is not valid JSON ({e}).", "leave out --checkpoint so that the build quantizes.")]
    if not isinstance(cfg, dict):
        return [refuse("--checkpoint", f"{path} does not hold a JSON object.", "leave out --checkpoint so that the build quantizes.")]
    want = derive_mapping(p)
    got = cfg.get("mapping") or {}
    if not isinstance(got, dict):
        got = {}
    out = []
    diffs = []
    for k in ("tp_size", "pp_size"):
        g = got.get(k, 1)
        if g != want[k]:
            diffs.append(f"{k} {g} (profile {want[k]})")
    for k in ("moe_tp_size", "moe_ep_size"):
        if k in got and got[k] != want[k]:
            diffs.append(f"{k} {got[k]} (profile {want[k]})")
    if diffs:
        out.append(refuse("parallel.tp_size", f"the reused checkpoint {checkpoint_dir} was exported with " + ", ".join(diffs) + ".",
                          "re-quantize: the checkpoint's rank*.safetensors are split for its own mapping "
                          "(delete the checkpoint or change the profile's parallel layout back)."))
    qz = cfg.get("quantization") or {}
    if isinstance(qz, dict):
        qa = qz.get("quant_algo") or QuantAlgo.NO_QUANT.value
        kv = qz.get("kv_cache_quant_algo") or KVCacheQuantAlgo.NONE.value
        if qa != p.quantization.quant_algo.value or kv != p.quantization.kv_cache_quant_algo.value:
            out.append(refuse("quantization.quant_algo",
                              f"the reused checkpoint {checkpoint_dir} holds quant_algo {qa} / kv_cache_quant_algo {kv}, "
                              f"the profile asks for {p.quantization.quant_algo.value} / {p.quantization.kv_cache_quant_algo.value}.",
                              "leave out --checkpoint so that the build quantizes, or use a profile that matches it."))
        elif F.GEMM[p.quantization.quant_algo].per_layer:
            out.extend(_mixed_reuse_findings(p, Path(checkpoint_dir)))
    return out


def _mixed_reuse_findings(p: Profile, ckpt: Path) -> list[Finding]:
    """A reused MIXED_PRECISION checkpoint must use only the profile's candidates and meet its budget."""
    fix = "leave out --checkpoint so that the build runs the search, or change the profile to match."
    try:
        qc = json.loads((ckpt / "quant_cfg.json").read_text(encoding="utf-8"))
        layers = qc.get("quantized_layers") if isinstance(qc, dict) else None
        used = {e.get("quant_algo") for e in layers.values() if isinstance(e, dict)} if isinstance(layers, dict) else set()
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return []  # the checkpoint reader reports a missing/broken quant_cfg.json with its own message
    want = {c.value for c in p.quantization.auto_quantize_formats}
    out = []
    extra = sorted(str(u) for u in used - want)
    if extra:
        out.append(refuse("quantization.auto_quantize_formats",
                          f"the reused checkpoint {ckpt} has layers in {', '.join(extra)}, which the profile's candidates "
                          f"({', '.join(sorted(want)) or 'none'}) do not include.", fix))
    try:
        achieved = json.loads((ckpt / "autoquant.json").read_text(encoding="utf-8")).get("effective_bits_achieved")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        achieved = None
    budget = p.quantization.auto_quantize_bits
    if isinstance(achieved, (int, float)) and budget is not None and achieved > budget + 1e-6:
        out.append(refuse("quantization.auto_quantize_bits",
                          f"the reused checkpoint {ckpt} averages {achieved:.3f} bits per searched weight, over the "
                          f"profile's budget of {budget}.", fix))
    return out


@rule("layout.checkpoint_mapping", "a reused checkpoint's mapping equals the profile's", "TRT-LLM checkpoint config.json mapping "
      "(" + F.SRC_CKPT + ")", needs_gpu=False)
def _ckpt(ctx: Context) -> list[Finding]:
    return checkpoint_mapping_findings(ctx.profile, ctx.checkpoint_dir)


# ---------------------------------------------------------------------------------------------
# Rules: limits


@rule("limits.derived", "limits left out are derived as trtllm-build does (shown with reasons)", f"{F.SRC_INIT_SEQ}; {F.SRC_COMMON}",
      needs_gpu=False)
def _derived(ctx: Context) -> list[Finding]:
    return list(ctx.limit_notes)


@rule("limits.input_within_seq", "max_input_len <= max_seq_len", F.SRC_INIT_SEQ, needs_gpu=False)
def _input_seq(ctx: Context) -> list[Finding]:
    b, lim = ctx.profile.build, ctx.limits
    if b.max_input_len is not None and b.max_input_len > lim["max_seq_len"]:
        src = "" if ctx.profile.build.max_seq_len is not None else " (derived)"
        return [refuse("build.max_input_len", f"{b.max_input_len:,} is more than max_seq_len {lim['max_seq_len']:,}{src}; "
                                              "a prompt cannot be longer than the whole sequence.",
                       f"set max_input_len <= {lim['max_seq_len']:,} or raise max_seq_len.")]
    return []


@rule("limits.seq_within_positions", "max_seq_len within max_position_embeddings x rope factor", F.SRC_INIT_SEQ, needs_gpu=False)
def _seq_pos(ctx: Context) -> list[Finding]:
    m, msl = ctx.model, ctx.limits["max_seq_len"]
    if m.max_position_embeddings is None:
        return []
    limit = m.max_position_embeddings * m.rope_scaling_factor
    if msl > limit:
        scal = "without rope scaling" if m.rope_scaling_factor == 1 else f"x rope factor {m.rope_scaling_factor:g}"
        return [warn("build.max_seq_len", f"{msl:,} is more than the model's max_position_embeddings {m.max_position_embeddings:,} "
                                          f"{scal}; accuracy past {int(limit):,} tokens is not trained for.",
                     f"set max_seq_len <= {int(limit):,} or use a model with rope scaling.")]
    return []


@rule("limits.num_tokens_vs_input", "max_num_tokens < max_input_len needs chunked context (and paged context FMHA)",
      f"{F.SRC_COMMON}; tensorrtllm_backend enable_chunked_context", needs_gpu=False)
def _mnt_input(ctx: Context) -> list[Finding]:
    lim, eff = ctx.limits, ctx.effective
    if lim["max_num_tokens"] >= lim["max_input_len"]:
        return []
    if eff["enable_chunked_context"] and eff["use_paged_context_fmha"]:
        return []
    missing = []
    if not eff["enable_chunked_context"]:
        missing.append("context_phase.enable_chunked_context: true")
    if not eff["use_paged_context_fmha"]:
        missing.append("context_phase.use_paged_context_fmha: true (effective value is off)")
    return [refuse("build.max_num_tokens",
                   f"{lim['max_num_tokens']:,} is less than max_input_len {lim['max_input_len']:,}: a prompt that long only fits "
                   "if it is processed in chunks.",
                   "set " + " and ".join(missing) + f", or raise max_num_tokens to >= {lim['max_input_len']:,}.")]


@rule("limits.num_tokens_large", "max_num_tokens <= 16384 advised", F.SRC_COMMON, needs_gpu=False)
def _mnt_large(ctx: Context) -> list[Finding]:
    n = ctx.limits["max_num_tokens"]
    if n > F.MAX_NUM_TOKENS_ADVISED:
        return [warn("build.max_num_tokens", f"{n:,} > {F.MAX_NUM_TOKENS_ADVISED:,}: usually no speed gain, more activation memory, "
                                             "and it may exceed TensorRT's tensor volume.",
                     f"use max_num_tokens <= {F.MAX_NUM_TOKENS_ADVISED:,} with chunked context.")]
    return []


# ---------------------------------------------------------------------------------------------
# Rules: context-phase attention (builder overrides)


@rule("context.fp8_context_fmha", "use_fp8_context_fmha only with FP8/W4A8_AWQ/NVFP4 on SM >= 89 (and an FP8 KV cache when paged)",
      F.SRC_BUILDER + " (FP8 context FMHA logic)")
def _fp8_ctx(ctx: Context) -> list[Finding]:
    asked = ctx.profile.context_phase.use_fp8_context_fmha
    if not asked or ctx.effective["use_fp8_context_fmha"] or not ctx.gemm_format_ok:
        return []
    o = next(o for o in ctx.overrides if o.field == "context_phase.use_fp8_context_fmha")
    if not ctx.profile.context_phase.context_fmha:
        fix = "turn context_fmha on, or set use_fp8_context_fmha: false."
    elif not ctx.fmt.fp8_context_fmha:
        fix = f"set use_fp8_context_fmha: false, or use quant_algo {F.join_or(list(F.FP8_CONTEXT_FMHA_ALGOS))}."
    elif ctx.sm < F.FP8_CONTEXT_FMHA_MIN_SM:
        fix = "set use_fp8_context_fmha: false on this GPU."
    else:
        fix = "set kv_cache_quant_algo: FP8, or use_fp8_context_fmha: false."
    return [refuse("context_phase.use_fp8_context_fmha", f"trtllm-build would turn it off: {o.reason}.", fix)]


@rule("context.builder_overrides", "no asked-for feature is lost to a silent trtllm-build override", F.SRC_BUILDER)
def _overrides(ctx: Context) -> list[Finding]:
    out = []
    if not ctx.gemm_format_ok:
        return out
    for o in ctx.overrides:
        if o.field == "context_phase.use_fp8_context_fmha" and o.asked:
            continue  # context.fp8_context_fmha
        if o.field == "context_phase.use_paged_context_fmha" and o.asked and not o.effective:
            lost = []
            if ctx.profile.runtime.enable_kv_cache_reuse:
                lost.append("runtime.enable_kv_cache_reuse")
            if ctx.profile.context_phase.enable_chunked_context:
                lost.append("context_phase.enable_chunked_context")
            if lost:
                out.append(refuse("context_phase.use_paged_context_fmha",
                                  f"trtllm-build would turn paged context FMHA off ({o.reason}), which disables "
                                  f"{' and '.join(lost)} that the profile asks for.",
                                  _paged_fix(ctx, lost)))
            else:
                out.append(warn("context_phase.use_paged_context_fmha",
                                f"trtllm-build turns it off: {o.reason} (no KV-cache reuse or chunked prefill with this engine)."))
        else:
            out.append(warn(o.field, f"trtllm-build sets it to {o.effective} (asked {o.asked}): {o.reason}."))
    return out


def _paged_fix(ctx: Context, lost: list[str]) -> str:
    if not ctx.kv_fmt.paged_context_fmha:
        return "use kv_cache_quant_algo FP8 or NONE, or turn " + " and ".join(lost) + " off."
    if ctx.kv_fmt.fp8_context_fmha and not ctx.fmt.fp8_context_fmha:
        return ("use kv_cache_quant_algo NONE with this quant_algo, or a quant_algo with FP8 context FMHA "
                f"({', '.join(F.FP8_CONTEXT_FMHA_ALGOS)}), "
                "or turn " + " and ".join(lost) + " off.")
    if not ctx.profile.context_phase.context_fmha:
        return "turn context_fmha on, or turn " + " and ".join(lost) + " off."
    return "use kv_cache_quant_algo NONE on this GPU, or turn " + " and ".join(lost) + " off."


# ---------------------------------------------------------------------------------------------
# Rules: runtime / build coupling


@rule("runtime.kv_cache_reuse", "KV-cache reuse needs paged context FMHA and a paged KV cache, and no INT8 KV cache",
      f"{F.SRC_BUILDER}; {F.SRC_BACKEND} (enable_kv_cache_reuse)", needs_gpu=False)
def _reuse(ctx: Context) -> list[Finding]:
    p = ctx.profile
    if not p.runtime.enable_kv_cache_reuse:
        return []
    out = []
    if not p.context_phase.use_paged_context_fmha:
        out.append(refuse("runtime.enable_kv_cache_reuse",
                          "needs context_phase.use_paged_context_fmha (reused blocks are read by the context-phase attention).",
                          "set context_phase.use_paged_context_fmha: true, or enable_kv_cache_reuse: false."))
    if not ctx.kv_fmt.paged_context_fmha:
        out.append(refuse("runtime.enable_kv_cache_reuse", "is not possible with an INT8 KV cache (paged context FMHA does not "
                                                           "support INT8 KV).",
                          "use kv_cache_quant_algo FP8 or NONE, or set enable_kv_cache_reuse: false."))
    if p.build.kv_cache_type != "paged":
        out.append(refuse("runtime.enable_kv_cache_reuse", f"needs build.kv_cache_type paged (is {p.build.kv_cache_type}).",
                          "set build.kv_cache_type: paged, or enable_kv_cache_reuse: false."))
    return out


@rule("runtime.chunked_context", "chunked context needs paged context FMHA and a paged KV cache",
      f"{F.SRC_BACKEND} (enable_chunked_context); {F.SRC_PLUGIN} (use_paged_context_fmha)", needs_gpu=False)
def _chunked(ctx: Context) -> list[Finding]:
    p = ctx.profile
    if not p.context_phase.enable_chunked_context:
        return []
    out = []
    if not p.context_phase.use_paged_context_fmha:
        out.append(refuse("context_phase.enable_chunked_context", "needs context_phase.use_paged_context_fmha.",
                          "set use_paged_context_fmha: true, or enable_chunked_context: false."))
    if p.build.kv_cache_type != "paged":
        out.append(refuse("context_phase.enable_chunked_context", f"needs build.kv_cache_type paged (is {p.build.kv_cache_type}).",
                          "set build.kv_cache_type: paged."))
    return out


@rule("runtime.streaming", "streaming needs decoupled_mode", F.SRC_BACKEND + " (decoupled model transaction policy)", needs_gpu=False)
def _streaming(ctx: Context) -> list[Finding]:
    r = ctx.profile.runtime
    if r.streaming and not r.decoupled_mode:
        return [refuse("runtime.streaming", "needs runtime.decoupled_mode: true (Triton streams tokens only from a decoupled model).",
                       "set runtime.decoupled_mode: true, or streaming: false.")]
    return []


@rule("build.logits_dtype", "logits dtype is a trtllm-build choice; Triton output type recorded", f"{F.SRC_BUILD_CMD}; {F.SRC_BACKEND}",
      needs_gpu=False)
def _logits(ctx: Context) -> list[Finding]:
    d = ctx.profile.build.logits_dtype
    if d not in F.LOGITS_DTYPES_TRTLLM_BUILD:
        return [refuse("build.logits_dtype", f"{d!r} is not a trtllm-build --logits_dtype choice (float16, float32).",
                       "use float32 (FP32 logits, TYPE_FP32 in Triton).")]
    if d != "float32":
        return [warn("build.logits_dtype", f"{d} logits: sampling and log-probs are rounded to FP16 (Triton {F.TRITON_DTYPE[d]}).",
                     "use float32.")]
    return []


@rule("plugins.gemm_plugin", "an explicit --gemm_plugin matches the GEMM format", f"{F.SRC_PLUGIN}; {F.SRC_BUILDER}", needs_gpu=False)
def _gemm_plugin(ctx: Context) -> list[Finding]:
    g = ctx.profile.generation_phase.gemm_plugin
    q, fmt = ctx.quant, ctx.fmt
    owner = next((f for f in F.GEMM.values() if f.own_gemm_plugin == g), None)
    if owner is not None and owner is not fmt:
        return [refuse("generation_phase.gemm_plugin", f"'{g}' is the {owner.value} GEMM plugin; quant_algo is {q}.",
                       "use gemm_plugin: auto.")]
    if g == "disable" and fmt.plugin_off_warning:
        return [warn("generation_phase.gemm_plugin", fmt.plugin_off_warning, "use gemm_plugin: auto.")]
    if g in ("bfloat16", "float16") and g != ctx.profile.quantization.dtype:
        return [refuse("generation_phase.gemm_plugin", f"{g} differs from the model dtype {ctx.profile.quantization.dtype}.",
                       "use gemm_plugin: auto (the model dtype).")]
    return []


# ---------------------------------------------------------------------------------------------
# Rules: deployment and memory


@rule("deployment.fallback", "the fallback profile loads, runs on this GPU and fits next to the engine when warm",
      "build/precision_pipeline/spec/profile.py load_profile; " + F.SRC_BUILDER + " (engines are built per SM)", needs_gpu=False)
def _fallback(ctx: Context) -> list[Finding]:
    d = ctx.profile.deployment
    out = []
    if d.warm_fallback and not d.fallback:
        out.append(refuse("deployment.warm_fallback", "is true but no deployment.fallback profile is named.",
                          "name a fallback profile (e.g. fallback: bf16-h100) or set warm_fallback: false."))
    if not d.fallback:
        return out
    if ctx.fallback_problem is not None:
        pr = ctx.fallback_problem
        out.append(refuse("deployment.fallback", f"profile {d.fallback!r} cannot be used: {pr.field}: {pr.reason}", pr.fix))
        return out
    fb = ctx.fallback
    if fb is None:
        return out
    if fb.name and fb.name == ctx.profile.name:
        out.append(refuse("deployment.fallback", "names this profile itself.", "name a different (usually BF16) profile."))
    if ctx.gpu is not None:
        from precision_pipeline.spec.hardware import resolve_gpu  # local: avoid a cycle at import time
        from precision_pipeline.core.errors import UserError
        try:
            fg = resolve_gpu(fb.target.gpu)
        except UserError:
            fg = None
        if fg is None or fg.sm != ctx.gpu.sm:
            where = f"{fb.target.gpu} (SM {fg.sm})" if fg else repr(fb.target.gpu)
            out.append(warn("deployment.fallback",
                            f"profile {d.fallback!r} targets {where}; engines are built per SM, so its engine is built for "
                            f"{ctx.gpu.id} (SM {ctx.gpu.sm}) for this deployment (it is checked here with that target)."))
    fws = fb.parallel.tp_size * fb.parallel.pp_size
    ws = ctx.mapping.get("world_size", 1)
    if fws > ws:  # a rollback to it, warm or cold, runs on the replica's GPUs
        out.append(refuse("deployment.fallback", f"the {'warm' if d.warm_fallback else 'cold'} fallback {d.fallback!r} "
                          f"needs {fws} GPUs per engine; a replica has {ws}, so a rollback to it could not load.",
                          "use a fallback profile with the same or fewer GPUs (tp_size x pp_size), or more GPUs per "
                          "replica."))
    return out


@rule("memory.fit", "weights + activations (+ warm fallback) fit and the KV cache holds at least one max_seq_len sequence",
      f"{F.SRC_KVCONFIG}; {F.SRC_CKPT}; build/precision_pipeline/spec/hardware.py (driver-reported memory)")
def _memory(ctx: Context) -> list[Finding]:
    mem, g, lim = ctx.memory, ctx.gpu, ctx.limits
    if not mem:
        return []
    out = []
    need = mem["weight_bytes_per_gpu"] + mem["activation_bytes_estimate"] + mem["fallback_bytes"] + mem["runtime_reserve_bytes"]
    parts = (f"weights {gib(mem['weight_bytes_per_gpu'])} + activations ~{gib(mem['activation_bytes_estimate'])} "
             f"(max_num_tokens {lim['max_num_tokens']:,})")
    if mem["fallback_bytes"]:
        parts += f" + warm fallback {gib(mem['fallback_bytes'])}"
    parts += f" + runtime reserve {gib(mem['runtime_reserve_bytes'])}"
    if mem["usable_bytes"] <= 0:
        tp_need = _tp_hint(ctx)
        out.append(refuse("target.gpu",
                          f"does not fit on {g.id} ({g.memory_mib:,} MiB = {gib(g.memory_bytes)} per GPU): {parts} = {gib(need)} "
                          f"per GPU, {gib(-mem['usable_bytes'])} too much, before any KV cache.",
                          f"use a smaller format (e.g. fp8/int4-awq), {tp_need}a larger GPU, or lower max_num_tokens"
                          + (", or set deployment.warm_fallback: false (the fallback then loads only on rollback)."
                             if mem["fallback_bytes"] else ".")))
        return out
    msl = lim["max_seq_len"]
    if ctx.profile.build.kv_cache_type != "disabled" and mem["kv_tokens_capacity"] < msl:
        frac = ctx.profile.runtime.kv_cache_free_gpu_mem_fraction
        at_09 = int(mem["kv_cache_bytes"] / frac * 0.9 / max(mem["kv_bytes_per_token"], 1)) if frac else 0
        if frac < 0.9 and at_09 >= msl:  # the fraction, not the sequence length, is what starves the cache
            out.append(refuse("runtime.kv_cache_free_gpu_mem_fraction",
                              f"{frac} gives the KV cache on {g.id} only {mem['kv_tokens_capacity']:,} tokens "
                              f"({gib(mem['kv_cache_bytes'])}), less than one sequence of max_seq_len {msl:,}; at 0.9 it "
                              f"would hold {at_09:,}.",
                              "raise kv_cache_free_gpu_mem_fraction (0.9 is TensorRT-LLM's default)."))
            return out
        out.append(refuse("build.max_seq_len",
                          f"the KV cache on {g.id} holds {mem['kv_tokens_capacity']:,} tokens ({gib(mem['kv_cache_bytes'])} at "
                          f"{mem['kv_bytes_per_token']:,} B/token), less than one sequence of max_seq_len {msl:,} "
                          f"({gib(mem['kv_bytes_per_seq_at_max_seq_len'])}).",
                          "lower max_seq_len, use an FP8 KV cache, raise tp_size, or use a larger GPU."))
        return out
    want = lim["max_batch_size"] * msl
    if mem["kv_tokens_capacity"] < want:
        out.append(warn("build.max_batch_size",
                        f"the KV cache holds {mem['kv_tokens_capacity']:,} tokens = {mem['concurrent_seqs_at_max_seq_len']:,} "
                        f"sequences at max_seq_len {msl:,}, fewer than max_batch_size {lim['max_batch_size']} x {msl:,} = {want:,} tokens; "
                        "full-length batches will queue.",
                        "lower max_batch_size or max_seq_len, or use an FP8 KV cache."))
    return out


def gpus_needed(need: int, free_per_gpu: int, block: int) -> Optional[int]:
    """Smallest GPU count k with k x (free - reserve) - (k - 1) x block >= need (None: a layer alone does not fit)."""
    per = free_per_gpu - F.RUNTIME_RESERVE_BYTES
    if per <= 0 or (need > per and per <= block):
        return None
    if need <= per:
        return 1
    return max(1, math.ceil((need - block) / (per - block)))


def _as_cuda(ctx: Context, gpus: int, free: int, name: str, reference_dtype: Optional[str] = None) -> dict:
    """The build memory plan as if ``gpus`` GPUs with ``free`` bytes each were used (for a fix's numbers)."""
    from dataclasses import replace

    from precision_pipeline.spec.device import GpuInfo

    d = ctx.device
    alt = d.model_copy(update={"device": "cuda", "reference_dtype": reference_dtype or d.reference_dtype,
                               "gpus": tuple(GpuInfo(index=i, name=name, total_bytes=free, free_bytes=free)
                                             for i in range(gpus))})
    return build_memory_plan(replace(ctx, device=alt))


def _as_reference(ctx: Context, reference_dtype: str) -> dict:
    from dataclasses import replace

    return build_memory_plan(replace(ctx, device=ctx.device.model_copy(update={"reference_dtype": reference_dtype})))


def _gate_parts(bm: dict) -> str:
    g = bm["gate"]
    ref = f"{'FP32' if bm['reference_dtype'] == 'float32' else 'BF16'} reference {gib(g['reference'])}"
    floor = f" + its BF16 copy for the noise floor {gib(g['floor'])}" if g["floor"] else ""
    return (f"{ref}{floor} + the candidate in {bm['compute_dtype']} {gib(g['candidate'])} + activations "
            f"~{gib(g['activations'])}")


def _quant_parts(ctx: Context, bm: dict) -> str:
    qz, cal = bm["quantize"], ctx.profile.calibration
    out = (f"weights {bm['num_params']:,} parameters x {_bytes_of(bm['compute_dtype'])} B ({bm['compute_dtype']}) = "
           f"{gib(qz['weights'])} + calibration activations ~{gib(qz['calibration_activations'])} "
           f"(batch_size {cal.batch_size} x seq_len {cal.seq_len})")
    if qz["search"]:
        out += f" + the per-layer search's gradients ~{gib(qz['search'])}"
    return out


@rule("memory.build_fit", "quantize and the gate fit the chosen device and host memory (estimated from config.json "
      "before anything is loaded; builds only)",
      "build/precision_pipeline/resolve/rules.py build_memory_plan; build/precision_pipeline/spec/device.py "
      "(torch.cuda.mem_get_info, /proc/meminfo MemAvailable)", needs_gpu=False)
def _build_fit(ctx: Context) -> list[Finding]:
    bm = ctx.build_memory
    if not bm:
        return []
    d = ctx.device
    out: list[Finding] = []
    reused = ctx.checkpoint_dir is not None  # --checkpoint: nothing is quantized
    host = d.host_available_bytes
    qz, g = bm["quantize"], bm["gate"]
    bf16_ref = _as_reference(ctx, "bfloat16") if d.reference_dtype == "float32" else None
    if d.is_cuda:
        n = len(d.gpus)
        name = d.gpus[0].name
        free = min(x.free_bytes for x in d.gpus)
        have = (f"the {n} visible GPU(s) ({name}, {gib(free)} free on the fullest) hold ~{gib(bm['device_usable_bytes'])} "
                f"after {gib(F.RUNTIME_RESERVE_BYTES)} per GPU for CUDA and whole-layer placement")
        cpu_plan = build_memory_plan(_replace_device(ctx, "cpu"))
        cpu_fix = (f"--device cpu (needs ~{gib(cpu_plan['peak_bytes'])} of host memory, {gib(host)} available"
                   + (", so it does not fit either)" if cpu_plan["peak_bytes"] > host else "; slow for large models)"))
        for phase, need, parts in (("quantize", qz["device_bytes"], _quant_parts(ctx, bm)),
                                   ("the gate", g["device_bytes"], _gate_parts(bm))):
            if need <= bm["device_usable_bytes"] or (phase == "quantize" and reused):
                continue
            k = gpus_needed(need, free, bm["largest_block_bytes"])
            fixes = [f"make at least {k} such GPUs visible" if k else "use GPUs with more memory"]
            if phase == "the gate" and bf16_ref is not None:
                alt = bf16_ref["gate"]["device_bytes"]
                fixes.append(f"--reference-dtype bfloat16 (then ~{gib(alt)}: "
                             + ("fits)" if alt <= bf16_ref["device_usable_bytes"] else "still too much)"))
            if phase == "quantize":
                fixes.append(f"lower calibration.batch_size or calibration.seq_len (fewer samples per forward; "
                             f"activations ~{gib(qz['calibration_activations'] + qz['search'])})")
            fixes.append(cpu_fix)
            out.append(refuse("--device", f"{phase} needs ~{gib(need)} on the GPUs ({parts}); {have}.",
                              "; or ".join(fixes) + "."))
        for phase, need, what in (("quantize", qz["host_bytes"], "the export's copy of the checkpoint"),
                                  ("the gate", g["host_bytes"], "the checkpoint reader's FP32 tensors and the candidate "
                                                                "built on the host")):
            if need > host and not (phase == "quantize" and reused):
                out.append(refuse("--device", f"{phase} needs ~{gib(need)} of host memory on CUDA ({what}); "
                                  f"{gib(host)} available.", "run on a node with more host memory, or free memory."))
        return out
    spec = resolve_gpu(PLANNING_GPU)
    for phase, need, parts in (("quantize", qz["host_bytes"], _quant_parts(ctx, bm) + f" + the export's copy "
                                f"{gib(bm['checkpoint_bytes_estimate'])}"),
                               ("the gate", g["host_bytes"], _gate_parts(bm) + f" + the checkpoint read "
                                f"{gib(bm['checkpoint_bytes_estimate'])}")):
        if need <= host or (phase == "quantize" and reused):
            continue
        cuda = _as_cuda(ctx, 1, spec.memory_bytes, spec.name)
        cneed = cuda["quantize" if phase == "quantize" else "gate"]["device_bytes"]
        k = gpus_needed(cneed, spec.memory_bytes, cuda["largest_block_bytes"])
        fixes = [f"--device cuda on a GPU node (~{gib(cneed)} of GPU memory in {cuda['compute_dtype']}"
                 + (f", e.g. {k} x {spec.name}" if k else "") + ")"]
        if phase == "the gate" and bf16_ref is not None:
            alt = bf16_ref["gate"]["host_bytes"]
            fixes.append(f"--reference-dtype bfloat16 (then ~{gib(alt)}: " + ("fits)" if alt <= host else "still too much)"))
        if phase == "quantize":
            fixes.append("lower calibration.batch_size or calibration.seq_len (fewer samples per forward; "
                         f"activations ~{gib(qz['calibration_activations'] + qz['search'])})")
        out.append(refuse("--device", f"{phase} on the CPU needs ~{gib(need)} of host memory ({parts}); "
                          f"{gib(host)} available ({d.reason}).", "; or ".join(fixes) + "."))
    return out


def _replace_device(ctx: Context, device: str) -> Context:
    from dataclasses import replace

    return replace(ctx, device=ctx.device.model_copy(update={"device": device, "gpus": ()}))


def _tp_hint(ctx: Context) -> str:
    """'tp_size N, ' where N is the smallest tp that makes weights + activations fit (if any, <= 16)."""
    p = ctx.profile
    for tp in (2, 4, 8, 16):
        if ctx.model.num_heads % tp:
            continue
        mp = dict(ctx.mapping, tp_size=tp, world_size=tp * p.parallel.pp_size, moe_tp_size=tp)
        w = weight_bytes(ctx.model, p, mp)["total"]
        a = activation_bytes(ctx.model, p, mp, ctx.limits)
        if w + a + F.RUNTIME_RESERVE_BYTES + ctx.memory.get("fallback_bytes", 0) < ctx.gpu.memory_bytes * 0.9:
            return f"tp_size {tp} (weights {gib(w)} per GPU), "
    return ""


# ---------------------------------------------------------------------------------------------
# Rules: what the build itself needs of the profile and the model (before: checks inside run_build)


@rule("quantize.search_budget", "an effective-bits budget (auto_quantize_bits) only with quant_algo MIXED_PRECISION",
      "build/precision_pipeline/quantize/search.py (the per-layer search runs for MIXED_PRECISION only)", needs_gpu=False)
def _search_budget(ctx: Context) -> list[Finding]:
    q = ctx.profile.quantization
    if q.auto_quantize_bits is None or ctx.fmt.per_layer:
        return []
    return [refuse("quantization.auto_quantize_bits",
                   f"an effective-bits budget is set but quant_algo is {q.quant_algo.value}; the per-layer "
                   "search runs only for quant_algo MIXED_PRECISION.",
                   "set quant_algo: MIXED_PRECISION (with auto_quantize_formats), or remove auto_quantize_bits.")]


@rule("model.gate_reads", "the accuracy gate reads this model's checkpoints (spec/families.py GATE_ARCHITECTURES; "
      "builds and checks only)",
      "build/precision_pipeline/gate/model.py (load_checkpoint_model: the family's gate_reader, spec/families.py)", needs_gpu=False)
def _gate_reads(ctx: Context) -> list[Finding]:
    if not ctx.for_build or ctx.model.architecture in GATE_ARCHITECTURES:
        return []
    return [refuse("--model",
                   f"{ctx.model.name} is a {ctx.model.architecture} model; the accuracy gate's checkpoint reader handles "
                   f"{', '.join(GATE_ARCHITECTURES)} only, so the build would stop after quantizing.",
                   f"use a model of: {', '.join(GATE_ARCHITECTURES)}; a Mixtral MoE can be quantized and exported with "
                   "expert parallelism by precision_pipeline.quantize.ptq.run_quantize, but not gated yet.")]


@rule("calibration.dataset", "the calibration dataset is 'builtin' or a readable UTF-8 JSONL of {\"text\": ...} lines, "
      "at least num_samples of them (builds and checks that quantize)",
      "build/precision_pipeline/resolve/dataset.py", needs_gpu=False)
def _calibration_dataset(ctx: Context) -> list[Finding]:
    if not ctx.for_build or ctx.checkpoint_dir is not None:  # a reused checkpoint is not calibrated again
        return []
    from precision_pipeline.resolve.dataset import dataset_problems

    c = ctx.profile.calibration
    return [refuse(pr.field, pr.reason, pr.fix) for pr in dataset_problems(c.dataset, c.num_samples, c.seq_len)]


def describe_rules() -> list[dict]:
    """Every rule: name, what it checks, and its source (for docs and ``invoke``)."""
    return [{"rule": "gpu.known", "summary": "target.gpu is a catalog id or alias", "source": "build/precision_pipeline/spec/hardware.py"}] + [
        {"rule": r.name, "summary": r.summary, "source": r.source} for r in RULES]


__all__ = ["describe_rules", "Finding", "Rule", "RULES", "Context", "Override", "derive_mapping", "derive_limits", "derive_effective",
           "resolve_gemm_plugin", "weight_bytes", "kv_bytes_per_token", "activation_bytes", "memory_plan",
           "checkpoint_mapping_findings", "layers_per_rank", "kv_heads_per_rank", "build_memory_plan", "gpus_needed",
           "GATE_ARCHITECTURES"]
