"""Precision observability on a real tritonserver (CPU reference backend): the BLS's per-request
precision path and custom metrics on the server's own /metrics, `invoke probe` and its exporter.

One server for the module: stable release = the default model in FP32 (no checkpoint); a second
unit (the FP8 + FP8-KV test checkpoint) serves as canary, then as fallback. The probe's prompts and
reference come from the small gate run of test_rollout (its ``gate_dir`` fixture).
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from precision_pipeline.serving import pack, probe, release
from precision_pipeline.spec.profile import load_profile
from tests.serving.test_rollout import REPO_ROOT, gate_dir  # noqa: F401  (gate_dir: a fixture)

pytestmark = pytest.mark.slow
MAX_TOKENS = 2


def _pack(base: Path, name: str, profile: str, ckpt: Path, model_dir: Path):
    from tests.serving.test_pack import make_plan, with_limits

    prof = load_profile(profile)
    d = base / name
    return pack.pack_repository(with_limits(make_plan(prof), max_batch_size=32), prof, model_dir, ckpt, d / "engine",
                                False, d / "model_repository", str(d))


@pytest.fixture(scope="module")
def obs_units(tmp_path_factory, fp8_checkpoint, default_model_dir):
    base = tmp_path_factory.mktemp("obs-units")
    return {"stable": _pack(base, "stable", "bf16-h100", base / "no-checkpoint", Path(default_model_dir)),
            "fp8": _pack(base, "fp8", "fp8-h100", Path(fp8_checkpoint), Path(default_model_dir))}


@pytest.fixture(scope="module")
def obs_served(tmp_path_factory, obs_units):
    from precision_pipeline.serving.triton_server import TritonServer, models_to_load

    repo = tmp_path_factory.mktemp("obs-serving") / "model_repository"
    release.init_serving_repo(repo, obs_units["stable"].out_dir, profile="bf16-h100")
    srv = TritonServer(repo, models_to_load(repo), log_file=repo.parent / "server.log")
    srv.start()
    yield repo, srv
    srv.stop()


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
