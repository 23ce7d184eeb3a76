"""The BLS applying the routing table per request (issue 31), without a server: tensorrt_llm_bls/1/model.py loaded
with a recording stand-in of ``triton_python_backend_utils`` (metrics, logger), on a repository laid out as a
serving repository (route.json, releases.json, the stable unit's routing.json). Fast; the live test on a real
tritonserver is tests/serving/test_observability.py ``test_routing_on_a_live_server``."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import types

import numpy as np
import pytest

from precision_pipeline.serving import pack
from precision_pipeline.serving.triton_server import METRICS_URL_ENV
from precision_pipeline.spec.profile import load_profile
from precision_pipeline.spec.routing import TIER_PARAMETER, routing_table

BLS_DIR = pack.TEMPLATES_DIR / "tensorrt_llm_bls" / "1"
STABLE, FALLBACK, CAND = "tensorrt_llm_aaaaaaaaaaaa", "tensorrt_llm_bbbbbbbbbbbb", "tensorrt_llm_cccccccccccc"


class _Metric:
    def __init__(self, family, labels):
        self.family, self.labels, self.value = family, labels, 0.0
        family.metrics.append(self)

    def increment(self, v):
        self.value += v

    def set(self, v):
        self.value = v


class _Family:
    COUNTER, GAUGE = "counter", "gauge"
    made: list = []

    def __init__(self, name, kind, description):
        self.name, self.metrics = name, []
        _Family.made.append(self)

    def Metric(self, labels):
        return _Metric(self, labels)


@pytest.fixture
def bls(monkeypatch, tmp_path):
    """(module, make(table=None, fallback=None, canary=None, stable=STABLE) -> an initialized TritonPythonModel
    whose current release is ``stable`` (a unit under ``tmp_path / "model_repository"``), logged lines)."""
    logged = []
    stub = types.ModuleType("triton_python_backend_utils")
    stub.MetricFamily = _Family
    stub.TritonModelException = RuntimeError
    stub.using_decoupled_model_transaction_policy = lambda cfg: False
    stub.Logger = types.SimpleNamespace(log_error=logged.append, log_warn=logged.append, log_info=logged.append)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub)
    monkeypatch.setenv(METRICS_URL_ENV, "http://127.0.0.1:9/metrics")  # nothing listens: signals stay unknown
    _Family.made = []
    spec = importlib.util.spec_from_file_location("_bls_model", BLS_DIR / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    repo = tmp_path / "model_repository"
    for unit in (STABLE, FALLBACK, CAND):
        (repo / unit).mkdir(parents=True)
        (repo / unit / "precision_path.json").write_text(json.dumps({"profile": unit[-1], "gemm": "g"}))
    (repo / "tensorrt_llm_bls").mkdir()

    def make(table=None, fallback=None, canary=None, stable=STABLE):
        if table is not None:
            (repo / stable / "routing.json").write_text(json.dumps(table))
        (tmp_path / "releases.json").write_text(json.dumps({"current": stable, "fallback": fallback}))
        route = {"tensorrt_llm_model_name": stable, **({"canary": canary} if canary else {})}
        (repo / "tensorrt_llm_bls" / "route.json").write_text(json.dumps(route))
        m = mod.TritonPythonModel()
        cfg = {"parameters": {"tensorrt_llm_model_name": {"string_value": stable}}}
        m.initialize({"model_config": json.dumps(cfg), "model_repository": str(repo / "tensorrt_llm_bls")})
        return m

    yield mod, make, logged


class _Request:
    def __init__(self, params=None):
        self.params = params

    def parameters(self):
        return "" if self.params is None else json.dumps(self.params)


def choose(m, prompt_tokens=10, max_tokens=8, tier=None, params=None):
    pre = {"REQUEST_INPUT_LEN": np.array([[prompt_tokens]], np.int32)}
    req = _Request({TIER_PARAMETER: tier} if tier else params)
    return m._choose(req, lambda name: np.array([[max_tokens]], np.int32) if name == "max_tokens" else None, pre)


def samples(name):
    return {tuple(sorted(x.labels.items())): x.value for f in _Family.made if f.name == name for x in f.metrics}


ROUTED = routing_table(load_profile("fp8-h100-routed").routing)


def test_shipped_table_sends_long_and_strict_requests_to_the_fallback(bls):
    _, make, _ = bls
    m = make(ROUTED, fallback=FALLBACK)
    assert choose(m) == (STABLE, ("default", "default"))
    assert choose(m, prompt_tokens=2049) == (FALLBACK, ("long-prompts", "prompt_tokens 2049 > 2048"))
    assert choose(m, prompt_tokens=2048) == (STABLE, ("default", "default"))
    assert choose(m, tier="strict") == (FALLBACK, ("strict-tier", "tier strict"))
    assert choose(m, params={TIER_PARAMETER: 3}) == (STABLE, ("default", "default"))  # not a tier name
    # the longest row decides for a batch
    pre = {"REQUEST_INPUT_LEN": np.array([[5], [3000]], np.int32)}
    assert m._choose(_Request(), lambda n: np.array([[8], [8]], np.int32), pre)[0] == FALLBACK


def test_an_llm_api_release_routes_by_the_table_its_pack_wrote(bls, tmp_path):
    """Issue 31 (b): an LLM-API unit packed from a routed profile carries routing.json (serving/llmapi_unit.py
    ``pack_llm_api_unit``, ``routing=``), and the BLS serving that release routes by it as for an engine unit."""
    from precision_pipeline.serving import llmapi_unit as U
    from tests.serving.test_llmapi_contract import MODEL_YAML

    _, make, _ = bls
    ckpt = tmp_path / "hf_checkpoint"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    repo = tmp_path / "model_repository"
    u = U.pack_llm_api_unit(repo, MODEL_YAML, ckpt, tmp_path, "/srv/out", {"profile": "p"}, version="1.2.1",
                            routing=ROUTED)
    assert json.loads((repo / u.name / "routing.json").read_text()) == ROUTED
    assert "routing.json" in u.unit_files  # part of the content key: another table, another unit
    m = make(None, fallback=FALLBACK, stable=u.name)
    assert choose(m) == (u.name, ("default", "default"))
    assert choose(m, prompt_tokens=3000) == (FALLBACK, ("long-prompts", "prompt_tokens 3000 > 2048"))
    assert choose(m, tier="strict") == (FALLBACK, ("strict-tier", "tier strict"))


def test_no_table_no_decision_and_no_fallback_serves_the_primary(bls):
    _, make, _ = bls
    assert choose(make(None, fallback=FALLBACK), prompt_tokens=5000) == (STABLE, None)
    m = make(ROUTED, fallback=None)
    unit, (rule, why) = choose(m, tier="strict")
    assert unit == STABLE and rule == "strict-tier" and why.endswith("releases.json has no fallback unit: the primary serves it")


def test_a_broken_table_is_logged_and_every_request_goes_to_the_primary(bls):
    _, make, logged = bls
    m = make({"version": 1, "rules": [{"name": "x", "target": "elsewhere", "when": {}}]}, fallback=FALLBACK)
    assert choose(m, tier="strict") == (STABLE, None)
    assert len(logged) == 1 and "routing.json" in logged[0] and "needs a name and a target" in logged[0]
    assert choose(m, tier="strict") == (STABLE, None) and len(logged) == 1  # logged once per change of the file


def test_the_canary_takes_its_share_of_the_primary_requests_only(bls):
    _, make, _ = bls
    m = make(ROUTED, fallback=FALLBACK, canary={"tensorrt_llm_model_name": CAND, "percent": 50})
    units = [choose(m, tier="strict")[0] for _ in range(4)] + [choose(m)[0] for _ in range(4)]
    assert units == [FALLBACK] * 4 + [STABLE, CAND, STABLE, CAND]


def test_signal_rule_switches_with_dwell_and_counts_on_metrics(bls, monkeypatch):
    mod, make, _ = bls
    # the signals come from this test: the model's scrape thread (nothing listens at its URL) would set them to {}
    # whenever its first failed scrape lands -- under load, between an assignment below and its choose (seen in CI)
    monkeypatch.setattr(mod.TritonPythonModel, "_scrape_loop", lambda self: None)
    m = make(ROUTED, fallback=FALLBACK)
    clock = [100.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: clock[0])
    trace = [(0, 3), (1, 20), (2, 3), (20, 3), (31, 3), (32, 20)]  # (seconds, queue depth)
    rules = []
    for t, depth in trace:
        clock[0], m.signals = 100.0 + t, {"inflight_requests": float(depth)}
        rules.append(choose(m, prompt_tokens=3000)[1][0])
    # busy turns on at 1 s; back under release_below at 2 s but the 30 s dwell holds it until 31 s
    assert rules == ["long-prompts", "busy", "busy", "busy", "long-prompts", "long-prompts"]
    assert samples("precision_pipeline_routing_switches_total") == {(("rule", "busy"), ("to", "on")): 1.0,
                                                                    (("rule", "busy"), ("to", "off")): 1.0}
    assert samples("precision_pipeline_routing_rule_active") == {(("rule", "busy"),): 0.0}
    assert samples("precision_pipeline_routing_signal") == {(("name", "inflight_requests"),): 20.0}
    assert list(samples("precision_pipeline_routing_last_switch_timestamp_seconds")) == [(("rule", "busy"),)]


def test_signals_from_the_servers_metrics_text():
    from precision_pipeline.spec.routing import evaluator

    text = "\n".join([
        "# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.",
        "# TYPE nv_inference_pending_request_count gauge",
        'nv_inference_pending_request_count{model="tensorrt_llm_bls",version="1"} 17',
        'nv_inference_pending_request_count{model="preprocessing",version="1"} 40',
        f'nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="used",model="{STABLE}",version="1"}} 30',
        f'nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="max",model="{STABLE}",version="1"}} 120',
        f'nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="max",model="{FALLBACK}",version="1"}} 999',
        'nv_inference_pending_request_count_other{model="tensorrt_llm_bls"} 5'])
    ev = evaluator()
    assert ev.signals_from_metrics(text, "tensorrt_llm_bls", STABLE) == {"inflight_requests": 17.0,
                                                                         "kv_cache_utilization": 0.25}
    assert ev.signals_from_metrics(text.replace("tensorrt_llm_bls", "x"), "tensorrt_llm_bls", FALLBACK) == {}


def test_the_bls_and_the_pipeline_agree_on_names():
    from precision_pipeline.serving.triton_server import METRICS_URL_ENV as env

    text = (BLS_DIR / "model.py").read_text()
    for const, value in (("ROUTING_FILE", pack.ROUTING_FILE), ("TIER_PARAMETER", TIER_PARAMETER),
                         ("METRICS_URL_ENV", env)):
        assert re.search(rf'^{const} = "([^"]+)"', text, re.M).group(1) == value, const
    from precision_pipeline.serving.k8s import METRICS_PORT  # the Deployment's --metrics-port: the BLS's default

    assert re.search(r'^DEFAULT_METRICS_URL = "([^"]+)"', text, re.M).group(1) == f"http://127.0.0.1:{METRICS_PORT}/metrics"
