"""Deploy stage: Kubernetes manifests that serve a packed Triton model repository.

``render_manifests(plan, profile, model_repository, out_dir, repo_root, image, namespace)`` fills
the templates in ``k8s/`` (repository root) and writes ``<out_dir>/k8s/*.yaml`` atomically:

* ``triton-deployment.yaml``: a Deployment running Triton from NVIDIA's TensorRT-LLM backend
  container; ``nvidia.com/gpu`` requests = limits = GPUs per replica (tp_size x pp_size); required
  node affinity on the GPU Feature Discovery label ``nvidia.com/gpu.product``; startup (generous),
  liveness (``/v2/health/live``) and readiness (``/v2/health/ready``) probes on port 8000; ports
  http 8000, grpc 8001, metrics 8002; ``/dev/shm`` as a sized memory-backed emptyDir; the artifacts
  PVC mounted read-only at ``repo_root``; ``replicas`` from ``deployment.replicas``.
* ``service.yaml``: a ClusterIP Service with the three ports.
* ``pdb.yaml``: a PodDisruptionBudget with ``minAvailable: 1``, only when ``replicas > 1`` (with a
  single replica such a budget would block every drain of its node).
* ``triton-leaderworkerset.yaml`` (+ ``lws-launcher-{serviceaccount,role,rolebinding}.yaml``) instead of the
  Deployment when tp_size x pp_size exceeds ``deployment.gpus_per_node``: a LeaderWorkerSet
  (leaderworkerset.x-k8s.io/v1) of ``ceil(world / gpus_per_node)`` pods per replica whose leader runs the
  ``mpirun`` line over the group (``LEADER_SCRIPT``); both pod templates are the Deployment's (``_pod_template``).
  The Service (and PDB) then select the leaders only (``LWS_WORKER_INDEX_LABEL`` = "0").
* ``probe-deployment.yaml`` (+ ``monitoring/probe-podmonitor.yaml``) when the build has a gate run: the accuracy
  probe (serving/probe.py) as a long-lived Deployment exporting ``precision_pipeline_probe_*`` on port 8004.
* ``argo-rollout.yaml``, ``analysis-template.yaml`` and ``service-canary.yaml`` with ``deployment.workload:
  argo-rollout``: the Rollout (``workloadRef`` to the Deployment), its AnalysisTemplate, and the Rollout's
  ``canaryService`` (``service.yaml`` rendered again as ``<name>-canary``: same ports and selector; Argo Rollouts
  adds the canary ReplicaSet's ``rollouts-pod-template-hash`` to its selector), which the probe then targets.

What is loaded: Triton runs with ``--model-control-mode=explicit`` and one ``--load-model`` per
model of the current release: ``releases.json`` next to the repository when it exists (current
unit, plus the fallback unit when ``warm_fallback``; see build/precision_pipeline/serving/release.py ``serving_models``), else
the repository's ``pack.json`` (its one engine unit). The engine unit ``tensorrt_llm_<h12>`` is
loaded before ``ensemble`` and ``tensorrt_llm_bls``, which call it.

Multi-GPU engines (world size > 1): the TensorRT-LLM backend runs one tritonserver process per
rank under MPI (leader mode). tensorrtllm_backend's ``launch_triton_server.py --world_size N``
builds that ``mpirun`` line and then *returns at once* (``subprocess.Popen`` without a wait), which
as a container's main process would end the container; its path in the image is not fixed either.
So the manifest runs the ``mpirun`` line that script builds (``get_cmd`` in
TensorRT-LLM ``triton_backend/scripts/launch_triton_server.py``) directly: ``mpirun
--allow-run-as-root -n 1 tritonserver ... : -n 1 tritonserver ...``, rank 0 loading every model
of the release and ranks > 0 loading only the engine unit(s), each rank with its own Python-backend
shared-memory prefix. Every loaded unit must have been packed for the same world size.

Image: ``DEFAULT_IMAGE`` (see ``DEFAULT_IMAGE_SOURCE`` for why this tag). A TensorRT engine only
loads under the TensorRT / TensorRT-LLM version that built it, so build the engine in the same
image you serve with, or pass ``image=`` for the image your build node used.

Checks (each failure is a ``UserError``, exit 2, naming the file and the path in it): every
``${name}`` placeholder is filled and is a whole YAML value, every parameter exists in its template
(a misspelt key is an error; ``serving/templates.py``, style ``YAML_VALUE``), gpus_per_replica = tp_size x pp_size = the repository's world size,
every manifest passes ``kubernetes_validate`` against Kubernetes ``K8S_VERSION`` in strict mode
(unknown fields are errors), plus the API-server rules the JSON schemas do not carry (DNS names,
label syntax, replicas >= 1, selector matching the pod labels, GPU requests = limits).
"""

from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml
from packaging.version import Version

from precision_pipeline.core.errors import Problem, UserError
from precision_pipeline.core.store import atomic_dir, hash_file, read_json
from precision_pipeline.serving import pack, templates
from precision_pipeline.serving.probe import PROBE_LAST_RUN, PROBE_METRIC_NAMES

from precision_pipeline.core.paths import REPO_ROOT
from precision_pipeline.resolve.plan import ResolvedPlan
from precision_pipeline.resolve.derive import lws_group  # the multi-node layout (also the rule layout.nodes)
TEMPLATES_DIR = REPO_ROOT / "k8s"
OUT_SUBDIR = "k8s"

K8S_VERSION = "1.30"
"""Kubernetes version the manifests are validated against (kubernetes-validate's bundled schemas)."""

DEFAULT_IMAGE = "nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3"
DEFAULT_IMAGE_TRTLLM = "1.2.1"
DEFAULT_IMAGE_SOURCE = (
    "TensorRT-LLM in the Triton trtllm-python-py3 containers: 25.12 ships TensorRT-LLM 1.1.0 (Triton release "
    "compatibility matrix, docs.nvidia.com/deeplearning/triton-inference-server/user-guide/docs/introduction/"
    "compatibility.html); 26.05 ships TensorRT-LLM 1.2.1 (github.com/triton-inference-server/server/issues/8805, "
    "2026-05-29). The first tag with 1.2.0 was not found; pass image= to pin the exact tag your engine was built in."
)

DEFAULT_PVC = "precision-artifacts"
TRITONSERVER = "/opt/tritonserver/bin/tritonserver"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
"""GPU Feature Discovery label (now part of NVIDIA/k8s-device-plugin): the NVML device name with spaces
replaced by '-' (``productLabel`` in internal/lm/resource.go), e.g. ``NVIDIA-H100-80GB-HBM3``. Time-sliced
GPUs get a ``-SHARED`` suffix and MIG devices ``-MIG-<profile>`` (mixed strategy): pass ``gpu_products=``."""

HTTP_PORT, GRPC_PORT, METRICS_PORT = 8000, 8001, 8002
STARTUP_PERIOD_S = 10
STARTUP_FAILURE_THRESHOLD = 180  # 30 minutes to load engines before the kubelet restarts the pod
TERMINATION_GRACE_S = 60
CPU_PER_GPU = 4
"""CPU request per GPU (tokenization, the Python BLS and pre/postprocessing run on CPU): a sizing default."""
MEMORY_GI_BASE, MEMORY_GI_PER_GPU = 16, 16
"""Memory request (= limit) ``MEMORY_GI_BASE + MEMORY_GI_PER_GPU x GPUs`` GiB: host copies of engine
shards while loading plus the pinned host buffers of the TensorRT-LLM runtime; a sizing default."""
TMP_SIZE = "4Gi"
LABEL_PREFIX = "precision-pipeline"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


@dataclass
class DeployResult:
    """What ``render_manifests`` wrote."""

    out_dir: Path
    files: list[str]
    replicas: int
    gpus_per_replica: int
    gpu_resource: str
    image: str
    namespace: str
    name: str
    gpu_products: list[str]
    engine_unit: str
    engine_hash: str
    engine_present: Optional[bool]
    load_models: list[str]
    release_source: str
    launcher: str
    command: list[str]
    k8s_version: str
    notes: list[str] = field(default_factory=list)
    monitoring: list[str] = field(default_factory=list)
    """Manifests under ``<out_dir>/monitoring/``: the PrometheusRule (needs the prometheus-operator CRDs) and
    the Grafana dashboard ConfigMap (serving/dashboard.py)."""

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["out_dir"] = str(self.out_dir)
        return d


# --------------------------------------------------------------------------------------------
# Names and labels


def k8s_name(profile_name: str, prefix: str = "triton-") -> str:
    """A DNS-1035 label (<= 63 characters) for the profile: ``triton-<profile>``, '.'/'_' -> '-'."""
    s = re.sub(r"[^a-z0-9-]+", "-", f"{prefix}{profile_name}".lower())
    s = re.sub(r"-+", "-", s)[:63].strip("-")
    if not _DNS_1035.match(s):
        raise UserError("profile.name", f"cannot make a Kubernetes name from {profile_name!r}.",
                        "use a profile name made of lower-case letters, digits and '-'.")
    return s


def gpu_product_label(gpu_name: str) -> str:
    """The ``nvidia.com/gpu.product`` value GPU Feature Discovery sets for an NVML device name."""
    return str(gpu_name).strip().replace(" ", "-")


def _label_value(v: str, max_len: int = 63) -> str:
    s = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(v))[:max_len]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", s)


# --------------------------------------------------------------------------------------------
# What the repository serves


@dataclass
class ServingSet:
    unit: str
    engine_hash: str
    engine_present: Optional[bool]
    models: list[str]
    units: list[str]
    source: str


def serving_set(model_repository: Path) -> ServingSet:
    """The models Triton must load: from releases.json when present, else from pack.json."""
    from precision_pipeline.serving import release

    repo = Path(model_repository)
    if not repo.is_dir():
        raise UserError("model_repository", f"{repo} is not a directory.", "pack the build first (build/precision_pipeline/serving/pack.py).")
    state = release.read_state(repo)
    if state and state.get("current"):
        unit = str(state["current"])
        models = release.serving_models(repo, state)
        rec = next((r for r in reversed(state.get("releases") or []) if r.get("unit") == unit), {})
        ehash, present, source = rec.get("engine_hash"), rec.get("engine_present"), str(release.state_path(repo))
    else:
        pj = read_json(repo / pack.PACK_FILE)
        if pj and pj.get("engine_unit"):
            unit, ehash, present, source = pj["engine_unit"], pj.get("engine_hash"), pj.get("engine_present"), str(repo / pack.PACK_FILE)
        else:
            found = sorted(d.name for d in repo.iterdir() if d.is_dir() and pack.is_unit(d.name))
            if len(found) != 1:
                raise UserError("model_repository", f"{repo} has no releases.json or pack.json and {len(found)} engine units.",
                                "pack the build (build/precision_pipeline/serving/pack.py) or init the serving repository (build/precision_pipeline/serving/release.py).")
            unit, ehash, present, source = found[0], None, None, f"{repo} (the only engine unit)"
        models = ["preprocessing", "postprocessing", unit, "ensemble", "tensorrt_llm_bls"]
    if not pack.is_unit(unit):
        raise UserError(source, f"names {unit!r} as the current engine unit, which is not tensorrt_llm_<12 hex>.",
                        "re-pack or repair the release state (build/precision_pipeline/serving/release.py recover).")
    if not ehash:
        ref = read_json(repo / unit / "engine" / pack.CPU_REFERENCE_FILE) or {}
        ehash = ref.get("engine_hash") or unit[len(pack.UNIT_PREFIX):]
        if present is None:
            present = ref.get("engine_present")
    missing = [m for m in models if not (repo / m / "config.pbtxt").is_file()]
    if missing:
        raise UserError("model_repository", f"{repo} lacks {', '.join(missing)} (needed by {Path(source).name}).",
                        "re-pack the build or run build/precision_pipeline/serving/release.py recover.")
    units = [m for m in models if pack.is_unit(m)]
    return ServingSet(unit=unit, engine_hash=str(ehash), engine_present=present, models=models, units=units, source=source)


def _rel_source(source: str, model_repository: Path) -> str:
    """The release source relative to the build output (no build-machine paths in manifests)."""
    try:
        return Path(source).relative_to(Path(model_repository).resolve().parent).as_posix()
    except ValueError:
        try:
            return Path(source).relative_to(Path(model_repository).parent).as_posix()
        except ValueError:
            return Path(source).name


def unit_world_size(model_repository: Path, unit: str) -> int:
    """GPUs a packed engine unit runs on (its ``gpu_device_ids`` parameter)."""
    path = Path(model_repository) / unit / "config.pbtxt"
    params = pack.config_params(pack.parse_model_config(path.read_text(), str(path)))
    ids = [s for s in str(params.get("gpu_device_ids", "")).split(",") if s.strip()]
    return len(ids) or 1


def _engine_version(model_repository: Path, unit: str) -> Optional[str]:
    cfg = read_json(Path(model_repository) / unit / "engine" / "config.json") or {}
    v = cfg.get("version")
    return str(v) if v else None


# --------------------------------------------------------------------------------------------
# Command line


def triton_command(world_size: int, repo_path: str, load_models: list[str], units: list[str],
                   trace_url: Optional[str] = None) -> tuple[list[str], list[str], str]:
    """(command, args, launcher) for the container.

    world_size 1: plain ``tritonserver``. world_size > 1: the ``mpirun`` line of tensorrtllm_backend's
    launch_triton_server.py (one tritonserver per rank; ranks > 0 load only the engine units).
    ``trace_url``: Triton's own OpenTelemetry tracing to that OTLP/HTTP URL (``triton_server.trace_args``),
    on the rank that takes requests (rank 0).
    """
    from precision_pipeline.serving.triton_server import trace_args

    common = [f"--model-repository={repo_path}", f"--http-port={HTTP_PORT}", f"--grpc-port={GRPC_PORT}",
              f"--metrics-port={METRICS_PORT}", "--model-control-mode=explicit"]

    def rank_args(rank: int, models: list[str]) -> list[str]:
        return [*common, *(f"--load-model={m}" for m in models), "--disable-auto-complete-config",
                f"--backend-config=python,shm-region-prefix-name=prefix{rank}_", *(trace_args(trace_url) if rank == 0 else [])]

    if world_size == 1:
        return [TRITONSERVER], rank_args(0, load_models), "tritonserver"
    args = ["--allow-run-as-root"]
    for rank in range(world_size):
        if rank:
            args.append(":")
        args += ["-n", "1", TRITONSERVER, *rank_args(rank, load_models if rank == 0 else units)]
    return ["mpirun"], args, "mpirun"


# --------------------------------------------------------------------------------------------
# Templates


def render_template(text: str, params: Mapping[str, Any], where: str) -> str:
    """Fill the ``${name}`` placeholders of a manifest template with JSON values (``templates.render`` in the
    ``YAML_VALUE`` style: unknown, missing and unused names are refused; each placeholder is a whole YAML value)."""
    return templates.render(text, params, where, templates.YAML_VALUE)


def parse_manifest(text: str, where: str) -> dict:
    """Exactly one YAML document, a mapping with apiVersion and kind."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(where, f"is not valid YAML after rendering{at}: {getattr(e, 'problem', e)}.", "fix the template.")
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise UserError(where, f"renders {len(docs)} YAML documents; one Kubernetes object per template is expected.",
                        "keep one object per template file.")
    doc = docs[0]
    for k in ("apiVersion", "kind"):
        if not isinstance(doc.get(k), str):
            raise UserError(f"{where}: {k}", "is missing.", "every manifest needs apiVersion and kind.")
    return doc


def _path_str(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


@functools.lru_cache(maxsize=32)
def _schema_validator(k8s_version: str, kind: str, api_version: str):
    """A cached jsonschema validator for one kind, from kubernetes-validate's bundled strict schemas.

    Same lookup as ``kubernetes_validate.validate(..., strict=True)`` (newest bundled schema version not
    newer than ``k8s_version``); cached because loading ``_definitions.json`` takes ~0.3 s per call.
    Returns (validator, schema version used).
    """
    import jsonschema
    from kubernetes_validate import utils as kvu
    from referencing import Registry, Resource

    want = kvu.major_minor(k8s_version.lstrip("v"))
    if Version(want) > Version(kvu.latest_version()):
        raise UserError("k8s_version", f"kubernetes-validate bundles schemas up to {kvu.latest_version()}, not {want}.",
                        "use an older Kubernetes version or upgrade kubernetes-validate.")
    older = [v for v in kvu.all_versions() if Version(kvu.major_minor(v)) <= Version(want)]
    if not older:
        raise UserError("k8s_version", f"kubernetes-validate bundles no schema for Kubernetes {want}.", "use a newer version.")
    version = older[-1]
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema_dir = f"v{version}-local-strict"
    try:
        schema = kvu.schema_contents(f"kubernetes-json-schema/{schema_dir}/{kind.lower()}-{group}.json", want)
    except FileNotFoundError:
        raise UserError("kind", f"no Kubernetes {kvu.major_minor(version)} schema for kind {kind} in {api_version}.",
                        "use a kind/apiVersion that exists in that Kubernetes version.")
    defs = kvu.schema_contents(f"kubernetes-json-schema/{schema_dir}/_definitions.json", want)
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry), kvu.major_minor(version)


CRD_DIR = Path(__file__).resolve().parent / "crds"
"""JSON schemas of the custom resources rendered here (``<group>-<version>-<Kind>.json``; each names its
source and version in its ``description``)."""


@functools.lru_cache(maxsize=8)
def _crd_validator(api_version: str, kind: str):
    import json

    import jsonschema

    path = CRD_DIR / f"{api_version.replace('/', '-')}-{kind}.json"
    if not path.is_file():
        raise UserError("kind", f"no schema for custom resource {kind} in {api_version} ({path.name}).",
                        f"add its CRD schema to {CRD_DIR}.")
    schema = json.loads(path.read_text())
    return jsonschema.validators.Draft202012Validator(schema), schema.get("title", path.name)


def validate_manifest(doc: dict, where: str, k8s_version: str = K8S_VERSION) -> None:
    """Strict schema validation (kubernetes-validate's schemas: unknown fields are errors; custom
    resources: the schemas in ``CRD_DIR``) plus the API-server rules the schemas lack. Raises
    UserError naming the file and the path of each problem."""
    api = str(doc.get("apiVersion"))
    if "." in api.split("/")[0] and not api.split("/")[0].endswith(".k8s.io"):
        validator, used = _crd_validator(api, str(doc.get("kind")))
    else:
        validator, used = _schema_validator(k8s_version, str(doc.get("kind")), api)
    errors = [(list(e.absolute_path), e.message) for e in validator.iter_errors(doc)]
    if not errors and doc.get("kind") == "LeaderWorkerSet":
        # the CRD schema leaves the two pod templates open: each is a core v1 PodTemplateSpec (strict)
        pod_validator, used = _schema_validator(k8s_version, "PodTemplate", "v1")
        lwt = (doc.get("spec") or {}).get("leaderWorkerTemplate") or {}
        for key in ("leaderTemplate", "workerTemplate"):
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": lwt.get(key) or {}}
            errors += [(["spec", "leaderWorkerTemplate", key, *list(e.absolute_path)[1:]], e.message)
                       for e in pod_validator.iter_errors(wrapped)]
    errors.sort(key=lambda e: [str(p) for p in e[0]])
    if errors:
        raise UserError([Problem(f"{where}: {_path_str(path)}",
                                 f"fails Kubernetes {used} schema validation (strict): {_short(msg)}.",
                                 "fix the template or the input that produced this value.") for path, msg in errors[:5]])
    problems = semantic_problems(doc, where)
    if problems:
        raise UserError(problems)


def _short(s: str, n: int = 300) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def _check_labels(labels: Any, path: str, where: str) -> list[Problem]:
    out = []
    for k, v in (labels or {}).items():
        prefix, _, name = str(k).rpartition("/")
        if (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix))) or len(name) > 63 or not _LABEL_NAME.match(name):
            out.append(Problem(f"{where}: {path}.{k}", "is not a valid label key ([prefix/]name, name <= 63 characters).", "rename it."))
        if not isinstance(v, str) or len(v) > 63 or not _LABEL_VALUE.match(v):
            out.append(Problem(f"{where}: {path}.{k}", f"value {v!r} is not a valid label value (<= 63 of [A-Za-z0-9._-], alphanumeric ends).",
                               "shorten or sanitise it."))
    return out


def semantic_problems(doc: dict, where: str) -> list[Problem]:
    """Rules the API server enforces that the OpenAPI JSON schemas do not express."""
    probs: list[Problem] = []
    kind = doc.get("kind")
    meta = doc.get("metadata") or {}
    name = str(meta.get("name", ""))
    name_re, what = (_DNS_1035, "a DNS-1035 label") if kind == "Service" else (_DNS_SUBDOMAIN, "a DNS-1123 subdomain")
    if not name_re.match(name) or len(name) > (63 if kind == "Service" else 253):
        probs.append(Problem(f"{where}: metadata.name", f"{name!r} is not {what}.", "use lower-case letters, digits and '-'."))
    ns = meta.get("namespace")
    if ns is not None and (not _DNS_LABEL.match(str(ns)) or len(str(ns)) > 63):
        probs.append(Problem(f"{where}: metadata.namespace", f"{ns!r} is not a DNS-1123 label.", "pass a valid namespace."))
    probs += _check_labels(meta.get("labels"), "metadata.labels", where)
    spec = doc.get("spec") or {}
    if kind == "Deployment":
        reps = spec.get("replicas")
        if not isinstance(reps, int) or reps < 1:
            probs.append(Problem(f"{where}: spec.replicas", f"is {reps!r}; a serving Deployment needs at least 1.",
                                 "set deployment.replicas >= 1 in the profile."))
        sel = (spec.get("selector") or {}).get("matchLabels") or {}
        tmpl = spec.get("template") or {}
        pod_labels = (tmpl.get("metadata") or {}).get("labels") or {}
        probs += _check_labels(pod_labels, "spec.template.metadata.labels", where)
        if not sel or any(pod_labels.get(k) != v for k, v in sel.items()):
            probs.append(Problem(f"{where}: spec.selector.matchLabels", "does not match spec.template.metadata.labels.",
                                 "the selector's labels must all be on the pod template."))
        probs += _pod_template_problems(tmpl, "spec.template", where)
    elif kind == "LeaderWorkerSet":
        lwt = spec.get("leaderWorkerTemplate") or {}
        size = lwt.get("size")
        if not isinstance(size, int) or size < 2:
            probs.append(Problem(f"{where}: spec.leaderWorkerTemplate.size", f"is {size!r}; a multi-node group has a leader and "
                                 "at least one worker.", "render a Deployment for an engine that fits one node."))
        for key in ("leaderTemplate", "workerTemplate"):
            tmpl = lwt.get(key) or {}
            path = f"spec.leaderWorkerTemplate.{key}"
            probs += _check_labels((tmpl.get("metadata") or {}).get("labels"), f"{path}.metadata.labels", where)
            probs += _pod_template_problems(tmpl, path, where)
    elif kind == "PodDisruptionBudget":
        ma = spec.get("minAvailable")
        if isinstance(ma, int) and ma < 0:
            probs.append(Problem(f"{where}: spec.minAvailable", f"is {ma}.", "use >= 0."))
    return probs


def _pod_template_problems(tmpl: dict, path: str, where: str) -> list[Problem]:
    """API-server rules for one pod template (at ``path`` in the object): whole positive GPU counts with
    requests = limits, ports 1..65535, probe counts >= 1, emptyDir quantities, PVC names."""
    probs: list[Problem] = []
    for i, c in enumerate((tmpl.get("spec") or {}).get("containers") or []):
        res = c.get("resources") or {}
        lim, req = (res.get("limits") or {}).get(GPU_RESOURCE), (res.get("requests") or {}).get(GPU_RESOURCE)
        p = f"{where}: {path}.spec.containers[{i}].resources"
        if lim is not None and (not isinstance(lim, int) or lim < 1):
            probs.append(Problem(f"{p}.limits.{GPU_RESOURCE}", f"is {lim!r}; GPUs are whole positive numbers.", "fix gpus_per_replica."))
        if req is not None and req != lim:
            probs.append(Problem(f"{p}.requests.{GPU_RESOURCE}", f"is {req!r} but the limit is {lim!r}; extended resources need requests = limits.",
                                 "render both from gpus_per_replica."))
        for j, port in enumerate(c.get("ports") or []):
            cp = port.get("containerPort")
            if not isinstance(cp, int) or not 0 < cp < 65536:
                probs.append(Problem(f"{where}: {path}.spec.containers[{i}].ports[{j}].containerPort", f"is {cp!r}.", "use 1..65535."))
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            pr = c.get(probe) or {}
            for k in ("periodSeconds", "failureThreshold", "timeoutSeconds"):
                if k in pr and (not isinstance(pr[k], int) or pr[k] < 1):
                    probs.append(Problem(f"{where}: {path}.spec.containers[{i}].{probe}.{k}", f"is {pr[k]!r}; must be >= 1.", "fix it."))
    for i, v in enumerate((tmpl.get("spec") or {}).get("volumes") or []):
        size = (v.get("emptyDir") or {}).get("sizeLimit")
        if size is not None and not _QUANTITY.match(str(size)):
            probs.append(Problem(f"{where}: {path}.spec.volumes[{i}].emptyDir.sizeLimit", f"{size!r} is not a quantity.", "e.g. 2Gi."))
        claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
        if claim is not None and (not _DNS_SUBDOMAIN.match(str(claim)) or len(str(claim)) > 253):
            probs.append(Problem(f"{where}: {path}.spec.volumes[{i}].persistentVolumeClaim.claimName",
                                 f"{claim!r} is not a DNS-1123 subdomain.", "pass a valid PVC name."))
    return probs


# --------------------------------------------------------------------------------------------
# Parameters


def _gpus(plan: ResolvedPlan, profile) -> tuple[int, int, int]:
    """(gpus_per_replica, tp_size, pp_size) from the plan's mapping; refuses any disagreement."""
    mp = plan.mapping
    tp, pp, world = int(mp.tp_size), int(mp.pp_size), int(mp.world_size)
    if world != tp * pp:
        raise UserError("plan.mapping.world_size", f"is {world} but tp_size x pp_size = {tp} x {pp} = {tp * pp}.",
                        "re-resolve the plan (build/precision_pipeline/resolve/plan.py).")
    if (profile.parallel.tp_size, profile.parallel.pp_size) != (tp, pp):
        raise UserError("parallel", f"the profile says tp {profile.parallel.tp_size} x pp {profile.parallel.pp_size} "
                        f"but plan.json says tp {tp} x pp {pp}.", "deploy with the plan of this profile.")
    gpr = profile.deployment.gpus_per_replica
    if gpr is not None and int(gpr) != world:
        raise UserError("deployment.gpus_per_replica", f"is {gpr} but one engine needs tp_size x pp_size = {world} GPUs.",
                        f"set deployment.gpus_per_replica: {world} or remove it (default tp_size x pp_size).")
    return world, tp, pp


def _check_pod_spec_inputs(value: str, field_name: str, pattern: re.Pattern, what: str, max_len: int) -> None:
    if not isinstance(value, str) or len(value) > max_len or not pattern.match(value):
        raise UserError(field_name, f"{value!r} is not {what} (<= {max_len} characters).", "use lower-case letters, digits and '-'.")


REPO_ROOT_MAX = 1024
"""Longest ``--repo-root`` accepted (bytes): the configs append ``/model_repository/tensorrt_llm_<h12>/engine``
and the backend opens files below it, all within Linux's PATH_MAX of 4096 (linux/limits.h); 1024 leaves room."""
NAME_MAX = 255
"""Longest path component on Linux file systems (linux/limits.h NAME_MAX)."""


def check_repo_root(repo_root: str) -> None:
    """``--repo-root`` must be an absolute POSIX path (where the output is mounted in the container), at most
    ``REPO_ROOT_MAX`` bytes with components of at most ``NAME_MAX``. UserError if not."""
    if not isinstance(repo_root, str) or not repo_root.startswith("/"):
        raise UserError("--repo-root", f"{str(repo_root)[:200]!r} is not an absolute path.",
                        "give the absolute path of the build output in the serving container.")
    n = len(repo_root.encode("utf-8", "surrogateescape"))
    longest = max((len(c.encode("utf-8", "surrogateescape")) for c in repo_root.split("/")), default=0)
    if n > REPO_ROOT_MAX or longest > NAME_MAX:
        raise UserError("--repo-root", f"{repo_root[:60]!r}... is {n} bytes long (a part of it {longest}); at most "
                        f"{REPO_ROOT_MAX} bytes with parts of at most {NAME_MAX} fit the paths the configs build from it.",
                        "give the mount path of the build output in the serving container, e.g. /models/fp8-h100.")


def check_image(image: str, field: str = "--image") -> None:
    """A container image reference: non-empty, no whitespace. UserError on ``field`` if not."""
    if not isinstance(image, str) or not image.strip() or any(c.isspace() for c in image):
        raise UserError(field, f"{str(image)[:200]!r} is not a container image reference.", f"e.g. {DEFAULT_IMAGE}.")


# --------------------------------------------------------------------------------------------
# Multi-node engines: a LeaderWorkerSet (kubernetes-sigs/lws, leaderworkerset.x-k8s.io/v1)

LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
"""Label the LWS controller puts on every pod of a group: ``"0"`` on the leader, 1..size-1 on the workers."""
MPI_DIR = "/tmp/mpi"
"""Where the leader writes its hostfile and rsh agent (the /tmp emptyDir: the root filesystem is read-only)."""
SA_TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
"""Where kubectl's in-cluster configuration reads token, ca.crt and namespace (the path the kubelet's automount
would use; the leader mounts a projected short-lived token there instead)."""
SA_TOKEN_EXPIRATION_S = 3600
LEADER_SCRIPT = (
    # LWS sets LWS_LEADER_ADDRESS=<leader pod>.<lws>.<namespace> and LWS_GROUP_SIZE in every pod of a group;
    # the workers of leader pod <lws>-<g> are <lws>-<g>-1 .. <lws>-<g>-(size-1)
    'set -eu; mkdir -p ' + MPI_DIR + '; leader="${LWS_LEADER_ADDRESS%%.*}"; : > ' + MPI_DIR + '/hostfile; i=0; '
    'while [ "$i" -lt "$LWS_GROUP_SIZE" ]; do if [ "$i" -eq 0 ]; then h="$leader"; else h="$leader-$i"; fi; '
    'echo "$h slots=$MPI_SLOTS_PER_POD" >> ' + MPI_DIR + '/hostfile; i=$((i + 1)); done; '
    # OpenMPI's rsh agent is called as `agent <host> <orted command ...>`: run it in that pod's triton container
    "printf '%s\\n' '#!/bin/sh' 'pod=\"$1\"; shift' 'exec kubectl exec -i \"$pod\" -c triton -- /bin/sh -c \"$*\"' > "
    + MPI_DIR + '/kubexec; chmod 0755 ' + MPI_DIR + '/kubexec; '
    'exec mpirun --hostfile ' + MPI_DIR + '/hostfile --mca plm_rsh_agent ' + MPI_DIR + '/kubexec --mca plm_rsh_no_tree_spawn 1 "$@"'
)
"""The leader's shell: writes the group's hostfile (one line per pod, ``slots`` = GPUs per pod, so mpirun places
one rank per GPU, ranks 0..k-1 in the leader) and a ``kubectl exec`` rsh agent, then runs the ``mpirun`` line of
``triton_command`` (its arguments follow as ``$@``) over the group. The kubectl-exec agent is the launch
pattern of Triton's multi-node Kubernetes tutorial for TensorRT-LLM (``kubessh``); the image must ship kubectl."""
LEADER_SHELL = ["/bin/sh", "-c", LEADER_SCRIPT]
WORKER_COMMAND = ["/bin/sh", "-c", "exec sleep infinity"]
"""A worker pod only waits: the leader's mpirun starts the MPI daemon and its tritonserver ranks in it."""


def _pod_template(templates_dir: Path, dep: dict) -> dict:
    """The Deployment's hardened pod template (``triton-deployment.yaml`` rendered with ``dep``): the one home
    of the pod spec, adapted here for the LeaderWorkerSet's leader and workers and for the probe."""
    import copy

    where = "k8s/triton-deployment.yaml"
    text = render_template((Path(templates_dir) / "triton-deployment.yaml").read_text(), dep, where)
    return copy.deepcopy(parse_manifest(text, where)["spec"]["template"])


def _lws_params(dep: dict, pod_template: dict, group: int, pod_gpus: int) -> dict[str, dict]:
    """Parameters of the LeaderWorkerSet and its launcher ServiceAccount / Role / RoleBinding."""
    import copy

    name = f"{dep['name'][:50]}-lws"  # the LWS controller's headless Service takes this name; pods <name>-<g>-<i>
    launcher = f"{dep['name'][:54]}-mpi-launcher"
    leader = copy.deepcopy(pod_template)
    spec, c = leader["spec"], leader["spec"]["containers"][0]
    spec["serviceAccountName"] = launcher
    c["env"].append({"name": "MPI_SLOTS_PER_POD", "value": str(pod_gpus)})
    c["volumeMounts"].append({"name": "launcher-token", "mountPath": SA_TOKEN_DIR, "readOnly": True})
    spec["volumes"].append({"name": "launcher-token", "projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": SA_TOKEN_EXPIRATION_S}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}}]}})
    worker = copy.deepcopy(pod_template)
    wc = worker["spec"]["containers"][0]
    wc["command"] = list(WORKER_COMMAND)
    del wc["args"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        # nothing listens in a worker (its ranks > 0 serve no HTTP); the leader's probes cover the group, and a
        # failed rank ends mpirun, the leader's container, and so the group (RecreateGroupOnPodRestart)
        wc.pop(probe, None)
    labels = dep["labels"]
    workers = [f"{name}-{g}-{i}" for g in range(dep["replicas"]) for i in range(1, group)]
    return {
        "lws": {"name": name, "namespace": dep["namespace"], "labels": labels, "annotations": dep["annotations"],
                "replicas": dep["replicas"], "size": group, "leader_template": leader, "worker_template": worker},
        "sa": {"name": launcher, "namespace": dep["namespace"], "labels": labels},
        "role": {"name": launcher, "namespace": dep["namespace"], "labels": labels, "worker_pods": workers},
        "binding": {"name": launcher, "namespace": dep["namespace"], "labels": labels, "role_name": launcher,
                    "service_account": launcher},
    }


# --------------------------------------------------------------------------------------------
# The in-cluster accuracy probe (serving/probe.py as a long-lived Deployment)

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


def _probe_params(dep: dict, pod_template: dict, profile_name: str, unit: str, image: str,
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


def compute_params(plan: ResolvedPlan, profile, model_repository: Path, repo_root: str, image: str, namespace: str, *,
                   pvc_name: str = DEFAULT_PVC, gpu_products: Optional[list[str]] = None, shm_size: Optional[str] = None,
                   startup_failure_threshold: int = STARTUP_FAILURE_THRESHOLD,
                   templates_dir: Path = TEMPLATES_DIR) -> tuple[dict[str, Optional[dict]], dict]:
    """Template parameters per template file (None = template not rendered) and facts for DeployResult
    (``facts["derived"]``: output file -> (template file, parameters) for objects rendered from a template a
    second time: the canary Service).

    ``templates_dir``: where ``triton-deployment.yaml`` is read for the pod template of a multi-node
    LeaderWorkerSet and of the probe (the one home of the hardened pod spec)."""
    notes: list[str] = []
    model_repository = Path(model_repository)
    check_repo_root(repo_root)
    check_image(image, "image")
    _check_pod_spec_inputs(namespace, "namespace", _DNS_LABEL, "a DNS-1123 label", 63)
    _check_pod_spec_inputs(pvc_name, "pvc_name", _DNS_SUBDOMAIN, "a DNS-1123 subdomain", 253)
    if not isinstance(startup_failure_threshold, int) or startup_failure_threshold < 1:
        raise UserError("startup_failure_threshold", f"is {startup_failure_threshold!r}.", "use a positive number of probe periods.")

    gpu = plan.gpu
    if gpu is None or not gpu.id or not gpu.name:
        raise UserError("target.gpu", f"plan.json has no known GPU (asked: {plan.profile.target.gpu!r}).", "resolve the profile on a catalog GPU first.")
    world, tp, pp = _gpus(plan, profile)
    group = lws_group(world, profile.deployment.gpus_per_node, profile.deployment.workload)
    pod_gpus = world // group
    products = list(gpu_products) if gpu_products else [gpu_product_label(gpu.name)]
    for p in products:
        if not isinstance(p, str) or len(p) > 63 or not p or not _LABEL_VALUE.match(p):
            raise UserError("gpu_products", f"{p!r} is not a valid {GPU_PRODUCT_LABEL} label value.", "use the value GPU Feature Discovery sets, e.g. NVIDIA-H100-80GB-HBM3.")

    ss = serving_set(model_repository)
    for u in ss.units:
        uw = unit_world_size(model_repository, u)
        if uw != world:
            role = "current release" if u == ss.unit else "warm fallback"
            raise UserError("deployment.gpus_per_replica",
                            f"the {role} {u} in {model_repository} runs on {uw} GPU(s) but the plan needs {world} (tp {tp} x pp {pp}).",
                            "pack/promote an engine built from this plan" + ("" if u == ss.unit else
                            ", or set deployment.warm_fallback: false (every loaded engine must use the same GPUs)") + ".")
    for u in ss.units:
        eng = model_repository / u / "engine"
        # a built engine with provenance (every engine the pipeline packs has one): refused unless it matches
        # image, GPU and world size; one without it (hand-made repository) keeps the version note below
        if (eng / "config.json").is_file() and (eng / "provenance.json").is_file():
            from precision_pipeline.serving import skew

            notes += skew.check_engine(eng, image=image, sm=gpu.sm, world_size=world, where=f"{u}/engine",
                                       limits=pack.unit_limits(model_repository, u))
    if ss.engine_present is False:
        notes.append(f"engine absent in {ss.unit}: the real tensorrtllm backend will fail to load it; build the engine on a GPU node and re-pack.")
    ev = _engine_version(model_repository, ss.unit)
    if ev and image == DEFAULT_IMAGE and ev != DEFAULT_IMAGE_TRTLLM:
        notes.append(f"engine built by TensorRT-LLM {ev} but {image} ships {DEFAULT_IMAGE_TRTLLM}: engines load only under the "
                     "version that built them; pass image= with the build's container.")

    profile_name = plan.profile.name or profile.name
    name = k8s_name(profile_name)
    repo_path = pack.serving_path(repo_root, model_repository.name)
    from precision_pipeline.serving.triton_server import repository_traces_url

    trace_url = repository_traces_url(model_repository)  # what the BLS was packed with (deployment.otlp_endpoint)
    command, args, launcher = triton_command(world, repo_path, ss.models, ss.units, trace_url)
    if trace_url:
        notes.append(f"traces: Triton (--trace-config mode=opentelemetry) and the BLS send spans to {trace_url}; the BLS "
                     "imports opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http (requirements.lock pins): the "
                     "serving image must have them, or the BLS refuses to load.")
    if group > 1:
        command, launcher = [*LEADER_SHELL, "mpi-leader"], "mpirun-lws"
        notes.append(f"world size {world} > deployment.gpus_per_node {profile.deployment.gpus_per_node}: a LeaderWorkerSet "
                     f"of {group} pods x {pod_gpus} GPUs per replica; the leader's mpirun starts the ranks of the worker pods "
                     "through kubectl exec (the image needs kubectl; the LWS controller must be installed).")
    elif launcher == "mpirun":
        notes.append(f"world size {world}: mpirun runs {world} tritonserver ranks (tensorrtllm_backend leader mode), "
                     "the line launch_triton_server.py would build, run in the foreground.")
    replicas = profile.deployment.replicas
    h12 = ss.unit[len(pack.UNIT_PREFIX):]
    selector = {"app.kubernetes.io/name": "triton", "app.kubernetes.io/instance": name}
    labels = {
        **selector,
        "app.kubernetes.io/component": "inference-server",
        "app.kubernetes.io/part-of": LABEL_PREFIX,
        "app.kubernetes.io/managed-by": LABEL_PREFIX,
        f"{LABEL_PREFIX}/profile": _label_value(profile_name),
        f"{LABEL_PREFIX}/engine-hash": h12,
        f"{LABEL_PREFIX}/engine-unit": ss.unit,
    }
    annotations = {
        f"{LABEL_PREFIX}/engine-hash": ss.engine_hash,
        f"{LABEL_PREFIX}/engine-unit": ss.unit,
        f"{LABEL_PREFIX}/profile": profile_name,
        f"{LABEL_PREFIX}/gpu": str(gpu.id),
        f"{LABEL_PREFIX}/parallel": f"tp{tp}xpp{pp}",
        f"{LABEL_PREFIX}/release-source": _rel_source(ss.source, model_repository),
        f"{LABEL_PREFIX}/launcher": launcher,
    }
    shm = shm_size or f"{max(2, 1 + pod_gpus)}Gi"
    dep = {
        "name": name, "namespace": namespace, "labels": labels, "annotations": annotations,
        "replicas": replicas, "selector": selector, "pod_labels": labels,
        "pod_annotations": {**annotations, "kubectl.kubernetes.io/default-container": "triton"},
        "progress_deadline_s": STARTUP_PERIOD_S * startup_failure_threshold + 600,
        "termination_grace_s": TERMINATION_GRACE_S, "gpu_products": products,
        "image": image, "command": command, "args": args, "gpus": pod_gpus,
        "startup_period_s": STARTUP_PERIOD_S, "startup_failure_threshold": startup_failure_threshold,
        "repo_root": str(repo_root).rstrip("/") or "/", "shm_size": shm, "pvc_name": pvc_name,
        "cpu_request": str(CPU_PER_GPU * pod_gpus), "memory_request": f"{MEMORY_GI_BASE + MEMORY_GI_PER_GPU * pod_gpus}Gi",
        "tmp_size": TMP_SIZE,
    }
    pod_template = _pod_template(templates_dir, dep) if group > 1 or has_gate(model_repository) else None
    lws = _lws_params(dep, pod_template, group, pod_gpus) if group > 1 else {}
    serving_selector = {**selector, LWS_WORKER_INDEX_LABEL: "0"} if lws else selector
    svc = {"name": name, "namespace": namespace, "labels": labels, "selector": serving_selector}
    pdb = ({"name": name, "namespace": namespace, "labels": labels, "selector": serving_selector, "min_available": 1}
           if replicas > 1 else None)
    if pdb is None:
        notes.append("replicas = 1: no PodDisruptionBudget (minAvailable: 1 would block every drain of the node).")
    derived: dict[str, tuple[str, dict]] = {}
    canary = canary_service_name(name) if profile.deployment.workload == "argo-rollout" else None
    if canary is not None:
        # same ports and selector as the main Service; Argo Rollouts adds the canary ReplicaSet's
        # rollouts-pod-template-hash to this selector at runtime, so the probe reaches canary pods only
        derived[CANARY_SERVICE_FILE] = ("service.yaml", {**svc, "name": canary, "labels": {**labels, SERVICE_ROLE_LABEL: "canary"}})
    probe, monitor = (_probe_params(dep, pod_template, profile_name, ss.unit, image, canary or name)
                      if has_gate(model_repository) else (None, None))
    facts = {"name": name, "replicas": replicas, "gpus_per_replica": world, "gpu_products": products, "serving": ss,
             "launcher": launcher, "command": [*command, *args], "notes": notes, "probe_monitor": monitor,
             "group_size": group, "pod_params": dep, "derived": derived}
    rollout, analysis = _argo_params(plan, profile, name, namespace, labels, annotations, selector, ss.unit, dep, canary)
    if rollout is not None:
        notes.append(f"workload argo-rollout: apply the Rollout, AnalysisTemplate and canary Service {canary} with the "
                     "Deployment; the Rollout owns releases, the probe targets the canary Service (k8s/README.md).")
    return {"triton-deployment.yaml": None if lws else dep, "service.yaml": svc, "pdb.yaml": pdb, "argo-rollout.yaml": rollout,
            "analysis-template.yaml": analysis, "triton-leaderworkerset.yaml": lws.get("lws"),
            "lws-launcher-serviceaccount.yaml": lws.get("sa"), "lws-launcher-role.yaml": lws.get("role"),
            "lws-launcher-rolebinding.yaml": lws.get("binding"), "probe-deployment.yaml": probe}, facts


DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
"""Prometheus the AnalysisTemplate queries (the prometheus-operator's default Service name); an argument."""
PROBE_METRICS = PROBE_METRIC_NAMES
"""Gauges the accuracy probe publishes per engine unit (label ``engine_unit``; serving/probe.py ``ProbeExporter``)."""
MAX_ERROR_RATE = 0.01
ANALYSIS_INTERVAL = "60s"


def _argo_params(plan, profile, name, namespace, labels, annotations, selector, unit, dep,
                 canary_service: Optional[str]) -> tuple[Optional[dict], Optional[dict]]:
    """Rollout and AnalysisTemplate parameters (None, None unless ``deployment.workload: argo-rollout``);
    ``canary_service``: the Rollout's ``strategy.canary.canaryService``."""
    d = profile.deployment
    if d.workload != "argo-rollout":
        return None, None
    from precision_pipeline.gate.checkpoint_gate import CHECKS

    steps: list[dict] = []
    for pct in d.canary_steps:
        steps.append({"setWeight": int(pct)})
        if pct < 100:
            steps.append({"pause": {"duration": f"{int(d.canary_pause_s)}s"}})
    thr = profile.gate.for_model(plan.model.name)
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
    rollout = {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations,
               "replicas": dep["replicas"], "progress_deadline_s": dep["progress_deadline_s"], "selector": selector,
               "deployment_name": name, "analysis_name": name, "canary_service": canary_service, "steps": steps}
    analysis = {"name": name, "namespace": namespace, "labels": labels, "prometheus_address": DEFAULT_PROMETHEUS,
                "metrics": metrics}
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


def alert_groups(profile_name: str, thresholds, *, stale_s: int = PROBE_STALE_S) -> list[dict]:
    """The PrometheusRule's groups for one profile: the probe's checked metrics (``PROBE_METRICS``, ops
    and thresholds from ``checkpoint_gate.CHECKS`` and ``thresholds``, the profile's gate section for the
    model), probe staleness and errors, and the BLS's ``precision_pipeline_fallback_active`` gauge."""
    from precision_pipeline.gate.checkpoint_gate import CHECKS

    sel = f"profile={_promql_str(profile_name)}"
    rules: list[dict] = []
    for key, metric in PROBE_METRICS.items():
        field_name, op = CHECKS[key]
        v = getattr(thresholds, field_name)
        if v is None:
            continue
        bad = ">" if op == "<=" else "<"
        name = "PrecisionProbe" + "".join(w.capitalize() for w in key.split("_")) + ("AboveGate" if bad == ">" else "BelowGate")
        rules.append({"alert": name, "expr": f"max by (engine_unit) ({metric}{{{sel}}}) {bad} {v!r}",
                      "for": PROBE_ALERT_FOR, "labels": {"severity": "critical"},
                      "annotations": {"summary": f"live {key} of {{{{ $labels.engine_unit }}}} beyond the gate ({op} {v!r})",
                                      "description": f"The golden-prompt probe of profile {profile_name} measured "
                                                     f"{key} = {{{{ $value }}}} on the live server; the gate allows {op} {v!r}."}})
    rules.append({"alert": "PrecisionProbeStale",
                  "expr": f"time() - max by (engine_unit) ({PROBE_LAST_RUN}{{{sel}}}) > {int(stale_s)}",
                  "labels": {"severity": "warning"},
                  "annotations": {"summary": f"no probe run of {{{{ $labels.engine_unit }}}} for over {int(stale_s)} s"}})
    rules.append({"alert": "PrecisionProbeAbsent", "expr": f"absent({PROBE_LAST_RUN}{{{sel}}})", "for": f"{int(stale_s)}s",
                  "labels": {"severity": "warning"},
                  "annotations": {"summary": f"the accuracy probe of profile {profile_name} exports nothing"}})
    rules.append({"alert": "PrecisionProbeErrors",
                  "expr": f'increase(precision_pipeline_probe_runs_total{{{sel},result="error"}}[15m]) > 0',
                  "labels": {"severity": "warning"},
                  "annotations": {"summary": "probe runs of {{ $labels.engine_unit }} failed to get logits from the server"}})
    rules.append({"alert": "PrecisionFallbackActive", "expr": "max(precision_pipeline_fallback_active) > 0",
                  "for": "5m", "labels": {"severity": "warning"},
                  "annotations": {"summary": "the BLS serves the fallback release (releases.json fallback)"}})
    return [{"name": f"precision-pipeline.{profile_name}", "interval": "1m", "rules": rules}]


# --------------------------------------------------------------------------------------------
# Stage


def render_manifests(plan: ResolvedPlan, profile, model_repository: Path, out_dir: Path, repo_root: str,
                     image: str = DEFAULT_IMAGE, namespace: str = "default", *, pvc_name: str = DEFAULT_PVC,
                     gpu_products: Optional[list[str]] = None, shm_size: Optional[str] = None,
                     startup_failure_threshold: int = STARTUP_FAILURE_THRESHOLD, k8s_version: str = K8S_VERSION,
                     templates_dir: Path = TEMPLATES_DIR, workdir: Optional[Path] = None) -> DeployResult:
    """Render and validate the manifests; write ``<out_dir>/k8s/*.yaml`` atomically (all or nothing).

    ``repo_root``: where the build output (the parent of ``model_repository``) is mounted in the pod
    (the PVC ``pvc_name``, read-only). ``gpu_products``: node label values to accept instead of the one
    derived from the plan's GPU name. ``workdir``: write the manifests there instead of
    ``<out_dir>/k8s`` (the stage runner renames it into place). Raises UserError (exit 2) on any
    refused input or invalid manifest.
    """
    templates_dir = Path(templates_dir)
    params, facts = compute_params(plan, profile, Path(model_repository), repo_root, image, namespace, pvc_name=pvc_name,
                                   gpu_products=gpu_products, shm_size=shm_size,
                                   startup_failure_threshold=startup_failure_threshold, templates_dir=templates_dir)
    found = sorted(p.name for p in templates_dir.glob("*.yaml"))
    unknown = sorted(set(found) - set(params))
    missing = sorted(set(params) - set(found))
    if unknown or missing:
        raise UserError(str(templates_dir), (f"has templates build/precision_pipeline/serving/deploy.py does not fill: {', '.join(unknown)}. " if unknown else "")
                        + (f"lacks {', '.join(missing)}." if missing else ""),
                        "keep k8s/ and build/precision_pipeline/serving/deploy.py's parameter sets in step.")
    rendered: dict[str, str] = {}
    jobs = [(tname, tname, params[tname], f"k8s/{tname}") for tname in found]
    jobs += [(out, tname, p, f"k8s/{tname} (as {out})") for out, (tname, p) in facts["derived"].items()]
    for out, tname, p, where in jobs:
        if p is None:
            continue
        text = render_template((templates_dir / tname).read_text(), p, where)
        doc = parse_manifest(text, where)
        validate_manifest(doc, where, k8s_version)
        header = (f"# Rendered by build/precision_pipeline/serving/deploy.py from k8s/{tname}: profile {plan.profile.name or profile.name}, "
                  f"engine unit {facts['serving'].unit}.\n# Validated against Kubernetes {k8s_version} (strict). Re-render; do not edit.\n")
        rendered[out] = header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=1000)
    monitoring: dict[str, str] = {}
    mon_dir = templates_dir / MONITORING_SUBDIR
    for tpath in sorted(mon_dir.glob("*.yaml")) if mon_dir.is_dir() else []:
        where = f"k8s/{MONITORING_SUBDIR}/{tpath.name}"
        dep = facts["pod_params"]  # the Deployment's parameters (also for a LeaderWorkerSet, which replaces it)
        p = {"name": dep["name"], "namespace": dep["namespace"], "labels": dep["labels"]}
        if tpath.name == "probe-podmonitor.yaml":
            if facts["probe_monitor"] is None:
                continue
            p = facts["probe_monitor"]
        elif tpath.name == "prometheus-rule.yaml":
            p["groups"] = alert_groups(plan.profile.name or profile.name, profile.gate.for_model(plan.model.name))
        elif tpath.name == "grafana-dashboard.yaml":
            from precision_pipeline.serving import dashboard

            p["name"] = f"{dep['name']}-dashboard"[:63]
            p["labels"] = {**dep["labels"], "grafana_dashboard": "1"}
            p["data"] = {f"{dep['name']}.json": dashboard.to_json(dashboard.dashboard(plan, profile, dep["name"]))}
        else:
            raise UserError(str(tpath), "is a monitoring template build/precision_pipeline/serving/deploy.py does not fill.",
                            "keep k8s/monitoring/ and deploy.py in step.")
        doc = parse_manifest(render_template(tpath.read_text(), p, where), where)
        validate_manifest(doc, where, k8s_version)
        monitoring[f"{MONITORING_SUBDIR}/{tpath.name}"] = (
            f"# Rendered by build/precision_pipeline/serving/deploy.py from {where}: profile {plan.profile.name or profile.name}.\n"
            "# For a cluster with the prometheus-operator / Grafana's sidecar. Re-render; do not edit.\n"
            + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=1000))
    out_dir = Path(out_dir)
    target = out_dir / OUT_SUBDIR
    with (contextlib.nullcontext(Path(workdir)) if workdir is not None else atomic_dir(target)) as tmp:
        for tname, text in rendered.items():
            (tmp / tname).write_text(text)
        for tname, text in monitoring.items():
            (tmp / tname).parent.mkdir(parents=True, exist_ok=True)
            (tmp / tname).write_text(text)
    ss: ServingSet = facts["serving"]
    return DeployResult(
        out_dir=target, files=sorted(rendered), replicas=facts["replicas"], gpus_per_replica=facts["gpus_per_replica"],
        gpu_resource=GPU_RESOURCE, image=image, namespace=namespace, name=facts["name"], gpu_products=facts["gpu_products"],
        engine_unit=ss.unit, engine_hash=ss.engine_hash, engine_present=ss.engine_present, load_models=ss.models,
        release_source=ss.source, launcher=facts["launcher"], command=facts["command"], k8s_version=k8s_version,
        notes=facts["notes"], monitoring=sorted(monitoring))


def stage_inputs(plan: ResolvedPlan, profile, repo_root: str, image: str = DEFAULT_IMAGE, *, namespace: str = "default",
                 pvc_name: str = DEFAULT_PVC, templates_dir: Path = TEMPLATES_DIR) -> dict:
    """What the deploy stage's content key hashes, besides the pack stage's key and build/precision_pipeline/serving/deploy.py's source
    (the caller adds those: the release state of the repository comes from pack/release)."""
    gpu = plan.gpu
    return {
        "stage": "deploy",
        "k8s_version": K8S_VERSION,
        "image": image,
        "repo_root": repo_root,
        "namespace": namespace,
        "pvc_name": pvc_name,
        "profile": plan.profile.name or profile.name,
        "deployment": profile.deployment.model_dump(mode="json"),
        "parallel": {"tp_size": profile.parallel.tp_size, "pp_size": profile.parallel.pp_size},
        "gpu": {"id": gpu.id if gpu else None, "name": gpu.name if gpu else None},
        "mapping": plan.mapping.model_dump(mode="json"),
        "templates": {p.name: hash_file(p) for p in sorted(Path(templates_dir).glob("*.yaml"))},
        "monitoring_templates": {p.name: hash_file(p) for p in sorted((Path(templates_dir) / MONITORING_SUBDIR).glob("*.yaml"))},
    }


__all__ = ["render_manifests", "stage_inputs", "DeployResult", "DEFAULT_IMAGE", "DEFAULT_IMAGE_TRTLLM",
           "DEFAULT_IMAGE_SOURCE", "K8S_VERSION", "GPU_RESOURCE", "GPU_PRODUCT_LABEL", "serving_set",
           "triton_command", "render_template", "validate_manifest", "gpu_product_label", "k8s_name", "alert_groups",
           "canary_service_name", "CANARY_SERVICE_FILE"]
