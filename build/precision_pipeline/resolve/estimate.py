"""Roofline estimates of one resolved profile on its GPU, with the arithmetic shown (one home:
``plan.json`` ``estimate``, ``invoke check``, ``invoke compare`` and ``invoke recommend`` all call
``roofline``). Nothing here is measured: every number is an upper bound from two catalog figures
(``spec/hardware.py``: memory bandwidth and the dense Tensor Core peak of the GEMM's math format,
each with its datasheet source) and the memory plan's numbers (``rules.memory_plan``: weight bytes
per GPU, KV bytes per token, KV-cache token capacity), never a second memory formula.

Per GPU of one engine (the heaviest pipeline rank, as the memory plan counts it):

* decode step bytes = (weight_bytes_per_gpu - the embedding table) + B x L x kv_bytes_per_token:
  one decode step reads every weight once (of the embedding only the B looked-up rows, neglected) and the whole KV cache of B sequences at context L tokens (the worst case, all
  sequences at L).
* decode ceiling (tokens/s, one engine) = B / (step bytes / bandwidth); per GPU = that / world_size;
  one sequence alone: 1 / (pp x (weights + L x kv_bytes_per_token) / bandwidth).
* prefill ceiling (tokens/s) = peak / FLOPs per prompt token, FLOPs per token per GPU =
  2 x decoder GEMM parameters per GPU + attention 2 x S x heads/tp x head_dim x layers/pp (QK^T and
  PV over a causal prompt of S = min(max_input_len, L) tokens: S/2 keys on average, 2 FLOPs per
  multiply-add, two products). The lm_head runs on the last prompt token only and is left out.
  The GEMM math is the format's activation format (``GemmFormat.act_fake_quant``: FP8, INT8, NVFP4;
  weight-only formats and BF16 use the BF16 peak; MIXED_PRECISION uses the BF16 peak, a lower bound).
* KV-limited concurrency at L = kv_tokens_capacity // L (``memory_plan``: capacity in whole blocks).
  B defaults to min(max_batch_size, that concurrency).
* pipeline stages are assumed perfectly overlapped for throughput (the heaviest stage limits it).
* tensor-parallel communication is not in these ceilings: each decode step also all-reduces
  2 x layers x B x hidden x 2 bytes per GPU (after attention and after the MLP, BF16), shown as
  ``tp_allreduce_bytes_per_step``; ``resolve/perf.py`` (what compare and recommend rank on) times it
  over the catalog's interconnect.

Not in these ceilings either (``resolve/perf.py`` has them, calibrated on published measurements):
kernel efficiency, scheduling and launch overheads, the attention kernels' own limits, and the
dequantization cost of weight-only formats.
"""

from __future__ import annotations

from typing import Any, Optional

from precision_pipeline.core.errors import UserError
from precision_pipeline.spec import formats as F
from precision_pipeline.spec.hardware import GPUSpec
from precision_pipeline.spec.model_arch import ModelArch
from precision_pipeline.spec.profile import Profile

KIND = "roofline estimate (upper bound from catalog bandwidth and Tensor Core peak; not measured)"
TP_NOT_MODELLED = ("not in this ceiling: tensor-parallel all-reduces (2 per layer per step, "
                   "tp_allreduce_bytes_per_step bytes per GPU); resolve/perf.py times them over the catalog's "
                   "NVLink/PCIe figures (spec/hardware.py interconnect)")
SRC = "build/precision_pipeline/resolve/estimate.py"


def gemm_math(profile: Profile) -> Optional[str]:
    """The Tensor Core math of the profile's GEMMs: the activation format (``fp8``/``int8``/``nvfp4``),
    or None = the model dtype (BF16: unquantized, weight-only, and MIXED_PRECISION as a lower bound)."""
    fmt = F.GEMM[profile.quantization.quant_algo]
    return None if fmt.per_layer else fmt.act_fake_quant


def gemm_params_per_gpu(m: ModelArch, tp: int, pp: int) -> int:
    """Decoder GEMM parameters on the heaviest GPU: layers/pp x (qkv + o + 3 MLP matrices)/tp
    (MoE: the experts a token is routed to, plus the shared expert)."""
    layers = -(-m.num_layers // pp)
    mlp = (m.moe_intermediate_size * max(1, m.num_experts_per_tok) + m.shared_expert_intermediate_size
           if m.is_moe else m.intermediate_size)
    per_layer = m.hidden_size * m.qkv_out + m.num_heads * m.head_dim * m.hidden_size + 3 * m.hidden_size * mlp
    return int(layers * per_layer // tp)


def roofline(gpu: GPUSpec, model: ModelArch, profile: Profile, mapping: dict, limits: dict, memory: dict,
             batch: Optional[int] = None, context: Optional[int] = None) -> dict[str, Any]:
    """The roofline estimate of one resolved profile (a plan.json-ready dict; formulas in the module doc).

    ``mapping`` / ``limits`` / ``memory``: the plan's sections (``rules.derive_mapping``,
    ``derive_limits``, ``memory_plan``). ``batch``: concurrent sequences B (default
    min(max_batch_size, KV-limited concurrency at ``context``)); ``context``: tokens per sequence L
    (default max_seq_len). Units: bytes, seconds, tokens/s; TFLOPS / TOPS as in the catalog.
    Raises UserError (``--context`` / ``--batch``) for a context outside [1, max_seq_len] or a batch < 1.
    """
    msl = int(limits["max_seq_len"])
    L = msl if context is None else int(context)
    if not 1 <= L <= msl:
        raise UserError("--context", f"{L:,} tokens is outside 1..max_seq_len {msl:,} of this profile.",
                        f"pass a context of at most {msl:,}, or raise build.max_seq_len.")
    if batch is not None and int(batch) < 1:
        raise UserError("--batch", f"{batch} is not a positive number of sequences.", "pass e.g. --batch 8.")
    tp, pp, world = mapping["tp_size"], mapping["pp_size"], mapping["world_size"]
    w_all = int(memory["weight_bytes_per_gpu"])
    emb = int((memory.get("weight_breakdown") or {}).get("embedding", 0))
    w = w_all - emb  # a decode step reads B rows of the embedding table, not the table
    kvt = float(memory["kv_bytes_per_token"])
    cap = int(memory["kv_tokens_capacity"])
    conc = cap // L
    B = int(batch) if batch is not None else min(int(limits["max_batch_size"]), conc)
    bw = gpu.bandwidth_gbs * 1e9
    kv_read = B * L * kvt
    step = w + kv_read
    step_s = step / bw if B else 0.0
    decode = B / step_s if B else 0.0
    one_step = pp * (w + L * kvt) / bw
    math_fmt = gemm_math(profile)
    peak, peak_field = gpu.tensor_peak(math_fmt)
    S = min(int(limits["max_input_len"]), L)
    gparams = gemm_params_per_gpu(model, tp, pp)
    heads_r = -(-model.num_heads // tp)
    layers_r = -(-model.num_layers // pp)
    attn = 2 * S * heads_r * model.head_dim * layers_r
    flops_tok = 2 * gparams + attn
    prefill = peak * 1e12 / flops_tok if peak else None
    allreduce = 2 * model.num_layers * B * model.hidden_size * 2 if tp > 1 else 0
    unit = "TOPS" if peak_field == "int8_tops" else "TFLOPS"
    shown_peak = f"{peak:,} {unit}" if peak else f"none ({peak_field} is not catalogued for {gpu.id})"
    b_why = "given" if batch is not None else f"min(max_batch_size {limits['max_batch_size']}, {conc:,})"
    arithmetic = [
        f"KV-limited concurrency at L={L:,}: kv_tokens_capacity {cap:,} // {L:,} = {conc:,} sequences",
        f"B = {b_why} = {B:,}",
        f"weights read per step = weight_bytes_per_gpu {w_all:,} - embedding table {emb:,} (a step reads only "
        f"B of its rows) = {w:,} B",
        f"decode step bytes/GPU = weights {w:,} + B {B:,} x L {L:,} x KV {kvt:g} B/token = {step:,.0f} B",
        f"decode ceiling = B {B:,} / ({step:,.0f} B / {gpu.bandwidth_gbs:,} GB/s) = {decode:,.0f} tokens/s per engine, "
        f"{decode / world:,.0f} per GPU ({world} GPU{'s' if world != 1 else ''})",
        f"one sequence alone = 1 / (pp {pp} x ({w:,} + {L:,} x {kvt:g}) B / {gpu.bandwidth_gbs:,} GB/s) = "
        f"{1 / one_step:,.0f} tokens/s",
        f"prefill FLOPs/token/GPU = 2 x {gparams:,} GEMM params + 2 x S {S:,} x {heads_r} heads x {model.head_dim} "
        f"x {layers_r} layers = {flops_tok:,}",
        (f"prefill ceiling = {peak:,} {unit} ({peak_field}) / {flops_tok:,} = {prefill:,.0f} tokens/s"
         if prefill else f"prefill ceiling: unknown, {shown_peak}"),
    ]
    return {
        "kind": KIND,
        "context_tokens": L,
        "batch": B,
        "prompt_tokens": S,
        "kv_concurrency_at_context": conc,
        "decode_step_bytes_per_gpu": int(round(step)),
        "decode_weight_bytes_per_gpu": w,
        "decode_kv_bytes_per_gpu": int(round(kv_read)),
        "decode_tokens_per_s": round(decode, 1),
        "decode_tokens_per_s_per_gpu": round(decode / world, 1),
        "decode_tokens_per_s_one_sequence": round(1 / one_step, 1),
        "prefill_flops_per_token_per_gpu": int(flops_tok),
        "prefill_tokens_per_s": round(prefill, 1) if prefill else None,
        "gemm_math": math_fmt or profile.quantization.dtype,
        "tp_allreduce_bytes_per_step": int(allreduce),
        "tp_communication": TP_NOT_MODELLED if tp > 1 else "none (tp_size 1)",
        "hardware": {
            "gpu": gpu.id,
            "bandwidth_gbs": gpu.bandwidth_gbs,
            "tensor_peak": peak,
            "tensor_peak_field": peak_field,
            "source": gpu.source,
            **({"note": gpu.note} if gpu.note else {}),
        },
        "arithmetic": arithmetic,
        "not_modelled": "kernel efficiency, scheduling, sampling, attention kernel limits, weight-only "
                        "dequantization cost, " + ("tensor-parallel communication" if tp > 1 else "(tp 1: no communication)"),
        "source": SRC,
    }


def of_plan(plan, batch: Optional[int] = None, context: Optional[int] = None) -> Optional[dict]:
    """``roofline`` of a ``ResolvedPlan`` (None when it has no memory plan: unknown/unsupported GPU)."""
    if plan.gpu is None or plan.memory is None:
        return None
    return roofline(plan.gpu, plan.model, plan.profile, plan.mapping.model_dump(), plan.limits.model_dump(),
                    plan.memory.model_dump(), batch=batch, context=context)


__all__ = ["KIND", "TP_NOT_MODELLED", "roofline", "of_plan", "gemm_math", "gemm_params_per_gpu"]
