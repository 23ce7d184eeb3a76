"""The gate's aggregation per golden-set category and its verdict, on hand-made numbers (issue 26: the
per-category code was not covered by mutation testing).

Three prompts: ``a0`` and ``a1`` in category ``facts``, ``b0`` alone in ``code``; per-token KL, top-1, NLLs, greedy
tokens and the BF16 floor's numbers chosen so that every expected value below is worked out by hand (or by
numpy on the same few values). ``gate.assemble.assemble`` is the gate's aggregation step (the one that ``run_gate``
calls).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from precision_pipeline.gate.assemble import Measured, Settings
from precision_pipeline.gate.assemble import assemble as assemble_metrics
from precision_pipeline.gate.metrics import TokenMetrics
from precision_pipeline.gate.reference import ReferenceData
from precision_pipeline.gate.verdict import judge_metrics, rejudge, verdict_failures, verdict_reasons
from precision_pipeline.gate.golden import EncodedPrompt
from precision_pipeline.spec.profile import GateBar, GateThresholds
from tests.gate.test_report import _Tok

T, F = True, False
# id: (category, answer KL, answer top-1, reference NLL, candidate NLL, prompt-segment KL, prompt top-1, candidate greedy)
PROMPTS = {
    "a0": ("facts", [0.1, 0.3], [T, F], [1.0, 1.0], [1.2, 1.4], [0.0, 0.02], [T, T], [5, 6, 7]),
    "a1": ("facts", [0.2, 0.2, 0.5], [T, T, F], [1.0, 1.0, 1.0], [1.1, 1.1, 1.1], [0.01, 0.01], [T, F], [5, 9, 7]),
    "b0": ("code", [1.0], [F], [2.0], [3.0], [0.04, 0.0], [T, T], [5, 6, 7]),
}
REF_GREEDY = [5, 6, 7]
# the BF16 floor per prompt: answer KL, answer top-1, answer NLL, greedy
FLOOR = {"a0": ([0.01, 0.03], [T, T], [1.0, 1.0], [5, 6, 7]),
         "a1": ([0.0, 0.0, 0.02], [T, T, F], [1.0, 1.0, 1.0], [5, 6, 7]),
         "b0": ([0.1], [T], [2.0], [5, 6, 8])}


def assemble(bar: GateThresholds, bootstrap: int = 200, floor: bool = True, greedy_new_tokens: int = 3) -> dict:
    encoded, per_prompt, cand_greedy = [], [], []
    for pid, (cat, kl, top1, rnll, cnll, pkl, ptop, greedy) in PROMPTS.items():
        n_user, n_ans = len(pkl), len(kl)
        ids = list(range(1, 2 + n_user + n_ans + 1))
        encoded.append(EncodedPrompt(pid, cat, f"prompt {pid}", "answer", ids, 2, 2 + n_user, 2 + n_user + n_ans))
        per_prompt.append((TokenMetrics(np.array(kl), np.array(top1), np.array(rnll), np.array(cnll)),
                           TokenMetrics(np.array(pkl), np.array(ptop), np.full(n_user, np.nan), np.full(n_user, np.nan))))
        cand_greedy.append(greedy)
    fl = None
    if floor:
        fl = {"answer": [{"kl": np.array(k), "top1": np.array(t), "nll": np.array(n)} for k, t, n, _ in FLOOR.values()],
              "prompt": [{"kl": np.array([0.001, 0.003]), "top1": np.array([T, T])} for _ in FLOOR],
              "greedy": [g for *_, g in FLOOR.values()], "heldout_nll": np.full(10, 2.05)}
    ref = ReferenceData(hidden=[], ref_greedy=[REF_GREEDY] * 3, ref_heldout_nll=np.full(10, 2.0),
                        ref_answer_nll=[np.array(p[3]) for p in PROMPTS.values()], floor=fl, seconds={})
    out, _ = assemble_metrics(Measured(encoded, per_prompt, ref, cand_greedy, np.full(10, 2.1), [list(range(10))]), _Tok(),
                              bar, Settings(bootstrap=bootstrap, seed=0, greedy_new_tokens=greedy_new_tokens, heldout_window=10))
    return out


@pytest.fixture(scope="module")
def m():
    return assemble(GateBar(kl_mean_max=1.0))


def test_per_category_rows(m):
    a, b = m["per_category"]["facts"], m["per_category"]["code"]
    assert list(m["per_category"]) == ["facts", "code"]
    kl_a = [0.1, 0.3, 0.2, 0.2, 0.5]
    assert (a["prompts"], a["tokens"], b["prompts"], b["tokens"]) == (2, 5, 1, 1)
    assert a["kl_mean"] == pytest.approx(0.26, abs=1e-12) and a["kl_max"] == 0.5
    assert a["kl_p95"] == pytest.approx(np.percentile(kl_a, 95), abs=1e-12)
    assert a["kl_p99"] == pytest.approx(np.percentile(kl_a, 99), abs=1e-12) == pytest.approx(0.492, abs=1e-12)
    assert (a["top1"], a["greedy_same"]) == (0.6, 0.5)
    assert (b["kl_mean"], b["kl_p99"], b["kl_max"], b["top1"], b["greedy_same"]) == (1.0, 1.0, 1.0, 0.0, 1.0)
    # the floor per category: the same prompts' BF16 numbers
    assert a["floor_kl_mean"] == pytest.approx(0.012, abs=1e-12)
    assert a["floor_kl_p99"] == pytest.approx(np.percentile([0.01, 0.03, 0.0, 0.0, 0.02], 99), abs=1e-12)
    assert (a["floor_top1"], a["floor_greedy_same"]) == (0.8, 1.0)
    assert (b["floor_kl_mean"], b["floor_top1"], b["floor_greedy_same"]) == (0.1, 1.0, 0.0)


def test_per_category_intervals(m):
    """An interval per metric for a category of two or more prompts (greedy_same too), none for one prompt."""
    a, b = m["per_category"]["facts"], m["per_category"]["code"]
    assert b["ci95"] == {}
    assert sorted(a["ci95"]) == ["greedy_same", "kl_max", "kl_mean", "kl_p95", "kl_p99", "top1"]
    # resampling two prompts: both a0 (KL mean 0.2), both a1 (0.3) or one of each (0.26)
    lo, hi = a["ci95"]["kl_mean"]
    assert lo == pytest.approx(0.2, abs=1e-12) and hi == pytest.approx(0.3, abs=1e-12)
    assert a["ci95"]["greedy_same"] == [0.0, 1.0]
    no_boot = assemble(GateBar(kl_mean_max=1.0), bootstrap=0)["per_category"]["facts"]
    assert "greedy_same" not in no_boot["ci95"] and no_boot["greedy_same"] == 0.5
    one_boot = assemble(GateBar(kl_mean_max=1.0), bootstrap=1)["per_category"]["facts"]  # one resample is an interval
    assert sorted(one_boot["ci95"]) == sorted(a["ci95"])
    no_greedy = assemble(GateBar(kl_mean_max=1.0), greedy_new_tokens=0)
    assert "greedy_same" not in no_greedy["per_category"]["facts"] and no_greedy["metrics"]["greedy_same"]["value"] is None
    assert no_greedy["greedy"] == []
    one_token = assemble(GateBar(kl_mean_max=1.0), greedy_new_tokens=1)  # one greedy token is still measured: a0, b0 same
    assert one_token["metrics"]["greedy_same"]["value"] == pytest.approx(2 / 3, abs=1e-12) and len(one_token["greedy"]) == 3


def test_no_prompts_measure_nothing_and_fail():
    """No golden prompt: the answer metrics are NaN (not a KL of 0 over a stand-in position), so a KL bar fails."""
    ref = ReferenceData(hidden=[], ref_greedy=[], ref_heldout_nll=np.full(10, 2.0), ref_answer_nll=[], floor=None, seconds={})
    out, _ = assemble_metrics(Measured([], [], ref, [], np.full(10, 2.1), [list(range(10))]), _Tok(), GateBar(kl_mean_max=1.0),
                              Settings(bootstrap=200, seed=0, greedy_new_tokens=3, heldout_window=10))
    assert all(math.isnan(out["metrics"][k]["value"]) for k in ("kl_mean", "kl_p95", "kl_p99", "kl_max", "top1", "greedy_same"))
    assert (out["passed"], out["failures"], out["metrics"]["kl_mean"]["reason"]) == (
        False, ["kl_mean"], "kl_mean: not measured (threshold <= 1.0)")
    assert (out["per_category"], out["greedy"]) == ({}, [])


def test_overall_values_floor_and_perplexities(m):
    v = {k: r["value"] for k, r in m["metrics"].items()}
    assert v["kl_mean"] == pytest.approx(2.3 / 6, abs=1e-12) and v["kl_max"] == 1.0
    assert v["kl_p99"] == pytest.approx(np.percentile([0.1, 0.3, 0.2, 0.2, 0.5, 1.0], 99), abs=1e-12)
    assert v["top1"] == 0.5 and v["greedy_same"] == pytest.approx(2 / 3, abs=1e-12)
    assert v["ppl_delta_pct"] == pytest.approx((math.exp(0.1) - 1) * 100, abs=1e-9)
    fl = {k: r["noise_floor"] for k, r in m["metrics"].items()}
    assert fl["kl_mean"] == pytest.approx(0.16 / 6, abs=1e-12) and fl["top1"] == pytest.approx(5 / 6, abs=1e-12)
    assert fl["ppl_delta_pct"] == pytest.approx((math.exp(0.05) - 1) * 100, abs=1e-9)
    assert fl["greedy_same"] == pytest.approx(2 / 3, abs=1e-12)
    p = m["perplexity"]
    assert (p["heldout_reference"], p["heldout_candidate"]) == (pytest.approx(math.exp(2.0)), pytest.approx(math.exp(2.1)))
    assert p["heldout_floor"] == pytest.approx(math.exp(2.05))
    ga = p["golden_answers"]
    assert ga["reference"] == pytest.approx(math.exp(7 / 6)) and ga["floor"] == pytest.approx(math.exp(7 / 6))
    assert ga["candidate"] == pytest.approx(math.exp((1.2 + 1.4 + 3.3 + 3.0) / 6))
    seg = m["prompt_segment"]
    assert seg["tokens"] == 6 and seg["kl_mean"] == pytest.approx(0.08 / 6, abs=1e-12) and seg["kl_max"] == 0.04
    assert seg["top1"] == pytest.approx(5 / 6, abs=1e-12)
    assert seg["floor_kl_mean"] == pytest.approx(0.002, abs=1e-12) and seg["floor_top1"] == 1.0
    t = m["tokens"]
    assert (t["prompts"], t["answer_tokens"], t["prompt_tokens"], t["heldout_tokens"], t["heldout_predicted_tokens"],
            t["heldout_windows"], t["heldout_window"], t["greedy_new_tokens"]) == (3, 6, 6, 10, 9, 1, 10, 3)


def test_floor_exceeds_threshold_both_ways():
    r = assemble(GateBar(kl_mean_max=0.02, top1_min=0.9))["metrics"]
    assert (r["kl_mean"]["floor_exceeds_threshold"], r["top1"]["floor_exceeds_threshold"]) == (True, True)
    r = assemble(GateBar(kl_mean_max=0.03, top1_min=0.8))["metrics"]
    assert (r["kl_mean"]["floor_exceeds_threshold"], r["top1"]["floor_exceeds_threshold"]) == (False, False)
    assert r["kl_p99"]["floor_exceeds_threshold"] is None  # no threshold
    r = assemble(GateBar(kl_mean_max=0.02), floor=False)
    assert r["metrics"]["kl_mean"]["noise_floor"] is None and r["metrics"]["kl_mean"]["floor_exceeds_threshold"] is None
    assert "floor_kl_mean" not in r["per_category"]["facts"] and r["perplexity"]["heldout_floor"] is None


def test_prompt_rows_greedy_rows_and_worst_prompts(m):
    rows = {r["id"]: r for r in m["prompts"]}
    assert rows["a0"] == {"id": "a0", "category": "facts", "tokens": 2, "kl_mean": pytest.approx(0.2), "kl_max": 0.3,
                          "top1": 0.5, "floor_kl_mean": pytest.approx(0.02), "greedy_same": True, "first_divergence": None}
    assert (rows["a1"]["greedy_same"], rows["a1"]["first_divergence"]) == (False, 1)
    g = {r["id"]: r for r in m["greedy"]}
    assert g["a1"]["reference_text"] == "t5 t6 t7" and g["a1"]["candidate_text"] == "t5 t9 t7"
    assert (g["b0"]["floor_same"], g["b0"]["floor_first_divergence"]) == (False, 2)
    assert [w["id"] for w in m["worst_prompts"]] == ["b0", "a1", "a0"]  # highest KL mean first
    assert m["worst_prompts"][0]["prompt"] == "prompt b0" and m["worst_prompts"][1]["candidate_text"] == "t5 t9 t7"


# -- the verdict per category (judge_metrics)


def test_a_category_is_judged_on_the_edge_of_its_interval(m):
    """KL mean (a max): the category misses only when its interval's LOWER end is past the bar; top-1 (a min):
    only when its UPPER end is. Each exactly at the bar still meets it."""
    lo, hi = m["per_category"]["facts"]["ci95"]["kl_mean"]
    t_lo, t_hi = m["per_category"]["facts"]["ci95"]["top1"]

    def verdict(**bar):
        return judge_metrics(m, GateBar(categories={"facts": GateThresholds(**bar)}))

    assert verdict(kl_mean_max=lo)["passed"] is True
    v = verdict(kl_mean_max=np.nextafter(lo, 0))
    assert v["passed"] is False and verdict_failures(v) == ["category facts: kl_mean"]
    assert (t_lo, t_hi) == (0.5, pytest.approx(2 / 3, abs=1e-12))  # a0 twice, a1 twice
    assert verdict(top1_min=t_hi)["passed"] is True
    v = verdict(top1_min=np.nextafter(t_hi, 1))
    assert verdict_failures(v) == ["category facts: top1"]
    c = v["categories_judged"]["facts"]
    assert c["passed"] is False and c["checks"]["top1"]["judged_by"] == "interval"
    assert v["categories_judged"]["code"] == {"passed": True, "checks": {}, "bar": {}}  # no bar for code


def test_one_prompt_is_never_judged_and_no_check_is_a_pass(m):
    v = judge_metrics(m, GateBar(kl_mean_max=0.5, top1_min=0.5))
    b = v["categories_judged"]["code"]
    assert b["passed"] is None and {c["passed"] for c in b["checks"].values()} == {None}
    assert b["checks"]["kl_mean"]["reason"] == "category code: kl_mean not judged (one prompt gives no interval)"
    assert v["categories_judged"]["facts"]["passed"] is True
    # no category metric has a bar (only the held-out perplexity): each category passes with no checks
    v = judge_metrics(m, GateBar(ppl_delta_pct_max=50.0))
    assert v["categories_judged"]["facts"] == {"passed": True, "checks": {}, "bar": {}}


def test_a_category_without_an_interval_is_judged_on_its_point_estimate():
    m0 = assemble(GateBar(kl_mean_max=1.0), bootstrap=0)  # no resamples: (nan, nan) intervals
    v = judge_metrics(m0, GateBar(kl_mean_max=0.26))
    assert v["categories_judged"]["facts"]["checks"]["kl_mean"]["judged_by"] == "point estimate"
    assert v["categories_judged"]["facts"]["passed"] is True          # 0.26 <= 0.26
    v = judge_metrics(m0, GateBar(kl_mean_max=0.25))
    [f] = v["category_failures"]
    assert f["reason"] == "category facts: kl_mean = 0.26 misses <= 0.25" and f["judged_by"] == "point estimate"
    v = judge_metrics(m0, GateBar(top1_min=0.6))
    assert v["categories_judged"]["facts"]["passed"] is True          # 0.6 >= 0.6
    assert verdict_failures(judge_metrics(m0, GateBar(categories={"facts": GateThresholds(top1_min=0.61)}))) == [
        "category facts: top1"]


def test_a_category_metric_not_measured_fails():
    m1 = assemble(GateBar(kl_mean_max=1.0))
    m1["per_category"]["facts"]["kl_mean"] = float("nan")
    v = judge_metrics(m1, GateBar(kl_mean_max=1.0))
    [f] = v["category_failures"]
    assert (f["category"], f["judged_by"], f["reason"]) == ("facts", "not measured", "category facts: kl_mean = not measured misses <= 1")
    # an overall metric measured as NaN (or missing) fails with "not measured", never a formatted NaN
    m1["metrics"]["kl_mean"]["value"] = float("nan")
    v = judge_metrics(m1, GateBar(kl_mean_max=1.0))
    assert (v["failures"], v["metrics"]["kl_mean"]["reason"]) == (["kl_mean"], "kl_mean: not measured (threshold <= 1.0)")


def test_overall_failures_and_reasons_in_order(m):
    v = judge_metrics(m, GateBar(kl_mean_max=0.3, top1_min=0.7, categories={"facts": GateThresholds(kl_mean_max=0.1)}))
    assert v["failures"] == ["kl_mean", "top1"] and v["passed"] is False
    # the overall top-1 bar holds for each category too: facts' interval [0.5, 0.667] lies below 0.7
    assert verdict_failures(v) == ["kl_mean", "top1", "category facts: kl_mean", "category facts: top1"]
    assert verdict_reasons(v) == ("kl_mean = 0.3833 (outside <= 0.3); top1 = 0.5 (outside >= 0.7); category facts: kl_mean = "
                                  "0.26 [0.2, 0.3] misses <= 0.1 (whole interval past the bar); category facts: top1 = 0.6 "
                                  "[0.5, 0.6667] misses >= 0.7 (whole interval past the bar)")
    rows = v["metrics"]
    assert (rows["kl_mean"]["passed"], rows["kl_p99"]["passed"], rows["kl_p99"]["reason"]) == (False, None, "kl_p99: not checked")
    ok = judge_metrics(m, GateBar(kl_mean_max=2.3 / 6, top1_min=0.5))  # each exactly at its bar: passes
    assert ok["passed"] is True and ok["failures"] == []
    assert verdict_failures({}) == [] and verdict_reasons({}) == ""


def test_promotable_needs_the_whole_golden_set_or_min_prompts(m):
    v = judge_metrics(m, GateBar(kl_mean_max=1.0))  # 3 prompts of a 65-prompt golden set
    assert v["promotable"] is False and "the verdict covers 3 golden prompt(s), fewer than the whole golden set" in v["not_promotable"]
    v = judge_metrics(m, GateBar(kl_mean_max=1.0, min_prompts=3))
    assert (v["promotable"], v["not_promotable"]) == (True, "")
    v = judge_metrics(m, GateBar(kl_mean_max=1.0, min_prompts=4))
    assert v["promotable"] is False and v["not_promotable"].startswith("the verdict covers 3 golden prompt(s), fewer than "
                                                                        "gate.min_prompts 4: ")
    m2 = {**m, "golden": {"set_prompts": 3, "prompts_per_category": 1}}
    assert judge_metrics(m2, GateBar(kl_mean_max=1.0))["promotable"] is True
    m2 = {**m, "golden": {"set_prompts": 4, "prompts_per_category": 1}}
    assert "(--golden-limit 1): it is a quick check" in judge_metrics(m2, GateBar(kl_mean_max=1.0))["not_promotable"]


def test_rejudge_keeps_the_numbers_and_sets_floor_flags(m):
    r = rejudge(m, GateThresholds(kl_mean_max=0.02))
    assert r["metrics"]["kl_mean"]["value"] == m["metrics"]["kl_mean"]["value"] and r["passed"] is False
    assert r["metrics"]["kl_mean"]["floor_exceeds_threshold"] is True     # floor 0.0267 > 0.02
    assert r["metrics"]["kl_p99"]["floor_exceeds_threshold"] is None      # no threshold
    assert rejudge(m, GateThresholds(top1_min=0.9))["metrics"]["top1"]["floor_exceeds_threshold"] is True   # 0.833 < 0.9
    assert rejudge(m, GateThresholds(top1_min=0.8))["metrics"]["top1"]["floor_exceeds_threshold"] is False
    assert r["thresholds"]["kl_mean_max"] == 0.02 and m["metrics"]["kl_mean"]["threshold"] == 1.0  # a new dict


def test_no_prompts_give_no_answer_perplexity():
    from precision_pipeline.gate.assemble import Measured, _answer_perplexity
    from precision_pipeline.gate.reference import ReferenceData

    ref = ReferenceData(hidden=[], ref_greedy=[], ref_heldout_nll=np.zeros(0), ref_answer_nll=[], floor=None, seconds={})
    out = _answer_perplexity(Measured([], [], ref, [], np.zeros(0), []))
    assert set(out) == {"reference", "candidate"} and np.isnan(out["reference"]) and np.isnan(out["candidate"])


def test_greedy_texts_keep_special_tokens():
    """The greedy rows' texts show the special tokens (an answer that ends with <|im_end|> says so)."""
    import types

    calls = []

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(skip_special_tokens)
            return "x" if skip_special_tokens else "x<|im_end|>"

    m = assemble(GateBar(kl_mean_max=1.0))
    assert all(r["reference_text"].startswith("t") for r in m["greedy"])  # _Tok: "t<id> ..."
    from precision_pipeline.gate import assemble as A

    est = A.Estimates({}, {})
    enc = [EncodedPrompt("p", "facts", "q", "a", [1, 2, 3], 1, 2, 3)]
    ref = types.SimpleNamespace(ref_greedy=[[5, 6]])
    meas = types.SimpleNamespace(encoded=enc, ref=ref, cand_greedy=[[5, 6]], floor=None)
    settings = types.SimpleNamespace(greedy_new_tokens=2, bootstrap=0, seed=0)
    rows = A._greedy(meas, Tok(), settings, est, A.Estimates({}, {}))
    assert (rows[0]["reference_text"], rows[0]["candidate_text"]) == ("x<|im_end|>", "x<|im_end|>") and calls == [False, False]
