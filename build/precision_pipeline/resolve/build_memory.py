"""What the build itself needs: quantize and the gate on the chosen device and in host memory (rule
``memory.build_fit``), estimated from config.json before anything is loaded."""

from __future__ import annotations

import math
from typing import Optional


from precision_pipeline.spec import formats as F

from precision_pipeline.resolve.registry import Context
from precision_pipeline.resolve.memory import weight_bytes


# ---------------------------------------------------------------------------------------------
# What the build itself needs (quantize and the gate, on the chosen device and in host memory)

GATE_TOKENS_PER_FORWARD = 1024
"""Tokens of the gate's longest forward, for its activation estimate: every golden prompt is under
1,024 tokens (build/precision_pipeline/gate/data/golden_prompts.jsonl) and held-out windows are 512."""
GATE_DECODE_BATCH = 8
"""Prompts whose KV caches the gate keeps at once per model (``GateOptions.greedy_batch`` default)."""
PLANNING_GPU = "h100-sxm"
"""The GPU a CPU refusal prices its ``--device cuda`` alternative in (spec/hardware.py)."""


def bytes_of(dtype: str) -> int:
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
    c, r = bytes_of(cdt), bytes_of(d.reference_dtype)
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


def gpus_needed(need: int, free_per_gpu: int, block: int) -> Optional[int]:
    """Smallest GPU count k with k x (free - reserve) - (k - 1) x block >= need (None: a layer alone does not fit)."""
    per = free_per_gpu - F.RUNTIME_RESERVE_BYTES
    if per <= 0 or (need > per and per <= block):
        return None
    if need <= per:
        return 1
    return max(1, math.ceil((need - block) / (per - block)))
