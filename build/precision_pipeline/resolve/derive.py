"""Derivations: what trtllm-build does by itself, computed before the rules run.

* ``derive_mapping``: TensorRT-LLM's ``Mapping`` of one engine (moe_tp / moe_ep defaults).
* ``derive_limits``: the BuildConfig values used when a limit is left out (``max_seq_len`` =
  max_position_embeddings x rope factor, ``max_input_len`` 1024, ``max_num_tokens`` 8192), and
  the clamps of ``check_max_num_tokens`` -- each with its reason.
* ``derive_effective``: the plugin values after ``tensorrt_llm/builder.py build()`` silently
  overrides them (e.g. BF16/INT4-AWQ/SmoothQuant weights with an FP8 KV cache turn paged
  context FMHA off; an INT8 KV cache turns it off; FP8 KV + paged context FMHA turns FP8
  context FMHA on), plus the resolved ``--gemm_plugin``.
* ``lws_group``: pods per LeaderWorkerSet group of a multi-node engine (rule ``layout.nodes``, serving's manifests).
"""

from __future__ import annotations

import math
from typing import Optional

from precision_pipeline.core.errors import UserError
from precision_pipeline.spec import formats as F
from precision_pipeline.spec.model_arch import ModelArch
from precision_pipeline.spec.profile import Profile

from precision_pipeline.resolve.registry import Finding, Override, warn


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
