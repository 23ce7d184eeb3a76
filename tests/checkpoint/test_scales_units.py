"""checkpoint/scales.py's parts on chosen numbers (fast): the order statistics (exact and binned), the
plotted histogram, rounding, tensor classification, each kind's code max, and the outlier rules AT
their boundaries (8x exactly is not an outlier, a role of 2 tensors is not compared) on a synthetic
rank file whose scale values are set one by one (the real checkpoints: test_scales.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from precision_pipeline.checkpoint import scales as S
from precision_pipeline.checkpoint.reader import KV_SCALE_NAMES, SCALE_SUFFIXES

W, W2, ACT, PRE = SCALE_SUFFIXES
KVF = KV_SCALE_NAMES[-1]


def test_constants():
    assert (S.RATIO, S.MIN_GROUP, S.FINE_BINS, S.EXACT_MAX, S.PLOT_BINS, S.KV_FP8_CLAMP) == (8.0, 3, 100, 4096, 20, 1.0)


def test_quantile_exact_is_the_inverted_cdf_order_statistic():
    exact = {1.0: 2, 2.0: 1, 3.0: 1}
    q = lambda p: S._quantile({}, 4, p, 1.0, 3.0, exact)  # noqa: E731
    assert q(0.01) == 1.0 and q(0.5) == 1.0  # rank ceil(0.5 * 4) = 2: the second value
    assert q(0.51) == 2.0 and q(0.75) == 2.0 and q(0.76) == 3.0 and q(1.0) == 3.0
    assert S._quantile({}, 0, 0.5, 1.0, 3.0, exact) is None
    assert S._quantile({}, 9, 0.99, 1.0, 3.0, exact) == 3.0  # fewer values than n: the maximum


def test_quantile_from_bins_is_the_bins_centre_clamped():
    bins = {0: 1, 100: 1, 150: 2}  # values in [1, 1.023), [10, 10.23), [31.6, 32.4)
    q = lambda p, lo=1.0, hi=40.0: S._quantile(bins, 4, p, lo, hi)  # noqa: E731
    assert q(0.25) == pytest.approx(10 ** 0.005)
    assert q(0.5) == pytest.approx(10 ** 1.005)
    assert q(0.75) == pytest.approx(10 ** 1.505) and q(1.0) == pytest.approx(10 ** 1.505)
    assert q(0.25, lo=1.02) == 1.02 and q(1.0, hi=31.0) == 31.0  # clamped to [min, max]
    assert S._quantile(bins, 9, 1.0, 1.0, 33.0) == 33.0


def test_plot_histogram_merges_fine_bins():
    assert S._plot_histogram({0: 2, 4: 1, 5: 1, 12: 3}) == {"bins_per_decade": 20, "first_bin": 0, "counts": [3, 1, 3]}
    assert S._plot_histogram({-7: 1, 3: 2}) == {"bins_per_decade": 20, "first_bin": -2, "counts": [1, 0, 2]}
    assert S._plot_histogram({}) == {"bins_per_decade": 20, "first_bin": 0, "counts": []}


def test_r_rounds_to_six_significant_digits():
    assert S._r(1.23456789) == 1.23457 and S._r(123456789.0) == 123457000.0
    assert S._r(None) is None and S._r(math.nan) is None and S._r(math.inf) is None


def test_classify_granularity_and_code_max():
    q = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"], "group_size": None}
    assert S._classify("transformer.layers.3.attention.k_cache_scaling_factor", q) == (KVF, "FP8", "attention.k_cache_scaling_factor")
    assert S._classify("transformer.layers.3.attention.k_cache_scaling_factor", {"quant_algo": "FP8"}) is None
    assert S._classify("transformer.layers.3.mlp.fc.weights_scaling_factor", q) == (W, "FP8", "mlp.fc")
    assert S._classify("transformer.layers.3.mlp.fc.weight", q) is None
    assert S._classify("lm_head.weights_scaling_factor", q) == (W, "NO_QUANT", "lm_head")
    assert S._classify("transformer.layers.3.attention.dense.k_cache_scaling_factor", q) is None
    assert S._classify("transformer.layers.3.input_layernorm.weights_scaling_factor", q) is None
    assert S._granularity(W, "FP8") == "per_tensor" and S._granularity(W, "W4A16_AWQ") == "per_group"
    assert S._granularity(PRE, "W4A16_AWQ") == "per_input_channel" and S._granularity(ACT, "W4A16_AWQ") == "per_tensor"
    assert S._code_max(W, "FP8") == 448 and S._code_max(ACT, "FP8") == 448 and S._code_max(KVF, "FP8") == 448
    assert S._code_max(W, "W4A16_AWQ") == 7 and S._code_max(W, "W8A8_SQ_PER_CHANNEL") == 127
    assert S._code_max(ACT, "W8A8_SQ_PER_CHANNEL") == 127 and S._code_max(ACT, "W4A16_AWQ") is None
    assert S._code_max(PRE, "W4A16_AWQ") is None and S._code_max(W2, "NVFP4") is None
    assert S._code_max(W, "NOT_A_FORMAT") is None and S._code_max(KVF, "NOT_A_FORMAT") is None


# --------------------------------------------------------------------------------------------
# A synthetic FP8 checkpoint: config.json + rank0.safetensors with chosen scale values


def _ckpt(tmp_path, weights: dict[int, float], act: dict[int, float] | None = None, kv: dict[int, float] | None = None,
          role: str = "mlp.fc"):
    """FP8 + FP8 KV config; ``weights[layer]``: that layer's ``role`` weight scale; ``act``: activation
    scales of the same role; ``kv``: each layer's k/v/kv cache scale."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = {"architecture": "LlamaForCausalLM", "dtype": "bfloat16", "num_hidden_layers": max(weights) + 1,
           "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
           "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    t = {f"transformer.layers.{i}.{role}.weights_scaling_factor": torch.tensor([v]) for i, v in weights.items()}
    for i, v in (act or {}).items():
        t[f"transformer.layers.{i}.{role}.activation_scaling_factor"] = torch.tensor([v])
    for i, v in (kv or {}).items():
        for n in KV_SCALE_NAMES:
            t[f"transformer.layers.{i}.attention.{n}"] = torch.tensor([v])
    save_file(t, str(tmp_path / "rank0.safetensors"))
    return tmp_path


def _flags(rep):
    return sorted((o["tensor"].split(".")[2], o["rule"]) for o in rep["outliers"])


def test_ratio_boundary_exactly_8x_is_not_an_outlier(tmp_path):
    w = {i: 1.0 for i in range(6)}
    w.update({1: 8.0, 2: 0.125, 3: 8.01, 4: 0.124})
    rep = S.scale_report(_ckpt(tmp_path, w))
    assert _flags(rep) == [("3", "high"), ("4", "low")]
    hi = next(o for o in rep["outliers"] if o["rule"] == "high")
    assert (hi["value"], hi["median"], hi["ratio"], hi["rank"]) == (8.01, 1.0, 8.01, 0)
    assert hi["kind"] == f"{W}:FP8" and "8.01x the median 1 of mlp.fc over 6 tensors" in hi["reason"]


def test_median_is_geometric_over_the_role(tmp_path):
    """Median of log values: 1, 4, 16 -> 4 (the arithmetic median of 3 values is 4 too; with 1, 4, 64
    the geometric median is 4 and 64 is 16x: flagged)."""
    rep = S.scale_report(_ckpt(tmp_path, {0: 1.0, 1: 4.0, 2: 64.0}))
    assert _flags(rep) == [("2", "high")]
    assert rep["outliers"][0]["median"] == 4.0 and rep["outliers"][0]["ratio"] == 16.0


def test_min_group_roles_of_two_are_not_compared(tmp_path):
    assert _flags(S.scale_report(_ckpt(tmp_path / "two", {0: 1.0, 1: 100.0}))) == []
    assert _flags(S.scale_report(_ckpt(tmp_path / "three", {0: 1.0, 1: 1.0, 2: 100.0}))) == [("2", "high")]


def test_nonpositive_nonfinite_and_kv_large(tmp_path):
    w = {i: 1.0 for i in range(4)}
    w.update({0: 0.0, 1: -1.0})
    rep = S.scale_report(_ckpt(tmp_path, w, act={0: float("nan"), 1: 1.0, 2: 1.0}, kv={0: 1.0, 1: 1.5, 2: 0.5}))
    fl = _flags(rep)
    assert ("0", "nonpositive") in fl and ("1", "nonpositive") in fl and ("0", "nonfinite") in fl
    assert [x for x in fl if x[1] == "kv_large"] == [("1", "kv_large")] * 3  # k, v and kv of layer 1; 1.0 is not large
    o = next(o for o in rep["outliers"] if o["rule"] == "kv_large")
    assert "K/V amax 672 > 448" in o["reason"]
    k = rep["kinds"][f"{W}:FP8"]
    assert (k["zeros"], k["negative"], k["nonfinite"], k["count"], k["elements"]) == (1, 1, 0, 4, 4)
    assert (k["min"], k["max"], k["median"], k["p1"], k["p99"]) == (1.0, 1.0, 1.0, 1.0, 1.0)
    assert rep["kinds"][f"{ACT}:FP8"]["nonfinite"] == 1
    zero = next(o for o in rep["outliers"] if o["rule"] == "nonpositive" and ".0." in o["tensor"])
    assert zero["reason"] == "1 zero and 0 negative of 1 elements"


def test_kind_numbers_and_order(tmp_path):
    w = {0: 0.5, 1: 1.0, 2: 2.0, 3: 4.0}
    rep = S.scale_report(_ckpt(tmp_path, w, act={0: 3.0}, kv={0: 1.0}))
    assert list(rep["kinds"]) == [f"{W}:FP8", f"{ACT}:FP8", f"{KVF}:FP8"]  # the reader's family order, KV last
    k = rep["kinds"][f"{W}:FP8"]
    assert (k["min"], k["p1"], k["median"], k["p99"], k["max"]) == (0.5, 0.5, 1.0, 4.0, 4.0)
    assert k["implied_amax"] == 4.0 * 448 and k["quantiles_exact"] is True and k["stored_dtype"] == "F32"
    assert k["granularity"] == "per_tensor" and k["family"] == W and k["quant_algo"] == "FP8"
    assert sum(k["histogram"]["counts"]) == 4 and k["histogram"]["first_bin"] == math.floor(math.log10(0.5) * 20)
    assert rep["tensors"] == 4 + 1 + 3 and rep["ratio"] == 8.0 and rep["rule"] == S.RULE


def test_quantiles_stay_exact_up_to_exact_max_distinct_values(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "EXACT_MAX", 3)
    three = S.scale_report(_ckpt(tmp_path / "three", {0: 1.0, 1: 2.0, 2: 3.0}))["kinds"][f"{W}:FP8"]
    assert three["quantiles_exact"] is True and three["median"] == 2.0
    four = S.scale_report(_ckpt(tmp_path / "four", {0: 1.0, 1: 2.0, 2: 3.0, 3: 5.0}))["kinds"][f"{W}:FP8"]
    assert four["quantiles_exact"] is False  # binned: the median is a bin centre within 1.2 %
    assert four["median"] == pytest.approx(2.0, rel=0.012) and four["median"] != 2.0
