"""The sensitivity heatmap (``<out>/sensitivity/heatmap.png``): layers x kinds of per-cell KL mean, log colour
scale, annotated, with the per-kind rows underneath (analysis/sensitivity.py writes it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

HEATMAP_DPI = 100


def heatmap_size(n_layers: int, n_kinds: int) -> tuple[int, int]:
    """Pixel size (width, height) of heatmap.png for a matrix of ``n_layers`` x ``n_kinds``."""
    w, h = _heatmap_inches(n_layers, n_kinds)
    return int(round(w * HEATMAP_DPI)), int(round(h * HEATMAP_DPI))


def _heatmap_inches(n_layers: int, n_kinds: int) -> tuple[float, float]:
    return 2.6 + 1.25 * n_kinds, 2.4 + 0.3 * (n_layers + 1)


def plot_heatmap(matrix: np.ndarray, layers: Sequence[int], kinds: Sequence[str], kind_rows: Optional[np.ndarray],
                 path: Path, title: str = "") -> tuple[int, int]:
    """Write the heatmap PNG (KL mean per cell; NaN = not quantized in the checkpoint). Returns its pixel size."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    n, k = matrix.shape
    vals = np.concatenate([matrix.ravel(), kind_rows.ravel() if kind_rows is not None else np.zeros(0)])
    pos = vals[np.isfinite(vals) & (vals > 0)]
    vmin = float(pos.min()) if pos.size else 1e-6
    vmax = float(pos.max()) if pos.size else 1.0
    if vmax <= vmin:
        vmax = vmin * 10
    norm = LogNorm(vmin=vmin, vmax=vmax)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#dddddd")
    w, h = _heatmap_inches(n, k)
    fig = plt.figure(figsize=(w, h), dpi=HEATMAP_DPI)
    top, bottom_margin = 1.0 - 0.45 / h, 0.55 / h
    row_h = (top - bottom_margin) / (n + 2.0)
    ax = fig.add_axes((1.6 / w, bottom_margin + 2.0 * row_h, (w - 2.9) / w, n * row_h))
    ax2 = fig.add_axes((1.6 / w, bottom_margin, (w - 2.9) / w, row_h))
    cax = fig.add_axes(((w - 1.1) / w, bottom_margin + 2.0 * row_h, 0.18 / w, n * row_h))

    def draw(a, data, ylabels):
        masked = np.ma.masked_invalid(np.where(data > 0, data, np.nan) if np.isfinite(data).any() else data)
        im = a.imshow(masked, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
        a.set_yticks(range(len(ylabels)))
        a.set_yticklabels(ylabels, fontsize=7)
        for r in range(data.shape[0]):
            for c in range(data.shape[1]):
                v = data[r, c]
                if not np.isfinite(v):
                    txt, col = "excl", "#555555"
                else:
                    txt = f"{v:.2g}"
                    rgba = cmap(norm(max(v, vmin)))
                    lum = 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2]
                    col = "black" if lum > 0.5 else "white"
                a.text(c, r, txt, ha="center", va="center", fontsize=6.5, color=col)
        return im

    im = draw(ax, matrix, [str(i) for i in layers])
    ax.set_xticks(range(k))
    ax.set_xticklabels([])
    ax.set_ylabel("decoder layer", fontsize=8)
    ax.set_title(title or "KL mean (nats) with one cell quantized, rest FP32", fontsize=9)
    rows = kind_rows if kind_rows is not None else np.full((1, k), np.nan)
    draw(ax2, rows.reshape(1, k), ["all layers"])
    ax2.set_xticks(range(k))
    ax2.set_xticklabels(list(kinds), fontsize=7.5, rotation=20, ha="right")
    fig.colorbar(im, cax=cax).set_label("KL mean (nats, log)", fontsize=7)
    cax.tick_params(labelsize=6.5)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fig.savefig(tmp, format="png", dpi=HEATMAP_DPI)
    plt.close(fig)
    os.replace(tmp, path)
    return heatmap_size(n, k)


__all__ = ["HEATMAP_DPI", "heatmap_size", "plot_heatmap"]
