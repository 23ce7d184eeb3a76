"""Memory math of the deployment plan (bytes per GPU): weights (the export's exclusions: ``spec.families``),
KV cache per token, activations, and the per-GPU plan the ``memory.fit`` rule reads. Units: bytes unless a name
says GiB."""

from __future__ import annotations


from precision_pipeline.spec import formats as F
from precision_pipeline.spec.families import COLUMN, EXPERT, family, kept_linears
from precision_pipeline.spec.hardware import GIB
from precision_pipeline.spec.model_arch import ModelArch
from precision_pipeline.spec.profile import Profile

from precision_pipeline.resolve.registry import Context


# ---------------------------------------------------------------------------------------------
# Memory math (bytes per GPU)


def kept_in_high_precision(m: ModelArch, q) -> tuple[tuple[frozenset[str], ...], bool]:
    """Per decoder layer: the HF linears (relative names, ``Family.layer_linears``) the export keeps in high
    precision, and whether it keeps ``lm_head``: ``spec.families.kept_linears``, i.e. the export's own
    matching (``resolve_exclusions``: patterns on HF, TensorRT-LLM and short names, keep_first/last layers,
    fused groups kept whole), memoised."""
    return kept_linears(m.architecture, tuple(q.exclude_modules), q.keep_first_layers, q.keep_last_layers,
                        m.num_layers)


def decoder_linears_kept(m: ModelArch, q) -> tuple[int, int]:
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
