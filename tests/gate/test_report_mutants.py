"""gate/report.py's figures and HTML pinned on the matplotlib objects (issue 26: its fast tests read the reports'
text, so a figure drawn wrong passed): bars side by side on the category axis, the scale histograms' axes, the
limits section. ``report._png`` is replaced to keep the figure instead of rendering it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from matplotlib.ticker import NullFormatter

from precision_pipeline.gate import report as R


@pytest.fixture
def figs(monkeypatch):
    import matplotlib.pyplot as plt

    kept = []
    monkeypatch.setattr(R, "_png", lambda fig: kept.append(fig) or b"png")
    yield kept
    for f in kept:
        plt.close(f)


def test_category_bars_side_by_side(figs):
    per = {"facts": {"kl_mean": 0.1, "floor_kl_mean": 0.01, "top1": 0.9, "floor_top1": 0.95},
           "code": {"kl_mean": 0.3, "floor_kl_mean": 0.02, "top1": 0.8, "floor_top1": 0.97}}
    assert R.plot_categories(per) == b"png"
    (fig,) = figs
    assert len(fig.axes) == 2
    w = 0.38
    for ax, (cand, floor) in zip(fig.axes, (("kl_mean", "floor_kl_mean"), ("top1", "floor_top1"))):
        bars = [(round(p.get_x(), 6), round(p.get_width(), 6), round(p.get_height(), 6)) for p in ax.patches]
        # candidate at i - w/2 (its left edge i - w), the floor at i + w/2 (left edge i): touching, not overlapping
        assert bars == [(round(-w, 6), w, per["facts"][cand]), (round(1 - w, 6), w, per["code"][cand]),
                        (0.0, w, per["facts"][floor]), (1.0, w, per["code"][floor])]
        assert [t.get_text() for t in ax.get_xticklabels()] == ["facts", "code"]
    assert fig.axes[1].get_ylim() == (0.0, 1.12)
    assert [a.get_title() for a in fig.axes] == ["KL mean by category (nats)", "Top-1 agreement by category"]
    R.plot_categories({"facts": {"kl_mean": 0.1, "top1": 0.9}})  # no floor measured: candidate bars only
    assert [len(a.patches) for a in figs[1].axes] == [1, 1]


def _kind(counts, first_bin, median):
    return {"histogram": {"counts": counts, "first_bin": first_bin, "bins_per_decade": 20}, "median": median,
            "family": "weight", "quant_algo": "FP8", "granularity": "per-tensor", "count": 4, "elements": 4}


def test_scale_histogram_axes(figs):
    wide = _kind([1, 0, 0] * 20 + [1], -60, 0.01)          # 61 bins from 1e-3: about 3 decades
    narrow = _kind([2, 2], -40, 0.011)                    # 2 bins at 1e-2: a tenth of a decade
    R.plot_scale_histograms({"kinds": {"w": wide, "n": narrow}, "outliers": [{"kind": "w", "value": 0.5}]})
    (fig,) = figs
    ax_w, ax_n = fig.axes[:2]
    assert isinstance(ax_w.xaxis.get_minor_formatter(), NullFormatter)  # > 1.5 decades: decade labels only
    assert not isinstance(ax_n.xaxis.get_minor_formatter(), NullFormatter)
    lo, hi = -40 / 20, -38 / 20  # the narrow one's bin edges (log10), widened to one decade around their middle
    mid = (lo + hi) / 2
    assert ax_n.get_xlim() == pytest.approx((10 ** (mid - 0.5), 10 ** (mid + 0.5)), rel=1e-12)
    assert math.log10(ax_w.get_xlim()[1] / ax_w.get_xlim()[0]) > 2.9
    assert [ax.get_title() for ax in (ax_w, ax_n)] == ["weight\nFP8, per-tensor, 4 tensors"] * 2
    assert [t.get_text() for t in ax_w.get_legend().get_texts()] == ["median 0.01", "flagged: 1"]


def test_limits_section_holds_each_text_once():
    html = "".join(R._html_tail({}, None))
    assert f"<p>{R.html.escape(R.LIMITS_TEXT[0])}</p>" in html
    for t in R.LIMITS_TEXT[1:]:
        assert html.count(f"<li>{R.html.escape(t)}</li>") == 1
    assert html.count("<li>") == len(R.LIMITS_TEXT) - 1
    assert np.all([R.html.escape(t) in html for t in R.LIMITS_TEXT])


def test_kl_histogram_bins_and_size(figs):
    """59 log-spaced bins from 1e-6 to a twentieth of a decade past the largest KL (the floor's too), threshold lines."""
    kl, floor = np.array([1e-8, 0.01, 0.2]), np.array([0.001, 0.5])
    R.plot_kl_histogram(kl, floor, {"kl_mean_max": 0.05, "kl_p99_max": None})
    (fig,) = figs
    ax = fig.axes[0]
    assert tuple(fig.get_size_inches()) == (7.5, 3.6)
    edges = sorted({round(math.log10(p.get_x()), 9) for p in ax.patches} | {round(math.log10(p.get_x() + p.get_width()), 9)
                                                                          for p in ax.patches})
    assert edges[0] == -6.0 and edges[-1] == pytest.approx(math.log10(0.5) + 0.05, abs=1e-9) and len(edges) == 60
    assert len(ax.patches) == 2 * 59  # candidate and floor, 59 bins each
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["candidate (3 tokens)", "BF16 noise floor",
                                                                  "kl_mean_max = 0.05"]


def test_category_figure_size(figs):
    R.plot_categories({"facts": {"kl_mean": 0.1, "top1": 0.9}})
    assert tuple(figs[0].get_size_inches()) == (10.0, 3.6)


def test_clip_keeps_a_text_of_exactly_n_characters():
    assert R._clip("x" * 10, 10) == "x" * 10 and R._clip("x" * 11, 10) == "x" * 10 + " [...]"


def test_metric_rows_in_the_metrics_order_then_the_rest():
    met = {"zz": 1, "greedy_same": 2, "kl_mean": 3, "aa": 4}
    assert list(R._ordered(met)) == ["kl_mean", "greedy_same", "zz", "aa"]


@pytest.mark.parametrize("n, more", [(R.SCALE_ROWS_SHOWN, None), (R.SCALE_ROWS_SHOWN + 3, 3)])
def test_scale_outlier_rows_shown_and_the_rest_counted(n, more):
    kind = {"family": "weight", "quant_algo": "FP8", "granularity": "per-tensor", "stored_dtype": "F32", "count": 1,
            "elements": 1, "min": 1.0, "p1": 1.0, "median": 1.0, "p99": 1.0, "max": 1.0}
    outs = [{"kind": "w", "tensor": f"t{i}", "rank": 0, "rule": "r", "value": 2.0, "median": 1.0, "ratio": 2.0,
             "reason": "x"} for i in range(n)]
    html = "".join(R._html_scales({"scales": {"kinds": {"w": kind}, "outliers": outs, "tensors": 1, "rule": "r"}}, None))
    assert html.count("<tr data-tensor=") == min(n, R.SCALE_ROWS_SHOWN)
    assert ("more in metrics.json" in html) is (more is not None)
    if more:
        assert f"... and {more} more in metrics.json" in html


def test_scale_panel_titles_count_bad_values_and_the_figure_size(figs):
    k = _kind([1, 1], -40, 0.01)
    k.update(zeros=2, negative=1, nonfinite=1)
    R.plot_scale_histograms({"kinds": {"w": k, "a": _kind([1], -40, 0.01), "b": _kind([1], -40, 0.01),
                                       "c": _kind([1], -40, 0.01)}})
    fig = figs[0]
    assert fig.axes[0].get_title() == "weight\nFP8, per-tensor, 4 tensors, 4 <=0/non-finite"
    assert tuple(fig.get_size_inches()) == pytest.approx((4.4 * 3, 3.1 * 2))  # 4 kinds: 3 columns, 2 rows
