"""The Grafana dashboard of one deployment (``<out>/k8s/monitoring/grafana-dashboard.yaml``, a ConfigMap
with label ``grafana_dashboard: "1"``, the label Grafana's dashboard sidecar of kube-prometheus-stack
watches by default).

``dashboard(plan, profile, name) -> dict``: Grafana dashboard JSON (schemaVersion 39, Prometheus
datasource variable ``datasource``). Panels: requests and generated tokens per second by precision
path (the BLS's metrics), probe KL P99 and top-1 against the profile's gate thresholds, rollout
canary share and fallback state, traffic per routing rule and the signal rules' switches (the profile's
``routing`` section, spec/routing.py), KV-cache blocks of the tensorrtllm backend, and GPU memory-interface
activity from the DCGM exporter beside what the plan predicts.

Every metric a panel queries is in ``METRIC_SOURCES`` with where it is defined (ours: the module that
exports it; Triton's, the tensorrtllm backend's and DCGM's: their documentation). What needs a GPU
(the tensorrtllm backend's and DCGM's series) is empty on the CPU reference server: the dashboard
shows "No data" there, never invented numbers.

The predicted memory-interface activity is an upper bound at batch size 1: every generated token
reads the weights on the GPU once (``memory.weight_gib_per_gpu``) and its KV cache
(``kv_bytes_per_token`` x tokens in context is not known per request, so it is left out), divided by
the GPU's bandwidth (``spec/hardware.py`` ``bandwidth_gbs``). With in-flight batching one weight read
serves several tokens, so measured activity below the line is expected; above it means the engine
moves more bytes than its precision plan says (e.g. a path that runs wider formats).
"""

from __future__ import annotations

import json
import re
from typing import Any

from precision_pipeline.serving.probe import PROBE_GAUGES, PROBE_LAST_RUN

BLS_METRICS = ("precision_pipeline_requests_total", "precision_pipeline_request_failures_total",
               "precision_pipeline_tokens_total", "precision_pipeline_rollout_canary_percent",
               "precision_pipeline_fallback_active", "precision_pipeline_routing_switches_total",
               "precision_pipeline_routing_last_switch_timestamp_seconds", "precision_pipeline_routing_rule_active")
"""Families the BLS exports (triton_repo/all_models/inflight_batcher_llm/tensorrt_llm_bls/1/model.py)."""

METRIC_SOURCES: dict[str, str] = {
    **{m: "ours: tensorrt_llm_bls/1/model.py (pb_utils.MetricFamily)" for m in BLS_METRICS},
    **{m: "ours: serving/probe.py ProbeExporter" for m in (*PROBE_GAUGES, PROBE_LAST_RUN, "precision_pipeline_probe_runs_total")},
    "nv_inference_request_success": "Triton server docs, user_guide/metrics.md (inference request metrics)",
    "nv_inference_request_failure": "Triton server docs, user_guide/metrics.md (inference request metrics)",
    "nv_trt_llm_kv_cache_block_metrics": "tensorrtllm_backend inflight_batcher_llm/src/custom_metrics_reporter/"
                                         "custom_metrics_reporter.cc, gauge family with label kv_cache_block_type = "
                                         "max / free / used / tokens_per / reused / fraction",
    "DCGM_FI_PROF_DRAM_ACTIVE": "DCGM field identifiers (dcgm-exporter default-counters.csv): ratio of cycles the device memory interface is active",
}


def _target(expr: str, legend: str, ref: str) -> dict:
    return {"datasource": {"type": "prometheus", "uid": "${datasource}"}, "expr": expr, "legendFormat": legend, "refId": ref}


def _panel(pid: int, title: str, targets: list[dict], *, y: int, x: int = 0, unit: str = "short", desc: str = "",
           kind: str = "timeseries") -> dict:
    return {"id": pid, "type": kind, "title": title, "description": desc,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "targets": targets}


def dashboard(plan, profile, name: str) -> dict:
    """The dashboard JSON (module doc). ``name``: the deployment's Kubernetes name (its title and uid)."""
    from precision_pipeline.gate.metrics import CHECKS

    pname = plan.profile.name or profile.name
    sel = f'profile="{pname}"'
    thr = profile.gate.for_model(plan.model.name)
    panels = [
        _panel(1, "Requests/s by precision path", [_target(
            f"sum by (engine_unit, gemm, kv, context_fmha, route) (rate(precision_pipeline_requests_total{{{sel}}}[5m]))",
            "{{route}} {{engine_unit}} {{gemm}}/{{kv}} fmha {{context_fmha}}", "A")], y=0, unit="reqps",
            desc="BLS requests by the precision path that served them (stable, canary, fallback)."),
        _panel(2, "Generated tokens/s by precision path", [_target(
            f'sum by (engine_unit, route) (rate(precision_pipeline_tokens_total{{{sel},kind="output"}}[5m]))',
            "{{route}} {{engine_unit}}", "A")], y=0, x=12, unit="short"),
    ]
    y = 8
    for i, (key, metric) in enumerate((("kl_p99", "precision_pipeline_probe_kl_p99"), ("top1", "precision_pipeline_probe_top1"))):
        field_name, op = CHECKS[key]
        v = getattr(thr, field_name)
        targets = [_target(f"max by (engine_unit, route) ({metric}{{{sel}}})", "probe {{engine_unit}} (route {{route}})", "A")]
        if v is not None:
            targets.append(_target(f"max({metric}_threshold{{{sel}}})", f"gate threshold ({op} {v!r})", "B"))
        panels.append(_panel(3 + i, f"Probe {key} vs gate threshold", targets, y=y, x=12 * i,
                             desc="Golden-prompt probe of the live server against the gate's FP32 reference (invoke probe)."))
    y += 8
    panels.append(_panel(5, "Rollout canary share and fallback", [
        _target("max(precision_pipeline_rollout_canary_percent)", "canary %", "A"),
        _target("max(precision_pipeline_fallback_active) * 100", "fallback active (100 = yes)", "B")], y=y, unit="percent"))
    panels.append(_panel(6, "Probe age", [_target(f"time() - max by (engine_unit, route) ({PROBE_LAST_RUN}{{{sel}}})",
                                                  "{{engine_unit}} (route {{route}})", "A")], y=y, x=12, unit="s"))
    y += 8
    panels.append(_panel(7, "KV-cache blocks (tensorrtllm backend; GPU only)", [
        _target('sum(nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used"})', "used", "A"),
        _target('sum(nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"})', "max", "B"),
        _target('sum(nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="reused"})', "reused (prefix reuse)", "C")], y=y,
        desc="The tensorrtllm backend's KV-cache block gauges (used / max blocks and blocks reused from earlier "
             "requests' prefixes, enable_kv_cache_reuse). Empty on the CPU reference server."))
    gpu = plan.gpu
    mem = plan.memory
    targets = [_target("avg(DCGM_FI_PROF_DRAM_ACTIVE)", "measured (DCGM)", "A")]
    if gpu is not None and mem is not None and gpu.bandwidth_gbs:
        per_token = mem.weight_gib_per_gpu * 2**30 / (gpu.bandwidth_gbs * 1e9)  # seconds of the full bandwidth per token
        targets.append(_target(f'clamp_max(sum(rate(precision_pipeline_tokens_total{{{sel},kind="output"}}[5m])) * {per_token:.6g}, 1)',
                               "plan, batch 1 (upper bound)", "B"))
    panels.append(_panel(8, "GPU memory-interface activity: measured vs plan", targets, y=y, x=12, unit="percentunit",
                         desc="DCGM exporter (GPU only) vs weight bytes per generated token / GPU bandwidth (module doc)."))
    y += 8
    panels.append(_panel(9, "Requests/s by routing rule", [_target(
        f"sum by (route_rule, route, engine_unit) (rate(precision_pipeline_requests_total{{{sel}}}[5m]))",
        "{{route_rule}} -> {{route}} {{engine_unit}}", "A")], y=y, unit="reqps",
        desc="Per-request precision routing: the rule that chose each request's unit (empty rule: no routing table)."))
    panels.append(_panel(10, "Routing signal rules: switches and time since the last", [
        _target("sum by (rule, to) (increase(precision_pipeline_routing_switches_total[1h]))", "{{rule}} to {{to}} (1 h)", "A"),
        _target("time() - max by (rule) (precision_pipeline_routing_last_switch_timestamp_seconds)",
                "{{rule}}: seconds since the last switch", "B"),
        _target("max by (rule) (precision_pipeline_routing_rule_active)", "{{rule}} on", "C")], y=y, x=12,
        desc="Hysteresis and min_dwell_s keep switches rare; many switches per hour: widen the band."))
    return {"title": f"{name} precision", "uid": re.sub(r"[^a-zA-Z0-9-]", "-", name)[:40], "schemaVersion": 39,
            "tags": ["precision-pipeline", pname], "time": {"from": "now-6h", "to": "now"}, "refresh": "30s",
            "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}]},
            "panels": panels}


def expressions(dash: dict) -> list[str]:
    """Every PromQL expression of a dashboard."""
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


_NAME = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{|\[|\)|$)")
_FUNCS = {"sum", "max", "min", "avg", "rate", "increase", "time", "clamp_max", "clamp_min", "absent", "by"}


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (identifiers followed by a selector, range or a closing
    parenthesis; label names inside ``{}`` and ``by (...)`` lists are skipped)."""
    text = re.sub(r"\{[^}]*\}", "{}", expr)
    text = re.sub(r"by\s*\([^)]*\)", "", text)
    return {m for m in _NAME.findall(text) if m not in _FUNCS}


def to_json(dash: dict) -> str:
    return json.dumps(dash, indent=2, sort_keys=False) + "\n"


__all__: list[Any] = ["dashboard", "expressions", "metric_names", "METRIC_SOURCES", "BLS_METRICS", "to_json"]
