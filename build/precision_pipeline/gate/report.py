"""Gate reports: ``report.md`` and a self-contained ``report.html`` (plots as base64 PNG).

``write_report(metrics, out_dir, per_token=None, heatmap_png=None)`` renders what ``run_gate``
wrote to ``metrics.json`` (and the per-token KL arrays of ``per_token.npz`` for the histogram);
``render_dir(gate_dir)`` re-renders a finished gate folder.

Stable hooks for tests and DOM checks (HTML):

* ``div#verdict`` with class ``pass`` or ``fail``;
* ``table#metrics``, one ``tr[data-metric=<name>]`` per metric (kl_mean, kl_p95, kl_p99, kl_max,
  top1, ppl_delta_pct, greedy_same) with cells ``td.value``, ``td.ci``, ``td.floor``,
  ``td.threshold``, ``td.status`` (class ``pass`` / ``fail`` / ``unchecked`` on the row and cell);
* ``section#kl-histogram img.plot``, ``section#categories`` (``table#categories-table``,
  ``tr[data-category=...]``, ``img.plot``), ``section#worst-prompts`` (``div.worst[data-prompt-id]``
  with ``pre.reference`` and ``pre.candidate``), ``section#greedy`` (``table#greedy``),
  ``section#scales`` (checkpoint gates: ``table#scales-table`` with one ``tr[data-kind=<family>:<quant_algo>]``,
  cells ``td.count``, ``td.min``, ``td.p1``, ``td.median``, ``td.p99``, ``td.max``, ``td.flagged``; the
  histogram ``img.plot``; ``table#scale-outliers`` with ``tr[data-tensor][data-rule][data-rank]``),
  ``section#quantize-warnings`` (``li.warning``, class ``expected`` for known ones),
  ``section#heatmap`` (only when a heatmap PNG exists), ``section#limits`` (what this gate
  cannot see), ``section#method``.

Every image is ``<img class="plot" src="data:image/png;base64,...">``: no external files, no
scripts, no network.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np

from precision_pipeline.core.store import atomic_write_bytes, atomic_write_text

LIMITS_TEXT = [
    "This gate runs the checkpoint's weights (dequantized) and fake-quantized activations / KV cache in "
    "PyTorch on the CPU. It cannot see what the TensorRT-LLM engine's own kernels do:",
    "FP8 context FMHA (use_fp8_context_fmha) quantizes Q, K, V and the softmax output (P) to FP8 inside the "
    "attention kernel; the gate's attention runs in FP32.",
    "GEMM accumulation order, split-K and tactic choice of the engine's GEMM plugins (FP8 / NVFP4 / INT4 kernels) "
    "differ from PyTorch's matmul.",
    "Fused kernels (fused QKV + RoPE, fused gated MLP, fused residual + RMSNorm, XQA / masked MHA for decode, "
    "multi-block mode) and their intermediate precisions.",
    "Paged / chunked context, KV-cache reuse and the BF16 activations between layers of the real engine.",
    "That is what the engine gate is for: build/precision_pipeline/gate/engine_gate.py runs this golden set against the built engine "
    "on a GPU (context logits via gather_context_logits) and scores it with the same metric code.",
]


# ----------------------------------------------------------------------------------------------
# Formatting helpers


def _f(v: Any, digits: int = 4) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    try:
        x = float(v)
    except (TypeError, ValueError):
        return str(v)
    if math.isnan(x):
        return "n/a"
    if x == 0:
        return "0"
    if abs(x) < 1e-4 or abs(x) >= 1e6:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"  # significant digits: KL values span 1e-4 .. 10


def _ci(ci: Optional[list]) -> str:
    if not ci:
        return "n/a"
    return f"[{_f(ci[0])}, {_f(ci[1])}]"


def _thr(m: dict) -> str:
    if m.get("threshold") is None:
        return "not checked"
    return f"{m['op']} {_f(m['threshold'])}"


def _status(m: dict) -> str:
    p = m.get("passed")
    return "unchecked" if p is None else ("pass" if p else "fail")


def _status_word(m: dict) -> str:
    return {"unchecked": "-", "pass": "PASS", "fail": "FAIL"}[_status(m)]


# ----------------------------------------------------------------------------------------------
# Plots (matplotlib Agg -> PNG bytes)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def _ref_dtype(m: dict) -> str:
    """FP32 or BF16: the gate's reference (metrics.json ``reference.dtype``; FP32 before it was recorded)."""
    return "BF16" if (m.get("reference") or {}).get("dtype") == "bfloat16" else "FP32"


def plot_kl_histogram(kl: np.ndarray, floor_kl: Optional[np.ndarray], thresholds: dict) -> bytes:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    eps = 1e-6
    vals = [np.clip(kl, eps, None)]
    if floor_kl is not None and floor_kl.size:
        vals.append(np.clip(floor_kl, eps, None))
    hi = max(float(v.max()) for v in vals if v.size) if any(v.size for v in vals) else 1.0
    bins = np.logspace(math.log10(eps), math.log10(max(hi, 10 * eps)) + 0.05, 60)
    ax.hist(vals[0], bins=bins, alpha=0.75, label=f"candidate ({kl.size} tokens)", color="#c0392b")
    if len(vals) > 1:
        ax.hist(vals[1], bins=bins, alpha=0.55, label="BF16 noise floor", color="#2980b9")
    ax.set_xscale("log")
    ax.set_xlabel("per-token KL(P_ref || P_cand), nats (clipped at 1e-6)")
    ax.set_ylabel("tokens")
    for key, style in (("kl_mean_max", "--"), ("kl_p99_max", ":")):
        t = thresholds.get(key)
        if t:
            ax.axvline(t, color="k", linestyle=style, linewidth=1, label=f"{key} = {t:g}")
    ax.legend(fontsize=8)
    ax.set_title("Per-token KL divergence from the FP32 reference (answer tokens)")
    return _png(fig)


def plot_categories(per_category: dict) -> bytes:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    cats = list(per_category)
    x = np.arange(len(cats))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    w = 0.38
    kl = [per_category[c]["kl_mean"] for c in cats]
    fkl = [per_category[c].get("floor_kl_mean") for c in cats]
    axes[0].bar(x - w / 2, kl, w, label="candidate", color="#c0392b")
    if all(v is not None for v in fkl):
        axes[0].bar(x + w / 2, fkl, w, label="BF16 floor", color="#2980b9")
    axes[0].set_title("KL mean by category (nats)")
    t1 = [per_category[c]["top1"] for c in cats]
    ft1 = [per_category[c].get("floor_top1") for c in cats]
    axes[1].bar(x - w / 2, t1, w, label="candidate", color="#c0392b")
    if all(v is not None for v in ft1):
        axes[1].bar(x + w / 2, ft1, w, label="BF16 floor", color="#2980b9")
    axes[1].set_ylim(0, 1.12)
    axes[1].set_title("Top-1 agreement by category")
    for ax, loc in zip(axes, ("upper left", "upper center")):
        ax.set_xticks(x)
        ax.set_xticklabels(cats, rotation=30, ha="right", fontsize=8)
        ax.legend(fontsize=8, loc=loc, ncol=2)
    fig.tight_layout()
    return _png(fig)


SCALE_PNG = "scale_histogram.png"
"""The scale-factor figure beside report.md (report.html embeds the same PNG)."""
SCALE_ROWS_SHOWN = 40  # flagged tensors listed in the reports (metrics.json has them all)


def plot_scale_histograms(scales: dict) -> bytes:
    """One panel per scale kind of metrics.json ``scales`` (``checkpoint/scales.py``): the stored
    20-bins-per-decade histogram on a log axis, the median (dashed) and each flagged tensor's
    largest element (red ticks)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    kinds = scales["kinds"]
    keys = list(kinds)
    ncols = min(3, len(keys))
    nrows = -(-len(keys) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.4 * ncols, 3.1 * nrows), squeeze=False,
                             layout="constrained")  # tight_layout warns (and gives up) with two-line titles
    flagged: dict[str, list[float]] = {}
    for o in scales.get("outliers", []):
        if o.get("value"):
            flagged.setdefault(o["kind"], []).append(o["value"])
    for ax, key in zip(axes.flat, keys):
        k = kinds[key]
        h = k["histogram"]
        counts = np.asarray(h["counts"], dtype=float)
        if counts.size:
            edges = 10.0 ** ((h["first_bin"] + np.arange(counts.size + 1)) / h["bins_per_decade"])
            ax.stairs(counts, edges, fill=True, color="#2980b9", alpha=0.8)
            ax.set_xscale("log")
            lo, hi = math.log10(edges[0]), math.log10(edges[-1])
            if hi - lo < 1:  # at least one decade, so that a single value still gets a readable axis
                mid = (lo + hi) / 2
                ax.set_xlim(10 ** (mid - 0.5), 10 ** (mid + 0.5))
            if counts.max() / max(counts[counts > 0].min(), 1) > 200:
                ax.set_yscale("log")
        if k.get("median"):
            ax.axvline(k["median"], color="k", linestyle="--", linewidth=1, label=f"median {k['median']:.3g}")
        xs = flagged.get(key, [])
        if xs:
            # at the x axis in axes coordinates: y = 0 in data coordinates is -inf on a log count axis,
            # which stretched the figure to ~50,000 px (INT8 SmoothQuant's per-channel scales)
            ax.plot(xs, [0] * len(xs), "|", color="#c0392b", markersize=14, markeredgewidth=2, clip_on=False,
                    transform=ax.get_xaxis_transform(), label=f"flagged: {len(xs)}")
        if k.get("implied_amax") is not None:
            ax.plot([], [], " ", label=f"max -> amax {k['implied_amax']:.4g}")
        lo_x, hi_x = ax.get_xlim()
        if hi_x / lo_x > 30:  # > 1.5 decades: the decade labels suffice (minor ones would overlap)
            ax.xaxis.set_minor_formatter(NullFormatter())
        bad = k.get("zeros", 0) + k.get("negative", 0) + k.get("nonfinite", 0)
        ax.set_title(f"{k['family']}\n{k['quant_algo']}, {k['granularity']}, {k['count']} tensors"
                     + (f", {bad} <=0/non-finite" if bad else ""), fontsize=9)
        ax.set_xlabel("scale value", fontsize=8)
        ax.set_ylabel("values" if k["elements"] > k["count"] else "tensors", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.tick_params(which="minor", labelsize=6)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle("Scale factors of the exported checkpoint", fontsize=11)
    return _png(fig)


def _scale_rows(sc: dict) -> list[tuple[str, dict]]:
    return list(sc.get("kinds", {}).items())


def _markdown_scales(m: dict) -> list[str]:
    sc = m.get("scales")
    if sc is None:
        return []
    lines = ["", "## Scale factors", ""]
    if not sc.get("kinds"):
        return lines + ["The checkpoint has no scale tensors (nothing is quantized)."]
    lines += [f"{sc['tensors']} scale tensors (all ranks), read from the checkpoint in {sc.get('read_s', 0)} s. "
              f"Rule: {sc['rule']}", "",
              "| kind | format | granularity | dtype | tensors | values | min | p1 | median | p99 | max | amax at max | flagged |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    n_flag: dict[str, int] = {}
    for o in sc["outliers"]:
        n_flag[o["kind"]] = n_flag.get(o["kind"], 0) + 1
    for key, k in _scale_rows(sc):
        lines.append(f"| {k['family']} | {k['quant_algo']} | {k['granularity']} | {k['stored_dtype']} | {k['count']} | "
                     f"{k['elements']} | {_f(k['min'])} | {_f(k['p1'])} | {_f(k['median'])} | {_f(k['p99'])} | "
                     f"{_f(k['max'])} | {_f(k.get('implied_amax'))} | {n_flag.get(key, 0)} |")
    lines += ["", f"![scale-factor histograms]({SCALE_PNG})", ""]
    outs = sc["outliers"]
    if outs:
        lines += [f"Flagged tensors ({len(outs)}):", "", "| tensor | rank | rule | value | role median | ratio | why |",
                  "|---|---|---|---|---|---|---|"]
        for o in outs[:SCALE_ROWS_SHOWN]:
            lines.append(f"| `{o['tensor']}` | {o['rank']} | {o['rule']} | {_f(o['value'])} | {_f(o['median'])} | "
                         f"{_f(o['ratio'])} | {o['reason']} |")
        if len(outs) > SCALE_ROWS_SHOWN:
            lines.append(f"\n... and {len(outs) - SCALE_ROWS_SHOWN} more in metrics.json `scales.outliers`.")
    else:
        lines.append("No tensor is flagged.")
    return lines


def _markdown_warnings(m: dict) -> list[str]:
    qw = m.get("quantize_warnings")
    if qw is None:
        return []
    lines = ["", "## ModelOpt warnings during quantize", ""]
    ws = qw.get("warnings", [])
    if not ws:
        return lines + ["None were raised."]
    lines.append(f"{len(ws)} recorded ({qw.get('source', '')}); expected ones say why.")
    lines.append("")
    for w in ws:
        why = f" (expected: {w['expected']})" if w.get("expected") else ""
        lines.append(f"- {w['level']} {w['origin']}: {_clip(w['message'].strip(), 400)}{why}")
    return lines


# ----------------------------------------------------------------------------------------------
# Markdown




def _ordered(met: dict) -> dict:
    """``met`` with the known metrics in ``gate.metrics.METRIC_ORDER`` first (the one home of the table's row order;
    metrics.json is key-sorted), then any others in their order."""
    from precision_pipeline.gate.metrics import METRIC_ORDER  # imported here: this module needs no torch otherwise

    keys = [k for k in METRIC_ORDER if k in met] + [k for k in met if k not in METRIC_ORDER]
    return {k: met[k] for k in keys}


def render_markdown(m: dict) -> str:
    met = _ordered(m["metrics"])
    tok = m["tokens"]
    lines = [
        f"# Accuracy gate: {'PASSED' if m['passed'] else 'FAILED'}",
        "",
        f"- Model: `{m.get('model', '')}`; candidate: `{m.get('candidate', '')}`; reference: {_ref_dtype(m)} "
        f"`{m.get('reference_model_dir', '')}`",
        *([f"- Reference: {_ref_dtype(m)} on {r['device']}, candidate in {r['candidate_dtype']}; noise floor: "
           f"{r['noise_floor']}"] if (r := m.get("reference")) else []),
        f"- Golden set: {tok['prompts']} prompts, {tok['answer_tokens']} evaluated answer tokens "
        f"({tok['prompt_tokens']} prompt-segment tokens reported separately); held-out text: "
        f"{tok['heldout_predicted_tokens']} predicted tokens in {tok['heldout_windows']} windows; greedy: "
        f"{tok['greedy_new_tokens']} new tokens per prompt.",
    ]
    if m["failures"]:
        lines.append("- Failed: " + "; ".join(met[f]["reason"] for f in m["failures"]))
    if m.get("category_failures"):
        lines.append("- Failed categories: " + "; ".join(f["reason"] for f in m["category_failures"]))
    if m.get("promotable") is False:
        lines.append(f"- Not promotable: {m.get('not_promotable', '')}")
    lines += ["", "## Metrics", "",
              "| metric | value | 95% CI | BF16 noise floor | threshold | result |",
              "|---|---|---|---|---|---|"]
    for name, x in met.items():
        lines.append(f"| {name} | {_f(x['value'])} | {_ci(x.get('ci95'))} | {_f(x.get('noise_floor'))} | "
                     f"{_thr(x)} | {_status_word(x)} |")
    blocked = [n for n, x in met.items() if x.get("floor_exceeds_threshold")]
    if blocked:
        lines += ["", "Warning: the BF16 noise floor itself misses the threshold of " + ", ".join(blocked)
                  + " -- even an unquantized BF16 engine would fail it; the threshold is tighter than the floor."]
    ppl = m.get("perplexity", {})
    lines += ["", f"Held-out perplexity: reference {_f(ppl.get('heldout_reference'), 5)}, candidate "
                  f"{_f(ppl.get('heldout_candidate'), 5)}, BF16 {_f(ppl.get('heldout_floor'), 5)}. "
                  f"Golden-answer perplexity (teacher-forced): reference "
                  f"{_f(ppl.get('golden_answers', {}).get('reference'), 5)}, candidate "
                  f"{_f(ppl.get('golden_answers', {}).get('candidate'), 5)}."]
    lines += ["", "## Per category", "",
              "| category | prompts | tokens | KL mean | KL P99 | top-1 | greedy unchanged | floor KL mean | floor top-1 |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c, r in m["per_category"].items():
        lines.append(f"| {c} | {r['prompts']} | {r['tokens']} | {_f(r['kl_mean'])} | {_f(r['kl_p99'])} | "
                     f"{_f(r['top1'])} | {_f(r.get('greedy_same'))} | {_f(r.get('floor_kl_mean'))} | "
                     f"{_f(r.get('floor_top1'))} |")
    ps = m.get("prompt_segment", {})
    lines += ["", f"Prompt segment (user-turn positions, not gated): {ps.get('tokens', 0)} tokens, KL mean "
                  f"{_f(ps.get('kl_mean'))}, P99 {_f(ps.get('kl_p99'))}, top-1 {_f(ps.get('top1'))}."]
    lines += ["", "## Worst prompts (highest mean KL)", ""]
    for w in m.get("worst_prompts", []):
        lines += [f"### {w['id']} ({w['category']}): KL mean {_f(w['kl_mean'])}, max {_f(w['kl_max'])}, "
                  f"top-1 {_f(w['top1'])}, first greedy divergence {w.get('first_divergence')}", "",
                  "Prompt:", "", _md_block(_clip(w["prompt"], 600)), ""]
        if "reference_text" in w:
            lines += ["Reference (FP32) greedy:", "", _md_block(w["reference_text"]), "",
                      "Candidate greedy:", "", _md_block(w["candidate_text"]), ""]
    if m.get("greedy"):
        g = m["greedy"]
        lines += ["## Greedy generations", "",
                  f"{sum(r['same'] for r in g)} of {len(g)} prompts unchanged "
                  f"({_f(met['greedy_same']['value'])}); BF16 floor: {_f(met['greedy_same'].get('noise_floor'))}.", "",
                  "| prompt | unchanged | first divergence | BF16 unchanged |", "|---|---|---|---|"]
        for r in g:
            lines.append(f"| {r['id']} | {'yes' if r['same'] else 'no'} | {r['first_divergence'] if r['first_divergence'] is not None else '-'} | "
                         f"{_f(r.get('floor_same'))} |")
    lines += _markdown_scales(m) + _markdown_warnings(m)
    if m.get("_heatmap"):
        lines += ["", "## Sensitivity heatmap", "", "![sensitivity heatmap](sensitivity_heatmap.png)"]
    lines += ["", "## What this gate cannot see", ""]
    lines += [LIMITS_TEXT[0], ""] + [f"- {t}" for t in LIMITS_TEXT[1:]]
    lines += ["", "## Method", ""] + [f"- {k}: {v}" for k, v in m.get("method", {}).items()]
    t = m.get("timings_s", {})
    if t:
        lines += ["", "Timings (s): " + ", ".join(f"{k} {v}" for k, v in t.items())]
    return "\n".join(lines) + "\n"


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[:n] + " [...]"


def _md_block(s: str) -> str:
    fence = "~~~~" if "```" in s else "```"
    return f"{fence}text\n{s}\n{fence}"


# ----------------------------------------------------------------------------------------------
# HTML

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1100px;color:#222;padding:0 1em}
table{border-collapse:collapse;margin:1em 0;font-size:0.92em}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}
tr.fail td.status,td.fail{color:#b00020;font-weight:bold}
tr.pass td.status,td.pass{color:#1b7f3b;font-weight:bold}
#verdict{font-size:1.4em;padding:0.5em 1em;border-radius:6px;display:inline-block}
#verdict.pass{background:#e6f4ea;color:#1b7f3b}
#verdict.fail{background:#fde7e9;color:#b00020}
pre{background:#f7f7f7;padding:0.6em;white-space:pre-wrap;word-break:break-word;font-size:0.85em}
img.plot{max-width:100%;border:1px solid #eee}
.worst{border-left:4px solid #c0392b;padding-left:1em;margin:1em 0}
.cols{display:flex;gap:1em}.cols>div{flex:1;min-width:0}
.warn{color:#8a6d00}
#scales table{font-size:0.8em}#scales td,#scales th{padding:3px 5px}
"""


def _e(s: Any) -> str:
    return html.escape(str(s), quote=True)


def _img(png: bytes, alt: str) -> str:
    return f'<img class="plot" alt="{_e(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def render_html(m: dict, plots: dict[str, bytes], heatmap: Optional[bytes] = None) -> str:
    """The self-contained report.html of a gate's metrics.json ``m`` (``plots``: PNGs by name, ``heatmap``: the
    sensitivity heatmap), section by section."""
    met = _ordered(m["metrics"])
    h = _html_summary(m, met) + _html_metrics(m, met)
    if "kl_hist" in plots:
        h.append('<section id="kl-histogram"><h2>Per-token KL</h2>' + _img(plots["kl_hist"], "KL histogram") + "</section>")
    h += _html_categories(m, plots) + _html_worst(m) + _html_greedy(m)
    h += _html_scales(m, plots.get("scales")) + _html_warnings(m) + _html_tail(m, heatmap)
    return "\n".join(h) + "\n"


def _html_summary(m: dict, met: dict) -> list[str]:
    """The head, the verdict and the summary list."""
    tok = m["tokens"]
    verdict = "pass" if m["passed"] else "fail"
    h = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
         f"<title>Accuracy gate: {_e(m.get('model', ''))}</title>", f"<style>{_CSS}</style></head><body>",
         f'<h1>Accuracy gate report</h1><div id="verdict" class="{verdict}">{"PASSED" if m["passed"] else "FAILED"}</div>',
         '<section id="summary"><ul>',
         f"<li>Model: <code>{_e(m.get('model', ''))}</code>; candidate: <code>{_e(m.get('candidate', ''))}</code>; "
         f"reference: {_ref_dtype(m)} <code>{_e(m.get('reference_model_dir', ''))}</code></li>",
         *([f"<li id=\"reference\">Reference: {_ref_dtype(m)} on {_e(r['device'])}, candidate in "
            f"{_e(r['candidate_dtype'])}; noise floor: {_e(r['noise_floor'])}</li>"] if (r := m.get("reference")) else []),
         f"<li>Golden set: <span id=\"n-prompts\">{tok['prompts']}</span> prompts, "
         f"<span id=\"n-answer-tokens\">{tok['answer_tokens']}</span> evaluated answer tokens; held-out: "
         f"{tok['heldout_predicted_tokens']} predicted tokens; greedy: {tok['greedy_new_tokens']} new tokens.</li>"]
    if m["failures"]:
        h.append('<li id="failures">Failed: ' + "; ".join(_e(met[f]["reason"]) for f in m["failures"]) + "</li>")
    if m.get("category_failures"):
        h.append('<li id="category-failures">Failed categories: '
                 + "; ".join(_e(f["reason"]) for f in m["category_failures"]) + "</li>")
    if m.get("promotable") is False:
        h.append(f'<li id="not-promotable">Not promotable: {_e(m.get("not_promotable", ""))}</li>')
    h.append("</ul></section>")
    return h


def _html_metrics(m: dict, met: dict) -> list[str]:
    """The metric table, the noise-floor warning and the held-out perplexities."""
    h = ['<section id="metric-table"><h2>Metrics</h2><table id="metrics"><thead><tr><th>metric</th><th>value</th>'
         "<th>95% CI</th><th>BF16 noise floor</th><th>threshold</th><th>result</th></tr></thead><tbody>"]
    for name, x in met.items():
        st = _status(x)
        h.append(f'<tr data-metric="{_e(name)}" class="{st}"><td class="name" title="{_e(x.get("label", ""))}">{_e(name)}</td>'
                 f'<td class="value">{_f(x["value"])}</td><td class="ci">{_ci(x.get("ci95"))}</td>'
                 f'<td class="floor">{_f(x.get("noise_floor"))}</td><td class="threshold">{_e(_thr(x))}</td>'
                 f'<td class="status {st}">{_status_word(x)}</td></tr>')
    h.append("</tbody></table>")
    blocked = [n for n, x in met.items() if x.get("floor_exceeds_threshold")]
    if blocked:
        h.append(f'<p class="warn" id="floor-warning">The BF16 noise floor itself misses the threshold of '
                 f'{_e(", ".join(blocked))}: even an unquantized BF16 engine would fail it.</p>')
    ppl = m.get("perplexity", {})
    h.append(f"<p>Held-out perplexity: reference {_f(ppl.get('heldout_reference'), 5)}, candidate "
             f"{_f(ppl.get('heldout_candidate'), 5)}, BF16 {_f(ppl.get('heldout_floor'), 5)}.</p></section>")
    return h


def _html_categories(m: dict, plots: dict[str, bytes]) -> list[str]:
    """The per-category table and bars, and the prompt segment."""
    h: list[str] = []
    h.append('<section id="categories"><h2>Per category</h2><table id="categories-table"><thead><tr><th>category</th>'
             "<th>prompts</th><th>tokens</th><th>KL mean</th><th>KL P99</th><th>top-1</th><th>greedy unchanged</th>"
             "<th>floor KL mean</th><th>floor top-1</th></tr></thead><tbody>")
    for c, r in m["per_category"].items():
        h.append(f'<tr data-category="{_e(c)}"><td>{_e(c)}</td><td>{r["prompts"]}</td><td>{r["tokens"]}</td>'
                 f'<td class="kl_mean">{_f(r["kl_mean"])}</td><td class="kl_p99">{_f(r["kl_p99"])}</td>'
                 f'<td class="top1">{_f(r["top1"])}</td><td>{_f(r.get("greedy_same"))}</td>'
                 f'<td>{_f(r.get("floor_kl_mean"))}</td><td>{_f(r.get("floor_top1"))}</td></tr>')
    h.append("</tbody></table>")
    if "categories" in plots:
        h.append(_img(plots["categories"], "per-category bars"))
    ps = m.get("prompt_segment", {})
    h.append(f"<p>Prompt segment (user-turn positions, not gated): {ps.get('tokens', 0)} tokens, KL mean "
             f"{_f(ps.get('kl_mean'))}, P99 {_f(ps.get('kl_p99'))}, top-1 {_f(ps.get('top1'))}.</p></section>")
    return h


def _html_worst(m: dict) -> list[str]:
    """The worst prompts with both generations."""
    h: list[str] = []
    h.append('<section id="worst-prompts"><h2>Worst prompts</h2>')
    for w in m.get("worst_prompts", []):
        h.append(f'<div class="worst" data-prompt-id="{_e(w["id"])}"><h3>{_e(w["id"])} ({_e(w["category"])})</h3>'
                 f"<p>KL mean {_f(w['kl_mean'])}, max {_f(w['kl_max'])}, top-1 {_f(w['top1'])}, first greedy "
                 f"divergence at token {_e(w.get('first_divergence'))}</p>"
                 f'<pre class="prompt">{_e(_clip(w["prompt"], 800))}</pre>')
        if "reference_text" in w:
            h.append(f'<div class="cols"><div><h4>Reference (FP32)</h4><pre class="reference">{_e(w["reference_text"])}</pre></div>'
                     f'<div><h4>Candidate</h4><pre class="candidate">{_e(w["candidate_text"])}</pre></div></div>')
        h.append("</div>")
    h.append("</section>")
    return h


def _html_greedy(m: dict) -> list[str]:
    """The greedy generations table (when greedy was measured)."""
    h: list[str] = []
    if m.get("greedy"):
        g = m["greedy"]
        h.append(f'<section id="greedy"><h2>Greedy generations</h2><p>{sum(r["same"] for r in g)} of {len(g)} prompts '
                 f"unchanged.</p><table id=\"greedy-table\"><thead><tr><th>prompt</th><th>unchanged</th><th>first divergence</th>"
                 "<th>BF16 unchanged</th><th>reference</th><th>candidate</th></tr></thead><tbody>")
        for r in g:
            fd = r["first_divergence"]
            h.append(f'<tr data-prompt-id="{_e(r["id"])}" class="{"same" if r["same"] else "diff"}"><td>{_e(r["id"])}</td>'
                     f'<td>{"yes" if r["same"] else "no"}</td><td>{"-" if fd is None else fd}</td>'
                     f'<td>{_f(r.get("floor_same"))}</td><td><pre>{_e(r["reference_text"])}</pre></td>'
                     f'<td><pre>{_e(r["candidate_text"])}</pre></td></tr>')
        h.append("</tbody></table></section>")
    return h


def _html_tail(m: dict, heatmap: Optional[bytes]) -> list[str]:
    """The heatmap, what the gate cannot see, the method and the timings."""
    h: list[str] = []
    if heatmap is not None:
        h.append('<section id="heatmap"><h2>Sensitivity heatmap</h2>' + _img(heatmap, "sensitivity heatmap") + "</section>")

    h.append('<section id="limits"><h2>What this gate cannot see</h2><p>' + _e(LIMITS_TEXT[0]) + "</p><ul>")
    h += [f"<li>{_e(t)}</li>" for t in LIMITS_TEXT[1:]]
    h.append("</ul></section>")
    h.append('<section id="method"><h2>Method</h2><ul>')
    h += [f"<li><b>{_e(k)}</b>: {_e(v)}</li>" for k, v in m.get("method", {}).items()]
    t = m.get("timings_s", {})
    if t:
        h.append("<li><b>timings (s)</b>: " + _e(", ".join(f"{k} {v}" for k, v in t.items())) + "</li>")
    h.append("</ul></section></body></html>")
    return h


def _html_scales(m: dict, png: Optional[bytes]) -> list[str]:
    sc = m.get("scales")
    if sc is None:
        return []
    h = ['<section id="scales"><h2>Scale factors</h2>']
    if not sc.get("kinds"):
        return h + ["<p>The checkpoint has no scale tensors (nothing is quantized).</p></section>"]
    h.append(f'<p><span id="n-scale-tensors">{sc["tensors"]}</span> scale tensors (all ranks), read from the checkpoint '
             f'in {_e(sc.get("read_s", 0))} s. <span class="rule">Rule: {_e(sc["rule"])}</span></p>')
    n_flag: dict[str, int] = {}
    for o in sc["outliers"]:
        n_flag[o["kind"]] = n_flag.get(o["kind"], 0) + 1
    h.append('<table id="scales-table"><thead><tr><th>kind</th><th>format</th><th>granularity</th><th>dtype</th>'
             "<th>tensors</th><th>values</th><th>min</th><th>p1</th><th>median</th><th>p99</th><th>max</th>"
             "<th>amax at max</th><th>flagged</th></tr></thead><tbody>")
    for key, k in _scale_rows(sc):
        h.append(f'<tr data-kind="{_e(key)}"><td class="family">{_e(k["family"])}</td><td class="format">{_e(k["quant_algo"])}</td>'
                 f'<td>{_e(k["granularity"])}</td><td>{_e(k["stored_dtype"])}</td><td class="count">{k["count"]}</td>'
                 f'<td class="elements">{k["elements"]}</td>'
                 + "".join(f'<td class="{c}">{_f(k[c])}</td>' for c in ("min", "p1", "median", "p99", "max"))
                 + f'<td class="implied_amax">{_f(k.get("implied_amax"))}</td><td class="flagged">{n_flag.get(key, 0)}</td></tr>')
    h.append("</tbody></table>")
    if png is not None:
        h.append(_img(png, "scale-factor histograms"))
    outs = sc["outliers"]
    if outs:
        h.append(f'<h3>Flagged tensors (<span id="n-scale-outliers">{len(outs)}</span>)</h3><table id="scale-outliers"><thead><tr>'
                 "<th>tensor</th><th>rank</th><th>rule</th><th>value</th><th>role median</th><th>ratio</th><th>why</th>"
                 "</tr></thead><tbody>")
        for o in outs[:SCALE_ROWS_SHOWN]:
            h.append(f'<tr data-tensor="{_e(o["tensor"])}" data-rule="{_e(o["rule"])}" data-rank="{o["rank"]}">'
                     f'<td><code>{_e(o["tensor"])}</code></td><td>{o["rank"]}</td><td class="rule">{_e(o["rule"])}</td>'
                     f'<td class="value">{_f(o["value"])}</td><td>{_f(o["median"])}</td><td class="ratio">{_f(o["ratio"])}</td>'
                     f'<td>{_e(o["reason"])}</td></tr>')
        h.append("</tbody></table>")
        if len(outs) > SCALE_ROWS_SHOWN:
            h.append(f"<p>... and {len(outs) - SCALE_ROWS_SHOWN} more in metrics.json <code>scales.outliers</code>.</p>")
    else:
        h.append('<p id="no-scale-outliers">No tensor is flagged.</p>')
    h.append("</section>")
    return h


def _html_warnings(m: dict) -> list[str]:
    qw = m.get("quantize_warnings")
    if qw is None:
        return []
    ws = qw.get("warnings", [])
    h = ['<section id="quantize-warnings"><h2>ModelOpt warnings during quantize</h2>']
    if not ws:
        return h + ["<p>None were raised.</p></section>"]
    h.append(f"<p>{len(ws)} recorded ({_e(qw.get('source', ''))}); expected ones say why.</p><ul>")
    for w in ws:
        exp = w.get("expected")
        h.append(f'<li class="warning{" expected" if exp else ""}"><b>{_e(w["level"])}</b> {_e(w["origin"])}: '
                 f'<pre>{_e(_clip(w["message"].strip(), 1000))}</pre>' + (f'<span class="why">expected: {_e(exp)}</span>' if exp else "")
                 + "</li>")
    h.append("</ul></section>")
    return h


# ----------------------------------------------------------------------------------------------
# Entry points


def write_report(metrics: dict, out_dir: Path, per_token: Optional[dict] = None,
                 heatmap_png: Optional[Path] = None) -> tuple[Path, Path]:
    """Write ``report.md`` and ``report.html`` into ``out_dir`` (and ``scale_histogram.png`` when
    ``metrics`` has scale factors); returns the two report paths."""
    out_dir = Path(out_dir)
    plots: dict[str, bytes] = {}
    if per_token is not None and per_token.get("kl") is not None and np.asarray(per_token["kl"]).size:
        plots["kl_hist"] = plot_kl_histogram(np.asarray(per_token["kl"]),
                                             np.asarray(per_token["floor_kl"]) if per_token.get("floor_kl") is not None else None,
                                             metrics.get("thresholds", {}))
    if metrics.get("per_category"):
        plots["categories"] = plot_categories(metrics["per_category"])
    if (metrics.get("scales") or {}).get("kinds"):
        plots["scales"] = plot_scale_histograms(metrics["scales"])
        atomic_write_bytes(out_dir / SCALE_PNG, plots["scales"])
    heat = Path(heatmap_png).read_bytes() if heatmap_png and Path(heatmap_png).is_file() else None
    md_metrics = dict(metrics, _heatmap=heat is not None)
    md = out_dir / "report.md"
    ht = out_dir / "report.html"
    atomic_write_text(md, render_markdown(md_metrics))
    atomic_write_text(ht, render_html(metrics, plots, heat))
    return md, ht


def render_dir(gate_dir: Path) -> tuple[Path, Path]:
    """Re-render the reports of a finished gate folder (metrics.json + per_token.npz)."""
    gate_dir = Path(gate_dir)
    metrics = json.loads((gate_dir / "metrics.json").read_text())
    per_token = None
    if (gate_dir / "per_token.npz").is_file():
        z = np.load(gate_dir / "per_token.npz")
        per_token = {k: z[k] for k in z.files}
    heat = gate_dir / "sensitivity_heatmap.png"
    return write_report(metrics, gate_dir, per_token, heat if heat.is_file() else None)


__all__ = ["write_report", "render_dir", "render_markdown", "render_html", "plot_kl_histogram", "plot_categories",
           "plot_scale_histograms", "LIMITS_TEXT", "SCALE_PNG"]
