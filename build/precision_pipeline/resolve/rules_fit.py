"""The rules that follow ``resolve/rules.py``'s, in evaluation order: deployment and memory (the fallback, the
memory plan's fit, quantize and the gate on the build's device) and what the build itself needs of the profile
and the model. ``resolve/rules.py`` imports this module after its own rules, so ``RULES`` keeps one order."""

from __future__ import annotations

from typing import Optional

from precision_pipeline.spec import formats as F
from precision_pipeline.spec.families import GATE_ARCHITECTURES, HF_READ_ARCHITECTURES, MOE_HF_READ_FORMATS, family
from precision_pipeline.spec.hardware import resolve_gpu

from precision_pipeline.resolve.registry import Context, Finding, refuse, rule, warn
from precision_pipeline.resolve.memory import activation_bytes, gib, weight_bytes
from precision_pipeline.resolve.build_memory import PLANNING_GPU, build_memory_plan, bytes_of, gpus_needed


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


@rule("routing", "every routing target is a warm unit of the release; long prompts on FP8 attention are flagged",
      "build/precision_pipeline/spec/routing.py; the design brief (FP8 attention degrades on long contexts: BF16 for "
      "long prompts)", needs_gpu=False)
def _routing(ctx: Context) -> list[Finding]:
    r, p = ctx.profile.routing, ctx.profile
    if r is None:
        return []
    out = []
    d = p.deployment
    for i, rr in enumerate(r.rules):
        if rr.target == "fallback" and not (d.fallback and d.warm_fallback):
            why = "no deployment.fallback is named" if not d.fallback else "deployment.warm_fallback is false"
            out.append(refuse(f"routing.rules.{i}.target", f"rule {rr.name!r} sends requests to the fallback, but {why}: "
                              "only a loaded (warm) unit can serve a request.",
                              "name a fallback profile and set deployment.warm_fallback: true (the memory plan then "
                              "counts it), or target primary."))
    kv = F.kv(p.quantization.kv_cache_quant_algo)
    fp8_attention = p.context_phase.use_fp8_context_fmha or kv.is_quantized
    # where a long prompt of no tier goes with no signal rule on: the decision file the BLS runs decides it (one home)
    from precision_pipeline.spec.routing import evaluator, routing_table

    long_prompt = {"prompt_tokens": r.long_context_tokens + 1, "max_tokens": 1, "tier": None}
    long_to_fallback = evaluator().decide(routing_table(r), long_prompt).target == "fallback"
    mil = int(ctx.limits.get("max_input_len") or 0)
    if fp8_attention and mil > r.long_context_tokens and not long_to_fallback:
        out.append(warn("routing.rules", f"the primary attends in low precision (KV cache {kv.value}"
                        f"{', FP8 context FMHA' if p.context_phase.use_fp8_context_fmha else ''}) on prompts up to "
                        f"max_input_len {mil:,} tokens, and no rule sends prompts over "
                        f"long_context_tokens {r.long_context_tokens:,} to the fallback.",
                        f"add a rule `prompt_tokens_over: {r.long_context_tokens}` with target fallback before the "
                        "default (FP8 attention loses accuracy on long contexts)."))
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
    out = (f"weights {bm['num_params']:,} parameters x {bytes_of(bm['compute_dtype'])} B ({bm['compute_dtype']}) = "
           f"{gib(qz['weights'])} + calibration activations ~{gib(qz['calibration_activations'])} "
           f"(batch_size {cal.batch_size} x seq_len {cal.seq_len})")
    if qz["search"]:
        out += f" + the per-layer search's gradients ~{gib(qz['search'])}"
    return out


@rule("memory.build_fit", "quantize and the gate fit the chosen device and host memory (estimated from config.json "
      "before anything is loaded; builds only)",
      "build/precision_pipeline/resolve/build_memory.py build_memory_plan; build/precision_pipeline/spec/device.py "
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


@rule("model.family_serves", "TensorRT-LLM serves the model's family on the profile's route, line and format "
      "(spec/families.py routes, trtllm_versions, FAMILY_FORMATS)", "spec/families.py (each family's sources)",
      needs_gpu=False)
def _family_serves(ctx: Context) -> list[Finding]:
    from precision_pipeline.spec.families import family_problems
    from precision_pipeline.spec.llm_args import trtllm_line

    try:
        line = trtllm_line(ctx.trtllm_version)
    except ValueError:
        return []  # route.trtllm_version refuses it
    found = family_problems(family(ctx.model.architecture), ctx.route, line, ctx.quant)
    return [refuse(f, reason, fix) for f, reason, fix in found]


@rule("model.gate_reads", "the build runs this model's family on the profile's route: a quantize export and a gate "
      "reader (spec/families.py Family.build_gaps(route); builds and checks only)",
      "build/precision_pipeline/gate/model.py (load_checkpoint_model: the family's gate_reader), gate/moe_model.py "
      "(load_hf_moe_model: Family.hf_read), spec/families.py", needs_gpu=False)
def _gate_reads(ctx: Context) -> list[Finding]:
    found = family(ctx.model.architecture).build_gaps(ctx.route, ctx.quant, ctx.kv)
    if not ctx.for_build or not found:
        return []
    gaps = "; ".join(f"{stage}: {why}" for stage, why in found)
    return [refuse("--model",
                   f"{ctx.model.name} is a {ctx.model.architecture} model; the accuracy gate's checkpoint reader handles "
                   f"{', '.join(GATE_ARCHITECTURES)} only. Stages missing for "
                   f"{ctx.model.architecture}: {gaps} (invoke check, profiles, compare and recommend plan it).",
                   f"use a model of: {', '.join(GATE_ARCHITECTURES)} ({', '.join(HF_READ_ARCHITECTURES)}: route "
                   f"llm_api with {' or '.join(MOE_HF_READ_FORMATS)} and kv_cache_quant_algo NONE, spec/families.py "
                   "Family.hf_read; GptOssForCausalLM: route llm_api, W4A16_MXFP4 from its MXFP4 checkpoint as "
                   "shipped, --checkpoint).")]


@rule("calibration.dataset", "the calibration dataset is 'builtin' or a readable UTF-8 JSONL of {\"text\": ...} lines, "
      "at least num_samples of them (builds and checks that quantize)",
      "build/precision_pipeline/resolve/dataset.py", needs_gpu=False)
def _calibration_dataset(ctx: Context) -> list[Finding]:
    if not ctx.for_build or ctx.checkpoint_dir is not None:  # a reused checkpoint is not calibrated again
        return []
    from precision_pipeline.resolve.dataset import dataset_problems

    c = ctx.profile.calibration
    return [refuse(pr.field, pr.reason, pr.fix) for pr in dataset_problems(c.dataset, c.num_samples, c.seq_len)]
