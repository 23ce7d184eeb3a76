"""Workload performance model: output tokens/s per GPU and per replica, TTFT and TPOT of one resolved
profile serving a workload (input/output lengths, concurrency or request rate), with the range the
model is honest about. One home for the numbers ``invoke compare`` and ``invoke recommend`` rank on;
``benchmarks/planner.py`` holds it against published TensorRT-LLM measurements.

Inputs: the memory plan (``rules.memory_plan``: weight bytes per GPU, KV bytes per token, KV-cache
capacity; never a second memory formula), the GPU catalog (``spec/hardware.py``: bandwidth, dense
Tensor Core peak of the GEMM's math, the tensor-parallel interconnect) and the efficiency factors
below. Per GPU of one engine (tp x pp GPUs; the heaviest pipeline stage):

* **batch** B, sized as the runtime sizes it (in-flight batching, ``guaranteed_no_evict`` reserves
  a whole sequence): KV-limited sequences = kv_tokens_capacity // (input + output, in whole
  ``tokens_per_block`` blocks; ``max_utilization`` reserves input + output/2); B = min(max_batch_size,
  that, the workload's concurrency per replica). Not the base profile's batch.
* **decode step** (s) = max(bytes / (bandwidth x BW_EFF), FLOPs / (peak x GEMM_EFF x dequant)) +
  all-reduce + STEP_OVERHEAD_S, with bytes = weights read (less the embedding table) + B x
  (input + output/2) x KV bytes per token (the workload's mean context, not max_seq_len) and FLOPs =
  B x (2 x GEMM parameters + 2 x hidden x vocab / tp for the lm_head + 4 x context x heads/tp x
  head_dim x layers for attention).
* **prefill** of one request (s) = input x (2 x GEMM parameters) + 2 x input^2 x heads/tp x head_dim
  x layers (causal attention) FLOPs at the format's Tensor Core rate x GEMM_EFF x dequant, plus its
  all-reduces.
* **tensor parallel**: 2 all-reduces per layer (after attention and after the MLP) of tokens x
  hidden x 2 bytes (BF16), ring time 2 (tp-1)/tp x bytes / link GB/s + link latency
  (``hardware.interconnect``: NVLink or PCIe per GPU model, with its source) at ALLREDUCE_EFF of it.
* **weight-only formats** (INT4/INT8 weights under BF16 or FP8 math: W4A16_AWQ, W8A16, W4A8_AWQ)
  dequantize every weight tile in the GEMM: their compute-bound GEMMs run at DEQUANT_EFF of the
  math's rate (decode at small batch stays bound by the 4/8-bit weight bytes).
* **throughput** (steady state, B sequences in flight): an engine spends B x prefill + output x step
  per B requests, so output tokens/s per replica = B x output / that; per GPU = that / (tp x pp).
* **TPOT** = step + B x prefill / output (the prefills the in-flight batch interleaves), x pp.
  **TTFT** = prefill + one step (P50); P99 adds the prefills of the requests that arrive while one
  runs (Poisson arrivals at the replica's request rate, 99th percentile).

Efficiency factors are per GPU generation and GEMM math, calibrated once on one declared public table
(``CALIBRATION``) and not fitted per row; ``RANGE`` is the spread of estimate/measured over every row
of ``benchmarks/planner.py``'s table, so each output is given as [value x RANGE[0], value x RANGE[1]].
Not modelled: speculative decoding, prefix-cache hits, sampling beyond greedy, CUDA-graph padding,
pipeline bubbles (pp stages assumed overlapped), MoE routing imbalance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from precision_pipeline.core.errors import UserError
from precision_pipeline.resolve.estimate import gemm_math, gemm_params_per_gpu
from precision_pipeline.spec import formats as F
from precision_pipeline.spec.hardware import GPUSpec, interconnect
from precision_pipeline.spec.model_arch import ModelArch
from precision_pipeline.spec.profile import Profile

SRC = "build/precision_pipeline/resolve/perf.py"
KIND = "performance model (roofline terms x efficiency factors calibrated on published TensorRT-LLM measurements)"

DEFAULT_INPUT_LEN = 1000
DEFAULT_OUTPUT_LEN = 1000
"""Workload defaults: 1,000 input and 1,000 output tokens per request (a row of TensorRT-LLM's
perf-overview tables), concurrency = as many sequences as one replica holds (the offline
maximum-throughput scenario ``trtllm-bench throughput`` measures)."""

CALIBRATION = ("TensorRT-LLM docs/source/performance/perf-overview.md, v0.17 table (commit 258c754), "
               "Llama 3.1 8B FP8 tp1 on H100 SXM and H200, engine flow (trtllm-bench build + throughput); the "
               "weight-only terms on TensorRT-Model-Optimizer benchmark.md section 1.1 (H200, TensorRT-LLM v0.15); the "
               "all-reduce share on the v0.17 table's Llama 3.1 70B tp 1/2/4/8 rows")
"""The tables the efficiency factors were set on (by hand, a few global numbers rounded to one or two
digits, no per-row fit). Honestly: they were adjusted with benchmarks/planner.py's whole table in view
(KV_BW_EFF, STEP_OVERHEAD_PER_SEQ_S and ALLREDUCE_EFF after a first look at the 70B rows), so that table
is a check of a ten-number model against 162 rows, not an independent hold-out."""

BW_EFF = {"Ampere": 0.80, "Ada Lovelace": 0.80, "Hopper": 0.80, "Blackwell": 0.75, "Blackwell Ultra": 0.75}
"""Fraction of the catalog memory bandwidth a decode step reaches (weights + KV streamed once)."""
_BW_EFF_OTHER = 0.70

GEMM_EFF = {"bf16": 0.60, "fp8": 0.50, "int8": 0.50, "nvfp4": 0.40}
"""Fraction of the dense Tensor Core peak large GEMMs (prefill, big decode batches) reach, by math.
Blackwell's FP4 rate is the least proven (fewer kernels tuned): the lowest factor."""

KV_BW_EFF = 0.6
"""Fraction of the catalog bandwidth decode attention reaches reading the paged KV cache (block gathers,
per-sequence work, FP8 KV dequantized in the kernel): well below weight streaming."""

DEQUANT_EFF = 0.65
"""Weight-only formats, prefill: the share of the math rate their large-M GEMMs keep (every weight tile is
dequantized inside the kernel; TensorRT-LLM's weight-only GEMMs trail the plain ones)."""
DEQUANT_ROWS_MAX = 16
DEQUANT_ELEMS_PER_S = 2.0e13
"""Weight-only formats, decode: the kernel dequantizes every weight once per batch row up to
DEQUANT_ROWS_MAX rows (GEMV-style kernels), at DEQUANT_ELEMS_PER_S weights/s per GPU: a step adds
min(B, 16) x GEMM parameters per GPU / 2e13 s. Set on the ModelOpt H200 table (benchmarks/planner.py rows
'modelopt-v0.15'), the one public table with weight-only formats."""

STEP_OVERHEAD_S = 0.3e-3
STEP_OVERHEAD_PER_LAYER_S = 35e-6
STEP_OVERHEAD_PER_SEQ_S = 4e-6
"""Fixed cost of one in-flight-batching iteration (scheduling, sampling: 0.3 ms) plus per decoder layer
(kernel launches and small kernels: 35 us) plus per sequence in the batch (the runtime's per-request
bookkeeping, sampling and KV block management: 4 us), seconds."""

ALLREDUCE_EFF = 0.5
"""Share of the link's per-direction bandwidth an all-reduce reaches at the message sizes of a decode step
(a few MB: launch, synchronisation and reduction arithmetic do not hide behind the transfer). Set on the
Llama 3.1 70B tp 1/2/4/8 rows of the same v0.17 table (the per-GPU order across tp), not per row."""

RANGE = (0.7, 1.7)
"""Honest range of every output: a throughput v is given as [v x 0.7, v x 1.7], a time t as [t / 1.7, t / 0.7]:
estimate/measured spans 0.60-1.41 over the 162 rows of benchmarks/planner.py (median 0.94), so every
row's measurement (estimate / ratio) lies in that band around its estimate."""

_MATH_BITS = {None: 16, "fp8": 8, "int8": 8, "nvfp4": 4}


@dataclass(frozen=True)
class Workload:
    """What the service is asked to do: tokens per request in and out, and either ``concurrency``
    (sequences in flight per replica, a closed loop) or ``request_rate`` (requests/s for the whole
    service, open loop). Neither = as many as a replica holds (offline maximum throughput)."""

    input_len: int = DEFAULT_INPUT_LEN
    output_len: int = DEFAULT_OUTPUT_LEN
    concurrency: Optional[int] = None
    request_rate: Optional[float] = None

    def __post_init__(self):
        for flag, v in (("--input-len", self.input_len), ("--output-len", self.output_len)):
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 10_000_000:
                raise UserError(flag, f"{v!r} is not a number of tokens in 1..10,000,000.", f"pass e.g. {flag} 1000.")
        if self.concurrency is not None and self.request_rate is not None:
            raise UserError("--concurrency", "and --request-rate are both given; a workload is one or the other.",
                            "pass --concurrency (sequences in flight per replica) or --request-rate (requests/s).")
        if self.concurrency is not None and (isinstance(self.concurrency, bool) or not 1 <= int(self.concurrency) <= 1_000_000):
            raise UserError("--concurrency", f"{self.concurrency!r} is not a number of sequences in 1..1,000,000.",
                            "pass e.g. --concurrency 64.")
        if self.request_rate is not None and not (isinstance(self.request_rate, (int, float))
                                                  and 0 < self.request_rate <= 1e7 and self.request_rate == self.request_rate):
            raise UserError("--request-rate", f"{self.request_rate!r} is not a rate in requests/s above 0.",
                            "pass e.g. --request-rate 10.")

    @property
    def context(self) -> int:
        """Tokens a finished sequence holds (input + output): what a candidate's max_seq_len must cover."""
        return self.input_len + self.output_len

    def describe(self) -> str:
        load = (f"concurrency {self.concurrency:,} per replica" if self.concurrency is not None
                else f"{self.request_rate:g} requests/s" if self.request_rate is not None
                else "as many sequences as a replica holds (offline maximum throughput)")
        return f"input {self.input_len:,} / output {self.output_len:,} tokens, {load}"

    def to_json(self) -> dict:
        return {**self.__dict__, "described": self.describe()}


def dequantizes(profile: Profile) -> bool:
    """True when the GEMMs dequantize narrower weights to a wider math (W4A16_AWQ, W8A16, W4A8_AWQ)."""
    fmt = F.GEMM[profile.quantization.quant_algo]
    if fmt.per_layer or fmt.weight_bits is None:
        return False
    return fmt.weight_bits < _MATH_BITS[gemm_math(profile)]


def _allreduce_s(tokens: float, hidden: int, tp: int, layers: int, link) -> float:
    """2 all-reduces per layer of ``tokens`` x hidden BF16 values over a ring of ``tp`` GPUs."""
    if tp <= 1:
        return 0.0
    per = link.latency_us * 1e-6 + 2 * (tp - 1) / tp * tokens * hidden * 2 / (link.gbs * 1e9 * ALLREDUCE_EFF)
    return 2 * layers * per


def _poisson_p99(lam: float) -> int:
    """Smallest k with P(Poisson(lam) <= k) >= 0.99."""
    if lam <= 0:
        return 0
    k, term = 0, math.exp(-lam) if lam < 700 else 0.0
    if term == 0.0:  # normal approximation for huge means
        return int(math.ceil(lam + 2.326 * math.sqrt(lam)))
    cdf = term
    while cdf < 0.99:
        k += 1
        term *= lam / k
        cdf += term
    return k


def performance(gpu: GPUSpec, model: ModelArch, profile: Profile, mapping: dict, limits: dict, memory: dict,
                workload: Workload = Workload()) -> dict[str, Any]:
    """The workload estimate of one resolved profile (formulas in the module doc). Units: tokens/s, seconds.

    Returns a dict: ``batch`` (sequences in flight per replica), ``kv_limited_batch``, ``output_tokens_per_s_per_gpu``,
    ``..._per_replica``, ``replicas_needed`` (for a request rate), ``ttft_s`` / ``ttft_p99_s``, ``tpot_s``,
    ``ranges`` ([low, high] of each), ``terms`` (the step's parts), ``arithmetic`` (lines), ``fits_workload``
    (False when not one sequence of the workload fits: then every rate is 0). Raises UserError
    (``--input-len``/``--output-len``) when a request is longer than the profile's max_seq_len / max_input_len.
    """
    wl = workload
    msl, mil = int(limits["max_seq_len"]), int(limits["max_input_len"])
    if wl.context > msl:
        raise UserError("--output-len", f"input {wl.input_len:,} + output {wl.output_len:,} tokens exceed max_seq_len "
                        f"{msl:,} of this profile.", "raise build.max_seq_len or shorten the workload.")
    if wl.input_len > mil:
        raise UserError("--input-len", f"{wl.input_len:,} tokens exceed max_input_len {mil:,} of this profile.",
                        "raise build.max_input_len or shorten the workload.")
    tp, pp, world = int(mapping["tp_size"]), int(mapping["pp_size"]), int(mapping["world_size"])
    arch = gpu.arch
    link = interconnect(gpu)
    # --- batch as the runtime sizes it
    tpb = int(profile.build.tokens_per_block)
    policy = profile.runtime.batch_scheduler_policy
    reserve = wl.input_len + (wl.output_len if policy == "guaranteed_no_evict" else -(-wl.output_len // 2))
    reserve = -(-reserve // tpb) * tpb
    cap = int(memory["kv_tokens_capacity"])
    kv_batch = cap // reserve
    mbs = int(limits["max_batch_size"])
    B = min(mbs, kv_batch)
    if wl.concurrency is not None:
        B = min(B, int(wl.concurrency))
    # --- bytes and FLOPs
    emb = int((memory.get("weight_breakdown") or {}).get("embedding", 0))
    w = int(memory["weight_bytes_per_gpu"]) - emb
    kvt = float(memory["kv_bytes_per_token"])
    ctx_mean = wl.input_len + wl.output_len / 2
    bw = gpu.bandwidth_gbs * 1e9 * BW_EFF.get(arch, _BW_EFF_OTHER)
    mth = gemm_math(profile)
    peak, peak_field = gpu.tensor_peak(mth)
    if not peak:  # a format whose math the catalog lacks: the BF16 rate (the estimate says so)
        peak, peak_field = gpu.tensor_peak(None)
    eff = GEMM_EFF.get(mth or "bf16", GEMM_EFF["bf16"]) * (DEQUANT_EFF if dequantizes(profile) else 1.0)
    rate = (peak or 0) * 1e12 * eff
    gparams = gemm_params_per_gpu(model, tp, pp)
    heads_r = -(-model.num_heads // tp)
    layers_r = -(-model.num_layers // pp)
    lm_head = 2 * model.hidden_size * model.vocab_size / tp
    attn_tok = 4 * ctx_mean * heads_r * model.head_dim * layers_r
    flops_decode_tok = 2 * gparams + lm_head + attn_tok
    fits = B >= 1 and rate > 0
    if not fits:
        zero = {"fits_workload": False, "batch": 0, "kv_limited_batch": kv_batch, "output_tokens_per_s_per_gpu": 0.0,
                "output_tokens_per_s_per_replica": 0.0, "ttft_s": None, "ttft_p99_s": None, "tpot_s": None}
        return {"kind": KIND, "workload": wl.to_json(), **zero, "ranges": {}, "terms": {},
                "arithmetic": [f"KV cache holds {kv_batch} sequences of {reserve:,} reserved tokens: the workload does not fit"],
                "source": SRC}
    kv_read = B * ctx_mean * kvt
    step_bytes = w + kv_read
    t_mem = w / bw + kv_read / (gpu.bandwidth_gbs * 1e9 * KV_BW_EFF)
    t_cmp = B * flops_decode_tok / rate
    t_ar = _allreduce_s(B, model.hidden_size, tp, layers_r, link)
    t_dq = min(B, DEQUANT_ROWS_MAX) * gparams / DEQUANT_ELEMS_PER_S if dequantizes(profile) else 0.0
    overhead = STEP_OVERHEAD_S + STEP_OVERHEAD_PER_LAYER_S * layers_r + STEP_OVERHEAD_PER_SEQ_S * B
    step = max(t_mem, t_cmp) + t_dq + t_ar + overhead
    S = wl.input_len
    pre_flops = S * 2 * gparams + 2 * S * S * heads_r * model.head_dim * layers_r
    # weights are read at least once per prefill iteration (max_num_tokens tokens each)
    chunks = -(-S // int(limits["max_num_tokens"]))
    t_pre = max(pre_flops / rate, chunks * w / bw) + _allreduce_s(S, model.hidden_size, tp, layers_r, link)
    # --- steady state of B sequences
    t_cycle = B * t_pre + wl.output_len * step
    per_replica = B * wl.output_len / t_cycle
    tpot = pp * (step + B * t_pre / wl.output_len)
    req_rate_replica = B / t_cycle
    replicas = None
    if wl.request_rate is not None:
        replicas = max(1, math.ceil(wl.request_rate / req_rate_replica))
    arrivals = (wl.request_rate / replicas if replicas else req_rate_replica) * t_pre
    k99 = _poisson_p99(arrivals)
    ttft = pp * t_pre + step
    ttft99 = pp * t_pre * (1 + k99) + step
    per_gpu = per_replica / world
    lo, hi = RANGE
    bound = "memory" if t_mem >= t_cmp else "compute"
    out = {
        "kind": KIND,
        "workload": wl.to_json(),
        "fits_workload": True,
        "batch": B,
        "kv_limited_batch": kv_batch,
        "reserved_tokens_per_sequence": reserve,
        "output_tokens_per_s_per_gpu": round(per_gpu, 1),
        "output_tokens_per_s_per_replica": round(per_replica, 1),
        "requests_per_s_per_replica": round(req_rate_replica, 3),
        "replicas_needed": replicas,
        "ttft_s": round(ttft, 4),
        "ttft_p99_s": round(ttft99, 4),
        "tpot_s": round(tpot, 5),
        "decode_bound": bound,
        "ranges": {"output_tokens_per_s_per_gpu": [round(per_gpu * lo, 1), round(per_gpu * hi, 1)],
                   "output_tokens_per_s_per_replica": [round(per_replica * lo, 1), round(per_replica * hi, 1)],
                   "ttft_s": [round(ttft / hi, 4), round(ttft / lo, 4)],
                   "ttft_p99_s": [round(ttft99 / hi, 4), round(ttft99 / lo, 4)],
                   "tpot_s": [round(tpot / hi, 5), round(tpot / lo, 5)]},
        "terms": {"step_s": step, "step_memory_s": t_mem, "step_compute_s": t_cmp, "step_allreduce_s": t_ar,
                  "step_dequant_s": t_dq, "step_overhead_s": overhead, "prefill_s": t_pre, "step_bytes_per_gpu": step_bytes,
                  "decode_flops_per_token_per_gpu": flops_decode_tok, "prefill_flops_per_request_per_gpu": pre_flops},
        "factors": {"bw_eff": BW_EFF.get(arch, _BW_EFF_OTHER), "gemm_eff": round(eff, 4),
                    "dequantizes": dequantizes(profile), "tensor_peak": peak, "tensor_peak_field": peak_field,
                    "calibration": CALIBRATION},
        "interconnect": link.to_json() if tp > 1 else None,
        "arithmetic": [
            f"workload: {wl.describe()}",
            f"batch B = min(max_batch_size {mbs:,}, KV capacity {cap:,} // {reserve:,} reserved tokens = {kv_batch:,}"
            + (f", concurrency {wl.concurrency:,}" if wl.concurrency is not None else "") + f") = {B:,}",
            f"decode step: memory {step_bytes:,.0f} B / ({gpu.bandwidth_gbs:,} GB/s x {BW_EFF.get(arch, _BW_EFF_OTHER)}) = "
            f"{t_mem * 1e3:.3f} ms (KV {kv_read:,.0f} B at {KV_BW_EFF} of it); compute {B:,} x {flops_decode_tok:,.0f} FLOPs / ({peak:,} x {eff:.3g}) T = {t_cmp * 1e3:.3f} ms; "
            f"dequant {t_dq * 1e3:.3f} ms; all-reduce {t_ar * 1e3:.3f} ms; overhead {overhead * 1e3:.2f} ms -> {step * 1e3:.3f} ms ({bound}-bound)",
            f"prefill of {S:,} tokens: {pre_flops:,.0f} FLOPs / ({peak:,} x {eff:.3g}) T -> {t_pre * 1e3:.2f} ms",
            f"output tokens/s per replica = {B:,} x {wl.output_len:,} / ({B:,} x {t_pre * 1e3:.2f} ms + {wl.output_len:,} x "
            f"{step * 1e3:.3f} ms) = {per_replica:,.0f}; per GPU ({world}) = {per_gpu:,.0f}",
            f"TPOT = {tpot * 1e3:.2f} ms; TTFT P50 = {ttft * 1e3:.1f} ms, P99 = {ttft99 * 1e3:.1f} ms ({k99} prefills queued "
            f"ahead at the 99th percentile)",
        ],
        "source": SRC,
    }
    if replicas is not None:
        out["arithmetic"].append(f"{wl.request_rate:g} requests/s / {req_rate_replica:.3f} per replica -> {replicas} replicas")
    return out


def of_plan(plan, workload: Workload = Workload()) -> Optional[dict]:
    """``performance`` of a ``ResolvedPlan`` (None without a memory plan: unknown/unsupported GPU)."""
    if plan.gpu is None or plan.memory is None:
        return None
    return performance(plan.gpu, plan.model, plan.profile, plan.mapping.model_dump(), plan.limits.model_dump(),
                       plan.memory.model_dump(), workload)


__all__ = ["Workload", "performance", "of_plan", "dequantizes", "BW_EFF", "KV_BW_EFF", "ALLREDUCE_EFF", "GEMM_EFF", "DEQUANT_EFF",
           "DEQUANT_ROWS_MAX", "DEQUANT_ELEMS_PER_S", "STEP_OVERHEAD_S", "STEP_OVERHEAD_PER_LAYER_S", "STEP_OVERHEAD_PER_SEQ_S", "RANGE", "CALIBRATION", "DEFAULT_INPUT_LEN", "DEFAULT_OUTPUT_LEN", "KIND"]
