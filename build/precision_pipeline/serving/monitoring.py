"""What watches a deployment: the in-cluster accuracy probe (serving/probe.py as a long-lived Deployment and its
PodMonitor), the canary Service and Argo Rollouts analysis of ``deployment.workload: argo-rollout``, and the
PrometheusRule's alerts. Parameters for the templates in ``k8s/`` (serving/deploy.py renders and validates them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from precision_pipeline.serving.k8s import HTTP_PORT, LABEL_PREFIX, TMP_SIZE
from precision_pipeline.serving.probe import PROBE_LAST_RUN, PROBE_METRIC_NAMES

GATE_SUBDIR = "gate"
"""The build's gate output next to ``model_repository`` (metrics.json, per_token.npz): what the probe reads."""
SOURCE_DIR = "/workspace/precision-pipeline"
"""The repository checkout inside the image of cluster-side jobs (the nightly CronJob, the probe): bake it into a
derived image of the serving image (its ``.venv`` set up: the root filesystem is read-only)."""
PROBE_METRICS_PORT = 8004
PROBE_EVERY_S = 600
PROBE_FIRST_RESULT_S = 180
"""The AnalysisTemplate's ``initialDelay`` of the probe metrics: the canary's first probe result needs a
probe retry after the canary pods are ready (``probe.RETRY_AFTER_ERROR_S``, 30 s), one probe run and a
Prometheus scrape; without it the first measurement can precede any probe run of the new unit
(``len(result) > 0`` fails) and abort a healthy canary."""
"""Seconds between probe runs (``PROBE_STALE_S`` allows three missed runs)."""
PROBE_CPU, PROBE_MEMORY = "2", "8Gi"
"""Probe pod requests (memory limit = request): the tokenizer, lm_head in FP32 and the stored reference hidden
states of the probe's prompts; a sizing default, not a measured number."""
PROBE_SCRAPE_INTERVAL = "60s"


def has_gate(model_repository: Path) -> bool:
    """Whether the build output holds a gate run (``<out>/gate/metrics.json``): the probe Deployment and its
    PodMonitor are rendered only then."""
    return (Path(model_repository).parent / GATE_SUBDIR / "metrics.json").is_file()


def probe_command(service: str, namespace: str, repo_root: str, unit: str, profile_name: str) -> list[str]:
    """``invoke probe`` (through run.sh) against the Service ``service`` (the serving Service, or the Rollout's
    canary Service under ``workload: argo-rollout``; ``--url <service>.<namespace>.svc:8000``), every
    ``PROBE_EVERY_S`` s, exporting on ``PROBE_METRICS_PORT``; ``--unit``/``--profile`` name the release so no
    repository state is read or written."""
    from precision_pipeline.serving.probe import DEFAULT_PROMPTS

    root = str(repo_root).rstrip("/") or ""
    return ["./run.sh", "probe", "--url", f"{service}.{namespace}.svc:{HTTP_PORT}", "--gate", f"{root}/{GATE_SUBDIR}",
            "--prompts", str(DEFAULT_PROMPTS), "--every", str(PROBE_EVERY_S), "--metrics-port", str(PROBE_METRICS_PORT),
            "--unit", unit, "--profile", profile_name]


def probe_params(dep: dict, pod_template: dict, profile_name: str, unit: str, image: str,
                  service: str) -> tuple[dict, dict]:
    """Parameters of the probe Deployment and its PodMonitor (requests go to the Service ``service``); the
    securityContexts are the Triton pod's."""
    name = f"{dep['name'][:57]}-probe"
    selector = {"app.kubernetes.io/name": "precision-probe", "app.kubernetes.io/instance": dep["name"]}
    labels = {**dep["labels"], **selector, "app.kubernetes.io/component": "accuracy-probe"}
    root = dep["repo_root"]
    probe = {"name": name, "namespace": dep["namespace"], "labels": labels, "selector": selector,
             "annotations": {k: v for k, v in dep["annotations"].items() if k != f"{LABEL_PREFIX}/launcher"},
             "pod_security_context": pod_template["spec"]["securityContext"],
             "container_security_context": pod_template["spec"]["containers"][0]["securityContext"],
             "image": image, "working_dir": SOURCE_DIR,
             "command": probe_command(service, dep["namespace"], root, unit, profile_name),
             "cache_dir": f"{root.rstrip('/')}/.cache", "cpu_request": PROBE_CPU, "memory_request": PROBE_MEMORY,
             "repo_root": root, "pvc_name": dep["pvc_name"], "tmp_size": TMP_SIZE}
    monitor = {"name": name, "namespace": dep["namespace"], "labels": labels, "selector": selector,
               "interval": PROBE_SCRAPE_INTERVAL}
    return probe, monitor


CANARY_SERVICE_FILE = "service-canary.yaml"
"""Output file of the Rollout's canary Service: ``service.yaml`` rendered a second time (one home for the ports)."""
SERVICE_ROLE_LABEL = f"{LABEL_PREFIX}/service-role"
"""Label on the canary Service only (value ``canary``), so that a ServiceMonitor or a selector over Services can tell
it from the main Service (both front the same pods between rollouts)."""


def canary_service_name(name: str) -> str:
    """``<name>-canary`` (a DNS-1035 label, <= 63 characters): the Service the Rollout names as ``canaryService``."""
    return f"{name[:56]}-canary"


DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
"""Prometheus the AnalysisTemplate queries (the prometheus-operator's default Service name); an argument."""
PROBE_METRICS = PROBE_METRIC_NAMES
"""Gauges the accuracy probe publishes per engine unit (label ``engine_unit``; serving/probe.py ``ProbeExporter``)."""
MAX_ERROR_RATE = 0.01
ANALYSIS_INTERVAL = "60s"


def argo_params(deployment: Any, thresholds: Any, dep: dict, unit: str,
                canary_service: Optional[str]) -> tuple[Optional[dict], Optional[dict]]:
    """Rollout and AnalysisTemplate parameters (None, None unless ``deployment.workload: argo-rollout``).

    ``deployment``: the profile's deployment section; ``thresholds``: its gate bar for the served model (the
    analysis fails a canary past it); ``dep``: the Deployment's parameters (name, namespace, labels, annotations,
    selector, replicas, progress deadline); ``unit``: the engine unit the analysis queries; ``canary_service``:
    the Rollout's ``strategy.canary.canaryService``."""
    d = deployment
    if d.workload != "argo-rollout":
        return None, None
    from precision_pipeline.gate.metrics import CHECKS

    steps: list[dict] = []
    for pct in d.canary_steps:
        steps.append({"setWeight": int(pct)})
        if pct < 100:
            steps.append({"pause": {"duration": f"{int(d.canary_pause_s)}s"}})
    thr = thresholds
    canary = 'rollouts_pod_template_hash="{{args.canary-hash}}"'
    metrics = []
    for key, metric in PROBE_METRICS.items():
        field_name, op = CHECKS[key]
        v = getattr(thr, field_name)
        if v is None:
            continue
        metrics.append({"name": f"probe-{key.replace('_', '-')}", "interval": ANALYSIS_INTERVAL,
                        "initialDelay": f"{PROBE_FIRST_RESULT_S}s", "failureLimit": 0,
                        "successCondition": f"len(result) > 0 && result[0] {op} {v!r}",
                        "provider": {"prometheus": {"address": "{{args.prometheus-address}}",
                                                    "query": f'max({metric}{{engine_unit="{unit}"}})'}}})
    fail = f"sum(rate(nv_inference_request_failure{{{canary}}}[2m]))"
    total = f"sum(rate(nv_inference_request_success{{{canary}}}[2m])) + {fail}"
    metrics.append({"name": "error-rate", "interval": ANALYSIS_INTERVAL, "failureLimit": 0,
                    "successCondition": f"len(result) == 0 || result[0] <= {MAX_ERROR_RATE!r}",
                    "provider": {"prometheus": {"address": "{{args.prometheus-address}}",
                                                "query": f"({fail}) / clamp_min({total}, 1e-9)"}}})
    name = dep["name"]
    rollout = {"name": name, "namespace": dep["namespace"], "labels": dep["labels"], "annotations": dep["annotations"],
               "replicas": dep["replicas"], "progress_deadline_s": dep["progress_deadline_s"], "selector": dep["selector"],
               "deployment_name": name, "analysis_name": name, "canary_service": canary_service, "steps": steps}
    analysis = {"name": name, "namespace": dep["namespace"], "labels": dep["labels"],
                "prometheus_address": DEFAULT_PROMETHEUS, "metrics": metrics}
    return rollout, analysis


MONITORING_SUBDIR = "monitoring"
"""``<out>/k8s/monitoring/``: manifests of the prometheus-operator's kinds (``k8s/monitoring/`` templates),
apart so that ``kubectl apply -f <out>/k8s/`` works on a cluster without that operator."""
PROBE_STALE_S = 1800
"""PrecisionProbeStale fires when the probe's last run of a profile is older than this (seconds): 3 runs
of a probe every 10 minutes (``invoke probe --every 600``) missed."""
PROBE_ALERT_FOR = "5m"
"""How long a probe result beyond the gate threshold must persist (the next runs did not clear it)."""


def _promql_str(s: str) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'


ROUTE_NAMED = "{{ with $labels.route }} (route {{ . }}){{ end }}"
"""The probe alerts' summary names the route (`` (route strict-tier,long-prompts)``) when the series has one."""


def alert_groups(profile_name: str, thresholds, *, stale_s: int = PROBE_STALE_S) -> list[dict]:
    """The PrometheusRule's groups for one profile: the probe's checked metrics (``PROBE_METRICS``, ops
    and thresholds from ``gate.metrics.CHECKS`` and ``thresholds``, the profile's gate section for the
    model), probe staleness and errors, and the BLS's ``precision_pipeline_fallback_active`` gauge. The probe's alerts
    keep the ``route`` label (``probe.route_units``: the routing rules the judged unit serves) and name it in their
    summary (``ROUTE_NAMED``), so a failing fallback says which requests it fails."""
    from precision_pipeline.gate.metrics import CHECKS

    sel = f"profile={_promql_str(profile_name)}"
    rules: list[dict] = []
    for key, metric in PROBE_METRICS.items():
        field_name, op = CHECKS[key]
        v = getattr(thresholds, field_name)
        if v is None:
            continue
        bad = ">" if op == "<=" else "<"
        name = "PrecisionProbe" + "".join(w.capitalize() for w in key.split("_")) + ("AboveGate" if bad == ">" else "BelowGate")
        rules.append({"alert": name, "expr": f"max by (engine_unit, route) ({metric}{{{sel}}}) {bad} {v!r}",
                      "for": PROBE_ALERT_FOR, "labels": {"severity": "critical"},
                      "annotations": {"summary": f"live {key} of {{{{ $labels.engine_unit }}}}{ROUTE_NAMED} beyond the gate ({op} {v!r})",
                                      "description": f"The golden-prompt probe of profile {profile_name} measured "
                                                     f"{key} = {{{{ $value }}}} on the live server; the gate allows {op} {v!r}."}})
    rules.append({"alert": "PrecisionProbeStale",
                  "expr": f"time() - max by (engine_unit, route) ({PROBE_LAST_RUN}{{{sel}}}) > {int(stale_s)}",
                  "labels": {"severity": "warning"},
                  "annotations": {"summary": f"no probe run of {{{{ $labels.engine_unit }}}}{ROUTE_NAMED} for over {int(stale_s)} s"}})
    rules.append({"alert": "PrecisionProbeAbsent", "expr": f"absent({PROBE_LAST_RUN}{{{sel}}})", "for": f"{int(stale_s)}s",
                  "labels": {"severity": "warning"},
                  "annotations": {"summary": f"the accuracy probe of profile {profile_name} exports nothing"}})
    rules.append({"alert": "PrecisionProbeErrors",
                  "expr": f'increase(precision_pipeline_probe_runs_total{{{sel},result="error"}}[15m]) > 0',
                  "labels": {"severity": "warning"},
                  "annotations": {"summary": f"probe runs of {{{{ $labels.engine_unit }}}}{ROUTE_NAMED} failed to get logits from the server"}})
    rules.append({"alert": "PrecisionFallbackActive", "expr": "max(precision_pipeline_fallback_active) > 0",
                  "for": "5m", "labels": {"severity": "warning"},
                  "annotations": {"summary": "the BLS serves the fallback release (releases.json fallback)"}})
    return [{"name": f"precision-pipeline.{profile_name}", "interval": "1m", "rules": rules}]


__all__ = ["GATE_SUBDIR", "SOURCE_DIR", "PROBE_METRICS_PORT", "PROBE_EVERY_S", "PROBE_FIRST_RESULT_S", "PROBE_CPU",
           "PROBE_MEMORY", "PROBE_SCRAPE_INTERVAL", "has_gate", "probe_command", "probe_params", "CANARY_SERVICE_FILE",
           "SERVICE_ROLE_LABEL", "canary_service_name", "DEFAULT_PROMETHEUS", "PROBE_METRICS", "MAX_ERROR_RATE",
           "ANALYSIS_INTERVAL", "argo_params", "MONITORING_SUBDIR", "PROBE_STALE_S", "PROBE_ALERT_FOR", "alert_groups", "ROUTE_NAMED"]
