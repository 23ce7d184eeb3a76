"""The gate's verdict: stored measurements (a metrics.json mapping) judged against a bar.

``judge_metrics`` is the one rule (the gate when it runs, ``invoke promote``/``rollout`` and the serving
acceptance when they re-judge a build's stored numbers); ``rejudge`` applies it to a whole metrics.json;
``GateResult`` is the gate's outcome. The rule itself is in ``gate.checkpoint_gate``'s module doc
(Pass/fail).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from precision_pipeline.core.errors import GateFailed, UserError
from precision_pipeline.gate.golden import load_golden
from precision_pipeline.gate.metrics import CHECKS, METRIC_ORDER
from precision_pipeline.spec.profile import GateBar, GateThresholds

# The gate


@dataclass
class GateResult:
    """Outcome of ``run_gate``: verdict, failing metrics and everything written to metrics.json."""

    passed: bool
    failures: list[str]
    metrics: dict[str, Any]
    out_dir: Path
    per_token: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / "metrics.json"

    @property
    def report_md(self) -> Path:
        return self.out_dir / "report.md"

    @property
    def report_html(self) -> Path:
        return self.out_dir / "report.html"

    def failed_metrics(self) -> list[str]:
        """Failing overall metrics and failing categories (``category C: metric``)."""
        return verdict_failures(self.metrics)

    def summary(self) -> dict[str, Any]:
        """Headline numbers (for the build summary)."""
        m = self.metrics["metrics"]
        out = {k: m[k]["value"] for k in METRIC_ORDER if k in m} | {
            "passed": self.passed, "eval_tokens": self.metrics["tokens"]["answer_tokens"]}
        if self.metrics.get("scales") is not None:  # checkpoint gates: tensors flagged by checkpoint/scales.py
            out["scale_outliers"] = len({o["tensor"] for o in self.metrics["scales"]["outliers"]})
        return out

    def raise_if_failed(self) -> None:
        if not self.passed:
            detail = verdict_reasons(self.metrics)
            raise GateFailed(f"accuracy gate failed: {detail}. See {self.report_md}")


def _check(value: Optional[float], threshold: Optional[float], op: str) -> tuple[Optional[bool], str]:
    if threshold is None:
        return None, "not checked"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False, "not measured but a threshold is set"
    ok = value <= threshold if op == "<=" else value >= threshold
    return ok, f"{value:.4g} {'meets' if ok else 'misses'} {op} {threshold:.4g}"


# metrics judged per category: everything but the held-out perplexity (the news text has no categories)
CATEGORY_METRICS = ("kl_mean", "kl_p99", "top1", "greedy_same")


def as_bar(thresholds: GateThresholds) -> GateBar:
    """``thresholds`` as a ``GateBar`` (a plain ``GateThresholds``: no category bars, ``min_prompts`` None)."""
    if isinstance(thresholds, GateBar):
        return thresholds
    return GateBar(**thresholds.model_dump(exclude_unset=True))


def _category_check(value: Optional[float], ci: Optional[Sequence[float]], threshold: Optional[float],
                    op: str, prompts: int) -> tuple[Optional[bool], str]:
    """(ok, how): a category misses its bar when its whole 95% interval lies past it (lower end above
    a max, upper end below a min); with no resamples (``bootstrap_resamples`` 0) its point estimate.
    A category of one prompt (``--golden-limit 1``) has no interval and is not judged (ok None): one
    prompt's numbers are noise (the FP8 test checkpoint's single facts prompt has top-1 0.843 where the
    whole set has 0.894), and such a verdict is not promotable anyway."""
    if threshold is None:
        return None, "not checked"
    if prompts < 2:
        return None, "not judged"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False, "not measured"
    if ci and len(ci) == 2 and not any(c is None or math.isnan(c) for c in ci):
        edge = ci[0] if op == "<=" else ci[1]
        return (edge <= threshold if op == "<=" else edge >= threshold), "interval"
    return (value <= threshold if op == "<=" else value >= threshold), "point estimate"


def golden_set_size(golden_path: Optional[Path] = None) -> int:
    """Prompts in the whole golden set (``golden_path``; None: the shipped file)."""
    return len(load_golden(golden_path))


def check_min_prompts(profile) -> None:
    """Refuse (UserError on ``gate.min_prompts``, exit 2) a profile whose ``gate.min_prompts`` exceeds the golden
    set (``golden_set_size``): no verdict could ever be promotable. Called by ``load_build_profile``."""
    need = profile.gate.min_prompts
    if need is None:
        return
    golden = load_golden()
    if need > len(golden):
        per: dict[str, int] = {}
        for g in golden:
            per[g.category] = per.get(g.category, 0) + 1
        raise UserError("gate.min_prompts", f"is {need:,} but the golden set has {len(golden)} prompts ("
                        + ", ".join(f"{c} {n}" for c, n in per.items()) + "), so no verdict could ever be promotable.",
                        f"set gate.min_prompts to at most {len(golden)}, or leave it out (the whole golden set).")


def load_build_profile(profile_ref: str) -> Any:
    """The profile ``build``, ``check`` and ``nightly`` run: ``resolve.dataset.load_build_profile`` (a relative
    ``calibration.dataset`` made absolute against the profile's folder) plus ``check_min_prompts`` (a fact of the
    golden set, so it is checked here, above resolve). Raises UserError."""
    from precision_pipeline.resolve.dataset import load_build_profile as load_with_dataset

    profile = load_with_dataset(profile_ref)
    check_min_prompts(profile)
    return profile


def judge_metrics(m: dict, thresholds: GateThresholds) -> dict:
    """Judge stored gate measurements (a metrics.json mapping) against ``thresholds`` (a ``GateBar``).

    The one verdict rule, used when the gate runs and again when ``invoke promote``/``rollout``
    re-judge a build's stored numbers against the profile's current bar:

    * overall: each checked metric's point estimate against its threshold (``CHECKS``); a checked
      metric that was not measured fails;
    * per category (``per_category``): ``CATEGORY_METRICS`` against ``bar.for_category(c)``; a
      category misses when its whole 95% interval lies past the bar (``_category_check``; a
      category of one prompt is not judged: no interval);
    * promotable: the verdict covers at least ``bar.min_prompts`` prompts (None: the whole golden
      set, ``golden.set_prompts``); fewer (``--golden-limit``) is recorded as not promotable.

    Returns the keys it decides: ``passed``, ``failures`` (overall metric names), ``category_failures``
    (rows with category, metric, value, ci95, threshold, op, reason), ``metrics`` (the overall rows
    with passed/threshold/reason set), ``categories_judged``, ``judged_against`` (the bar),
    ``promotable`` and ``not_promotable`` (the reason, "" when promotable).
    """
    bar = as_bar(thresholds)
    rows, failures = _judge_overall(m.get("metrics") or {}, bar)
    judged, cat_fail = _judge_categories(m.get("per_category") or {}, bar)
    promotable, why = _promotable(m, bar)
    return {"passed": not failures and not cat_fail, "failures": failures, "category_failures": cat_fail,
            "metrics": rows, "categories_judged": judged, "judged_against": bar.model_dump(mode="json"),
            "promotable": promotable, "not_promotable": why}


def _judge_overall(metric_rows: dict, bar: GateBar) -> tuple[dict[str, dict], list[str]]:
    """(the overall rows with threshold/op/passed/reason set, the failing metric names)."""
    rows = {k: dict(v) for k, v in metric_rows.items()}
    failures: list[str] = []
    for name in METRIC_ORDER:
        if name not in rows:
            continue
        thr_field, op = CHECKS.get(name, (None, None))
        thr = getattr(bar, thr_field) if thr_field else None
        v = rows[name].get("value")
        ok, _ = _check(v, thr, op) if thr_field else (None, "")
        rows[name].update({"threshold": thr, "op": op, "threshold_field": thr_field, "passed": ok,
                           "reason": _fmt_reason(name, v, thr, op or "", ok)})
        if ok is False:
            failures.append(name)
    return rows, failures


def _judge_categories(per_category: dict, bar: GateBar) -> tuple[dict[str, dict], list[dict]]:
    """(``categories_judged``: per category its checks, verdict and bar; ``category_failures`` rows)."""
    cat_fail: list[dict] = []
    judged: dict[str, dict] = {}
    for cat, r in per_category.items():
        cbar = bar.for_category(cat)
        checks: dict[str, dict] = {}
        for name in CATEGORY_METRICS:
            thr_field, op = CHECKS[name]
            thr = getattr(cbar, thr_field)
            if thr is None:
                continue
            v, ci = r.get(name), (r.get("ci95") or {}).get(name)
            ok, how = _category_check(v, ci, thr, op, int(r.get("prompts") or 0))
            checks[name] = {"value": v, "ci95": ci, "threshold": thr, "op": op, "passed": ok, "judged_by": how,
                            "reason": _category_reason(cat, name, v, ci, thr, op, ok, how)}
            if ok is False:
                cat_fail.append({"category": cat, "metric": name, **checks[name]})
        judged[cat] = {"passed": None if checks and all(c["passed"] is None for c in checks.values()) else
                       all(c["passed"] is not False for c in checks.values()), "checks": checks,
                       "bar": cbar.model_dump(mode="json", exclude_none=True)}
    return judged, cat_fail


def _category_reason(cat: str, name: str, v: Optional[float], ci: Optional[Sequence[float]], thr: float, op: str,
                     ok: Optional[bool], how: str) -> str:
    if how == "not judged":
        return f"category {cat}: {name} not judged (one prompt gives no interval)"
    shown = "not measured" if how == "not measured" else (
        f"{v:.4g}" + (f" [{ci[0]:.4g}, {ci[1]:.4g}]" if how == "interval" else ""))
    return (f"category {cat}: {name} = {shown} "
            f"{'meets' if ok else 'misses'} {op} {thr:.4g}" + (" (whole interval past the bar)"
                                                              if not ok and how == "interval" else ""))


def _promotable(m: dict, bar: GateBar) -> tuple[bool, str]:
    """(promotable, the reason when not): the verdict covers at least ``bar.min_prompts`` prompts."""
    prompts = int((m.get("tokens") or {}).get("prompts") or 0)
    golden = m.get("golden") or {}
    need = bar.min_prompts
    if need is None:
        need = int(golden.get("set_prompts") or golden_set_size())
        what = f"the whole golden set ({need} prompts)"
    else:
        what = f"gate.min_prompts {need}"
    promotable = prompts >= need
    why = "" if promotable else (
        f"the verdict covers {prompts} golden prompt(s), fewer than {what}"
        + (f" (--golden-limit {golden['prompts_per_category']})" if golden.get("prompts_per_category") else "")
        + ": it is a quick check, not a release verdict")
    return promotable, why


def verdict_failures(m: dict) -> list[str]:
    """The failing checks of a judged mapping, named: overall metric names and ``category C: metric``."""
    return list(m.get("failures") or []) + [f"category {f['category']}: {f['metric']}" for f in m.get("category_failures") or []]


def verdict_reasons(m: dict) -> str:
    """Every failing check's reason, '; '-joined (overall first, then categories)."""
    rows = m.get("metrics") or {}
    return "; ".join([rows[f]["reason"] for f in m.get("failures") or [] if f in rows]
                     + [f["reason"] for f in m.get("category_failures") or []])


def _fmt_reason(name: str, value: Optional[float], threshold: Optional[float], op: str, ok: Optional[bool]) -> str:
    if ok is None:
        return f"{name}: not checked"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{name}: not measured (threshold {op} {threshold})"
    return f"{name} = {value:.4g} ({'within' if ok else 'outside'} {op} {threshold:.4g})"


def rejudge(metrics: dict[str, Any], thresholds: GateThresholds) -> dict[str, Any]:
    """``metrics`` (a gate's metrics.json content) judged against ``thresholds`` instead of the ones it was
    measured with, by the one verdict rule (``judge_metrics``: overall rows, categories, promotable), plus each
    row's ``floor_exceeds_threshold`` and the top-level ``thresholds``. The measured values, intervals and the
    rest are kept. Returns a new dict."""
    import copy

    out = copy.deepcopy(metrics)
    out.update(judge_metrics(out, thresholds))
    for m in out.get("metrics", {}).values():
        thr, op, fv = m.get("threshold"), m.get("op"), m.get("noise_floor")
        m["floor_exceeds_threshold"] = None if thr is None or fv is None else ((fv > thr) if op == "<=" else (fv < thr))
    out["thresholds"] = thresholds.model_dump(mode="json")
    return out


__all__ = ["GateResult", "CATEGORY_METRICS", "as_bar", "golden_set_size", "check_min_prompts", "load_build_profile", "judge_metrics", "verdict_failures", "verdict_reasons",
           "rejudge"]
