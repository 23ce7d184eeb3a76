"""Gate report.html in a real browser (headless Chromium via Playwright): the metric table's rows
and cells, read from the rendered DOM, must match the metrics.json the report was rendered from,
and every embedded image must actually decode (``naturalWidth > 0``, and the size the PNG header
declares). The HTML parser tests in test_report.py check the markup; these check what a browser
makes of it.

Reports: synthetic gate numbers (``test_report._write``: no model, a passing and a failing
variant, with a heatmap image) and, when the pipeline has produced one, the real fp8-h100 gate
(``artifacts/fp8-h100/gate``: its metrics.json + per_token.npz copied and re-rendered with the
current build/precision_pipeline/gate/report.py). Skipped with the reason when /usr/bin/chromium or the playwright
package is missing (no browser is downloaded).
"""

from __future__ import annotations

import base64
import json
import math
import shutil
import struct
import zlib
from pathlib import Path

import pytest

from precision_pipeline.gate.metrics import METRIC_ORDER
from precision_pipeline.spec.profile import GateThresholds

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
REPO_ROOT = Path(__file__).resolve().parents[2]
REAL_GATE = REPO_ROOT / "artifacts" / "fp8-h100" / "gate"


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} is not installed (Debian package chromium); DOM checks need a browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright Python package is not installed; DOM checks need it")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=60_000)
        try:
            yield b
        finally:
            b.close()


# ------------------------------------------------------------------------------------------------
# Reading a report in the browser

_EXTRACT = """() => {
  const txt = (el) => el ? el.textContent.trim() : null;
  const rows = Array.from(document.querySelectorAll('table#metrics tbody tr')).map(tr => ({
    metric: tr.dataset.metric, cls: tr.className,
    name: txt(tr.querySelector('td.name')), value: txt(tr.querySelector('td.value')),
    ci: txt(tr.querySelector('td.ci')), floor: txt(tr.querySelector('td.floor')),
    threshold: txt(tr.querySelector('td.threshold')), status: txt(tr.querySelector('td.status')),
    statusCls: tr.querySelector('td.status') ? tr.querySelector('td.status').className : null,
    visible: tr.getBoundingClientRect().height > 0,
  }));
  const cats = Array.from(document.querySelectorAll('table#categories-table tbody tr')).map(tr => ({
    category: tr.dataset.category, kl_mean: txt(tr.querySelector('td.kl_mean')),
    kl_p99: txt(tr.querySelector('td.kl_p99')), top1: txt(tr.querySelector('td.top1')),
  }));
  const imgs = Array.from(document.images).map(i => ({
    src: i.getAttribute('src'), complete: i.complete, nw: i.naturalWidth, nh: i.naturalHeight,
    w: i.getBoundingClientRect().width, h: i.getBoundingClientRect().height,
    section: i.closest('section') ? i.closest('section').id : null,
  }));
  const v = document.querySelector('#verdict');
  return {rows, cats, imgs, verdict: v ? {cls: v.className, text: txt(v)} : null,
          failures: txt(document.querySelector('#failures')),
          floorWarning: txt(document.querySelector('#floor-warning')),
          nPrompts: txt(document.querySelector('#n-prompts')),
          nAnswerTokens: txt(document.querySelector('#n-answer-tokens')),
          title: document.title};
}"""


def read_dom(browser, html_path: Path) -> tuple[dict, list[str]]:
    """Open ``html_path`` (file://), wait for every image, return the extracted DOM facts and the
    URLs of any non-file, non-data request the page tried (a self-contained report makes none)."""
    page = browser.new_page()
    external: list[str] = []

    def _route(route):
        url = route.request.url
        if url.startswith(("file:", "data:")):
            route.continue_()
        else:
            external.append(url)
            route.abort()

    try:
        page.route("**/*", _route)
        page.goto(html_path.resolve().as_uri(), wait_until="load", timeout=60_000)
        # wait until every image is decoded or has failed (decode() rejects for a broken image;
        # the failure then shows as naturalWidth 0 in the extracted facts)
        decoded = page.evaluate(
            "() => Promise.all(Array.from(document.images).map(i => i.decode().then(() => true, () => false)))")
        facts = page.evaluate(_EXTRACT)
        for im, ok in zip(facts["imgs"], decoded):
            im["decoded"] = ok
        return facts, external
    finally:
        page.close()


# ------------------------------------------------------------------------------------------------
# Expected cell texts, from metrics.json (the report's documented formatting: 4 significant
# digits; exponent notation below 1e-4 or from 1e6; None/NaN -> "n/a"; exact zero -> "0")


def fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    x = float(v)
    if math.isnan(x):
        return "n/a"
    if x == 0:
        return "0"
    if abs(x) < 1e-4 or abs(x) >= 1e6:
        return f"{x:.3e}"
    return f"{x:.4g}"


def fmt_ci(ci) -> str:
    return "n/a" if not ci else f"[{fmt(ci[0])}, {fmt(ci[1])}]"


def _num(text: str) -> float:
    return float("nan") if text == "n/a" else float(text)


def png_size(src: str) -> tuple[int, int]:
    """(width, height) from the IHDR chunk of a data:image/png;base64 URL, after walking every
    chunk to IEND with its CRC (Chromium shows a truncated PNG partially, with its full
    naturalWidth, so the browser alone does not prove the bytes are complete)."""
    assert src.startswith("data:image/png;base64,"), src[:40]
    raw = base64.b64decode(src.split(",", 1)[1], validate=True)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR"
    pos, kinds = 8, []
    while pos < len(raw):
        (n,) = struct.unpack(">I", raw[pos:pos + 4])
        kind, body = raw[pos + 4:pos + 8], raw[pos + 8:pos + 8 + n]
        assert len(body) == n and len(raw) >= pos + 12 + n, f"PNG cut short in {kind!r}"
        assert struct.unpack(">I", raw[pos + 8 + n:pos + 12 + n])[0] == zlib.crc32(kind + body), f"bad CRC in {kind!r}"
        kinds.append(kind)
        pos += 12 + n
    assert kinds[-1] == b"IEND" and b"IDAT" in kinds
    return struct.unpack(">II", raw[16:24])


def check_report(dom: dict, external: list[str], m: dict, n_images: int, check_order: bool = True) -> None:
    """Assert the browser's view of a report against the metrics.json it was rendered from.

    ``check_order``: the metric rows must come in the gate's order (``METRIC_ORDER``); metrics.json
    itself is key-sorted (``store.atomic_write_json``), so its order is not the table's."""
    met = m["metrics"]
    assert external == [], f"the report requested external resources: {external}"
    assert dom["verdict"] == {"cls": "pass" if m["passed"] else "fail", "text": "PASSED" if m["passed"] else "FAILED"}
    assert dom["nPrompts"] == str(m["tokens"]["prompts"])
    assert dom["nAnswerTokens"] == str(m["tokens"]["answer_tokens"])

    # metric table: one visible row per metric, in the gate's order, numbers as in metrics.json
    rows = dom["rows"]
    assert sorted(r["metric"] for r in rows) == sorted(met)
    if check_order:
        assert [r["metric"] for r in rows] == [k for k in METRIC_ORDER if k in met]
    for r in rows:
        x = met[r["metric"]]
        status = "unchecked" if x["passed"] is None else ("pass" if x["passed"] else "fail")
        assert r["visible"], r["metric"]
        assert r["name"] == r["metric"]
        assert r["value"] == fmt(x["value"]), (r["metric"], r["value"], x["value"])
        assert r["ci"] == fmt_ci(x.get("ci95")), (r["metric"], r["ci"], x.get("ci95"))
        assert r["floor"] == fmt(x.get("noise_floor")), (r["metric"], r["floor"], x.get("noise_floor"))
        thr = "not checked" if x["threshold"] is None else f"{x['op']} {fmt(x['threshold'])}"
        assert r["threshold"] == thr, (r["metric"], r["threshold"])
        assert r["cls"] == status and r["statusCls"] == f"status {status}"
        assert r["status"] == {"unchecked": "-", "pass": "PASS", "fail": "FAIL"}[status]
        # and the displayed number is the value to 4 significant digits (not merely the same string rule)
        v = x["value"]
        if v is not None and not math.isnan(v):
            assert _num(r["value"]) == pytest.approx(v, rel=5e-4, abs=1e-12)
    failed_rows = [r["metric"] for r in rows if r["cls"] == "fail"]
    assert sorted(failed_rows) == sorted(m["failures"])
    if m["failures"]:
        for f in m["failures"]:
            assert met[f]["reason"] in dom["failures"]
    else:
        assert dom["failures"] is None
    blocked = [n for n, x in met.items() if x.get("floor_exceeds_threshold")]
    assert (dom["floorWarning"] is not None) == bool(blocked)
    for n in blocked:
        assert n in dom["floorWarning"]

    # per-category table
    assert sorted(c["category"] for c in dom["cats"]) == sorted(m["per_category"])
    for c in dom["cats"]:
        pc = m["per_category"][c["category"]]
        assert (c["kl_mean"], c["kl_p99"], c["top1"]) == (fmt(pc["kl_mean"]), fmt(pc["kl_p99"]), fmt(pc["top1"]))

    # every image decoded by the browser, at the size its PNG header declares, and laid out
    assert len(dom["imgs"]) == n_images
    for im in dom["imgs"]:
        assert im["complete"] and im["decoded"] and im["nw"] > 0 and im["nh"] > 0, im["section"]
        assert (im["nw"], im["nh"]) == png_size(im["src"]), im["section"]
        assert im["w"] > 0 and im["h"] > 0, im["section"]


# ------------------------------------------------------------------------------------------------
# Synthetic reports (no model)


def _synthetic_gate(tmp_path: Path, thr: GateThresholds, heatmap: bool) -> Path:
    from tests.gate.test_report import _write  # the report tests' synthetic gate folder writer

    return _write(tmp_path, thr, heatmap=heatmap).out_dir


def test_dom_of_passing_synthetic_report(browser, tmp_path):
    gate = _synthetic_gate(tmp_path, GateThresholds(kl_mean_max=0.5, kl_p99_max=5.0, top1_min=0.5,
                                                    ppl_delta_pct_max=6.0, greedy_same_min=0.5), heatmap=True)
    m = json.loads((gate / "metrics.json").read_text())
    assert m["passed"] is True
    dom, external = read_dom(browser, gate / "report.html")
    check_report(dom, external, m, n_images=3)  # KL histogram, category bars, heatmap
    assert sorted(im["section"] for im in dom["imgs"]) == ["categories", "heatmap", "kl-histogram"]
    assert dom["title"] == "Accuracy gate: SmolLM2-135M-Instruct"
    assert {r["metric"]: r["cls"] for r in dom["rows"]}["kl_p95"] == "unchecked"


def test_dom_checks_catch_a_broken_image_and_a_wrong_number(browser, tmp_path):
    """Negative controls: the same checks fail on a report with an image that is not a PNG (the
    browser cannot decode it: naturalWidth 0), with a PNG cut short (Chromium still shows it, from
    its header: caught by the chunk walk), or whose kl_mean cell shows another number."""
    gate = _synthetic_gate(tmp_path, GateThresholds(kl_mean_max=0.5), heatmap=False)
    m = json.loads((gate / "metrics.json").read_text())
    html_text = (gate / "report.html").read_text()
    start = html_text.index("data:image/png;base64,") + len("data:image/png;base64,")
    end = html_text.index('"', start)
    broken = gate.parent / "broken.html"
    broken.write_text(html_text[:start] + base64.b64encode(b"not a PNG at all").decode() + html_text[end:])
    dom, external = read_dom(browser, broken)
    assert [(im["decoded"], im["nw"]) for im in dom["imgs"]][0] == (False, 0)
    assert all(im["decoded"] and im["nw"] > 0 for im in dom["imgs"][1:])
    with pytest.raises(AssertionError, match="kl-histogram"):
        check_report(dom, external, m, n_images=2)

    cut = gate.parent / "cut.html"
    cut.write_text(html_text[:start] + html_text[start:end][:400] + html_text[end:])  # 300 bytes of the PNG
    dom, external = read_dom(browser, cut)
    assert dom["imgs"][0]["nw"] > 0  # the browser does not notice
    with pytest.raises(AssertionError, match="PNG cut short"):
        check_report(dom, external, m, n_images=2)

    shown = fmt(m["metrics"]["kl_mean"]["value"])
    wrong = gate.parent / "wrong.html"
    wrong.write_text(html_text.replace(f'<td class="value">{shown}</td>', '<td class="value">0.001</td>', 1))
    assert wrong.read_text() != html_text
    dom, external = read_dom(browser, wrong)
    with pytest.raises(AssertionError, match="kl_mean"):
        check_report(dom, external, m, n_images=2)


def test_dom_of_failing_synthetic_report(browser, tmp_path):
    # kl_p99 <= 1e-6 is below the synthetic BF16 floor (flagged); top1 >= 0.99 misses too
    gate = _synthetic_gate(tmp_path, GateThresholds(kl_mean_max=0.5, kl_p99_max=1e-6, top1_min=0.99), heatmap=False)
    m = json.loads((gate / "metrics.json").read_text())
    assert m["failures"] == ["kl_p99", "top1"]
    dom, external = read_dom(browser, gate / "report.html")
    check_report(dom, external, m, n_images=2)
    assert dom["floorWarning"] and "kl_p99" in dom["floorWarning"]
    row = {r["metric"]: r for r in dom["rows"]}
    assert row["kl_p99"]["threshold"] == "<= 1.000e-06"  # exponent notation below 1e-4
    assert row["kl_p99"]["status"] == "FAIL" and row["kl_mean"]["status"] == "PASS"


@pytest.fixture(scope="module")
def real_gate(request) -> tuple[Path, int]:
    """A real gate directory and its minimum prompt count: the fp8-h100 build's (full golden set)
    when ``artifacts/`` has one, else the real gate run of the fp8 test checkpoint with one prompt per category
    (as on a fresh clone / in CI): ``fp8_gates``' engine run (tests/conftest.py, once per test run, with reports).
    Read only: the tests copy its files."""
    if (REAL_GATE / "metrics.json").is_file() and (REAL_GATE / "per_token.npz").is_file():
        return REAL_GATE, 60
    return request.getfixturevalue("fp8_gates")["engine"].out_dir, 6


def _rerender_real_gate(src: Path, tmp_path: Path) -> Path:
    from precision_pipeline.gate.report import render_dir

    gate = tmp_path / "gate"
    gate.mkdir()
    for f in ("metrics.json", "per_token.npz", "sensitivity_heatmap.png"):
        if (src / f).is_file():
            shutil.copy(src / f, gate / f)
    render_dir(gate)
    return gate


def test_dom_of_real_fp8_gate_report(browser, tmp_path, real_gate):
    """Real fp8-h100 gate numbers (the build's when present), re-rendered with the current code."""
    gate = _rerender_real_gate(real_gate[0], tmp_path)
    m = json.loads((gate / "metrics.json").read_text())
    dom, external = read_dom(browser, gate / "report.html")
    has_scales = bool((m.get("scales") or {}).get("kinds"))  # gates since checkpoint/scales.py: the scale figure
    check_report(dom, external, m, n_images=2 + (gate / "sensitivity_heatmap.png").is_file() + has_scales,
                 check_order=False)
    assert len(dom["cats"]) == 6 and int(dom["nPrompts"]) == m["tokens"]["prompts"] >= real_gate[1]


_SCALES = """() => {
  const txt = (el) => el ? el.textContent.trim() : null;
  const kinds = Array.from(document.querySelectorAll('table#scales-table tbody tr')).map(tr => ({
    kind: tr.dataset.kind, count: txt(tr.querySelector('td.count')), min: txt(tr.querySelector('td.min')),
    p1: txt(tr.querySelector('td.p1')), median: txt(tr.querySelector('td.median')),
    p99: txt(tr.querySelector('td.p99')), max: txt(tr.querySelector('td.max')),
    flagged: txt(tr.querySelector('td.flagged')), visible: tr.getBoundingClientRect().height > 0}));
  const outliers = Array.from(document.querySelectorAll('table#scale-outliers tbody tr')).map(tr => ({
    tensor: tr.dataset.tensor, rule: tr.dataset.rule, rank: tr.dataset.rank}));
  const img = document.querySelector('section#scales img.plot');
  return {kinds, outliers, img: img ? {nw: img.naturalWidth, w: img.getBoundingClientRect().width} : null,
          nTensors: txt(document.querySelector('#n-scale-tensors')),
          warnings: Array.from(document.querySelectorAll('section#quantize-warnings li.warning')).map(li => li.className)};
}"""


def test_dom_of_the_real_fp8_gate_scale_section(browser, tmp_path, real_gate):
    """The scale-factor table of the real FP8 gate as the browser shows it, against metrics.json ``scales``."""
    gate = _rerender_real_gate(real_gate[0], tmp_path)
    m = json.loads((gate / "metrics.json").read_text())
    if not (m.get("scales") or {}).get("kinds"):
        pytest.skip("this gate was written before checkpoint/scales.py (no metrics.json scales)")
    read_dom(browser, gate / "report.html")  # images decoded, nothing external (asserted by the other tests)
    page = browser.new_page()
    try:
        page.goto((gate / "report.html").resolve().as_uri(), wait_until="load")
        page.evaluate("() => Promise.all(Array.from(document.images).map(i => i.decode().catch(() => null)))")
        d = page.evaluate(_SCALES)
    finally:
        page.close()
    sc = m["scales"]
    assert d["nTensors"] == str(sc["tensors"])
    assert [r["kind"] for r in d["kinds"]] == list(sc["kinds"])
    flagged: dict = {}
    for o in sc["outliers"]:
        flagged[o["kind"]] = flagged.get(o["kind"], 0) + 1
    for r in d["kinds"]:
        k = sc["kinds"][r["kind"]]
        assert r["visible"] and r["count"] == str(k["count"]) and r["flagged"] == str(flagged.get(r["kind"], 0))
        assert [r[c] for c in ("min", "p1", "median", "p99", "max")] == [fmt(k[c]) for c in ("min", "p1", "median", "p99", "max")]
    assert [(o["tensor"], o["rule"], o["rank"]) for o in d["outliers"]] == \
        [(o["tensor"], o["rule"], str(o["rank"])) for o in sc["outliers"][:len(d["outliers"])]]
    assert d["img"] is not None and d["img"]["nw"] > 0 and d["img"]["w"] > 0
    assert "transformer.layers.11.mlp.proj.activation_scaling_factor" in {o["tensor"] for o in d["outliers"]}
    if m.get("quantize_warnings") is not None:
        assert len(d["warnings"]) == len(m["quantize_warnings"]["warnings"])


def test_rerendered_real_report_keeps_metric_order(browser, tmp_path, real_gate):
    gate = _rerender_real_gate(real_gate[0], tmp_path)
    m = json.loads((gate / "metrics.json").read_text())
    dom, _ = read_dom(browser, gate / "report.html")
    assert [r["metric"] for r in dom["rows"]] == [k for k in METRIC_ORDER if k in m["metrics"]]
