"""metrics.json from the gate's measurements: one function per section, assembled by ``assemble``.

Input: a ``Measured`` (the candidate's per-prompt token metrics, greedy answers and held-out NLL, with the
reference's ``ReferenceData``) and the ``Settings`` the numbers were measured with. Output: the metrics.json
mapping (judged by ``gate.verdict.judge_metrics``) and the per-token arrays of per_token.npz. The layout
(every key, every number) is pinned by tests/gate/test_report.py and read by the report, promote, the probe,
the sensitivity analysis and nightly.

Sections: ``metrics`` (one row per ``METRIC_ORDER`` metric: value, 95% interval, noise floor),
``per_category``, ``prompt_segment``, ``perplexity``, ``prompts``, ``greedy``, ``worst_prompts``,
``tokens``, ``noise_floor``, ``method``, ``golden`` and the verdict's keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from precision_pipeline.gate.golden import EncodedPrompt, summarize
from precision_pipeline.gate.metrics import (CHECKS, METRIC_LABELS, METRIC_ORDER, TokenMetrics, bootstrap_ci,
                                             ci_for_all, compare_generations, kl_summary, perplexity)
from precision_pipeline.gate.options import GateOptions
from precision_pipeline.gate.reference import ReferenceData
from precision_pipeline.gate.verdict import as_bar, judge_metrics
from precision_pipeline.spec.profile import GateThresholds

WORST_PROMPTS = 5


@dataclass(frozen=True)
class Settings:
    """The ``GateOptions`` fields metrics.json's numbers and method text depend on."""

    bootstrap: int          # bootstrap resamples (0: no intervals)
    seed: int
    greedy_new_tokens: int  # 0: greedy not measured
    heldout_window: int     # tokens per held-out window

    @classmethod
    def of(cls, options: GateOptions) -> "Settings":
        return cls(options.bootstrap_resamples, options.seed, options.greedy_new_tokens, options.heldout_window)


@dataclass
class Measured:
    """What one gate run measured, prompt i of every list belonging to ``encoded[i]``."""

    encoded: Sequence[EncodedPrompt]
    per_prompt: Sequence[tuple[TokenMetrics, TokenMetrics]]  # (answer positions, prompt positions)
    ref: ReferenceData
    cand_greedy: Sequence[Sequence[int]]                     # greedy answers ([] when not measured)
    cand_heldout: np.ndarray                                 # held-out per-token NLL, nats
    windows: Sequence[Sequence[int]]                         # held-out windows (token ids)

    @property
    def floor(self) -> Optional[dict[str, Any]]:
        return self.ref.floor


@dataclass
class Groups:
    """Per-prompt answer-position arrays (one entry per prompt), pooled for the summaries."""

    kl: list[np.ndarray]
    top1: list[np.ndarray]   # float64 0/1

    def kl_all(self) -> np.ndarray:
        return np.concatenate(self.kl) if self.kl else np.zeros(0)

    def top1_all(self) -> np.ndarray:
        return np.concatenate(self.top1) if self.top1 else np.zeros(0)


@dataclass
class Estimates:
    """Point estimates and 95% intervals by metric name (a metric's value is None when not measured)."""

    values: dict[str, Optional[float]]
    ci95: dict[str, list[float]]


def _same_ci(same: Sequence[bool], s: Settings) -> list[float]:
    """95% interval of a share of prompts (each prompt one resampled group)."""
    return list(bootstrap_ci([np.array([float(x)]) for x in same], np.mean, s.bootstrap, s.seed))


def _candidate_estimates(g: Groups, s: Settings) -> Estimates:
    values: dict[str, Optional[float]] = dict(kl_summary(g.kl_all()))
    top1_all = g.top1_all()
    values["top1"] = float(top1_all.mean()) if top1_all.size else float("nan")
    return Estimates(values, ci_for_all(g.kl, g.top1, s.bootstrap, s.seed))


def _floor_estimates(fl: Optional[dict[str, Any]], s: Settings) -> Estimates:
    floor = Estimates({k: None for k in METRIC_ORDER}, {})
    if fl is not None:
        fkl_groups = [r["kl"] for r in fl["answer"]]
        ftop_groups = [r["top1"].astype(np.float64) for r in fl["answer"]]
        fkl = np.concatenate(fkl_groups) if fkl_groups else np.zeros(0)
        floor.values.update(kl_summary(fkl))
        floor.values["top1"] = float(np.concatenate(ftop_groups).mean()) if ftop_groups else None
        floor.ci95 = ci_for_all(fkl_groups, ftop_groups, s.bootstrap, s.seed)
    return floor


def _heldout(m: Measured, est: Estimates, floor: Estimates) -> dict[str, Optional[float]]:
    """The held-out perplexities (metrics.json ``perplexity.heldout_*``); sets both ``ppl_delta_pct``."""
    ppl_ref = perplexity(m.ref.ref_heldout_nll) if m.windows else None
    ppl_cand = perplexity(m.cand_heldout) if m.windows else None
    est.values["ppl_delta_pct"] = (ppl_cand / ppl_ref - 1.0) * 100.0 if m.windows else None
    ppl_floor = None
    if m.floor is not None and m.windows:
        ppl_floor = perplexity(m.floor["heldout_nll"])
        floor.values["ppl_delta_pct"] = (ppl_floor / ppl_ref - 1.0) * 100.0
    return {"heldout_reference": ppl_ref, "heldout_candidate": ppl_cand, "heldout_floor": ppl_floor}


def _greedy(m: Measured, tok: Any, s: Settings, est: Estimates, floor: Estimates) -> list[dict[str, Any]]:
    """The per-prompt greedy rows (metrics.json ``greedy``); sets both ``greedy_same``."""
    if s.greedy_new_tokens <= 0:
        est.values["greedy_same"] = None
        return []
    fl = m.floor
    with_floor = fl is not None and bool(fl.get("greedy"))
    rows = []
    for i, e in enumerate(m.encoded):
        r, c = m.ref.ref_greedy[i], m.cand_greedy[i]
        d = compare_generations(r, c)
        row = {"id": e.id, "category": e.category, "same": d is None, "first_divergence": d,
               "reference_tokens": len(r), "candidate_tokens": len(c),
               "reference_text": tok.decode(r, skip_special_tokens=False),
               "candidate_text": tok.decode(c, skip_special_tokens=False)}
        if with_floor:
            fd = compare_generations(r, fl["greedy"][i])
            row["floor_same"] = fd is None
            row["floor_first_divergence"] = fd
        rows.append(row)
    same = [row["same"] for row in rows]
    est.values["greedy_same"] = float(np.mean(same)) if same else float("nan")
    est.ci95["greedy_same"] = _same_ci(same, s)
    if with_floor:
        fsame = [row["floor_same"] for row in rows]
        floor.values["greedy_same"] = float(np.mean(fsame))
        floor.ci95["greedy_same"] = _same_ci(fsame, s)
    return rows


def _metric_rows(est: Estimates, floor: Estimates, thresholds: GateThresholds) -> dict[str, dict[str, Any]]:
    """The overall rows, not judged yet (``judge_metrics`` sets passed and reason)."""
    rows: dict[str, dict[str, Any]] = {}
    for name in METRIC_ORDER:
        thr_field, op = CHECKS.get(name, (None, None))
        thr = getattr(thresholds, thr_field) if thr_field else None
        fv = floor.values.get(name)
        floor_blocks = None
        if thr is not None and fv is not None:
            floor_blocks = (fv > thr) if op == "<=" else (fv < thr)
        rows[name] = {
            "label": METRIC_LABELS[name], "value": est.values.get(name), "ci95": est.ci95.get(name), "noise_floor": fv,
            "noise_floor_ci95": floor.ci95.get(name), "threshold": thr, "op": op, "threshold_field": thr_field,
            "passed": None, "floor_exceeds_threshold": floor_blocks, "reason": "",
        }
    return rows


def _category_row(idx: list[int], g: Groups, greedy_rows: list[dict], fl: Optional[dict], s: Settings) -> dict:
    kl_c = np.concatenate([g.kl[i] for i in idx])
    t_c = np.concatenate([g.top1[i] for i in idx])
    row = {"prompts": len(idx), "tokens": int(kl_c.size), **kl_summary(kl_c), "top1": float(t_c.mean())}
    # 95% intervals per category: the same bootstrap over the category's own prompts (none for one prompt)
    row["ci95"] = ci_for_all([g.kl[i] for i in idx], [g.top1[i] for i in idx], s.bootstrap, s.seed) \
        if len(idx) > 1 else {}
    if greedy_rows:
        row["greedy_same"] = float(np.mean([greedy_rows[i]["same"] for i in idx]))
        if len(idx) > 1 and s.bootstrap > 0:
            row["ci95"]["greedy_same"] = _same_ci([greedy_rows[i]["same"] for i in idx], s)
    if fl is not None:
        fk = np.concatenate([fl["answer"][i]["kl"] for i in idx])
        ft = np.concatenate([fl["answer"][i]["top1"] for i in idx]).astype(np.float64)
        row["floor_kl_mean"] = float(fk.mean())
        row["floor_kl_p99"] = float(np.percentile(fk, 99))
        row["floor_top1"] = float(ft.mean())
        if greedy_rows and "floor_same" in greedy_rows[0]:
            row["floor_greedy_same"] = float(np.mean([greedy_rows[i]["floor_same"] for i in idx]))
    return row


def _per_category(m: Measured, g: Groups, greedy_rows: list[dict], s: Settings) -> dict[str, dict]:
    cats: dict[str, list[int]] = {}
    for i, e in enumerate(m.encoded):
        cats.setdefault(e.category, []).append(i)
    return {c: _category_row(idx, g, greedy_rows, m.floor, s) for c, idx in cats.items()}


def _prompt_segment(m: Measured) -> dict[str, Any]:
    """The user-turn positions (informational)."""
    pkl = np.concatenate([mp.kl for _, mp in m.per_prompt]) if m.per_prompt else np.zeros(0)
    ptop = np.concatenate([mp.top1 for _, mp in m.per_prompt]) if m.per_prompt else np.zeros(0)
    seg = {"tokens": int(pkl.size), **kl_summary(pkl), "top1": float(ptop.mean()) if ptop.size else None}
    fl = m.floor
    if fl is not None and fl["prompt"]:
        fpk = np.concatenate([r["kl"] for r in fl["prompt"]])
        seg["floor_kl_mean"] = float(fpk.mean()) if fpk.size else None
        seg["floor_top1"] = float(np.concatenate([r["top1"] for r in fl["prompt"]]).mean()) if fpk.size else None
    return seg


def _answer_perplexity(m: Measured) -> dict[str, float]:
    """Teacher-forced perplexity of the golden answers."""
    ref_ans = np.concatenate(m.ref.ref_answer_nll) if m.ref.ref_answer_nll else np.zeros(0)
    cand_ans = np.concatenate([ma.cand_nll for ma, _ in m.per_prompt]) if m.per_prompt else np.zeros(0)
    out = {"reference": perplexity(ref_ans), "candidate": perplexity(cand_ans)}
    if m.floor is not None:
        out["floor"] = perplexity(np.concatenate([r["nll"] for r in m.floor["answer"]]))
    return out


def _prompt_rows(m: Measured, greedy_rows: list[dict]) -> list[dict[str, Any]]:
    rows = []
    for i, e in enumerate(m.encoded):
        ma = m.per_prompt[i][0]
        row = {"id": e.id, "category": e.category, "tokens": int(ma.kl.size), "kl_mean": float(ma.kl.mean()),
               "kl_max": float(ma.kl.max()), "top1": float(ma.top1.mean())}
        if m.floor is not None:
            row["floor_kl_mean"] = float(m.floor["answer"][i]["kl"].mean())
        if greedy_rows:
            row["greedy_same"] = greedy_rows[i]["same"]
            row["first_divergence"] = greedy_rows[i]["first_divergence"]
        rows.append(row)
    return rows


def _worst_prompts(m: Measured, prompt_rows: list[dict], greedy_rows: list[dict]) -> list[dict[str, Any]]:
    """The ``WORST_PROMPTS`` prompts of highest answer KL mean, with their text and both generations."""
    worst = sorted(range(len(m.encoded)), key=lambda i: -prompt_rows[i]["kl_mean"])[:WORST_PROMPTS]
    rows = []
    for i in worst:
        w = dict(prompt_rows[i])
        w["prompt"] = m.encoded[i].prompt
        if greedy_rows:
            w["reference_text"] = greedy_rows[i]["reference_text"]
            w["candidate_text"] = greedy_rows[i]["candidate_text"]
        rows.append(w)
    return rows


def _tokens(m: Measured, s: Settings) -> dict[str, int]:
    summ = summarize(m.encoded)
    return {"prompts": summ.prompts, "answer_tokens": summ.answer_tokens, "prompt_tokens": summ.prompt_tokens,
            "total_tokens": summ.total_tokens,
            "heldout_tokens": int(sum(len(w) for w in m.windows)),
            "heldout_predicted_tokens": int(sum(len(w) - 1 for w in m.windows)),
            "heldout_windows": len(m.windows), "heldout_window": s.heldout_window,
            "greedy_new_tokens": s.greedy_new_tokens}


def _method(s: Settings) -> dict[str, str]:
    return {
        "encoding": "tokenizer.apply_chat_template([user, assistant], tokenize=False) then tokenize with "
                    "add_special_tokens=False (template's default system message; no extra BOS)",
        "evaluated": "answer positions: targets are the assistant answer tokens and its closing end-of-turn token",
        "kl": "KL(P_ref || P_cand) per token, nats, FP32 log-softmax",
        "ci": f"percentile bootstrap over prompts, {s.bootstrap} resamples, seed {s.seed}",
        "heldout": "held-out news (gensim lee.cor), raw text without BOS, windows of "
                   f"{s.heldout_window} tokens",
        "greedy": f"greedy decoding from the generation prompt, {s.greedy_new_tokens} new tokens or up to end-of-turn "
                  "(HF models: batches of prompts of similar length, left-padded and masked)",
        "pass_rule": "overall: point estimate vs threshold; per category: misses its bar when its whole 95% "
                     "interval lies past the bar (the point estimate when it has no interval); None = not "
                     "checked; a checked metric not measured fails",
    }


def _per_token(g: Groups, fl: Optional[dict]) -> dict[str, np.ndarray]:
    """per_token.npz: answer-position KL and top-1 of every prompt, pooled, with each token's prompt index."""
    out = {"kl": g.kl_all(), "top1": g.top1_all()}
    if fl is not None:
        out["floor_kl"] = np.concatenate([r["kl"] for r in fl["answer"]]) if fl["answer"] else np.zeros(0)
    out["prompt_index"] = np.concatenate([np.full(k.size, i, dtype=np.int32) for i, k in enumerate(g.kl)]) \
        if g.kl else np.zeros(0, np.int32)
    return out


def assemble(m: Measured, tok: Any, thresholds: GateThresholds, s: Settings,
             golden: Optional[dict] = None) -> tuple[dict, dict]:
    """(metrics.json mapping, per_token arrays) of one gate run, judged against ``thresholds``.

    ``tok``: the tokenizer (``decode`` of the greedy answers); ``golden``: extra ``golden`` keys
    (``set_prompts``, ``prompts_per_category``)."""
    g = Groups([ma.kl for ma, _ in m.per_prompt], [ma.top1.astype(np.float64) for ma, _ in m.per_prompt])
    est, floor = _candidate_estimates(g, s), _floor_estimates(m.floor, s)
    heldout = _heldout(m, est, floor)
    greedy_rows = _greedy(m, tok, s, est, floor)
    prompt_rows = _prompt_rows(m, greedy_rows)
    out = {
        "passed": None,
        "failures": [],
        "metrics": _metric_rows(est, floor, thresholds),
        "thresholds": as_bar(thresholds).thresholds().model_dump(mode="json"),
        "tokens": _tokens(m, s),
        "perplexity": {**heldout, "golden_answers": _answer_perplexity(m)},
        "per_category": _per_category(m, g, greedy_rows, s),
        "prompt_segment": _prompt_segment(m),
        "prompts": prompt_rows,
        "greedy": greedy_rows,
        "worst_prompts": _worst_prompts(m, prompt_rows, greedy_rows),
        "noise_floor": {"measured": m.floor is not None,
                        "how": "same HF folder loaded in torch.bfloat16 (weights and compute)"},
        "method": _method(s),
    }
    out["golden"] = {"prompts": len(m.encoded), **(golden or {})}
    out.update(judge_metrics(out, thresholds))
    return out, _per_token(g, m.floor)


__all__ = ["WORST_PROMPTS", "Settings", "Measured", "assemble"]
