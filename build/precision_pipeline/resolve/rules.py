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

Module map of resolve: ``registry.py`` (Finding, Rule, RULES, Context), ``derive.py`` (what trtllm-build
derives), ``memory.py`` (the memory plan), ``build_memory.py`` (quantize and the gate on the build's device),
``reuse.py`` (a reused checkpoint's files), this module and ``rules_fit.py`` (the rules, in order).
Units: bytes unless a name says GiB; token counts are tokens.
"""

from __future__ import annotations

import math

from precision_pipeline.core.errors import UserError
from precision_pipeline.spec import formats as F
from precision_pipeline.spec.model_arch import ModelArch

from precision_pipeline.resolve.registry import RULES, Context, Finding, refuse, rule, warn
from precision_pipeline.resolve.derive import lws_group
from precision_pipeline.resolve.memory import decoder_linears_kept
from precision_pipeline.resolve.reuse import checkpoint_mapping_findings

ENGINE_ONLY = ("engine",)
"""``routes`` of the rules that model trtllm-build's own behaviour (plugin flags, builder overrides): on the llm_api
route the runtime chooses these itself (``resolve/rules_llm_api.py`` records such settings as runtime-chosen)."""


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


def _needs(ctx: Context, entry) -> str:
    """What ``entry`` needs, in words, on the profile's route (engine: the registry's ``needs``)."""
    if ctx.route == "engine":
        return entry.needs
    from precision_pipeline.spec.capability import row

    r = row(ctx.route, ctx.trtllm_version, entry.kind, entry.algo)
    where = f"on the {ctx.route} route (TensorRT-LLM {ctx.trtllm_version})"
    if r is None or not r.sm:
        return f"{(r.why if r and r.why else 'no path')} {where}"
    return f"{where} it runs on {F.sm_text(r.sm)} only"


def _llm_api_fix(ctx: Context, entry, field_word: str, alts: list[str]) -> str:
    """The fix of a format refused on a non-engine route: what runs here on this route, and the engine route when
    it takes the format on this SM (``spec/capability.py``)."""
    from precision_pipeline.spec.capability import supports

    here = (f"on SM {ctx.sm} the {ctx.route} route runs {field_word} {F.join_or(alts)}" if alts
            else f"the {ctx.route} route runs no such format on SM {ctx.sm}")
    engine = (f"; or keep {entry.value} with route: engine (trtllm-build, TensorRT-LLM 1.2.1)"
              if supports("engine", "1.2.1", entry.kind, entry.algo, ctx.sm) else "")
    return here + engine + "."


def _format_fix(ctx: Context, entry: F.GemmFormat) -> str:
    if ctx.route != "engine":
        from precision_pipeline.spec.capability import supports

        from precision_pipeline.spec.capability import where_supported

        alts = [a for a in F.SUGGEST_ORDER if a != entry.value and supports(ctx.route, ctx.trtllm_version, "gemm", a, ctx.sm)]
        text = _llm_api_fix(ctx, entry, "quant_algo", alts)
        fp8 = F.GEMM[F.QuantAlgo.FP8]
        text += f" (e.g. {fp8.value} on Hopper, SM 90)" if fp8.value not in alts else ""
        where = where_supported("gemm", entry.algo)
        return text + (f" {entry.value} itself runs on {where}." if where else "")
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
    why = ctx.fmt_refusal
    if why:
        from precision_pipeline.spec.capability import where_supported

        where = where_supported("gemm", e.algo)
        fix = (f"{e.value} runs on {where}: set that route/target; otherwise " if where else "") + \
            "use NVFP4 (W4A4, Blackwell) or W4A16_AWQ (INT4 weight-only) instead."
        return [refuse("quantization.quant_algo", why, fix)]
    return []


def _no_line(ctx: Context) -> bool:
    """The route does not run the targeted TensorRT-LLM line (rule ``route.trtllm_version`` refuses that): the format
    rules have no row to judge by and keep quiet, not "needs SM >= 89" on an SM 90 GPU (hostile s9 F2)."""
    from precision_pipeline.spec.capability import route_runs_line

    return not route_runs_line(ctx.route, ctx.trtllm_version)


@rule("format.gemm_sm", "GEMM format runs on the target SM", f"{F.SRC_QUANT_MD}; {F.SRC_BUILDER}")
def _gemm_sm(ctx: Context) -> list[Finding]:
    e = ctx.fmt
    if ctx.fmt_refusal or _no_line(ctx):
        return []  # format.trtllm_buildable / route.trtllm_version report it
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
            if ctx.refusal_of(ce) or not ctx.runs(ce):
                out.append(refuse("quantization.auto_quantize_formats",
                                  f"candidate {cand.value}: {_needs(ctx, ce)}; {ctx.gpu_text()}.", _format_fix(ctx, ce)))
        return out
    if not ctx.runs(e):
        out.append(refuse("quantization.quant_algo", f"{e.value}: {_needs(ctx, e)}; {ctx.gpu_text()}.",
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
    if ctx.fmt.not_exported and ctx.for_build and ctx.checkpoint_dir is None and not ctx.fmt_refusal:
        out.append(refuse("quantization.quant_algo", f"{ctx.quant}: {ctx.fmt.not_exported[0]}", ctx.fmt.not_exported[1]))
    if ctx.fmt.is_quantized and q.keep_first_layers + q.keep_last_layers >= m.num_layers > 0:
        out.append(refuse("quantization.keep_first_layers",
                          f"keep_first_layers {q.keep_first_layers} + keep_last_layers {q.keep_last_layers} keep all "
                          f"{m.num_layers} decoder layers of {m.name} in high precision: nothing would be quantized.",
                          f"keep fewer layers (together < {m.num_layers}), or use quant_algo NO_QUANT."))
    elif ctx.fmt.is_quantized and not m.is_moe and m.num_layers > 0 and q.exclude_modules:
        # the same matching the export applies (spec/families.py): patterns on HF, TensorRT-LLM and short names
        kept, n_decoder = decoder_linears_kept(m, q)
        if kept == n_decoder:
            out.append(refuse("quantization.exclude_modules",
                              f"the patterns {_short_list(q.exclude_modules)} keep every one of the {n_decoder} "
                              f"decoder linears of {m.name} in high precision: nothing would be quantized.",
                              "exclude fewer modules (e.g. lm_head, *router*), or use quant_algo NO_QUANT."))
    if ctx.fmt.is_quantized and m.num_layers > 0 and q.exclude_modules:  # a typo keeps nothing, silently (s15b F1)
        from precision_pipeline.spec.families import family, unmatched_exclusions

        n_linears = len(family(m.architecture).linear_names(m.num_layers))
        for pat, near in unmatched_exclusions(m.architecture, tuple(q.exclude_modules), m.num_layers):
            say = refuse if not m.is_moe else warn  # MoE: only expert 0 is named here; another index may exist
            out.append(say("quantization.exclude_modules",
                           f"the pattern {pat!r} matches none of the {n_linears} quantizable linears of "
                           f"{m.name} (matched against HF, TensorRT-LLM and short names), so it keeps nothing in high "
                           "precision.", (f"did you mean {near!r}? " if near else "") + "fix or remove the pattern "
                           "(names: `lm_head`, `model.layers.N.mlp.down_proj`, `transformer.layers.N.mlp.proj`, `*q_proj*`)."))
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
    if _no_line(ctx):
        return []  # route.trtllm_version reports it
    if not ctx.runs(e):
        if ctx.route != "engine":
            from precision_pipeline.spec.capability import runnable

            ok = runnable(ctx.route, ctx.trtllm_version, "kv", ctx.sm)
            return [refuse("quantization.kv_cache_quant_algo", f"{e.value}: {_needs(ctx, e)}; {ctx.gpu_text()}.",
                           _llm_api_fix(ctx, e, "kv_cache_quant_algo", ok))]
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
    elif fmt.fixed_block:
        g, what = fmt.fixed_block, f"the {fmt.short} block ({fmt.fixed_block})"
        if q.group_size not in (None, g):
            out.append(refuse("quantization.group_size", f"{algo} uses a fixed block of {g} elements; "
                              f"got {q.group_size}.", f"remove quantization.group_size (or set it to {g})."))
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


@rule("layout.nodes", "a multi-node engine (tp_size x pp_size > deployment.gpus_per_node) splits evenly over pods "
      "and is owned by a plain Deployment's LeaderWorkerSet", "LeaderWorkerSet API leaderworkerset.x-k8s.io/v1 "
      "(one worker template per group); build/precision_pipeline/resolve/derive.py lws_group", needs_gpu=False)
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
      f"{F.SRC_COMMON}; tensorrtllm_backend enable_chunked_context", needs_gpu=False, routes=ENGINE_ONLY)
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
      F.SRC_BUILDER + " (FP8 context FMHA logic)", routes=ENGINE_ONLY)
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


@rule("context.builder_overrides", "no asked-for feature is lost to a silent trtllm-build override", F.SRC_BUILDER, routes=ENGINE_ONLY)
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
      f"{F.SRC_BUILDER}; {F.SRC_BACKEND} (enable_kv_cache_reuse)", needs_gpu=False, routes=ENGINE_ONLY)
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
      f"{F.SRC_BACKEND} (enable_chunked_context); {F.SRC_PLUGIN} (use_paged_context_fmha)", needs_gpu=False, routes=ENGINE_ONLY)
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
      needs_gpu=False, routes=ENGINE_ONLY)
def _logits(ctx: Context) -> list[Finding]:
    d = ctx.profile.build.logits_dtype
    if d not in F.LOGITS_DTYPES_TRTLLM_BUILD:
        return [refuse("build.logits_dtype", f"{d!r} is not a trtllm-build --logits_dtype choice (float16, float32).",
                       "use float32 (FP32 logits, TYPE_FP32 in Triton).")]
    if d != "float32":
        return [warn("build.logits_dtype", f"{d} logits: sampling and log-probs are rounded to FP16 (Triton {F.TRITON_DTYPE[d]}).",
                     "use float32.")]
    return []


@rule("plugins.gemm_plugin", "an explicit --gemm_plugin matches the GEMM format", f"{F.SRC_PLUGIN}; {F.SRC_BUILDER}", needs_gpu=False, routes=ENGINE_ONLY)
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


# the rules after these (deployment and memory, what the build needs) register in this order
from precision_pipeline.resolve import rules_fit  # noqa: E402,F401
from precision_pipeline.resolve import rules_llm_api  # noqa: E402,F401  (route and TensorRT-LLM line, issue 28)


def describe_rules() -> list[dict]:
    """Every rule: name, what it checks, and its source (for docs and ``invoke``)."""
    return [{"rule": "gpu.known", "summary": "target.gpu is a catalog id or alias", "source": "build/precision_pipeline/spec/hardware.py"}] + [
        {"rule": r.name, "summary": r.summary, "source": r.source} for r in RULES]


__all__ = ["describe_rules", "RULES"]
