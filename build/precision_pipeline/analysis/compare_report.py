"""``invoke compare``'s outputs: the table rows, the Pareto chart (PNG) and a self-contained HTML page
(``write_compare``: compare.json, pareto.png, compare.html)."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from precision_pipeline.analysis.candidate import Candidate, pareto, tokens_per_gpu
from precision_pipeline.core.store import atomic_write_bytes, atomic_write_text
from precision_pipeline.resolve import perf as PF


def pareto_png(cands: list[Candidate]) -> bytes:
    """Accuracy loss (KL P99) vs estimated decode tokens/s per GPU; marker area ~ weight bytes per GPU;
    the frontier joined by a line and its points outlined."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    pts = [c for c in cands if not c.refused and c.accuracy.kl_p99 is not None]
    front = pareto(cands)
    fig, ax = plt.subplots(figsize=(8.5, 5.2), dpi=100)
    wmax = max((c.plan.memory.weight_bytes_per_gpu for c in pts), default=1)
    gpus = {c.label.rpartition("@")[2] for c in pts if "@" in c.label}
    same_gpu = len(gpus) == 1 and all("@" in c.label for c in pts)  # compare --gpu G: G goes into the title
    for c in pts:
        x, y = tokens_per_gpu(c), c.accuracy.kl_p99
        size = 60 + 600 * c.plan.memory.weight_bytes_per_gpu / wmax
        on = c in front
        ax.scatter([x], [y], s=size, alpha=0.6, edgecolors="black" if on else "none", linewidths=2 if on else 0,
                   marker="o" if c.accuracy.kind == "measured" else "s")
    _annotate_apart(ax, fig, [((tokens_per_gpu(c), c.accuracy.kl_p99),
                               c.label.rpartition("@")[0] if same_gpu else c.label) for c in pts])
    if front:
        f = sorted(front, key=tokens_per_gpu)
        ax.plot([tokens_per_gpu(c) for c in f], [c.accuracy.kl_p99 for c in f], "k--", lw=1,
                label="Pareto frontier")
        ax.legend(loc="lower right", fontsize=8)
        lo, hi = PF.RANGE
        for c in pts:  # the honest range of each estimate, as a horizontal bar
            ax.plot([tokens_per_gpu(c) * lo, tokens_per_gpu(c) * hi], [c.accuracy.kl_p99] * 2, "-", color="0.6", lw=0.8)
    w = next((c.perf["workload"] for c in pts if c.perf), None)
    load = "" if w is None else (f", concurrency {w['concurrency']:,}" if w["concurrency"] is not None
                                 else f", {w['request_rate']:g} req/s" if w["request_rate"] is not None else ", max load")
    wl = "" if w is None else f"; {w['input_len']:,} in / {w['output_len']:,} out tokens{load}"
    ax.set_xlabel(f"output tokens/s per GPU (performance model{wl}; grey: its range)", fontsize=9)
    ax.set_ylabel("KL P99 vs reference (nats; circle measured, square prior)")
    ax.set_title("accuracy loss vs estimated throughput" + (f" on {gpus.pop()}" if same_gpu else ", each on its own GPU")
                 + " (marker size = weight bytes per GPU)", fontsize=10)
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _annotate_apart(ax, fig, points: list[tuple[tuple[float, float], str]], line_px: float = 11.0) -> None:
    """Label each point to its upper right, moving a label up (in screen pixels) while it would
    overlap one placed before it (points taken bottom to top), with a leader line when moved."""
    fig.canvas.draw()
    to_px = ax.transData.transform
    placed: list[tuple[float, float, float]] = []  # x0, x1, y of each label's baseline, in pixels
    for (x, y), text in sorted(points, key=lambda p: (p[0][1], p[0][0])):
        px, py = to_px((x, y))
        lx, ly = px + 6, py + 6
        width = 5.2 * len(text)  # 8 pt sans: ~5.2 px per character at 100 dpi
        while any(lx < b1 and a0 < lx + width and abs(ly - by) < line_px for a0, b1, by in placed):
            ly += line_px
        placed.append((lx, lx + width, ly))
        moved = ly - py > 6 + 0.5
        ax.annotate(text, (x, y), xytext=(lx - px, ly - py), textcoords="offset pixels", fontsize=8,
                    arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.4"} if moved else None)


def table_rows(cands: list[Candidate]) -> list[dict]:
    """One row per candidate (the table of ``invoke compare`` and of the HTML page)."""
    front = pareto(cands)
    rows = []
    for c in cands:
        if c.refused:
            rows.append({"profile": c.label, "runs": False,
                         "refused": "; ".join(f"{r['rule']}: {r['reason']}" for r in c.refused)})
            continue
        mem, e, a = c.plan.memory, c.estimate, c.accuracy
        rows.append({"profile": c.label, "runs": True, "gpu": c.plan.gpu.id, "gpus": c.world_size,
                     "weight_bytes_per_gpu": mem.weight_bytes_per_gpu, "kv_bytes_per_token": mem.kv_bytes_per_token,
                     "kv_tokens_capacity": mem.kv_tokens_capacity,
                     "concurrency": e["kv_concurrency_at_context"], "context": e["context_tokens"],
                     "decode_tokens_per_s_per_gpu": e["decode_tokens_per_s_per_gpu"],
                     "output_tokens_per_s_per_gpu": tokens_per_gpu(c),
                     "output_tokens_per_s_per_replica": c.perf["output_tokens_per_s_per_replica"] if c.perf else None,
                     "ttft_p99_s": c.perf["ttft_p99_s"] if c.perf else None, "tpot_s": c.perf["tpot_s"] if c.perf else None,
                     "ranges": c.perf.get("ranges") if c.perf else None, "batch": c.perf["batch"] if c.perf else None,
                     "fallback": c.fallback.get("where"),
                     "prefill_tokens_per_s": e["prefill_tokens_per_s"],
                     "kl_mean": a.kl_mean, "kl_p99": a.kl_p99, "top1": a.top1, "accuracy": a.kind,
                     "accuracy_source": a.source, "frontier": c in front})
    return rows


def _cell(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else ""
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


COLUMNS = ("profile", "gpu", "gpus", "weight_bytes_per_gpu", "kv_bytes_per_token", "kv_tokens_capacity", "batch",
           "output_tokens_per_s_per_gpu", "output_tokens_per_s_per_replica", "ttft_p99_s", "tpot_s", "kl_mean", "kl_p99", "top1", "accuracy", "frontier")


def render_html(cands: list[Candidate], png: bytes) -> str:
    """Self-contained page: the table (``table#compare``, one ``tr[data-profile]`` per runnable profile),
    the chart (base64 PNG), the refused profiles (``ul#refused``) and the estimate's limits."""
    e = lambda s: html.escape(str(s), quote=True)  # noqa: E731
    rows = table_rows(cands)
    head = "".join(f"<th>{e(c)}</th>" for c in COLUMNS)
    body = "".join(
        f'<tr data-profile="{e(r["profile"])}" class="{"frontier" if r["frontier"] else ""}">'
        + "".join(f'<td class="{c}">{e(_cell(r.get(c)))}</td>' for c in COLUMNS) + "</tr>"
        for r in rows if r["runs"])
    refused = "".join(f'<li data-profile="{e(r["profile"])}">{e(r["profile"])}: {e(r["refused"])}</li>'
                      for r in rows if not r["runs"])
    return ("<!doctype html><html><head><meta charset='utf-8'><title>profile comparison</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 8px;border-bottom:1px solid #ddd}"
            "tr.frontier td{font-weight:bold}</style></head><body><h1>profile comparison</h1>"
            f"<p id='kind'>Throughput, TTFT, TPOT: {e(PF.KIND)} ({e(PF.CALIBRATION)}); every value lies within "
            f"x{PF.RANGE[0]}..x{PF.RANGE[1]} of the measured ones on benchmarks/planner.py's table. Accuracy: measured gate numbers "
            "of an existing build of the same quantization and calibration, else a per-format prior (labelled).</p>"
            f"<table id='compare'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
            f"<section id='chart'><img class='plot' alt='Pareto chart' src='data:image/png;base64,"
            f"{base64.b64encode(png).decode()}'></section>"
            f"<h2>cannot run</h2><ul id='refused'>{refused}</ul></body></html>")


def write_compare(cands: list[Candidate], out_dir: Path) -> dict[str, Path]:
    """compare.json, pareto.png and compare.html in ``out_dir`` (each written atomically)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = pareto_png(cands)
    paths = {"json": out_dir / "compare.json", "png": out_dir / "pareto.png", "html": out_dir / "compare.html"}
    atomic_write_text(paths["json"], json.dumps({"rows": table_rows(cands), "candidates": [c.to_json() for c in cands]},
                                                indent=2))
    atomic_write_bytes(paths["png"], png)
    atomic_write_text(paths["html"], render_html(cands, png))
    return paths


__all__ = ["pareto_png", "table_rows", "COLUMNS", "render_html", "write_compare"]
