"""Gate reports from synthetic gate numbers (no model): markdown table, self-contained HTML with
stable ids, base64 PNG plots, heatmap section, re-rendering from a gate folder."""

from __future__ import annotations

import base64
import json
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from precision_pipeline.gate.assemble import Measured, Settings, assemble
from precision_pipeline.gate.checkpoint_gate import write_gate_dir
from precision_pipeline.gate.metrics import TokenMetrics
from precision_pipeline.gate.reference import ReferenceData
from precision_pipeline.gate.verdict import GateResult
from precision_pipeline.gate.golden import CATEGORIES, EncodedPrompt
from precision_pipeline.spec.profile import GateThresholds
from precision_pipeline.gate.report import LIMITS_TEXT, render_dir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"t{i}" for i in ids)


def _synthetic(thresholds: GateThresholds, seed: int = 0) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    encoded, per_prompt, ref_greedy, cand_greedy, floor_rows, floor_prompt, floor_greedy = [], [], [], [], [], [], []
    for ci, cat in enumerate(CATEGORIES):
        for j in range(3):
            n_user, n_ans = 10 + j, 20 + 5 * j
            ids = list(range(1, 5 + n_user + n_ans + 1))
            e = EncodedPrompt(f"{cat}-{j:02d}", cat, f"prompt <b>{cat}</b> {j}", "answer", ids, 4, 4 + n_user,
                              4 + n_user + n_ans)
            encoded.append(e)
            kl = rng.exponential(0.02 * (ci + 1), size=n_ans)
            per_prompt.append((TokenMetrics(kl, rng.random(n_ans) > 0.1, rng.random(n_ans), rng.random(n_ans) + 0.1),
                               TokenMetrics(rng.exponential(0.01, n_user), rng.random(n_user) > 0.05,
                                            np.full(n_user, np.nan), np.full(n_user, np.nan))))
            floor_rows.append({"kl": rng.exponential(0.002, n_ans), "top1": rng.random(n_ans) > 0.02,
                               "nll": rng.random(n_ans)})
            floor_prompt.append({"kl": rng.exponential(0.001, n_user), "top1": rng.random(n_user) > 0.01})
            r = [5, 6, 7, 8]
            ref_greedy.append(r)
            cand_greedy.append(r if j else [5, 9, 7, 8])
            floor_greedy.append(r)
    ref = ReferenceData(hidden=[], ref_greedy=ref_greedy, ref_heldout_nll=np.full(100, 3.0),
                        ref_answer_nll=[p[0].ref_nll for p in per_prompt],
                        floor={"answer": floor_rows, "prompt": floor_prompt, "greedy": floor_greedy,
                               "heldout_nll": np.full(100, 3.001)}, seconds={})
    return assemble(Measured(encoded, per_prompt, ref, cand_greedy, np.full(100, 3.05), [list(range(101))]), _Tok(),
                    thresholds, Settings(bootstrap=100, seed=0, greedy_new_tokens=4, heldout_window=101))


class _Parser(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: list[str] = []
        self.metric_rows: dict[str, str] = {}
        self.category_rows: list[str] = []
        self.imgs: list[str] = []
        self.worst: list[str] = []
        self.verdict_class = None
        self.scripts = 0
        self.links: list[str] = []
        self._cell = None
        self._row = None
        self.cells: dict[tuple[str, str], str] = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.append(a["id"])
        if a.get("id") == "verdict":
            self.verdict_class = a.get("class")
        if tag == "tr" and "data-metric" in a:
            self.metric_rows[a["data-metric"]] = a.get("class", "")
            self._row = a["data-metric"]
        if tag == "tr" and "data-category" in a:
            self.category_rows.append(a["data-category"])
        if tag == "td" and self._row:
            self._cell = (a.get("class") or "").split()[0] if a.get("class") else None
        if tag == "img":
            self.imgs.append(a.get("src", ""))
        if tag == "div" and "worst" in (a.get("class") or ""):
            self.worst.append(a["data-prompt-id"])
        if tag == "script":
            self.scripts += 1
        if tag == "link":
            self.links.append(a.get("href", ""))

    def handle_endtag(self, tag):
        if tag == "tr":
            self._row = None
        if tag == "td":
            self._cell = None

    def handle_data(self, data):
        if self._row and self._cell:
            self.cells[(self._row, self._cell)] = self.cells.get((self._row, self._cell), "") + data


def _write(tmp_path: Path, thr: GateThresholds, heatmap: bool = False) -> GateResult:
    metrics, per_token = _synthetic(thr)
    metrics.update({"model": "SmolLM2-135M-Instruct", "candidate": "synthetic", "reference_model_dir": "/ref"})
    res = GateResult(metrics["passed"], metrics["failures"], metrics, tmp_path / "gate", per_token)
    hp = None
    if heatmap:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(2, 2))
        ax.imshow(np.arange(9).reshape(3, 3))
        hp = tmp_path / "heat.png"
        fig.savefig(hp)
        plt.close(fig)
    write_gate_dir(res, heatmap_png=hp)
    return res


def test_markdown_table(tmp_path):
    res = _write(tmp_path, GateThresholds(kl_mean_max=0.5, kl_p99_max=1e-6, top1_min=0.5))
    md = (tmp_path / "gate" / "report.md").read_text()
    assert md.startswith("# Accuracy gate: FAILED")
    assert "| metric | value | 95% CI | BF16 noise floor | threshold | result |" in md
    for name in ("kl_mean", "kl_p95", "kl_p99", "kl_max", "top1", "ppl_delta_pct", "greedy_same"):
        assert f"| {name} |" in md
    assert "| kl_p99 |" in md and "FAIL" in md and "PASS" in md
    assert "What this gate cannot see" in md and "FP8 context FMHA" in md
    assert "| long_context |" in md
    assert res.failures == ["kl_p99"]
    # the floor itself misses kl_p99 <= 1e-6: flagged
    assert "noise floor itself misses" in md


def test_html_structure_and_images(tmp_path):
    _write(tmp_path, GateThresholds(kl_mean_max=0.5, kl_p99_max=5.0, top1_min=0.5, ppl_delta_pct_max=6.0,
                                    greedy_same_min=0.5), heatmap=True)
    html_text = (tmp_path / "gate" / "report.html").read_text()
    p = _Parser()
    p.feed(html_text)
    p.close()
    assert p.verdict_class == "pass"
    assert {"metrics", "kl-histogram", "categories", "worst-prompts", "greedy", "heatmap", "limits", "method"} <= set(p.ids)
    assert len(p.ids) == len(set(p.ids)), "ids must be unique"
    assert list(p.metric_rows) == ["kl_mean", "kl_p95", "kl_p99", "kl_max", "top1", "ppl_delta_pct", "greedy_same"]
    assert p.metric_rows["kl_p99"] == "pass" and p.metric_rows["kl_p95"] == "unchecked"
    m = json.loads((tmp_path / "gate" / "metrics.json").read_text())
    assert float(p.cells[("kl_mean", "value")]) == pytest.approx(m["metrics"]["kl_mean"]["value"], rel=1e-3)
    assert p.cells[("top1", "threshold")] == ">= 0.5"
    assert float(p.cells[("ppl_delta_pct", "value")]) == pytest.approx(m["metrics"]["ppl_delta_pct"]["value"], rel=1e-3)
    assert p.cells[("ppl_delta_pct", "ci")] == "n/a"
    assert sorted(p.category_rows) == sorted(["facts", "reasoning", "code", "instructions", "long_context", "non_english"])
    assert len(p.worst) == 5
    # self-contained: no scripts, no external links, every image an embedded PNG
    assert p.scripts == 0 and p.links == []
    assert len(p.imgs) == 3  # KL histogram, category bars, heatmap
    for src in p.imgs:
        assert src.startswith("data:image/png;base64,")
        raw = base64.b64decode(src.split(",", 1)[1], validate=True)
        assert raw[:8] == PNG_MAGIC
    # user text is escaped
    assert "prompt &lt;b&gt;" in html_text and "prompt <b>" not in html_text
    assert LIMITS_TEXT[1][:40].replace("'", "&#x27;") in html_text


def test_no_heatmap_section_without_png(tmp_path):
    _write(tmp_path, GateThresholds())
    p = _Parser()
    p.feed((tmp_path / "gate" / "report.html").read_text())
    assert "heatmap" not in p.ids
    assert p.verdict_class == "pass"  # nothing checked -> pass
    assert set(p.metric_rows.values()) == {"unchecked"}


def test_render_dir_rerenders(tmp_path):
    _write(tmp_path, GateThresholds(kl_mean_max=0.5))
    gate = tmp_path / "gate"
    (gate / "report.md").unlink()
    (gate / "report.html").unlink()
    md, html_path = render_dir(gate)
    assert md.is_file() and html_path.is_file()
    assert "| kl_mean |" in md.read_text()


def test_greedy_numbers_in_synthetic_metrics(tmp_path):
    metrics, _ = _synthetic(GateThresholds(greedy_same_min=0.9))
    g = metrics["metrics"]["greedy_same"]
    assert g["value"] == pytest.approx(12 / 18)  # first prompt of each category diverges
    assert g["noise_floor"] == 1.0
    assert g["passed"] is False and metrics["failures"] == ["greedy_same"]
    firsts = [r["first_divergence"] for r in metrics["greedy"]]
    assert firsts.count(1) == 6 and firsts.count(None) == 12
    assert metrics["metrics"]["ppl_delta_pct"]["value"] == pytest.approx((np.exp(3.05) / np.exp(3.0) - 1) * 100)


# ------------------------------------------------------------------------------------------------
# Scale factors and ModelOpt's warnings (checkpoint gates): the synthetic gate numbers plus the real
# scales of the session's FP8 checkpoint (checkpoint/scales.py) and a recorded warning list


def _write_with_scales(tmp_path: Path, ckpt: Path) -> GateResult:
    from precision_pipeline.checkpoint.scales import scale_report

    metrics, per_token = _synthetic(GateThresholds(kl_mean_max=0.5))
    sc = scale_report(ckpt)
    metrics.update({"model": "SmolLM2-135M-Instruct", "candidate": "synthetic", "reference_model_dir": "/ref",
                    "scales": sc, "quantize_warnings": {"source": "test", "warnings": [
                        {"level": "UserWarning", "origin": "quant_utils.py:401", "expected": None,
                         "message": "Warning: Large KV activation detected: 0.71, Quantized KV cache may lead to higher accuracy drop."},
                        {"level": "UserWarning", "origin": "postprocess.py:750", "expected": "lm_head stays BF16",
                         "message": "Enable lm_head quantization."}]}})
    res = GateResult(metrics["passed"], metrics["failures"], metrics, tmp_path / "gate", per_token)
    write_gate_dir(res)
    return res


def test_scale_section_png_and_markdown(tmp_path, fp8_checkpoint):
    res = _write_with_scales(tmp_path, fp8_checkpoint)
    gate = tmp_path / "gate"
    png = (gate / "scale_histogram.png").read_bytes()
    assert png[:8] == PNG_MAGIC
    md = (gate / "report.md").read_text()
    assert "## Scale factors" in md and "![scale-factor histograms](scale_histogram.png)" in md
    sc = res.metrics["scales"]
    for key, k in sc["kinds"].items():
        assert f"| {k['family']} | {k['quant_algo']} | {k['granularity']} | {k['stored_dtype']} | {k['count']} |" in md
    for o in sc["outliers"]:
        assert f"| `{o['tensor']}` | {o['rank']} | {o['rule']} |" in md
    assert "## ModelOpt warnings during quantize" in md and "Large KV activation detected: 0.71" in md
    assert "(expected: lm_head stays BF16)" in md


def test_scale_histogram_stays_page_sized_with_flagged_values_on_a_log_count_axis(fp8_checkpoint):
    """A kind whose counts span > 200x gets a log count axis; its flagged markers must not sit at y = 0
    (-inf there): that once stretched an INT8 SmoothQuant histogram to 1076 x 51222 px."""
    import io
    import warnings

    from PIL import Image

    from precision_pipeline.checkpoint.scales import scale_report
    from precision_pipeline.gate.report import plot_scale_histograms

    sc = scale_report(fp8_checkpoint)
    key = next(k for k in sc["kinds"] if k.startswith("activation_scaling_factor"))
    h = sc["kinds"][key]["histogram"]
    h["counts"] = [1000] + list(h["counts"][1:])  # force the log count axis (max/min > 200)
    assert any(o["kind"] == key and o.get("value") for o in sc["outliers"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layout warning either
        png = plot_scale_histograms(sc)
    w, hgt = Image.open(io.BytesIO(png)).size
    assert w < 2000 and hgt < 800


def test_scale_section_html(tmp_path, fp8_checkpoint):
    res = _write_with_scales(tmp_path, fp8_checkpoint)
    html_text = (tmp_path / "gate" / "report.html").read_text()
    p = _Parser()
    p.feed(html_text)
    assert {"scales", "scales-table", "scale-outliers", "quantize-warnings"} <= set(p.ids)
    assert len(p.ids) == len(set(p.ids))
    sc = res.metrics["scales"]
    for key in sc["kinds"]:
        assert f'<tr data-kind="{key}">' in html_text
    first = sc["outliers"][0]
    assert f'<tr data-tensor="{first["tensor"]}" data-rule="{first["rule"]}" data-rank="{first["rank"]}">' in html_text
    # the embedded figure is the PNG written beside report.md
    png = (tmp_path / "gate" / "scale_histogram.png").read_bytes()
    assert "data:image/png;base64," + base64.b64encode(png).decode() in p.imgs
    assert len(p.imgs) == 3  # KL histogram, category bars, scale factors
    assert html_text.count('<li class="warning') == 2 and '<li class="warning expected">' in html_text


def test_render_dir_redraws_the_scales_from_metrics_json(tmp_path, fp8_checkpoint):
    _write_with_scales(tmp_path, fp8_checkpoint)
    gate = tmp_path / "gate"
    for f in ("report.md", "report.html", "scale_histogram.png"):
        (gate / f).unlink()
    render_dir(gate)
    assert (gate / "scale_histogram.png").read_bytes()[:8] == PNG_MAGIC
    assert 'id="scales"' in (gate / "report.html").read_text()


def test_no_scale_section_without_scales(tmp_path):
    _write(tmp_path, GateThresholds())
    p = _Parser()
    p.feed((tmp_path / "gate" / "report.html").read_text())
    assert "scales" not in p.ids and "quantize-warnings" not in p.ids
    assert not (tmp_path / "gate" / "scale_histogram.png").exists()
    assert "## Scale factors" not in (tmp_path / "gate" / "report.md").read_text()
