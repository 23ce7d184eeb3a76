"""The gate's bootstrap CIs against an independent computation (issue 12 mutation survivors:
the n_boot edges and the percentile constants)."""

from __future__ import annotations

import math

import numpy as np

from precision_pipeline.gate import metrics as G


def _groups(seed=3, k=12):
    rng = np.random.default_rng(seed)
    kl = [rng.gamma(0.5, 0.2, size=int(rng.integers(5, 40))) for _ in range(k)]
    top1 = [(rng.random(g.size) < 0.9).astype(np.float64) for g in kl]
    return kl, top1


def _oracle(kl, top1, n_boot, seed):
    rng = np.random.default_rng(seed)
    k = len(kl)
    rows = {m: [] for m in ("kl_mean", "kl_p95", "kl_p99", "kl_max", "top1")}
    for _ in range(n_boot):
        idx = rng.integers(0, k, size=k)
        pk = np.concatenate([kl[i] for i in idx])
        pt = np.concatenate([top1[i] for i in idx])
        rows["kl_mean"].append(pk.mean())
        rows["kl_p95"].append(np.percentile(pk, 95))
        rows["kl_p99"].append(np.percentile(pk, 99))
        rows["kl_max"].append(pk.max())
        rows["top1"].append(pt.mean())
    return {m: [np.percentile(v, 2.5), np.percentile(v, 97.5)] for m, v in rows.items()}


def test_shared_resample_cis_match_an_independent_computation():
    kl, top1 = _groups()
    got = G.ci_for_all(kl, top1, n_boot=200, seed=5)
    want = _oracle(kl, top1, 200, 5)
    assert set(got) == set(want)
    for m in want:
        assert np.allclose(got[m], want[m], rtol=1e-12, atol=1e-15), m
        assert got[m][0] < got[m][1]


def test_no_groups_or_no_resamples_give_no_interval():
    kl, top1 = _groups()
    assert G.ci_for_all([], [], n_boot=100, seed=0) == {}
    assert G.ci_for_all(kl, top1, n_boot=0, seed=0) == {}
    assert G.ci_for_all(kl, top1, n_boot=1, seed=0) != {}
    lo, hi = G.bootstrap_ci(kl, np.mean, n_boot=0)
    assert math.isnan(lo) and math.isnan(hi)
    lo, hi = G.bootstrap_ci(kl, np.mean, n_boot=1)
    assert lo == hi and math.isfinite(lo)
    assert all(math.isnan(x) for x in G.bootstrap_ci([], np.mean, n_boot=10))


def test_bootstrap_ci_is_the_central_interval_of_the_resampled_statistic():
    """``bootstrap_ci`` (greedy_same's interval): percentiles (1 - level) / 2 and 1 - (1 - level) / 2 of the statistic
    over resampled groups (issue 26 survivor: the ``/ 2.0`` of the tail share)."""
    kl, _ = _groups()
    for level, lo_pct, hi_pct in ((0.95, 2.5, 97.5), (0.8, 10.0, 90.0)):
        rng = np.random.default_rng(5)
        vals = [np.concatenate([kl[i] for i in rng.integers(0, len(kl), size=len(kl))]).mean() for _ in range(200)]
        want = (np.percentile(vals, lo_pct), np.percentile(vals, hi_pct))
        got = G.bootstrap_ci(kl, np.mean, n_boot=200, seed=5, level=level)
        assert np.allclose(got, want, rtol=1e-12, atol=1e-15), (level, got, want)
