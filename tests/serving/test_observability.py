"""Precision observability on a real tritonserver (CPU reference backend): the BLS's per-request
precision path and custom metrics on the server's own /metrics, `invoke probe` and its exporter.

One server for the module: stable release = the default model in FP32 (no checkpoint); a second
unit (the FP8 + FP8-KV test checkpoint) serves as canary, then as fallback. The probe's prompts and
reference come from the small gate run ``gate_dir`` (tests/serving/conftest.py, shared with test_rollout.py). The stable unit is
packed with ``deployment.otlp_endpoint`` = a real OTLP/HTTP receiver on 127.0.0.1 (``OtlpReceiver``,
decoding with opentelemetry-proto), so the server and its BLS trace every request to it.
"""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from precision_pipeline.serving import pack, probe, release, release_configs, release_state, release_units
from tests.serving.test_rollout import REPO_ROOT, pack_unit, serve_repository

pytestmark = pytest.mark.slow
MAX_TOKENS = 2


def _otlp_json_ids(obj):
    """OTLP/JSON writes trace and span ids as hex (OTLP specification, "JSON Protobuf Encoding"), where
    protobuf's JSON mapping expects base64: convert them in place before ``json_format.ParseDict``."""
    import base64

    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("traceId", "spanId", "parentSpanId") and isinstance(v, str):
                obj[k] = base64.b64encode(bytes.fromhex(v)).decode()
            else:
                _otlp_json_ids(v)
    elif isinstance(obj, list):
        for v in obj:
            _otlp_json_ids(v)
    return obj


class OtlpReceiver:
    """An OTLP/HTTP traces receiver on 127.0.0.1: ``POST /v1/traces`` bodies decoded as
    ``ExportTraceServiceRequest``, binary protobuf (the Python SDK's exporter) or OTLP/JSON (Triton 2.51's
    exporter sends ``application/json``); ``spans()`` = [(resource attrs, scope name, Span, content type)]."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                              ExportTraceServiceResponse)

        rx = self
        self.lock, self.items, self.bad = threading.Lock(), [], []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                from google.protobuf import json_format

                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                ctype = self.headers.get("Content-Type")
                if self.path != "/v1/traces" or ctype not in ("application/x-protobuf", "application/json"):
                    rx.bad.append((self.path, ctype))
                    self.send_response(404)
                    self.end_headers()
                    return
                if ctype == "application/json":
                    req = json_format.ParseDict(_otlp_json_ids(json.loads(body)), ExportTraceServiceRequest())
                else:
                    req = ExportTraceServiceRequest.FromString(body)
                with rx.lock:
                    for rs in req.resource_spans:
                        res = {a.key: a.value.string_value for a in rs.resource.attributes}
                        rx.items += [(res, ss.scope.name, sp, ctype) for ss in rs.scope_spans for sp in ss.spans]
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def spans(self):
        with self.lock:
            return list(self.items)

    def wait(self, pred, timeout_s=20.0):
        """The spans once ``pred(spans)`` holds (polled), else the spans at the timeout."""
        deadline = time.monotonic() + timeout_s
        while not pred(self.spans()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.spans()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def otlp_receiver():
    rx = OtlpReceiver()
    yield rx
    rx.close()


@pytest.fixture(scope="module")
def obs_units(tmp_path_factory, fp8_checkpoint, default_model_dir, otlp_receiver):
    base = tmp_path_factory.mktemp("obs-units")
    return {"stable": pack_unit(base, "stable", base / "no-checkpoint", Path(default_model_dir),
                                deployment={"otlp_endpoint": otlp_receiver.url}),
            "fp8": pack_unit(base, "fp8", Path(fp8_checkpoint), Path(default_model_dir), profile="fp8-h100")}


@pytest.fixture(scope="module")
def obs_served(tmp_path_factory, obs_units):
    # the BLS's BatchSpanProcessor (OTel SDK, OTEL_BSP_SCHEDULE_DELAY in ms) holds spans for 10 minutes here:
    # only its flush on unload (finalize) can deliver them while a test waits
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
        gen = serve_repository(tmp_path_factory, "obs-serving", obs_units["stable"])
        served = next(gen)
    yield served
    gen.close()


def _ask(srv, text="What is 2 + 2?", stream=False):
    from precision_pipeline.serving.triton_server import text_request

    c = srv.http_client()
    try:
        r = c.infer("tensorrt_llm_bls", text_request(text, MAX_TOKENS, **({"stream": ("BOOL", [[True]])} if stream else {})))
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
    return json.loads((release_units.resolve_unit_source(unit_dir) / pack.PRECISION_PATH_FILE).read_text())


def test_precision_path_per_request_and_server_metrics(obs_served, obs_units):
    from precision_pipeline.serving.rollout import metrics_url

    repo, srv = obs_served
    stable = release_state.read_state(repo)["current"]
    sp, cp = _unit_path(obs_units["stable"].out_dir), _unit_path(obs_units["fp8"].out_dir)
    assert sp["unit"] == stable and sp["gemm"] != cp["gemm"] and sp["kv"] != cp["kv"]
    cand = release_units.install_unit(repo, obs_units["fp8"].out_dir)
    srv.load(cand)
    release_configs.set_canary(repo, stable, cand, 50)
    try:
        params = [_ask(srv) for _ in range(4)]
        fams = _families(metrics_url(srv))
    finally:
        release_configs.point_bls(repo, stable)
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


def _attrs(span):
    """A protobuf Span's attributes as {key: str | int}."""
    out = {}
    for a in span.attributes:
        out[a.key] = a.value.int_value if a.value.WhichOneof("value") == "int_value" else a.value.string_value
    return out


def test_one_span_per_request_with_the_packed_path_on_a_real_otlp_receiver(obs_served, obs_units, otlp_receiver,
                                                                          default_model_dir):
    """The BLS sends one span per request to the profile's OTLP endpoint (the stable unit was packed with
    it): attributes = the serving unit's precision_path.json + the route + gen_ai usage, equal to what the
    response and the token counter say; a failed request's span has status ERROR; the spans leave on unload
    (finalize flushes); Triton's own tracing (same endpoint) is the span's parent."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

    from precision_pipeline.serving.rollout import metrics_url
    from precision_pipeline.serving.triton_server import TRACE_SERVICE_NAME, TRITON_BSP_DELAY_MS

    repo, srv = obs_served
    url = otlp_receiver.url + "/v1/traces"
    with urllib.request.urlopen(f"http://{srv.http_url}/v2/trace/setting", timeout=10) as r:
        setting = json.loads(r.read())
    assert (setting["trace_mode"], setting["url"], setting["trace_rate"], setting["bsp_schedule_delay"]) == (
        "opentelemetry", url, "1", str(TRITON_BSP_DELAY_MS))
    stable = release_state.read_state(repo)["current"]
    sp, cp = _unit_path(obs_units["stable"].out_dir), _unit_path(obs_units["fp8"].out_dir)
    assert sp["model"] == cp["model"] == Path(default_model_dir).name
    cand = release_units.install_unit(repo, obs_units["fp8"].out_dir)
    srv.load(cand)
    t0 = time.time_ns()
    tok0 = _families(metrics_url(srv))
    release_configs.set_canary(repo, stable, cand, 50)
    try:
        answers = [_ask(srv) for _ in range(4)]
        with pytest.raises(Exception, match="stream=true is not supported"):
            _ask(srv, stream=True)
        tok1 = _families(metrics_url(srv))
    finally:
        release_configs.point_bls(repo, stable)
    srv.unload("tensorrt_llm_bls")  # finalize: the BatchSpanProcessor flushes (obs_served: its schedule is 10 min)
    try:
        def ours(spans):
            return [(res, s) for res, scope, s, ctype in spans if scope == "precision_pipeline.tensorrt_llm_bls"
                    and s.start_time_unix_nano >= t0 and ctype == "application/x-protobuf"]

        got = ours(otlp_receiver.wait(lambda xs: len(ours(xs)) >= 5, timeout_s=10))
    finally:
        srv.load("tensorrt_llm_bls")
    assert len(got) == 5, got  # one span per request sent, the failed one included
    assert not otlp_receiver.bad
    assert all(res["service.name"] == TRACE_SERVICE_NAME for res, _ in got)
    ok = [s for _, s in got if s.status.code != Status.STATUS_CODE_ERROR]
    bad = [s for _, s in got if s.status.code == Status.STATUS_CODE_ERROR]
    assert len(ok) == 4 and len(bad) == 1
    assert _attrs(bad[0]) == {"gen_ai.operation.name": "chat", "error.type": "ValueError"}
    assert "stream=true" in bad[0].status.message
    by_route = {}
    for s, answer in zip(sorted(ok, key=lambda x: x.start_time_unix_nano), answers):
        a = _attrs(s)
        path = cp if a["precision.route"] == "canary" else sp
        assert answer["route"] == a["precision.route"] and answer["unit"] == a["precision.unit"]  # the response's path
        n_in, n_out = a.pop("gen_ai.usage.input_tokens"), a.pop("gen_ai.usage.output_tokens")
        assert a == {"gen_ai.operation.name": "chat", "gen_ai.request.model": path["model"],
                     "gen_ai.response.model": path["unit"], "gen_ai.request.max_tokens": MAX_TOKENS,
                     **{f"precision.{k}": v for k, v in path.items() if k != "model"},
                     "precision.route": a["precision.route"]}
        assert s.name == f"chat {path['model']}" and s.kind == Span.SPAN_KIND_SERVER
        assert s.status.code == Status.STATUS_CODE_UNSET
        t = by_route.setdefault(a["precision.route"], [0, 0])
        t[0], t[1] = t[0] + n_in, t[1] + n_out
    assert sorted(by_route) == ["canary", "stable"]
    for route, path in (("canary", cp), ("stable", sp)):  # the span's usage = what the tokens counter added
        for i, kind in enumerate(("input", "output")):
            before = sum(x.value for x in _samples(tok0, "precision_pipeline_tokens", route=route, engine_unit=path["unit"], kind=kind))
            after = sum(x.value for x in _samples(tok1, "precision_pipeline_tokens", route=route, engine_unit=path["unit"], kind=kind))
            assert by_route[route][i] == after - before > 0, (route, kind)
    # Triton's own spans (its exporter, same endpoint) arrive on its schedule: each BLS span is a child of one
    def triton_spans(xs):
        return {s.span_id: (res, s) for res, sc, s, _ in xs if sc != "precision_pipeline.tensorrt_llm_bls"}

    triton = triton_spans(otlp_receiver.wait(lambda xs: all(s.parent_span_id in triton_spans(xs) for _, s in got), timeout_s=15))
    for _, s in got:
        assert s.parent_span_id and s.parent_span_id in triton, "BLS span without its Triton parent"
        res, parent = triton[s.parent_span_id]
        assert parent.trace_id == s.trace_id and res.get("service.name") == TRACE_SERVICE_NAME


def test_invoke_probe_records_history(obs_served, gate_dir, invoke_here):
    """``invoke probe`` (run by Invoke's own program in this process, ``invoke_here``: no new Python importing torch)."""
    repo, srv = obs_served
    stable = release_state.read_state(repo)["current"]
    n0 = len(release_state.read_state(repo)["history"])
    p = invoke_here("probe", "--url", srv.http_url, "--repo", str(repo), "--gate", str(gate_dir), "--prompts", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    st = release_state.read_state(repo)
    assert len(st["history"]) == n0 + 1 and st["current"] == stable
    rec = st["history"][-1]
    assert rec["action"] == "probe" and rec["unit"] == stable and rec["from"] is None
    pr = rec["probe"]
    # the FP32 stable unit against the FP32 reference: the same numbers up to float noise
    assert pr["prompts"] == 2 and pr["tokens"] > 5 and pr["passed"] is True
    assert pr["kl_p99"] < 1e-3 and pr["top1"] == 1.0
    assert f"KL P99 {pr['kl_p99']:.4f}" in p.stdout


def test_probe_exporter_serves_the_result(obs_served, gate_dir):
    from precision_pipeline.serving.triton_server import free_port

    repo, srv = obs_served
    stable = release_state.read_state(repo)["current"]
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
    assert "error" in bad["probe"] and release_state.read_state(repo)["history"][-1]["probe"]["passed"] is False


PROMETHEUS = shutil.which("prometheus")


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian package prometheus)")
def test_real_prometheus_scrapes_server_and_probe_and_evaluates_rules(obs_served, gate_dir, tmp_path):
    """A real Prometheus scrapes the real server's /metrics and the probe exporter; the rendered rules
    are evaluated there (the fallback alert pending/firing is not waited for: `for: 5m`)."""
    import time

    import yaml

    from precision_pipeline.serving import monitoring
    from precision_pipeline.serving.triton_server import free_port

    repo, srv = obs_served
    stable = release_state.read_state(repo)["current"]
    _ask(srv)
    pset = probe.load_probe_set(gate_dir, prompts=1)
    ex_port, prom_port = free_port(), free_port()
    ex = probe.ProbeExporter(ex_port, addr="127.0.0.1")
    probe.probe_and_record(srv, stable, pset, profile="fp8-h100", exporter=ex)
    # fp8-h100's rules with a threshold the FP32 unit is below, and one it is above (the latter fires)
    groups = monitoring.alert_groups("fp8-h100", pset.thresholds.model_copy(update={"kl_p99_max": -1.0}))
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


# ---------------------------------------------------------------------------------------------
# per-request precision routing (issue 31) on this module's server

# fp8-h100-routed's table with two numbers made cheap (the shipped ones are tested without a server in
# test_bls_routing.py and test_routing.py): min_dwell_s 5 s, not 30 s (25 s less waiting), and prompt_tokens_over
# 256, not 2,048 (the CPU stand-in prefills 2,048 tokens in tens of CPU seconds, at FP32 on one thread)
ROUTING_DWELL_S, ROUTING_LONG_TOKENS = 5.0, 256
LONG_PROMPT = "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 30  # ~300 tokens


def _routed_unit(base, ckpt, model_dir):
    """fp8-h100-routed packed with the FP8 test checkpoint; min_dwell_s and prompt_tokens_over made cheap (above)."""
    from precision_pipeline.spec.profile import load_profile
    from tests.serving.test_pack import make_plan, with_limits

    prof = load_profile("fp8-h100-routed")
    rules = [r.model_copy(update={"signal": r.signal.model_copy(update={"min_dwell_s": ROUTING_DWELL_S})}) if r.signal
             else r.model_copy(update={"prompt_tokens_over": ROUTING_LONG_TOKENS}) if r.prompt_tokens_over else r
             for r in prof.routing.rules]
    prof = prof.model_copy(update={"routing": prof.routing.model_copy(update={"rules": rules})})
    d = base / "routed"
    return pack.pack_repository(with_limits(make_plan(prof), max_batch_size=32), prof, model_dir, ckpt, d / "engine",
                                False, d / "model_repository", str(d))


def _routed_ask(c, text, tier=None):
    """(precision_path dict, latency ms) of one BLS request with ``precision_tier`` = ``tier``."""
    from precision_pipeline.serving.triton_server import text_request

    t0 = time.perf_counter()
    r = c.infer("tensorrt_llm_bls", text_request(text, MAX_TOKENS), parameters={"precision_tier": tier} if tier else None)
    return json.loads(r.as_numpy("precision_path").reshape(-1)[0]), (time.perf_counter() - t0) * 1e3


def _wait_metric(srv, family, value, timeout_s=60.0, **match):
    from precision_pipeline.serving.rollout import metrics_url

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = [s.value for s in _samples(_families(metrics_url(srv)), family, **match)]
        if got == [value]:
            return True
        time.sleep(0.2)
    return False


def test_routing_on_a_live_server(obs_served, obs_units, otlp_receiver, fp8_checkpoint, default_model_dir, tmp_path):
    """fp8-h100-routed's table (dwell shortened) in the BLS of a real tritonserver: the primary = the FP8 unit, the
    warm fallback = the module's bf16-h100 unit. Long prompts and the strict tier go to the fallback, the rest to
    the primary (every response's precision_path); a burst of 24 clients of the project's load generator
    (benchmarks/_load.py) turns rule busy on (the server's queue depth for the BLS over 16: long prompts stay on
    the primary) and off again after the dwell, 2 switches; metrics and spans carry rule and reason."""
    import importlib.util
    import re

    from precision_pipeline.serving.rollout import metrics_url

    spec = importlib.util.spec_from_file_location("_load", REPO_ROOT / "benchmarks" / "_load.py")
    load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load)
    repo, srv = obs_served
    stable = release_state.read_state(repo)["current"]
    routed = _routed_unit(tmp_path, Path(fp8_checkpoint), Path(default_model_dir))
    release.set_fallback(repo, obs_units["stable"].out_dir, server=srv, warm=True, by="test")
    release.promote(repo, routed.out_dir, server=srv, profile="fp8-h100-routed", promoted_by="test")
    primary, c, lat = routed.engine_unit, srv.http_client(), {}
    try:
        t0 = time.time_ns()
        asked = []
        for text, tier, want in (("What is 2 + 2?", None, ("stable", primary, "default")),
                                 (LONG_PROMPT, None, ("fallback", stable, "long-prompts")),
                                 ("What is 2 + 2?", "strict", ("fallback", stable, "strict-tier")),
                                 ("What is 2 + 2?", "gold", ("stable", primary, "default"))):
            p, ms = _routed_ask(c, text, tier)
            asked.append(p)
            assert (p["route"], p["unit"], p["route_rule"]) == want, p
            lat.setdefault(want[2], []).append(ms)
        assert re.fullmatch(r"prompt_tokens \d+ > 256", asked[1]["route_reason"]) and asked[2]["route_reason"] == "tier strict"
        for _ in range(4):  # latencies per route (sequential, idle server)
            for text, tier, rule in (("What is 2 + 2?", None, "default"), ("What is 2 + 2?", "strict", "strict-tier")):
                lat[rule].append(_routed_ask(c, text, tier)[1])
        # a burst: the BLS's queue goes over 16, rule busy turns on, a long prompt stays on the primary
        burst = load.ClientLoad(srv.http_url, 24, 3, lambda cl, i: None if load.ask(cl, "tensorrt_llm_bls", "Hi", 2) else "empty")
        t_burst = time.monotonic()
        burst.start()
        try:
            assert _wait_metric(srv, "precision_pipeline_routing_rule_active", 1.0, rule="busy"), "busy never turned on"
            t_on = _samples(_families(metrics_url(srv)), "precision_pipeline_routing_last_switch_timestamp_seconds",
                            rule="busy")[0].value
            p, ms = _routed_ask(c, LONG_PROMPT)
            lat["busy (long prompt)"] = [ms]
        finally:
            burst.stop()
        assert (p["route"], p["unit"], p["route_rule"]) == ("stable", primary, "busy"), p
        assert p["route_reason"].startswith("inflight_requests > 16.0 (value ")
        # after the burst: quiet requests until the dwell has passed and the queue is under 8 -> off
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and [s.value for s in _samples(
                _families(metrics_url(srv)), "precision_pipeline_routing_rule_active", rule="busy")] != [0.0]:
            _routed_ask(c, "Hi")
            time.sleep(0.2)
        p, ms = _routed_ask(c, LONG_PROMPT)
        lat["long-prompts"].append(ms)
        assert (p["route"], p["unit"], p["route_rule"]) == ("fallback", stable, "long-prompts"), p
        fams = _families(metrics_url(srv))
        switches = {s.labels["to"]: s.value for s in _samples(fams, "precision_pipeline_routing_switches", rule="busy")}
        t_off = _samples(fams, "precision_pipeline_routing_last_switch_timestamp_seconds", rule="busy")[0].value
        burst_s = time.monotonic() - t_burst
        assert switches == {"on": 1.0, "off": 1.0}, switches  # no flapping: one on, one off
        assert t_off - t_on >= ROUTING_DWELL_S
        assert burst.stats["failed"] == 0 and burst.stats["requests"] >= 24, burst.stats
        by_rule = {s.labels["route_rule"]: s.value for s in _samples(fams, "precision_pipeline_requests", engine_unit=primary)}
        assert by_rule.get("busy", 0) >= 1 and by_rule["default"] >= 6, by_rule
        assert [s.value for s in _samples(fams, "precision_pipeline_requests", engine_unit=stable,
                                          route_rule="strict-tier")] == [5.0]
        assert _samples(fams, "precision_pipeline_request_failures") == []
        print(f"\nrouting live: busy on->off {t_off - t_on:.1f} s (dwell {ROUTING_DWELL_S} s), switches {switches}, "
              f"burst {burst.stats['requests']} requests / {burst_s:.1f} s, failed {burst.stats['failed']}; latency ms "
              + ", ".join(f"{k} {sorted(v)[len(v) // 2]:.0f} (n={len(v)})" for k, v in lat.items()))
    finally:
        c.close()
        release.rollback(repo, to=stable, server=srv, by="test")
    srv.unload("tensorrt_llm_bls")  # the spans leave on unload (obs_served: the processor's schedule is 10 min)
    try:
        def ours(spans):
            return [s for _, scope, s, _ in spans if scope == "precision_pipeline.tensorrt_llm_bls"
                    and s.start_time_unix_nano >= t0]

        got = sorted(ours(otlp_receiver.wait(lambda xs: len(ours(xs)) >= 4, timeout_s=10)), key=lambda s: s.start_time_unix_nano)
    finally:
        srv.load("tensorrt_llm_bls")
    for s, p in zip(got[:4], asked):  # the first four requests: the span says what the response says
        a = _attrs(s)
        assert (a["precision.route"], a["precision.unit"], a["precision.route_rule"], a["precision.route_reason"]) == (
            p["route"], p["unit"], p["route_rule"], p["route_reason"])
