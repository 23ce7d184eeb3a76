"""Scale factors of an exported TensorRT-LLM checkpoint: their distribution and the outliers.

``scale_report(ckpt_dir)`` reads every scale tensor of every rank file (only those tensors, via
``safetensors.safe_open``: milliseconds for SmolLM2-135M, no weight is decoded) and returns what the
gate writes to ``metrics.json`` ``scales`` and draws in its report. Tensor names come from the
reader (``reader.SCALE_SUFFIXES``, ``reader.KV_SCALE_NAMES``), each linear's format from
``config.json`` / ``quant_cfg.json`` (``reader.linear_format``), what a scale means from the codecs
(``Codec.code_max``, ``codecs.CODE_MAX``) and the registry (``GemmFormat.scales.kind``).

**Kinds.** One group per scale family and format, keyed ``<family>:<quant_algo>``:
``weights_scaling_factor`` (FP8 per tensor = amax/448; NVFP4 one FP8 E4M3 scale per 16 inputs,
relative to the global scale; INT4 AWQ per group = group amax/7; INT8 per output channel =
amax/127), ``weights_scaling_factor_2`` (NVFP4 global = amax/(6*448); W4A8 FP8 per tensor),
``activation_scaling_factor`` (per tensor: FP8 amax/448, INT8 amax/127, NVFP4 global),
``prequant_scaling_factor`` (AWQ / SmoothQuant per input channel, a multiplier) and
``kv_cache_scaling_factor`` (k, v and kv of each attention, keyed by ``kv_cache_quant_algo``).
Per kind: ``count`` (tensors, all ranks), ``elements`` (scale values), ``min``/``max`` (exact),
``p1``/``median``/``p99`` over the positive finite values, ``implied_amax`` (``max * code_max``
where the format defines it) and a 20-bins-per-decade ``histogram`` (what the report plots).

Quantiles are order statistics (inverted-CDF rank ``ceil(q*n)``), exact while a kind has at most
``EXACT_MAX`` distinct values (per-tensor scales; FP8 block scales, counted per code), else read
from a histogram of 100 bins per decade (the bin's geometric centre, clamped to [min, max]: within
1.2%; ``quantiles_exact`` says which), in one pass and bounded memory however large the model.

**Outliers** (``outliers``: one entry per flagged tensor and rule; flagged, never failing: the gate's
verdict stays the measured accuracy):

* ``nonpositive`` / ``nonfinite``: any zero, negative, NaN or infinite element (a zero scale divides
  by zero in the engine's quantize step; no exported scale may be <= 0), always;
* ``high`` / ``low``: the tensor's largest element (its amax / code max; the value itself for a
  per-tensor scale) lies more than ``RATIO`` (8x) above or below the median of the same family,
  format and role over layers and ranks (``mlp.proj`` against every other layer's ``mlp.proj``),
  compared in log space; roles with fewer than ``MIN_GROUP`` (3) tensors are not compared;
* ``kv_large``: an FP8 KV-cache scale above 1.0, i.e. K or V amax above 448. ModelOpt 0.47 clamps
  the exported FP8 KV scale to at least 1.0 and warns above 0.5 ("Large KV activation detected";
  ``get_kv_cache_scaling_factor`` in modelopt/torch/export/quant_utils.py), so 1.0 everywhere means
  no layer's K/V exceeded 448 during calibration.
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from precision_pipeline.checkpoint import codecs
from precision_pipeline.checkpoint.reader import (KV_SCALE_NAMES, LINEAR_NAMES, SCALE_SUFFIXES, linear_format,
                                                  rank_files, read_config, read_quant_cfg, safetensors_header)
from precision_pipeline.spec import formats as FMT

RATIO = 8.0
"""A tensor is ``high``/``low`` when its largest element is more than this factor from its role's median."""
MIN_GROUP = 3
"""Roles with fewer tensors than this are not compared with their median."""
FINE_BINS = 100  # per decade, for the quantiles of kinds with many distinct values
EXACT_MAX = 4096  # distinct values up to which quantiles are exact
PLOT_BINS = 20   # per decade, stored for the figure
WEIGHT, WEIGHT_2, ACTIVATION, PREQUANT = SCALE_SUFFIXES  # the reader's names, in its order
KV_FAMILY = KV_SCALE_NAMES[-1]  # k, v and kv cache scales form one family
KV_FP8_CLAMP = 1.0  # ModelOpt 0.47 exports max(amax/448, 1.0) for an FP8 KV cache
SOURCE = ("rank*.safetensors scale tensors (names: checkpoint/reader.py SCALE_SUFFIXES, KV_SCALE_NAMES; meaning: "
          "checkpoint/codecs.py; ModelOpt 0.47 modelopt/torch/export/quant_utils.py)")
RULE = (f"flagged: any zero, negative or non-finite element; a tensor whose largest element is more than {RATIO:g}x "
        f"above or below the median of its family, format and role over layers and ranks (roles with >= {MIN_GROUP} "
        f"tensors); an FP8 KV-cache scale above {KV_FP8_CLAMP:g} (K/V amax above 448; ModelOpt clamps the exported "
        f"scale to >= 1 and warns above 0.5). Flags do not fail the gate.")
_LAYER = re.compile(r"^transformer\.layers\.(\d+)\.(.+)$")


@dataclass
class _Tensor:
    name: str
    rank: int
    family: str
    algo: str
    role: str
    elements: int
    vmin: float
    vmax: float
    bad: dict[str, int]


@dataclass
class _Kind:
    family: str
    algo: str
    granularity: str
    code_max: Optional[float]
    dtypes: set = field(default_factory=set)
    tensors: list[_Tensor] = field(default_factory=list)
    bins: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    exact: Optional[dict[float, int]] = field(default_factory=lambda: defaultdict(int))
    """value -> count while the kind has at most ``EXACT_MAX`` distinct values (then None: bins only)."""


def _classify(name: str, qinfo: dict) -> Optional[tuple[str, str, str]]:
    """``(family, quant_algo, role)`` of a scale tensor name, None for any other tensor."""
    stem, _, leaf = name.rpartition(".")
    m = _LAYER.match(stem)
    role = m.group(2) if m else stem
    if leaf in KV_SCALE_NAMES and role == "attention":
        kv = qinfo.get("kv_cache_quant_algo")
        return (KV_FAMILY, kv, f"attention.{leaf}") if kv else None
    if leaf in SCALE_SUFFIXES and (role in LINEAR_NAMES or stem == "lm_head"):
        algo, _ = linear_format(qinfo, stem)
        return leaf, algo, role
    return None


def _granularity(family: str, algo: str) -> str:
    if family == WEIGHT:  # the format's layout
        return FMT.gemm(algo).scales.kind
    if family == PREQUANT:
        return "per_input_channel"
    return "per_tensor"


def _code_max(family: str, algo: str) -> Optional[float]:
    if family == WEIGHT:
        fmt = FMT.GEMM.get(algo)
        codec = codecs.CODECS.get(fmt.codec or "") if fmt is not None else None
        return codec.code_max if codec is not None else None
    if family == ACTIVATION:
        fmt = FMT.GEMM.get(algo)
        return codecs.CODE_MAX.get(fmt.act_fake_quant or "") if fmt is not None else None
    if family == KV_FAMILY:
        kv = FMT.KV.get(algo)
        return codecs.CODE_MAX.get(kv.fake_quant or "") if kv is not None else None
    return None


_FP8_VALUES: Optional[np.ndarray] = None


def _values(t) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """float32 values of a scale tensor, flattened, and None; for an FP8 E4M3 tensor (NVFP4 block
    scales) the 256 code values (``codecs.fp8_e4m3_to_float``) with how often each occurs instead."""
    import torch

    global _FP8_VALUES
    if t.dtype == torch.float8_e4m3fn:
        if _FP8_VALUES is None:
            _FP8_VALUES = codecs.fp8_e4m3_to_float(torch.arange(256, dtype=torch.int32).to(torch.uint8)).numpy()
        counts = np.bincount(t.reshape(-1).view(torch.uint8).numpy(), minlength=256)
        used = counts > 0
        return _FP8_VALUES[used], counts[used]
    return t.float().reshape(-1).numpy(), None


def _quantile(bins: dict[int, int], n: int, q: float, lo: float, hi: float,
              exact: Optional[dict[float, int]] = None) -> Optional[float]:
    """Value at inverted-CDF rank ``ceil(q*n)``: exact from ``exact`` (value -> count) when given,
    else from ``FINE_BINS``-per-decade bins (the bin's geometric centre, clamped to [lo, hi])."""
    if n == 0:
        return None
    k = max(1, math.ceil(q * n))
    seen = 0
    if exact is not None:
        for x in sorted(exact):
            seen += exact[x]
            if seen >= k:
                return float(x)
        return hi
    for b in sorted(bins):
        seen += bins[b]
        if seen >= k:
            return float(min(max(10 ** ((b + 0.5) / FINE_BINS), lo), hi))
    return hi


def _plot_histogram(bins: dict[int, int]) -> dict[str, Any]:
    coarse: dict[int, int] = defaultdict(int)
    step = FINE_BINS // PLOT_BINS
    for b, c in bins.items():
        coarse[b // step] += c
    if not coarse:
        return {"bins_per_decade": PLOT_BINS, "first_bin": 0, "counts": []}
    first, last = min(coarse), max(coarse)
    return {"bins_per_decade": PLOT_BINS, "first_bin": first, "counts": [coarse.get(i, 0) for i in range(first, last + 1)]}


def _r(x: Optional[float]) -> Optional[float]:
    return None if x is None or not math.isfinite(x) else float(f"{x:.6g}")


def scale_report(ckpt_dir: Path) -> dict[str, Any]:
    """The scale factors of checkpoint ``ckpt_dir`` (see the module doc), as metrics.json stores them.

    Returns ``{"source", "rule", "tensors" (scale tensors, all ranks), "kinds": {"<family>:<quant_algo>":
    {"family", "quant_algo", "granularity", "stored_dtype", "count", "elements", "min", "p1", "median",
    "p99", "max", "implied_amax", "zeros", "negative", "nonfinite", "histogram": {"bins_per_decade",
    "first_bin", "counts"}}}, "outliers": [{"tensor", "rank", "kind", "rule", "value", "median", "ratio",
    "reason"}], "read_s"}``. Raises UserError for a checkpoint the reader refuses (missing rank file,
    truncated safetensors, unknown per-layer format).
    """
    from safetensors import safe_open

    t0 = time.perf_counter()
    ckpt_dir = Path(ckpt_dir)
    cfg = read_config(ckpt_dir)
    qinfo = read_quant_cfg(ckpt_dir, cfg)
    kinds: dict[str, _Kind] = {}
    for rank, f in enumerate(rank_files(ckpt_dir, cfg)):
        header = safetensors_header(f)
        wanted = [(n, c) for n in header if n != "__metadata__" and (c := _classify(n, qinfo)) is not None]
        if not wanted:
            continue
        with safe_open(str(f), framework="pt") as st:
            for name, (family, algo, role) in wanted:
                key = f"{family}:{algo}"
                kind = kinds.get(key)
                if kind is None:
                    kind = kinds[key] = _Kind(family, algo, _granularity(family, algo), _code_max(family, algo))
                kind.dtypes.add(header[name]["dtype"])
                vals, counts = _values(st.get_tensor(name))
                finite = np.isfinite(vals)
                posm = finite & (vals > 0)
                pos, pc = vals[posm], (None if counts is None else counts[posm])

                def n_of(mask: np.ndarray) -> int:
                    return int(np.count_nonzero(mask) if counts is None else counts[mask].sum())
                bad = {"zeros": n_of(vals == 0), "negative": n_of(finite & (vals < 0)), "nonfinite": n_of(~finite)}
                if pos.size:
                    idx = np.floor(np.log10(pos.astype(np.float64)) * FINE_BINS).astype(np.int64)
                    first = int(idx.min())
                    for off, c in enumerate(np.bincount(idx - first, weights=pc).tolist()):
                        if c:
                            kind.bins[first + off] += int(c)
                    if kind.exact is not None:
                        u, uc = (np.unique(pos, return_counts=True) if pc is None else (pos, pc))
                        for x, c in zip(u.tolist(), uc.tolist()):
                            kind.exact[x] += int(c)
                        if len(kind.exact) > EXACT_MAX:
                            kind.exact = None
                kind.tensors.append(_Tensor(name, rank, family, algo, role, int(vals.size if counts is None else counts.sum()),
                                            float(pos.min()) if pos.size else math.nan,
                                            float(pos.max()) if pos.size else math.nan, bad))
    out_kinds: dict[str, Any] = {}
    outliers: list[dict[str, Any]] = []
    order = SCALE_SUFFIXES + (KV_FAMILY,)
    for key, k in sorted(kinds.items(), key=lambda kv: (order.index(kv[1].family), kv[1].algo)):
        lo = min((t.vmin for t in k.tensors if math.isfinite(t.vmin)), default=math.nan)
        hi = max((t.vmax for t in k.tensors if math.isfinite(t.vmax)), default=math.nan)
        n = sum(k.bins.values())
        bad = {b: sum(t.bad[b] for t in k.tensors) for b in ("zeros", "negative", "nonfinite")}
        out_kinds[key] = {
            "family": k.family, "quant_algo": k.algo, "granularity": k.granularity,
            "stored_dtype": "/".join(sorted(k.dtypes)), "count": len(k.tensors),
            "elements": sum(t.elements for t in k.tensors), "min": _r(lo),
            "p1": _r(_quantile(k.bins, n, 0.01, lo, hi, k.exact)), "median": _r(_quantile(k.bins, n, 0.5, lo, hi, k.exact)),
            "p99": _r(_quantile(k.bins, n, 0.99, lo, hi, k.exact)), "max": _r(hi), "quantiles_exact": k.exact is not None,
            "implied_amax": _r(hi * k.code_max) if k.code_max is not None and math.isfinite(hi) else None,
            **bad, "histogram": _plot_histogram(k.bins)}
        outliers += _flag(key, k)
    return {"source": SOURCE, "rule": RULE, "ratio": RATIO, "tensors": sum(len(k.tensors) for k in kinds.values()),
            "kinds": out_kinds, "outliers": outliers, "read_s": round(time.perf_counter() - t0, 4)}


def _flag(key: str, k: _Kind) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(t: _Tensor, rule: str, reason: str, median: Optional[float] = None) -> None:
        ratio = t.vmax / median if median and math.isfinite(t.vmax) else None
        out.append({"tensor": t.name, "rank": t.rank, "kind": key, "rule": rule, "value": _r(t.vmax),
                    "median": _r(median), "ratio": _r(ratio), "reason": reason})

    for t in k.tensors:
        if t.bad["zeros"] or t.bad["negative"]:
            add(t, "nonpositive", f"{t.bad['zeros']} zero and {t.bad['negative']} negative of {t.elements} elements")
        if t.bad["nonfinite"]:
            add(t, "nonfinite", f"{t.bad['nonfinite']} NaN/inf of {t.elements} elements")
    by_role: dict[str, list[_Tensor]] = defaultdict(list)
    for t in k.tensors:
        if math.isfinite(t.vmax):
            by_role[t.role].append(t)
    for role, ts in by_role.items():
        if len(ts) < MIN_GROUP:
            continue
        med = float(np.exp(np.median(np.log([t.vmax for t in ts]))))
        for t in ts:
            r = t.vmax / med
            if r > RATIO or r < 1 / RATIO:
                add(t, "high" if r > 1 else "low",
                    f"largest element {t.vmax:.4g} is {r:.3g}x the median {med:.4g} of {role} over {len(ts)} tensors",
                    med)
    kv = FMT.KV.get(k.algo) if k.family == KV_FAMILY else None
    if kv is not None and kv.fake_quant == "fp8":
        for t in k.tensors:
            if math.isfinite(t.vmax) and t.vmax > KV_FP8_CLAMP:
                add(t, "kv_large", f"K/V amax {t.vmax * codecs.FP8_MAX:.4g} > {codecs.FP8_MAX:g} (scale {t.vmax:.4g} > "
                    f"{KV_FP8_CLAMP:g}; ModelOpt warns 'Large KV activation detected' above 0.5)")
    return out


__all__ = ["scale_report", "RATIO", "MIN_GROUP", "RULE", "SOURCE", "FINE_BINS", "PLOT_BINS"]
