"""invoke recommend / compare (analysis/choose.py): choices and reasons on h100, a100 and l4, the
written profile, measured numbers over priors, the Pareto frontier, the chart page in a browser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from precision_pipeline.analysis import accuracy as A
from precision_pipeline.analysis import candidate as CD
from precision_pipeline.analysis import choose as C
from precision_pipeline.analysis import compare_report as R
from precision_pipeline.resolve import perf as PF
from precision_pipeline.resolve.plan import evaluate
from precision_pipeline.spec.profile import load_profile, shipped_profiles

NOWHERE = Path("/nonexistent-artifacts")


def by_label(rec: C.Recommendation) -> dict[str, CD.Candidate]:
    return {c.label: c for c in rec.candidates}


def rules_of(c: CD.Candidate) -> set[str]:
    return {r["rule"] for r in c.refused}


@pytest.fixture(scope="module")
def h100(default_model_dir):
    return C.recommend("h100", default_model_dir, NOWHERE, C.Constraints(max_kl_p99=0.5, max_gpus=1))


def test_h100_picks_fp8_and_says_why_the_others_lose(h100):
    assert h100.best.label == "fp8/kv-fp8/tp1/fb-same-gpus" and h100.best.base == "fp8-h100"
    c = by_label(h100)
    awq = c["int4-awq/kv-bf16/tp1"]  # int4-awq-a100 names no fallback: no placement suffix
    assert [v["constraint"] for v in awq.violations] == ["max_kl_p99"]
    assert awq.violations[0]["by"] == pytest.approx(2.517 - 0.5) and awq.accuracy.kind == "prior"
    assert c["int8-wo/kv-bf16/tp1"].violations[0]["value"] is None  # no prior: unknown accuracy
    assert "format.gemm_sm" in rules_of(c["nvfp4/kv-fp8/tp1/fb-none"])
    assert "format.kv_sm" in rules_of(c["fp8/kv-nvfp4/tp1/fb-none"])
    assert "layout.attention_heads" in rules_of(c["fp8/kv-fp8/tp2/fb-none"])  # 9 heads do not split over 2 GPUs
    assert "quantize.modelopt_inputs" in rules_of(c["bf16/kv-int8/tp1"])
    assert c["bf16/kv-bf16/tp1"].ok
    assert h100.feasible[0] is h100.best
    # the tiny model's KV cache holds max_batch_size 2,048 sequences either way: the warm fallback on the same GPU
    # costs no throughput and wins the tie with the cold one (instant rollback); its own replica halves tokens/GPU;
    # BF16 meets the KL bound but streams twice the bytes: below FP8
    assert [x.label for x in h100.feasible] == ["fp8/kv-fp8/tp1/fb-same-gpus", "fp8/kv-fp8/tp1/fb-none", "bf16/kv-bf16/tp1",
                                                "fp8/kv-fp8/tp1/fb-own-replica"]
    own = c["fp8/kv-fp8/tp1/fb-own-replica"]
    assert own.perf["deployment_gpus"] == 2 and CD.tokens_per_gpu(own) == pytest.approx(CD.tokens_per_gpu(h100.best) / 2, abs=0.1)
    assert c["fp8/kv-fp8/tp1/fb-none"].fallback["rollback_s"] > 0 == h100.best.fallback["rollback_s"]
    assert CD.tokens_per_gpu(h100.best) > CD.tokens_per_gpu(c["bf16/kv-bf16/tp1"])
    assert h100.best.estimate["context_tokens"] == C.DEFAULT_CONTEXT
    assert h100.best.perf["batch"] == h100.best.profile.build.max_batch_size == C.RUNTIME_MAX_BATCH  # sized by the runtime


def test_a100_has_no_fp8_so_bf16_wins_under_a_tight_bound(default_model_dir):
    rec = C.recommend("a100", default_model_dir, NOWHERE, C.Constraints(max_kl_p99=0.5, max_gpus=1))
    assert rec.best.label == "bf16/kv-bf16/tp1"
    c = by_label(rec)
    assert "format.gemm_sm" in rules_of(c["fp8/kv-fp8/tp1/fb-none"])
    assert "format.gemm_sm" in rules_of(c["w4a8-awq/kv-bf16/tp1"])
    # an FP8 KV cache on BF16 GEMMs runs on SM 80, but no build or prior measured it
    assert c["bf16/kv-fp8/tp1"].accuracy.kind == "unknown"
    assert c["bf16/kv-fp8/tp1"].overrides["context_phase"]["use_paged_context_fmha"] is False


def test_l4_loose_bound_and_infeasible_concurrency(default_model_dir):
    rec = C.recommend("l4", default_model_dir, NOWHERE, C.Constraints(max_kl_p99=3.0, max_gpus=1))
    # on a 24 GB card the warm BF16 fallback takes KV memory (a smaller batch): the cold one wins; FP8 GEMMs beat
    # the mixed FP8/INT4 profile, whose INT4 layers pay for dequantization
    assert rec.best.label == "fp8/kv-fp8/tp1/fb-none"
    same = by_label(rec)["fp8/kv-fp8/tp1/fb-same-gpus"]
    assert same.ok and same.perf["batch"] < rec.best.perf["batch"] and CD.tokens_per_gpu(same) < CD.tokens_per_gpu(rec.best)
    assert by_label(rec)["int4-awq/kv-bf16/tp1"].ok and by_label(rec)["mixed/kv-fp8/tp1/fb-none"].ok
    none = C.recommend("l4", default_model_dir, NOWHERE, C.Constraints(min_concurrency=100_000))
    assert none.best is None and not none.feasible
    runnable = [c for c in none.candidates if not c.refused]
    assert runnable
    for c in runnable:
        (v,) = c.violations
        assert v["constraint"] == "min_concurrency"
        assert v["by"] == 100_000 - c.estimate["kv_concurrency_at_context"] > 0
    assert by_label(none)["fp8/kv-fp8/tp1/fb-none"].profile.build.max_batch_size == 65536  # raised, capped by the schema


def test_h100_infeasible_kl_and_gpu_count(default_model_dir):
    rec = C.recommend("h100", default_model_dir, NOWHERE, C.Constraints(max_kl_p99=0.0001, max_gpus=1))
    assert rec.best.label == "bf16/kv-bf16/tp1"  # the measured-equal-to-reference prior
    rec = C.recommend("h100", default_model_dir, NOWHERE, C.Constraints(max_kl_p99=0.5, min_concurrency=2000),
                      context=4096)
    assert rec.best is None
    fp8 = by_label(rec)["fp8/kv-fp8/tp1/fb-none"]
    assert [v["constraint"] for v in fp8.violations] == ["min_concurrency"]
    assert fp8.violations[0]["value"] == fp8.plan.memory.kv_tokens_capacity // 4096


def test_measured_build_beats_the_prior(tmp_path, default_model_dir):
    base = evaluate(load_profile("fp8-h100"), default_model_dir)
    out = tmp_path / "fp8-h100"
    (out / "gate").mkdir(parents=True)
    (out / "plan.json").write_text(json.dumps(base.to_json()))
    (out / "gate" / "metrics.json").write_text(json.dumps(
        {"metrics": {"kl_p99": {"value": 0.9}, "kl_mean": {"value": 0.1}, "top1": {"value": 0.8}}}))
    rec = C.recommend("h100", default_model_dir, tmp_path, C.Constraints(max_kl_p99=0.5, max_gpus=1))
    fp8 = by_label(rec)["fp8/kv-fp8/tp1/fb-none"]
    # the build's max_seq_len differs (8192 vs the candidate's 4096) but the gate does not read it
    assert fp8.accuracy.kind == "measured" and fp8.accuracy.kl_p99 == 0.9 and str(out) in fp8.accuracy.source
    assert fp8.violations[0]["by"] == pytest.approx(0.4)
    assert rec.best.label == "bf16/kv-bf16/tp1"


def test_written_profile_is_accepted_by_the_strict_loader(tmp_path, h100, default_model_dir):
    path = C.write_profile(h100.best, tmp_path / "rec.yaml", command="--gpu h100")
    text = path.read_text()
    assert text.startswith("# Written by `invoke recommend` (--gpu h100)") and "extends: fp8-h100" in text
    p = load_profile(str(path))
    q = p.quantization
    assert (p.target.gpu, q.quant_algo.value, q.kv_cache_quant_algo.value, p.parallel.tp_size, p.build.max_seq_len) == \
        ("h100-sxm", "FP8", "FP8", 1, C.DEFAULT_CONTEXT)
    assert (p.deployment.fallback, p.deployment.warm_fallback) == ("bf16-h100", True)
    assert "# Fallback: bf16-h100 at tp 1, warm on the replica's own GPUs" in text
    plan = evaluate(p, default_model_dir, for_build=True)
    assert plan.ok and plan.estimate["decode_tokens_per_s_per_gpu"] == h100.best.estimate["decode_tokens_per_s_per_gpu"]


def test_context_kernel_fix_keeps_the_profile_buildable(tmp_path, default_model_dir):
    rec = C.recommend("l4", default_model_dir, NOWHERE, C.Constraints(max_kl_p99=3.0, max_gpus=1))
    awq = by_label(rec)["int4-awq/kv-fp8/tp1"]  # BF16-activation GEMMs + FP8 KV: builder turns paged FMHA off
    assert awq.overrides["context_phase"] == {"use_paged_context_fmha": False, "enable_chunked_context": False}
    assert awq.overrides["runtime"] == {"enable_kv_cache_reuse": False}
    p = load_profile(str(C.write_profile(awq, tmp_path / "awq.yaml")))
    assert evaluate(p, default_model_dir).ok


def test_compare_all_shipped_and_on_another_gpu(default_model_dir, tmp_path):
    names = shipped_profiles()
    own = C.compare(names, default_model_dir, NOWHERE)
    assert [c.label for c in own] == names and all(not c.refused for c in own)
    on_a100 = {c.label: c for c in C.compare(names, default_model_dir, NOWHERE, gpu="a100")}
    assert "format.gemm_sm" in rules_of(on_a100["fp8-h100@a100-80gb"])
    assert "format.gemm_sm" in rules_of(on_a100["nvfp4-b200@a100-80gb"])
    assert not on_a100["int4-awq-a100@a100-80gb"].refused
    rows = {r["profile"]: r for r in R.table_rows(list(on_a100.values()))}
    assert rows["fp8-h100@a100-80gb"]["runs"] is False and "format.gemm_sm" in rows["fp8-h100@a100-80gb"]["refused"]
    paths = R.write_compare(list(on_a100.values()), tmp_path)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(paths["json"].read_text())
    assert {r["profile"] for r in data["rows"]} == set(on_a100)


def _fake(label: str, tps: float, kl):
    c = CD.Candidate(label, "x", {})
    c.perf = {"deployed_tokens_per_s_per_gpu": tps}
    c.accuracy = A.Accuracy("prior", kl_p99=kl)
    return c


def test_pareto_frontier():
    a, b, d, e = _fake("a", 100, 0.0), _fake("b", 200, 0.5), _fake("d", 150, 0.6), _fake("e", 300, None)
    same = _fake("b2", 200, 0.5)
    front = CD.pareto([a, b, d, e, same])
    assert [c.label for c in front] == ["a", "b", "b2"]  # d is beaten by b on both axes; e has no KL


def test_compare_page_in_a_browser(default_model_dir, tmp_path):
    from tests.gate.test_report_dom import CHROMIUM, CHROMIUM_ARGS

    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} is not installed")
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    cands = C.compare(["fp8-h100", "bf16-h100", "nvfp4-b200", "int4-awq-a100"], default_model_dir, NOWHERE, gpu="h100")
    html_path = R.write_compare(cands, tmp_path)["html"]
    front = {c.label for c in CD.pareto(cands)}
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=60_000)
        try:
            page = b.new_page()
            page.goto(html_path.resolve().as_uri(), wait_until="load")
            ok = page.evaluate("() => Promise.all(Array.from(document.images).map(i => i.decode().then(() => true, () => false)))")
            facts = page.evaluate("""() => ({
              rows: Array.from(document.querySelectorAll('table#compare tbody tr')).map(tr => ({
                profile: tr.dataset.profile, frontier: tr.classList.contains('frontier'),
                kl: tr.querySelector('td.kl_p99').textContent})),
              refused: Array.from(document.querySelectorAll('ul#refused li')).map(li => li.textContent),
              img: Array.from(document.images).map(i => [i.naturalWidth, i.naturalHeight])})""")
        finally:
            b.close()
    assert ok == [True] and facts["img"] == [[850, 520]]
    assert {r["profile"] for r in facts["rows"]} == {"fp8-h100@h100-sxm", "bf16-h100@h100-sxm", "int4-awq-a100@h100-sxm"}
    assert {r["profile"] for r in facts["rows"] if r["frontier"]} == front
    assert {r["profile"]: r["kl"] for r in facts["rows"]}["fp8-h100@h100-sxm"] == "0.424"
    (refused,) = facts["refused"]
    assert refused.startswith("nvfp4-b200@h100-sxm: format.gemm_sm")


def _fake_gate_build(artifacts: Path, model_dir, kl_p99: float, calls: list):
    """A stand-in for ``invoke build`` through the gate (tests only): writes the plan and gate numbers
    where a real build of the profile file would (artifacts/<name>/)."""
    def build(path: Path):
        p = load_profile(str(path))
        calls.append(p.name)
        out = artifacts / p.name
        (out / "gate").mkdir(parents=True)
        (out / "plan.json").write_text(json.dumps(evaluate(p, model_dir).to_json()))
        (out / "gate" / "metrics.json").write_text(json.dumps(
            {"metrics": {"kl_p99": {"value": kl_p99}, "kl_mean": {"value": kl_p99 / 8}, "top1": {"value": 0.9}}}))
        return None
    return build


def test_measure_builds_the_top_unmeasured_candidates_and_reranks(tmp_path, default_model_dir):
    arts = tmp_path / "artifacts"
    k = C.Constraints(max_kl_p99=0.5, max_gpus=1)
    one = PF.Workload(1000, 100, concurrency=1)  # one user at a time: bytes per step decide, 4-bit weights help
    rec = C.recommend("h100", default_model_dir, arts, k, workload=one)
    assert rec.best.label == "fp8/kv-fp8/tp1/fb-same-gpus"  # on the priors
    near = sorted((c for c in rec.candidates if not c.refused
                   and all(v["constraint"] == "max_kl_p99" for v in c.violations)), key=C.rank_key)
    faster = [c for c in near if C.rank_key(c) < C.rank_key(rec.best)]
    assert faster and all(c.accuracy.kind != "measured" for c in faster)  # ruled out only by unmeasured accuracy
    calls: list = []
    builds = C.measure_top(rec, 2, arts / "recommend", _fake_gate_build(arts, default_model_dir, 0.1, calls))
    assert [b["label"] for b in builds] == [faster[0].label, faster[1].label] and all(b["reason"] is None for b in builds)
    assert calls == [C.profile_file_stem("h100-sxm", faster[0].label), C.profile_file_stem("h100-sxm", faster[1].label)]
    again = C.recommend("h100", default_model_dir, arts, k, workload=one)
    assert again.best.label == faster[0].label and again.best.accuracy.kind == "measured"
    assert again.best.accuracy.kl_p99 == 0.1 and calls[0] in again.best.accuracy.source
    # measured now: a second --measure builds the next ones, never the same quantization twice
    more = C.measure_top(again, 1, arts / "recommend", _fake_gate_build(arts, default_model_dir, 0.1, calls))
    assert more and more[0]["label"] not in {b["label"] for b in builds}
    with pytest.raises(C.UserError, match="--top"):
        C.measure_top(again, 0, arts, _fake_gate_build(arts, default_model_dir, 0.1, calls))


def test_compare_build_builds_only_the_unmeasured(tmp_path, default_model_dir):
    arts = tmp_path / "artifacts"
    names = ["fp8-h100", "bf16-h100", "fp8-h200"]  # fp8-h200 has the fp8-h100 quantization? only if equal
    cands = C.compare(names, default_model_dir, arts)
    calls: list = []
    C.build_unmeasured(cands, _fake_gate_build(arts, default_model_dir, 0.2, calls))
    q = {n: A.quality_key(load_profile(n)) for n in names}
    expected = [n for i, n in enumerate(names) if q[n] not in [q[m] for m in names[:i]]]
    assert calls == expected
    after = {c.label: c for c in C.compare(names, default_model_dir, arts)}
    assert all(after[n].accuracy.kind == "measured" for n in names)
    assert C.build_unmeasured(list(after.values()), _fake_gate_build(arts, default_model_dir, 0.2, calls)) == []


def test_b200_picks_the_tuned_nvfp4_profile_that_meets_the_bound(default_model_dir, tmp_path):
    """Tuned variants of a format are candidates of their own (``+<profile>``), with their own prior."""
    rec = C.recommend("b200", default_model_dir, NOWHERE, C.Constraints(max_kl_p99=2.0, max_gpus=1))
    c = by_label(rec)
    plain, tuned = c["nvfp4/kv-fp8/tp1/fb-same-gpus"], c["nvfp4/kv-fp8/tp1+nvfp4-b200-smollm2/fb-same-gpus"]
    assert plain.accuracy.kl_p99 == 3.614 and [v["constraint"] for v in plain.violations] == ["max_kl_p99"]
    assert tuned.ok and tuned.accuracy.kind == "prior" and tuned.accuracy.kl_p99 == 1.845
    assert rec.best is tuned and tuned.base == "nvfp4-b200-smollm2"
    # more bytes than the untuned one (44 cells in BF16), fewer than FP8: between them on the decode ceiling
    dec = {k: c[k].estimate["decode_tokens_per_s_per_gpu"] for k in ("nvfp4/kv-fp8/tp1/fb-same-gpus", "fp8/kv-fp8/tp1/fb-same-gpus")}
    assert dec["fp8/kv-fp8/tp1/fb-same-gpus"] < tuned.estimate["decode_tokens_per_s_per_gpu"] < dec["nvfp4/kv-fp8/tp1/fb-same-gpus"]
    assert not any(k.startswith("fp8/kv-fp8/tp1+fp8-h200") for k in c)  # same quantization as fp8-h100: no second candidate
    p = load_profile(str(C.write_profile(tuned, tmp_path / "b200.yaml")))
    assert p.quantization.exclude_modules == load_profile("nvfp4-b200-smollm2").quantization.exclude_modules
    assert C.profile_file_stem("b200", tuned.label) == "rec-b200-nvfp4-kv-fp8-tp1-nvfp4-b200-smollm2-fb-same-gpus"


def test_chart_labels_of_nearby_points_do_not_overlap():
    """Two profiles at (almost) the same point (fp8-h100 / fp8-h200 on one GPU): the second label moves
    up one line with a leader; a far point keeps its plain offset."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.2), dpi=100)
    ax.set_xlim(0, 100), ax.set_ylim(0, 10)
    R._annotate_apart(ax, fig, [((50, 5), "fp8-h100"), ((50.2, 5), "fp8-h200"), ((10, 1), "bf16-h100")])
    ann = {a.get_text(): a for a in ax.texts}
    offs = {k: a.xyann for k, a in ann.items()}
    assert offs["bf16-h100"] == (6.0, 6.0) and offs["fp8-h100"] == (6.0, 6.0)
    assert offs["fp8-h200"][1] >= 6 + 11 - 2  # moved up one line (minus the 0.2 x-offset's pixels)
    assert ann["fp8-h200"].arrow_patch is not None and ann["fp8-h100"].arrow_patch is None
    plt.close(fig)


def _fake_build(root: Path, name: str, plan_json: dict, golden_prompts=None) -> Path:
    out = root / name
    (out / "gate").mkdir(parents=True)
    (out / "plan.json").write_text(json.dumps(plan_json))
    doc = {"metrics": {"kl_p99": {"value": 0.3}, "kl_mean": {"value": 0.03}, "top1": {"value": 0.9}}}
    if golden_prompts is not None:
        doc["golden"] = {"prompts": golden_prompts}
    (out / "gate" / "metrics.json").write_text(json.dumps(doc))
    return out


def test_measured_accuracy_is_keyed_by_model_and_whole_golden_set(tmp_path, default_model_dir):
    """Issue 25 item 14: a SmolLM2 build is not 'measured' for another model, and a --golden-limit build is
    not a measurement."""
    from precision_pipeline.gate.golden import load_golden
    from precision_pipeline.spec.model_arch import read_model_arch

    smol = evaluate(load_profile("fp8-h100"), default_model_dir)
    other = read_model_arch(Path(__file__).resolve().parents[1] / "data" / "models" / "Llama-3.1-8B")
    full = len(load_golden())
    arts = tmp_path / "artifacts"
    _fake_build(arts, "fp8-h100", smol.to_json(), golden_prompts=full)
    prof = load_profile("fp8-h100")
    mine = A.accuracy_of(prof, smol.model, arts)
    assert mine.kind == "measured" and mine.kl_p99 == 0.3
    theirs = A.accuracy_of(prof, other, arts)
    assert theirs.kind == "prior" and "not this model" in theirs.source and theirs.kl_p99 == 0.424
    quick = tmp_path / "quick"
    _fake_build(quick, "fp8-h100", smol.to_json(), golden_prompts=18)
    assert A.accuracy_of(prof, smol.model, quick).kind == "prior"
    _fake_build(quick, "fp8-h100-full", smol.to_json(), golden_prompts=full)
    assert A.accuracy_of(prof, smol.model, quick).kind == "measured"


@pytest.mark.slow
def test_recommend_config_only_70b_picks_fp8_on_h100_and_h200():
    """Issue 30: a config-only Llama-3.1-70B, no accuracy bound: FP8 wins on H100 and H200 (the warm BF16 fallback
    is a placement choice, not 134 GiB on every GPU), and the answer says where the fallback lives."""
    model = Path(__file__).resolve().parents[1] / "data" / "models" / "Llama-3.1-70B"
    for gpu, label, warm_label in (("h100", "fp8/kv-fp8/tp2/fb-none", "fp8/kv-fp8/tp4/fb-same-gpus"),
                                   ("h200", "fp8/kv-fp8/tp1/fb-none", "fp8/kv-fp8/tp2/fb-same-gpus")):
        rec = C.recommend(gpu, model, NOWHERE)
        assert rec.best.profile.quantization.quant_algo.value == "FP8" and rec.best.label == label
        assert C.fallback_text(rec.best).startswith(f"bf16-h100 at tp {rec.best.world_size}, not loaded")
        assert rec.best.fallback["rollback_s"] > 0 and rec.best.plan.memory.fallback_bytes == 0
        # the warm BF16 fallback is counted where it lives: on the winner's GPUs it does not fit ...
        same = by_label(rec)[label.replace("fb-none", "fb-same-gpus")]
        assert any(r["rule"] == "memory.fit" for r in same.refused)
        # ... with more GPUs it does, at the KV cache's expense
        warm = by_label(rec)[warm_label]
        assert warm.ok and warm.plan.memory.fallback_bytes > 0 and warm.fallback["rollback_s"] == 0.0
        assert CD.tokens_per_gpu(warm) < CD.tokens_per_gpu(rec.best)
        bf16 = [c for c in rec.feasible if c.profile.quantization.quant_algo.value == "NO_QUANT"]
        assert bf16 and CD.tokens_per_gpu(bf16[0]) < CD.tokens_per_gpu(rec.best)


def test_written_70b_profile_names_its_fallback_as_deployed(tmp_path):
    """--write of a tp-2 FP8 70B with a cold BF16 fallback: the fallback file (bf16-h100 at tp 2 on h100) is
    written beside it and named, so the pair resolves as recommended (bf16-h100 itself is tp 1 and does not fit)."""
    from precision_pipeline.resolve import perf as PF
    from precision_pipeline.spec.algos import KVCacheQuantAlgo, QuantAlgo
    from precision_pipeline.spec.model_arch import read_model_arch
    from precision_pipeline.spec.profile import load_raw

    m70 = read_model_arch(Path(__file__).resolve().parents[1] / "data" / "models" / "Llama-3.1-70B")
    wl = PF.Workload()
    o = C._overrides("h100-sxm", QuantAlgo.FP8, KVCacheQuantAlgo.FP8, 2, load_raw("fp8-h100"), 4096, None, wl)
    c = C.evaluate_candidate("fp8/kv-fp8/tp2/fb-none", "fp8-h100", o, m70, NOWHERE, C.EvalSettings(4096, True, wl), "none")
    assert c.ok and c.fallback == {"where": "none", "profile": "bf16-h100", "tp_size": 2, "gpus": 0, "rollback_s": 35.8}
    path = C.write_profile(c, tmp_path / "rec.yaml")
    fb_path = tmp_path / "rec-fallback.yaml"
    p, fb = load_profile(str(path)), load_profile(str(fb_path))
    assert p.deployment.fallback == str(fb_path) and p.deployment.warm_fallback is False
    assert (fb.parallel.tp_size, fb.target.gpu, fb.quantization.quant_algo.value) == (2, "h100-sxm", "NO_QUANT")
    plan = evaluate(p, m70)
    assert plan.ok and plan.fallback.ok and plan.memory.fallback_bytes == 0
    # named as the shipped bf16-h100 (tp 1) instead, the same profile is refused: its fallback cannot run
    assert not evaluate(p.model_copy(update={"deployment": p.deployment.model_copy(update={"fallback": "bf16-h100"})}), m70).ok
    # hostile s8 #84/#85: a --write to a shipped profile is refused before the -fallback sibling is written
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.spec.profile import PROFILES_DIR

    before = sorted(p.name for p in PROFILES_DIR.iterdir())
    with pytest.raises(UserError, match="shipped profile"):
        C.write_profile(c, PROFILES_DIR / "int8-sq-l4-smollm2.yaml")
    assert sorted(p.name for p in PROFILES_DIR.iterdir()) == before
