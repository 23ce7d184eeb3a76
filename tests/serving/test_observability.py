"""Precision observability on a real tritonserver (CPU reference backend): the BLS's per-request
precision path and custom metrics on the server's own /metrics, `invoke probe` and its exporter.

One server for the module: stable release = the default model in FP32 (no checkpoint); a second
unit (the FP8 + FP8-KV test checkpoint) serves as canary, then as fallback. The probe's prompts and
reference come from the small gate run of test_rollout (its ``gate_dir`` fixture).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from precision_pipeline.serving import pack, probe, release
from tests.serving.test_rollout import REPO_ROOT, gate_dir, pack_unit, serve_repository  # noqa: F401  (gate_dir: a fixture)

pytestmark = pytest.mark.slow
MAX_TOKENS = 2


@pytest.fixture(scope="module")
def obs_units(tmp_path_factory, fp8_checkpoint, default_model_dir):
    base = tmp_path_factory.mktemp("obs-units")
    return {"stable": pack_unit(base, "stable", base / "no-checkpoint", Path(default_model_dir)),
            "fp8": pack_unit(base, "fp8", Path(fp8_checkpoint), Path(default_model_dir), profile="fp8-h100")}


@pytest.fixture(scope="module")
def obs_served(tmp_path_factory, obs_units):
    yield from serve_repository(tmp_path_factory, "obs-serving", obs_units["stable"])


def _ask(srv, text="What is 2 + 2?"):
    import tritonclient.http as hc

    c = srv.http_client()
    try:
        a = hc.InferInput("text_input", [1, 1], "BYTES")
        a.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
        b = hc.InferInput("max_tokens", [1, 1], "INT32")
        b.set_data_from_numpy(np.array([[MAX_TOKENS]], np.int32))
        r = c.infer("tensorrt_llm_bls", [a, b])
        return json.loads(r.as_numpy("precision_path").reshape(-1)[0])
    finally:
        c.close()


def _families(url):
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


def _samples(fams, family, **match):
    f = fams.get(family)
    return [] if f is None else [s for s in f.samples if all(s.labels.get(k) == v for k, v in match.items())]


def _unit_path(unit_dir):
    return json.loads((release.resolve_unit_source(unit_dir) / pack.PRECISION_PATH_FILE).read_text())


def test_precision_path_per_request_and_server_metrics(obs_served, obs_units):
    from precision_pipeline.serving.rollout import metrics_url

    repo, srv = obs_served
    stable = release.read_state(repo)["current"]
    sp, cp = _unit_path(obs_units["stable"].out_dir), _unit_path(obs_units["fp8"].out_dir)
    assert sp["unit"] == stable and sp["gemm"] != cp["gemm"] and sp["kv"] != cp["kv"]
    cand = release.install_unit(repo, obs_units["fp8"].out_dir)
    srv.load(cand)
    release.set_canary(repo, stable, cand, 50)
    try:
        params = [_ask(srv) for _ in range(4)]
        fams = _families(metrics_url(srv))
    finally:
        release.point_bls(repo, stable)
    routes = [p["route"] for p in params]
    assert routes.count("canary") == 2 and routes.count("stable") == 2, routes
    for p in params:  # every response names the path that served it: the unit's own precision_path.json
        want = cp if p["route"] == "canary" else sp
        assert {k: v for k, v in p.items() if k != "route"} == want
    for route, path in (("canary", cp), ("stable", sp)):
        req = _samples(fams, "precision_pipeline_requests", route=route, engine_unit=path["unit"], gemm=path["gemm"], kv=path["kv"],
                       profile=path["profile"], engine_hash=path["engine_hash"], context_fmha=path["context_fmha"])
        assert [s.value for s in req] == [2.0], (route, req)
        tin = _samples(fams, "precision_pipeline_tokens", route=route, engine_unit=path["unit"], kind="input")
        tout = _samples(fams, "precision_pipeline_tokens", route=route, engine_unit=path["unit"], kind="output")
        assert len(tin) == len(tout) == 1 and tin[0].value >= 2 * 8, (tin, tout)  # chat template + prompt
        assert 2 <= tout[0].value <= 2 * MAX_TOKENS, tout
    ins = {s.labels["route"]: s.value for s in _samples(fams, "precision_pipeline_tokens", kind="input")}
    assert ins["canary"] == ins["stable"]  # same prompt, same tokenizer
    assert [s.value for s in _samples(fams, "precision_pipeline_rollout_canary_percent")] == [50.0]
    assert [s.value for s in _samples(fams, "precision_pipeline_fallback_active")] == [0.0]
    assert _samples(fams, "precision_pipeline_request_failures") == []
    # Triton's own per-model counters are still there, beside ours
    assert any(s.labels.get("model") == "tensorrt_llm_bls" for s in _samples(fams, "nv_inference_request_success"))

    # fallback: the fp8 unit becomes releases.json's fallback and the release rolls back to it
    release.set_fallback(repo, obs_units["fp8"].out_dir, server=srv)
    release.rollback(repo, fallback=True, server=srv, by="test")
    try:
        p = _ask(srv)
        fams = _families(metrics_url(srv))
    finally:
        release.rollback(repo, to=stable, server=srv, by="test")
    assert p["route"] == "fallback" and p["unit"] == cand
    assert [s.value for s in _samples(fams, "precision_pipeline_fallback_active")] == [1.0]
    assert [s.value for s in _samples(fams, "precision_pipeline_rollout_canary_percent")] == [0.0]
    assert [s.value for s in _samples(fams, "precision_pipeline_requests", route="fallback", engine_unit=cand)] == [1.0]


def test_invoke_probe_records_history(obs_served, gate_dir):  # noqa: F811
    repo, srv = obs_served
    stable = release.read_state(repo)["current"]
    n0 = len(release.read_state(repo)["history"])
    p = subprocess.run([sys.executable, "-m", "invoke", "probe", "--url", srv.http_url, "--repo", str(repo),
                        "--gate", str(gate_dir), "--prompts", "2"], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    st = release.read_state(repo)
    assert len(st["history"]) == n0 + 1 and st["current"] == stable
    rec = st["history"][-1]
    assert rec["action"] == "probe" and rec["unit"] == stable and rec["from"] is None
    pr = rec["probe"]
    # the FP32 stable unit against the FP32 reference: the same numbers up to float noise
    assert pr["prompts"] == 2 and pr["tokens"] > 5 and pr["passed"] is True
    assert pr["kl_p99"] < 1e-3 and pr["top1"] == 1.0
    assert f"KL P99 {pr['kl_p99']:.4f}" in p.stdout


def test_probe_exporter_serves_the_result(obs_served, gate_dir):  # noqa: F811
    from precision_pipeline.serving.triton_server import free_port

    repo, srv = obs_served
    stable = release.read_state(repo)["current"]
    pset = probe.load_probe_set(gate_dir, prompts=1)
    port = free_port()
    ex = probe.ProbeExporter(port, addr="127.0.0.1")
    try:
        rec = probe.probe_and_record(srv, stable, pset, repo_dir=repo, profile="bf16-h100", exporter=ex)
        bad = probe.probe_and_record(srv, "tensorrt_llm_000000000000", pset, repo_dir=repo, profile="bf16-h100",
                                     exporter=ex)
        fams = _families(f"http://127.0.0.1:{port}/metrics")
    finally:
        ex.close()
    lab = {"profile": "bf16-h100", "engine_unit": stable}
    s = rec["probe"]
    assert [x.value for x in _samples(fams, "precision_pipeline_probe_kl_p99", **lab)] == [pytest.approx(s["kl_p99"])]
    assert [x.value for x in _samples(fams, "precision_pipeline_probe_top1", **lab)] == [pytest.approx(s["top1"])]
    assert [x.value for x in _samples(fams, "precision_pipeline_probe_kl_p99_threshold", **lab)] == [
        pytest.approx(pset.thresholds.kl_p99_max)]
    assert [x.value for x in _samples(fams, "precision_pipeline_probe_passed", **lab)] == [1.0]
    assert [x.value for x in _samples(fams, "precision_pipeline_probe_runs", result="pass", **lab)] == [1.0]
    assert [x.value for x in _samples(fams, "precision_pipeline_probe_runs", result="error", engine_unit="tensorrt_llm_000000000000")] == [1.0]
    assert len(_samples(fams, "precision_pipeline_probe_last_run_timestamp_seconds")) == 2
    assert "error" in bad["probe"] and release.read_state(repo)["history"][-1]["probe"]["passed"] is False


PROMETHEUS = shutil.which("prometheus")


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian package prometheus)")
def test_real_prometheus_scrapes_server_and_probe_and_evaluates_rules(obs_served, gate_dir, tmp_path):  # noqa: F811
    """A real Prometheus scrapes the real server's /metrics and the probe exporter; the rendered rules
    are evaluated there (the fallback alert pending/firing is not waited for: `for: 5m`)."""
    import time

    import yaml

    from precision_pipeline.serving import deploy
    from precision_pipeline.serving.triton_server import free_port

    repo, srv = obs_served
    stable = release.read_state(repo)["current"]
    _ask(srv)
    pset = probe.load_probe_set(gate_dir, prompts=1)
    ex_port, prom_port = free_port(), free_port()
    ex = probe.ProbeExporter(ex_port, addr="127.0.0.1")
    probe.probe_and_record(srv, stable, pset, profile="fp8-h100", exporter=ex)
    # fp8-h100's rules with a threshold the FP32 unit is below, and one it is above (the latter fires)
    groups = deploy.alert_groups("fp8-h100", pset.thresholds.model_copy(update={"kl_p99_max": -1.0}))
    for r in groups[0]["rules"]:
        r.pop("for", None)  # evaluate at once
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{**groups[0], "interval": "1s"}]}))
    (tmp_path / "prom.yaml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(tmp_path / "rules.yaml")],
        "scrape_configs": [{"job_name": "triton", "static_configs": [{"targets": [f"127.0.0.1:{srv.metrics_port}"]}]},
                           {"job_name": "probe", "static_configs": [{"targets": [f"127.0.0.1:{ex_port}"]}]}]}))
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prom.yaml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "prometheus.log", "wb"))

    def query(q):
        from urllib.parse import quote

        with urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/api/v1/query?query={quote(q)}", timeout=5) as r:
            return json.loads(r.read())["data"]["result"]

    try:
        deadline, req, kl, alerts = time.monotonic() + 60, [], [], []
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                req = query(f'precision_pipeline_requests_total{{engine_unit="{stable}",route="stable"}}')
                kl = query(f'precision_pipeline_probe_kl_p99{{engine_unit="{stable}"}}')
                alerts = query('ALERTS{alertstate="firing"}')
            except OSError:
                continue
            if req and kl and {a["metric"]["alertname"] for a in alerts} >= {"PrecisionProbeKlP99AboveGate"}:
                break
    finally:
        proc.terminate()
        proc.wait(30)
        ex.close()
    assert req and float(req[0]["value"][1]) >= 1, (tmp_path / "prometheus.log").read_text()[-2000:]
    assert req[0]["metric"]["job"] == "triton" and req[0]["metric"]["gemm"] == _unit_path(repo / stable)["gemm"]
    assert kl and kl[0]["metric"]["job"] == "probe" and float(kl[0]["value"][1]) < 1e-3
    firing = {a["metric"]["alertname"]: a["metric"] for a in alerts}
    assert firing["PrecisionProbeKlP99AboveGate"]["engine_unit"] == stable
    assert not {"PrecisionProbeTop1BelowGate", "PrecisionProbeStale", "PrecisionProbeAbsent", "PrecisionFallbackActive"} & set(firing)
