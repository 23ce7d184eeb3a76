"""The gate's metric core: per-token KL / top-1 / NLL, their summaries and bootstrap intervals.

Shared by the checkpoint gate (``gate.checkpoint_gate``), the engine gate, the serving probe and the
sensitivity analysis; the metric definitions are in ``gate.checkpoint_gate``'s module doc. Everything
here is computed on the CPU in FP32 (logits) and float64 (numpy results). ``CHECKS`` names each judged
metric's threshold field and comparison (the verdict, ``gate.verdict``, applies them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from precision_pipeline.gate.options import DEFAULT_BOOTSTRAP

KL_CHUNK_ROWS = 256

# metric name -> (threshold field, comparison)
CHECKS: dict[str, tuple[str, str]] = {
    "kl_mean": ("kl_mean_max", "<="),
    "kl_p99": ("kl_p99_max", "<="),
    "top1": ("top1_min", ">="),
    "ppl_delta_pct": ("ppl_delta_pct_max", "<="),
    "greedy_same": ("greedy_same_min", ">="),
}
METRIC_ORDER = ("kl_mean", "kl_p95", "kl_p99", "kl_max", "top1", "ppl_delta_pct", "greedy_same")
METRIC_LABELS = {
    "kl_mean": "KL mean (nats)", "kl_p95": "KL P95 (nats)", "kl_p99": "KL P99 (nats)", "kl_max": "KL max (nats)",
    "top1": "Top-1 agreement", "ppl_delta_pct": "Held-out perplexity change (%)",
    "greedy_same": "Greedy answers unchanged",
}


@dataclass
class TokenMetrics:
    """Per-position numbers for one prompt segment (numpy arrays of equal length)."""

    kl: np.ndarray        # KL(P_ref || P_cand), nats, float64
    top1: np.ndarray      # bool: argmax equal
    ref_nll: np.ndarray   # -log P_ref(target), nats (NaN without targets)
    cand_nll: np.ndarray  # -log P_cand(target)


def token_metrics(ref_logits: torch.Tensor, cand_logits: torch.Tensor, targets: Optional[torch.Tensor] = None,
                  chunk_rows: int = KL_CHUNK_ROWS) -> TokenMetrics:
    """Per-row KL(P_ref || P_cand), top-1 agreement and target NLLs of two ``[T, V]`` logit tensors.

    Computed in FP32 in chunks of ``chunk_rows`` rows (bounded memory); KL is clamped at 0 (it
    can come out at -1e-7 from rounding). A candidate with a padded vocabulary (engines pad to
    a multiple of the tensor-parallel size) is cut to the reference's vocabulary.
    """
    if ref_logits.dim() != 2 or cand_logits.dim() != 2:
        raise ValueError("logits must be [T, V]")
    if cand_logits.shape[0] != ref_logits.shape[0]:
        raise ValueError(f"row mismatch: reference {ref_logits.shape[0]}, candidate {cand_logits.shape[0]}")
    v = ref_logits.shape[1]
    if cand_logits.shape[1] < v:
        raise ValueError(f"candidate vocabulary {cand_logits.shape[1]} is smaller than the reference's {v}")
    cand_logits = cand_logits[:, :v]
    n = ref_logits.shape[0]
    kl = np.empty(n, dtype=np.float64)
    top1 = np.empty(n, dtype=bool)
    ref_nll = np.full(n, np.nan)
    cand_nll = np.full(n, np.nan)
    for s in range(0, n, chunk_rows):
        e = min(n, s + chunk_rows)
        lr = F.log_softmax(ref_logits[s:e].float(), dim=-1)
        lc = F.log_softmax(cand_logits[s:e].float(), dim=-1)
        klc = (lr.exp() * (lr - lc)).sum(-1)
        kl[s:e] = klc.clamp_min(0.0).double().numpy()
        top1[s:e] = (lr.argmax(-1) == lc.argmax(-1)).numpy()
        if targets is not None:
            tg = targets[s:e].long().view(-1, 1)
            ref_nll[s:e] = (-lr.gather(1, tg).squeeze(1)).double().numpy()
            cand_nll[s:e] = (-lc.gather(1, tg).squeeze(1)).double().numpy()
        del lr, lc, klc
    return TokenMetrics(kl, top1, ref_nll, cand_nll)


def kl_summary(kl: np.ndarray) -> dict[str, float]:
    """mean, P95, P99, max of pooled per-token KL (percentiles: numpy 'linear')."""
    if kl.size == 0:
        return {"kl_mean": float("nan"), "kl_p95": float("nan"), "kl_p99": float("nan"), "kl_max": float("nan")}
    return {"kl_mean": float(kl.mean()), "kl_p95": float(np.percentile(kl, 95)),
            "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max())}


def bootstrap_ci(groups: Sequence[np.ndarray], stat: Callable[[np.ndarray], float], n_boot: int = DEFAULT_BOOTSTRAP,
                 seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap CI of ``stat(pooled values)``, resampling whole groups (prompts).

    Deterministic for a given ``seed``. Returns (nan, nan) when there are no groups.
    """
    groups = [np.asarray(g, dtype=np.float64) for g in groups]
    if not groups or n_boot <= 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    k = len(groups)
    vals = np.empty(n_boot)
    for b in range(n_boot):
        idx = rng.integers(0, k, size=k)
        pooled = np.concatenate([groups[i] for i in idx])
        vals[b] = stat(pooled) if pooled.size else np.nan
    a = (1.0 - level) / 2.0
    return (float(np.nanpercentile(vals, 100 * a)), float(np.nanpercentile(vals, 100 * (1 - a))))


def ci_for_all(kl_groups: list[np.ndarray], top1_groups: list[np.ndarray], n_boot: int, seed: int) -> dict[str, list[float]]:
    """CIs of the KL stats and top-1 from one shared set of resamples (same prompts per replicate)."""
    if not kl_groups or n_boot <= 0:
        return {}
    rng = np.random.default_rng(seed)
    k = len(kl_groups)
    sums = np.array([g.sum() for g in kl_groups])
    cnts = np.array([g.size for g in kl_groups], dtype=np.float64)
    hits = np.array([g.sum() for g in top1_groups], dtype=np.float64)
    out = {m: np.empty(n_boot) for m in ("kl_mean", "kl_p95", "kl_p99", "kl_max", "top1")}
    for b in range(n_boot):
        idx = rng.integers(0, k, size=k)
        n = cnts[idx].sum()
        pooled = np.concatenate([kl_groups[i] for i in idx])
        out["kl_mean"][b] = sums[idx].sum() / n
        out["kl_p95"][b], out["kl_p99"][b] = np.percentile(pooled, [95, 99])
        out["kl_max"][b] = pooled.max()
        out["top1"][b] = hits[idx].sum() / n
    return {m: [float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))] for m, v in out.items()}


def compare_generations(ref: Sequence[int], cand: Sequence[int]) -> Optional[int]:
    """First index where two greedy generations differ (None when identical)."""
    for i, (a, b) in enumerate(zip(ref, cand)):
        if a != b:
            return i
    if len(ref) != len(cand):
        return min(len(ref), len(cand))
    return None


def perplexity(nll: np.ndarray) -> float:
    return float(math.exp(float(np.mean(nll)))) if nll.size else float("nan")


__all__ = ["KL_CHUNK_ROWS", "CHECKS", "METRIC_ORDER", "METRIC_LABELS", "TokenMetrics", "token_metrics", "kl_summary",
           "bootstrap_ci", "ci_for_all", "compare_generations", "perplexity"]
