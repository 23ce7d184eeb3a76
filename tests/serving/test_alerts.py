"""The PrometheusRule deploy renders (k8s/monitoring/prometheus-rule.yaml), checked by promtool.

promtool comes with Debian's ``prometheus`` package (``./run.sh test`` installs it when it can);
without it the promtool tests are skipped, the rendering checks still run. ``promtool test rules``
gets series that must fire and series that must not: a probe KL P99 above / below fp8-h100's gate
threshold for the default model, a fresh and a stale probe, the fallback gauge.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from precision_pipeline.serving import deploy
from tests.serving.test_deploy import REPO_ROOT_IN_POD, make_plan, make_profile, make_repo

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("alerts")
    prof = make_profile()
    plan = make_plan(prof)
    res = deploy.render_manifests(deploy.ManifestInputs(plan, prof, make_repo(tmp / "build"), REPO_ROOT_IN_POD), tmp / "build")
    doc = yaml.safe_load((res.out_dir / "monitoring" / "prometheus-rule.yaml").read_text())
    return res, doc, prof.gate.for_model(plan.model.name), tmp


ROUTE = "strict-tier,long-prompts"


def test_rule_rendered_apart_with_the_gate_thresholds(rendered):
    res, doc, thr, _ = rendered
    assert res.monitoring == ["monitoring/grafana-dashboard.yaml", "monitoring/prometheus-rule.yaml"]
    assert not [f for f in res.files if f.startswith("monitoring")]
    assert doc["kind"] == "PrometheusRule" and doc["metadata"]["name"] == res.name
    rules = {r["alert"]: r for r in doc["spec"]["groups"][0]["rules"]}
    assert rules["PrecisionProbeKlP99AboveGate"]["expr"] == (
        f'max by (engine_unit, route) (precision_pipeline_probe_kl_p99{{profile="fp8-h100"}}) > {thr.kl_p99_max!r}')
    assert rules["PrecisionProbeTop1BelowGate"]["expr"].endswith(f"< {thr.top1_min!r}")
    assert set(rules) >= {"PrecisionProbeStale", "PrecisionProbeAbsent", "PrecisionProbeErrors", "PrecisionFallbackActive"}


def test_rule_schema_refuses_unknown_fields(rendered):
    from precision_pipeline.core.errors import UserError

    _, doc, _, _ = rendered
    bad = yaml.safe_load(yaml.safe_dump(doc))
    bad["spec"]["groups"][0]["rules"][0]["exprr"] = "1"
    with pytest.raises(UserError):
        deploy.validate_manifest(bad, "k8s/monitoring/prometheus-rule.yaml")


def _rules_file(doc, tmp: Path) -> Path:
    p = tmp / "rules.yaml"
    p.write_text(yaml.safe_dump({"groups": doc["spec"]["groups"]}, sort_keys=False))
    return p


@needs_promtool
def test_promtool_check_rules(rendered):
    _, doc, _, tmp = rendered
    r = subprocess.run([PROMTOOL, "check", "rules", str(_rules_file(doc, tmp))], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(doc['spec']['groups'][0]['rules'])} rules found" in r.stdout + r.stderr


@needs_promtool
def test_promtool_unit_tests_fire_and_stay_quiet(rendered):
    _, doc, thr, tmp = rendered
    rules = _rules_file(doc, tmp)
    # good: exactly at both gate thresholds (the gate passes there: kl_p99 <= max, top1 >= min); bad: beyond both
    hi, lo = round(thr.kl_p99_max * 2, 6), thr.kl_p99_max
    t1_bad = round(thr.top1_min - 0.1, 6)
    # issue 31: the bad unit is a routed fallback; its alerts keep the route label and name the route
    good, bad = 'profile="fp8-h100",engine_unit="tensorrt_llm_good"', \
        'profile="fp8-h100",engine_unit="tensorrt_llm_bad",route="strict-tier,long-prompts"'
    # series values at 1m steps; time() at the evaluation time in seconds since 0
    tests = {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": [
        {"interval": "1m",
         "input_series": [
             {"series": f"precision_pipeline_probe_kl_p99{{{good}}}", "values": f"{lo}x20"},
             {"series": f"precision_pipeline_probe_kl_p99{{{bad}}}", "values": f"{hi}x20"},
             {"series": f"precision_pipeline_probe_top1{{{good}}}", "values": f"{thr.top1_min!r}x20"},
             {"series": f"precision_pipeline_probe_top1{{{bad}}}", "values": f"1x2 {t1_bad}x20"},
             # good: probed every minute (timestamp = now); bad: last run at t = 0
             {"series": f"precision_pipeline_probe_last_run_timestamp_seconds{{{good}}}", "values": "0+60x40"},
             {"series": f"precision_pipeline_probe_last_run_timestamp_seconds{{{bad}}}", "values": "0x40"},
             {"series": 'precision_pipeline_fallback_active{model="tensorrt_llm_bls"}', "values": "0x5 1x20"},
         ],
         "alert_rule_test": [
             {"eval_time": "10m", "alertname": "PrecisionProbeKlP99AboveGate",
              "exp_alerts": [{"exp_labels": {"severity": "critical", "engine_unit": "tensorrt_llm_bad", "route": ROUTE},
                              "exp_annotations": {
                                  "summary": f"live kl_p99 of tensorrt_llm_bad (route {ROUTE}) beyond the gate (<= {thr.kl_p99_max!r})",
                                  "description": f"The golden-prompt probe of profile fp8-h100 measured kl_p99 = {hi!r} "
                                                 f"on the live server; the gate allows <= {thr.kl_p99_max!r}."}}]},
             {"eval_time": "3m", "alertname": "PrecisionProbeKlP99AboveGate", "exp_alerts": []},  # not for 5m yet
             # top-1 below the gate from minute 2 on: fires once it held for 5 minutes, for the bad unit only
             {"eval_time": "6m", "alertname": "PrecisionProbeTop1BelowGate", "exp_alerts": []},
             {"eval_time": "10m", "alertname": "PrecisionProbeTop1BelowGate",
              "exp_alerts": [{"exp_labels": {"severity": "critical", "engine_unit": "tensorrt_llm_bad", "route": ROUTE},
                              "exp_annotations": {
                                  "summary": f"live top1 of tensorrt_llm_bad (route {ROUTE}) beyond the gate (>= {thr.top1_min!r})",
                                  "description": f"The golden-prompt probe of profile fp8-h100 measured top1 = {t1_bad!r} "
                                                 f"on the live server; the gate allows >= {thr.top1_min!r}."}}]},
             {"eval_time": "20m", "alertname": "PrecisionProbeStale", "exp_alerts": []},
             {"eval_time": "31m", "alertname": "PrecisionProbeStale",
              "exp_alerts": [{"exp_labels": {"severity": "warning", "engine_unit": "tensorrt_llm_bad", "route": ROUTE},
                              "exp_annotations": {"summary": f"no probe run of tensorrt_llm_bad (route {ROUTE}) for over 1800 s"}}]},
             {"eval_time": "31m", "alertname": "PrecisionProbeAbsent", "exp_alerts": []},
             {"eval_time": "8m", "alertname": "PrecisionFallbackActive", "exp_alerts": []},
             {"eval_time": "12m", "alertname": "PrecisionFallbackActive",
              "exp_alerts": [{"exp_labels": {"severity": "warning"},
                              "exp_annotations": {"summary": "the BLS serves the fallback release (releases.json fallback)"}}]},
         ]},
        {"interval": "1m", "input_series": [],
         "alert_rule_test": [
             {"eval_time": "29m", "alertname": "PrecisionProbeAbsent", "exp_alerts": []},
             {"eval_time": "31m", "alertname": "PrecisionProbeAbsent",
              "exp_alerts": [{"exp_labels": {"severity": "warning", "profile": "fp8-h100"},
                              "exp_annotations": {"summary": "the accuracy probe of profile fp8-h100 exports nothing"}}]}]},
    ]}
    tf = tmp / "rules_test.yaml"
    tf.write_text(yaml.safe_dump(tests, sort_keys=False))
    r = subprocess.run([PROMTOOL, "test", "rules", str(tf)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def _dashboard(rendered):
    import json

    res, _, _, _ = rendered
    cm = yaml.safe_load((res.out_dir / "monitoring" / "grafana-dashboard.yaml").read_text())
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = cm["data"].values()
    return json.loads(text)


def test_every_metric_is_exported_or_documented(rendered):
    """Dashboard and rules query only metrics in dashboard.METRIC_SOURCES; the ones we claim are ours
    are exported by the BLS model file or the probe exporter under exactly those names."""
    from prometheus_client import generate_latest

    from precision_pipeline.serving import dashboard, probe

    _, doc, _, _ = rendered
    exprs = dashboard.expressions(_dashboard(rendered)) + [r["expr"] for r in doc["spec"]["groups"][0]["rules"]]
    used = set().union(*(dashboard.metric_names(e) for e in exprs))
    assert used <= set(dashboard.METRIC_SOURCES), used - set(dashboard.METRIC_SOURCES)
    assert {"precision_pipeline_requests_total", "precision_pipeline_probe_kl_p99", "DCGM_FI_PROF_DRAM_ACTIVE",
            "nv_trt_llm_kv_cache_block_metrics", "precision_pipeline_fallback_active",
            "precision_pipeline_routing_switches_total", "precision_pipeline_routing_last_switch_timestamp_seconds"} <= used
    bls = (Path(__file__).resolve().parents[2] / "triton_repo" / "all_models" / "inflight_batcher_llm" / "tensorrt_llm_bls"
           / "1" / "model.py").read_text()
    ex = probe.ProbeExporter(None)
    ex.observe("p", "u", None)
    exported = generate_latest(ex.registry).decode()
    for m, src in dashboard.METRIC_SOURCES.items():
        if "tensorrt_llm_bls" in src:
            assert f'name="{m}"' in bls, m
        elif "ProbeExporter" in src:
            assert f"# HELP {m} " in exported or f"# HELP {m.removesuffix('_total')} " in exported, m


@needs_promtool
def test_dashboard_promql_parses(rendered):
    """promtool parses every dashboard expression (as recording rules: ``promtool check rules``)."""
    from precision_pipeline.serving import dashboard

    _, _, _, tmp = rendered
    exprs = dashboard.expressions(_dashboard(rendered))
    f = tmp / "dashboard_rules.yaml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr{i}", "expr": e} for i, e in enumerate(exprs)]}]}))
    r = subprocess.run([PROMTOOL, "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in r.stdout
    f.write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": [{"record": "x:y", "expr": exprs[0] + ")"}]}]}))
    assert subprocess.run([PROMTOOL, "check", "rules", str(f)], capture_output=True, text=True).returncode != 0
