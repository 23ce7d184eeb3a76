"""Deploy on the llm_api route with ``deployment.server: trtllm-serve``: Kubernetes manifests running TensorRT-LLM's
OpenAI-compatible server, ``trtllm-serve <checkpoint> --config <trtllm-serve.yaml>``, instead of Triton.

Written to ``<out>/k8s-trtllm-serve/`` from the templates in ``k8s/trtllm-serve/`` (all or nothing):

* ``deployment.yaml``: one container ``trtllm-serve`` (``serve_command``), hardened as the Triton Deployment
  (non-root uid 1000, no privilege escalation, every capability dropped, RuntimeDefault seccomp, read-only root
  filesystem with /tmp and /dev/shm emptyDirs, the artifacts PVC read-only at ``repo_root``), ``nvidia.com/gpu``
  requests = limits = tp_size x pp_size, required node affinity on ``nvidia.com/gpu.product``, startup/liveness/
  readiness probes on ``/health`` (trtllm-serve's health endpoint: TensorRT-LLM docs/source/commands/trtllm-serve.rst
  "The server also supports the following endpoints: /health, /metrics, /version"); port http 8000;
* ``service.yaml``: a ClusterIP Service on port 8000;
* ``monitoring/podmonitor.yaml``: Prometheus scrapes ``/prometheus/metrics`` on port http. trtllm-serve serves
  that endpoint only with ``return_perf_metrics: true`` in its ``--config`` (reference llm-api-route.md, TensorRT-LLM
  #5785; its ``/metrics`` is JSON iteration stats), so ``render_trtllm_serve`` refuses a config without it.

Paths are serving-side: the checkpoint ``<repo_root>/checkpoint`` and the config ``<repo_root>/llm_api/trtllm-serve.yaml``
(the build output's folders: quantize's ``checkpoint/``, the llm_api_config stage's ``llm_api/``). Every manifest
passes the same strict Kubernetes schema and API-server policy checks as the Triton ones (``k8s.validate_manifest``).
The image is given (no default): a TensorRT-LLM release image with trtllm-serve of the profile's
``target.trtllm_version`` (e.g. 1.3.0rc29); NOT verified on a GPU here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.paths import REPO_ROOT
from precision_pipeline.core.store import atomic_dir
from precision_pipeline.resolve.plan import ResolvedPlan
from precision_pipeline.serving import deploy
from precision_pipeline.serving.k8s import (DNS_LABEL, K8S_VERSION, LABEL_PREFIX, TMP_SIZE, gpu_product_label, k8s_name,
                                            label_value, parse_manifest, render_template, validate_manifest)

TEMPLATES_DIR = REPO_ROOT / "k8s" / "trtllm-serve"
OUT_SUBDIR = "k8s-trtllm-serve"
PORT = 8000
METRICS_PATH = "/prometheus/metrics"
CHECKPOINT_SUBDIR = "checkpoint"
CONFIG_FILE = "llm_api/trtllm-serve.yaml"
SERVER = "trtllm-serve"


@dataclass(frozen=True)
class ServeInputs:
    """What the trtllm-serve manifests are rendered from. ``llm_args``: the parsed ``trtllm-serve --config`` YAML
    (the llm_api_config stage's ``llm_api/trtllm-serve.yaml``)."""

    plan: ResolvedPlan
    profile: Any
    llm_args: Mapping[str, Any]
    repo_root: str
    image: str
    namespace: str = "default"
    pvc_name: str = deploy.DEFAULT_PVC
    gpu_products: Optional[list[str]] = None
    k8s_version: str = K8S_VERSION


def serve_command(repo_root: str) -> tuple[list[str], list[str]]:
    """(command, args) of the container: ``trtllm-serve <repo_root>/checkpoint --config <repo_root>/llm_api/
    trtllm-serve.yaml --host 0.0.0.0 --port 8000`` (the model is positional; ``--config`` per reference
    llm-api-route.md, ``--extra_llm_api_options`` its alias; the default host is local only)."""
    root = str(repo_root).rstrip("/")
    return [SERVER], [f"{root}/{CHECKPOINT_SUBDIR}", "--config", f"{root}/{CONFIG_FILE}", "--host", "0.0.0.0",
                      "--port", str(PORT)]


def check_serve_inputs(i: ServeInputs) -> None:
    """UserError (exit 2) for an input the manifests cannot serve: repo_root, image, namespace, PVC (as for Triton),
    a config without ``return_perf_metrics: true`` (nothing to scrape), a config whose ``otlp_traces_endpoint`` is not
    the profile's ``deployment.otlp_endpoint`` traces URL (None: no key), a plan without a known GPU."""
    deploy.check_repo_root(i.repo_root)
    deploy.check_image(i.image, "image")
    if not isinstance(i.namespace, str) or not DNS_LABEL.match(i.namespace) or len(i.namespace) > 63:
        raise UserError("namespace", f"{i.namespace!r} is not a DNS-1123 label.", "e.g. default.")
    if i.llm_args.get("return_perf_metrics") is not True:
        raise UserError("llm_api/trtllm-serve.yaml: return_perf_metrics",
                        f"is {i.llm_args.get('return_perf_metrics')!r}; trtllm-serve serves {METRICS_PATH} only with "
                        "return_perf_metrics: true, and the PodMonitor scrapes it.",
                        "render the config with return_perf_metrics: true (the llm_api_config stage).")
    want = i.profile.deployment.otlp_traces_url  # TorchLlmArgs.otlp_traces_endpoint (spec/llm_args.py _BASE_FIELDS)
    if i.llm_args.get("otlp_traces_endpoint") != want:
        raise UserError("llm_api/trtllm-serve.yaml: otlp_traces_endpoint",
                        f"is {i.llm_args.get('otlp_traces_endpoint')!r}, but deployment.otlp_endpoint sends spans to "
                        f"{want!r}: trtllm-serve would trace elsewhere, or not at all.",
                        "render the config again from this profile (the llm_api_config stage).")
    if i.plan.gpu is None or not i.plan.gpu.name:
        raise UserError("target.gpu", "plan.json has no known GPU.", "resolve the profile on a catalog GPU first.")


def compute_params(i: ServeInputs) -> dict[str, dict]:
    """Template file -> parameters (``k8s/trtllm-serve/``). Raises UserError (``check_serve_inputs``)."""
    check_serve_inputs(i)
    name = k8s_name(i.plan.profile.name or i.profile.name, prefix="trtllm-serve-")
    gpus = int(i.plan.mapping.world_size)
    selector = {"app.kubernetes.io/name": SERVER, "app.kubernetes.io/instance": name}
    labels = {**selector, "app.kubernetes.io/component": "inference-server", "app.kubernetes.io/part-of": LABEL_PREFIX,
              "app.kubernetes.io/managed-by": LABEL_PREFIX, f"{LABEL_PREFIX}/profile": label_value(i.plan.profile.name),
              f"{LABEL_PREFIX}/server": SERVER}
    annotations = {f"{LABEL_PREFIX}/profile": i.plan.profile.name, f"{LABEL_PREFIX}/server": SERVER,
                   f"{LABEL_PREFIX}/gpu": str(i.plan.gpu.id)}
    command, args = serve_command(i.repo_root)
    dep = {"name": name, "namespace": i.namespace, "labels": labels, "annotations": annotations,
           "replicas": i.profile.deployment.replicas, "selector": selector,
           "pod_annotations": {**annotations, "kubectl.kubernetes.io/default-container": SERVER},
           "progress_deadline_s": deploy.STARTUP_PERIOD_S * deploy.STARTUP_FAILURE_THRESHOLD + 600,
           "termination_grace_s": deploy.TERMINATION_GRACE_S,
           "gpu_products": list(i.gpu_products) if i.gpu_products else [gpu_product_label(i.plan.gpu.name)],
           "image": i.image, "command": command, "args": args, "gpus": gpus,
           "cpu_request": str(deploy.CPU_PER_GPU * gpus), "memory_request": f"{deploy.MEMORY_GI_BASE + deploy.MEMORY_GI_PER_GPU * gpus}Gi",
           "startup_period_s": deploy.STARTUP_PERIOD_S, "startup_failure_threshold": deploy.STARTUP_FAILURE_THRESHOLD,
           "repo_root": str(i.repo_root).rstrip("/") or "/", "shm_size": f"{max(2, 1 + gpus)}Gi", "tmp_size": TMP_SIZE,
           "pvc_name": i.pvc_name}
    small = {"name": name, "namespace": i.namespace, "labels": labels, "selector": selector}
    return {"deployment.yaml": dep, "service.yaml": small, "podmonitor.yaml": small}


def render(i: ServeInputs) -> dict[str, str]:
    """Output path (under ``OUT_SUBDIR``) -> rendered YAML, each validated (strict schema + policy)."""
    out = {}
    for tname, p in compute_params(i).items():
        where = f"k8s/trtllm-serve/{tname}"
        doc = parse_manifest(render_template((TEMPLATES_DIR / tname).read_text(), p, where), where)
        validate_manifest(doc, where, i.k8s_version)
        dest = f"monitoring/{tname}" if tname == "podmonitor.yaml" else tname
        out[dest] = (f"# Rendered by build/precision_pipeline/serving/trtllm_serve.py from {where}: profile "
                     f"{i.plan.profile.name}.\n# Validated against Kubernetes {i.k8s_version} (strict). Re-render; do not edit.\n"
                     + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=1000))
    return out


def render_trtllm_serve(i: ServeInputs, out_dir: Path, workdir: Optional[Path] = None) -> list[str]:
    """Write ``<out_dir>/k8s-trtllm-serve/`` atomically (or into ``workdir``); returns the files written."""
    texts = render(i)
    with (contextlib.nullcontext(Path(workdir)) if workdir is not None else atomic_dir(Path(out_dir) / OUT_SUBDIR)) as tmp:
        for rel, text in texts.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text)
    return sorted(texts)
