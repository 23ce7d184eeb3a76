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

from precision_pipeline.core.store import atomic_write_text

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


# ----------------------------------------------------------------------------------------------
# Markdown


# Row order of the metric table (same as build/precision_pipeline/gate/checkpoint_gate.py METRIC_ORDER; metrics.json is key-sorted).
METRIC_ORDER = ("kl_mean", "kl_p95", "kl_p99", "kl_max", "top1", "ppl_delta_pct", "greedy_same")


def _ordered(met: dict) -> dict:
    """``met`` with the known metrics in METRIC_ORDER first, then any others in their order."""
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
"""


def _e(s: Any) -> str:
    return html.escape(str(s), quote=True)


def _img(png: bytes, alt: str) -> str:
    return f'<img class="plot" alt="{_e(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def render_html(m: dict, plots: dict[str, bytes], heatmap: Optional[bytes] = None) -> str:
    met = _ordered(m["metrics"])
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
    h.append("</ul></section>")

    h += ['<section id="metric-table"><h2>Metrics</h2><table id="metrics"><thead><tr><th>metric</th><th>value</th>'
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

    if "kl_hist" in plots:
        h.append('<section id="kl-histogram"><h2>Per-token KL</h2>' + _img(plots["kl_hist"], "KL histogram") + "</section>")

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
    return "\n".join(h) + "\n"


# ----------------------------------------------------------------------------------------------
# Entry points


def write_report(metrics: dict, out_dir: Path, per_token: Optional[dict] = None,
                 heatmap_png: Optional[Path] = None) -> tuple[Path, Path]:
    """Write ``report.md`` and ``report.html`` into ``out_dir``; returns both paths."""
    out_dir = Path(out_dir)
    plots: dict[str, bytes] = {}
    if per_token is not None and per_token.get("kl") is not None and np.asarray(per_token["kl"]).size:
        plots["kl_hist"] = plot_kl_histogram(np.asarray(per_token["kl"]),
                                             np.asarray(per_token["floor_kl"]) if per_token.get("floor_kl") is not None else None,
                                             metrics.get("thresholds", {}))
    if metrics.get("per_category"):
        plots["categories"] = plot_categories(metrics["per_category"])
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
           "LIMITS_TEXT"]
