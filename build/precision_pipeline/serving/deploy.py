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
unit, plus the fallback unit when ``warm_fallback``; see build/precision_pipeline/serving/release_state.py ``serving_models``), else
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
label syntax, replicas >= 1, selector matching the pod labels, GPU requests = limits; serving/k8s.py).

Modules: serving/k8s.py (names, labels, rendering, strict validation), serving/monitoring.py (the probe
Deployment, canary Service, Argo Rollouts analysis, alerts); this module computes the parameters and renders.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.outputs import NAME_MAX
from precision_pipeline.core.paths import REPO_ROOT
from precision_pipeline.core.store import atomic_dir, hash_file, read_json
from precision_pipeline.resolve.plan import ResolvedPlan
from precision_pipeline.resolve.derive import lws_group  # the multi-node layout (also the rule layout.nodes)
from precision_pipeline.serving import pack
from precision_pipeline.serving.llmapi_unit import is_llm_api_unit
from precision_pipeline.serving.k8s import (DNS_LABEL, DNS_SUBDOMAIN, GPU_PRODUCT_LABEL, GPU_RESOURCE, GRPC_PORT,
                                            HTTP_PORT, K8S_VERSION, LABEL_PREFIX, LABEL_VALUE, METRICS_PORT, TMP_SIZE,
                                            gpu_product_label, k8s_name, label_value, parse_manifest, render_template,
                                            validate_manifest)
from precision_pipeline.serving.monitoring import (CANARY_SERVICE_FILE, MONITORING_SUBDIR, SERVICE_ROLE_LABEL, SOURCE_DIR,
                                                   alert_groups, argo_params, canary_service_name, has_gate, probe_params)

TEMPLATES_DIR = REPO_ROOT / "k8s"
OUT_SUBDIR = "k8s"

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
STARTUP_PERIOD_S = 10
STARTUP_FAILURE_THRESHOLD = 180  # 30 minutes to load engines before the kubelet restarts the pod
TERMINATION_GRACE_S = 60
CPU_PER_GPU = 4
"""CPU request per GPU (tokenization, the Python BLS and pre/postprocessing run on CPU): a sizing default."""
MEMORY_GI_BASE, MEMORY_GI_PER_GPU = 16, 16
"""Memory request (= limit) ``MEMORY_GI_BASE + MEMORY_GI_PER_GPU x GPUs`` GiB: host copies of engine
shards while loading plus the pinned host buffers of the TensorRT-LLM runtime; a sizing default."""


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
# What the repository serves


@dataclass
class ServingSet:
    unit: str
    engine_hash: str
    engine_present: Optional[bool]
    models: list[str]
    units: list[str]
    source: str
    llm_api_units: list[str] = field(default_factory=list)
    """LLM-API units (``llm_api_<h12>``, serving/llmapi_unit.py) among ``models``; ``units`` are the engine units."""


def serving_set(model_repository: Path) -> ServingSet:
    """The models Triton must load: from releases.json when present, else from pack.json."""
    from precision_pipeline.serving import release_state

    repo = Path(model_repository)
    if not repo.is_dir():
        raise UserError("model_repository", f"{repo} is not a directory.", "pack the build first (build/precision_pipeline/serving/pack.py).")
    state = release_state.read_state(repo)
    if state and state.get("current"):
        unit = str(state["current"])
        models = release_state.serving_models(repo, state)
        rec = next((r for r in reversed(state.get("releases") or []) if r.get("unit") == unit), {})
        ehash, present, source = rec.get("engine_hash"), rec.get("engine_present"), str(release_state.state_path(repo))
    else:
        pj = read_json(repo / pack.PACK_FILE)
        if pj and pj.get("engine_unit"):
            unit, ehash, present, source = (pj["engine_unit"], pj.get("engine_hash") or pj.get("unit_key"),
                                            pj.get("engine_present"), str(repo / pack.PACK_FILE))
        else:
            found = sorted(d.name for d in repo.iterdir() if d.is_dir() and pack.is_unit(d.name))
            if len(found) != 1:
                raise UserError("model_repository", f"{repo} has no releases.json or pack.json and {len(found)} engine units.",
                                "pack the build (build/precision_pipeline/serving/pack.py) or init the serving repository (build/precision_pipeline/serving/release.py).")
            unit, ehash, present, source = found[0], None, None, f"{repo} (the only engine unit)"
        # an LLM-API repository has no ensemble (llmapi_unit.REPO_MODELS)
        models = ["preprocessing", "postprocessing", unit, *([] if is_llm_api_unit(unit) else ["ensemble"]), "tensorrt_llm_bls"]
    if not (pack.is_unit(unit) or is_llm_api_unit(unit)):
        raise UserError(source, f"names {unit!r} as the current unit, which is not tensorrt_llm_<12 hex> or llm_api_<12 hex>.",
                        "re-pack or repair the release state (build/precision_pipeline/serving/release.py recover).")
    if not ehash:
        ref = read_json(repo / unit / "engine" / pack.CPU_REFERENCE_FILE) or {}
        ehash = ref.get("engine_hash") or unit.rsplit("_", 1)[-1]
        if present is None:
            present = ref.get("engine_present")
    missing = [m for m in models if not (repo / m / "config.pbtxt").is_file()]
    if missing:
        raise UserError("model_repository", f"{repo} lacks {', '.join(missing)} (needed by {Path(source).name}).",
                        "re-pack the build or run build/precision_pipeline/serving/release.py recover.")
    units = [m for m in models if pack.is_unit(m)]
    return ServingSet(unit=unit, engine_hash=str(ehash), engine_present=present, models=models, units=units, source=source,
                      llm_api_units=[m for m in models if is_llm_api_unit(m)])


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


_DOMAIN = r"(?:(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])(?:\.(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9]))*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
IMAGE_REFERENCE = re.compile(rf"(?P<name>(?:{_DOMAIN}/)?{_PATH})(?::(?P<tag>[\w][\w.-]{{0,127}}))?"
                             r"(?:@(?P<algo>[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*):(?P<hex>[0-9a-fA-F]{32,}))?")
"""The container image reference grammar of distribution/reference (what containerd, Docker and the kubelet parse;
github.com/distribution/reference v0.5.0, reference.go lines 4-26): ``[domain[:port]/]path[:tag][@algo:hex]``, path
components lower-case ``[a-z0-9]`` joined by ``.``, ``_``, ``__`` or dashes, a tag of at most 128 word characters,
dots and dashes. Also there: a name of at most 255 characters (``NameTotalLengthMax``); go-digest: sha256 is 64 hex."""


def check_image(image: str, field: str = "--image") -> None:
    """A container image reference (``IMAGE_REFERENCE``; a sha256 digest of 64 hex digits, a name of at most 255
    characters). UserError on ``field`` if not: the pod would fail with InvalidImageName (hostile s12 F-G:
    ``NVCR.io/Nvidia/Triton:tag`` and ``...@sha256:xyz`` were rendered)."""
    m = IMAGE_REFERENCE.fullmatch(image) if isinstance(image, str) else None
    bad = ("not a container image reference (distribution/reference: lower-case repository path, tag [A-Za-z0-9_.-] "
           "up to 128, digest ALGO:HEX)" if m is None else
           "a name longer than 255 characters" if len(m["name"]) > 255 else
           "a sha256 digest whose hex is not 64 digits" if m["algo"] == "sha256" and len(m["hex"]) != 64 else None)
    if bad:
        raise UserError(field, f"{str(image)[:200]!r} is {bad}.", f"e.g. {DEFAULT_IMAGE}.")


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
# Parameters of the manifests


@dataclass(frozen=True)
class ManifestInputs:
    """What ``render_manifests`` renders from (``compute_params`` checks every field).

    ``repo_root``: where the build output (the parent of ``model_repository``) is mounted in the pod (the PVC
    ``pvc_name``, read-only). ``gpu_products``: node label values to accept instead of the one derived from the
    plan's GPU name. ``shm_size``: the ``/dev/shm`` emptyDir (None: ``max(2, 1 + GPUs per pod)`` Gi).
    ``templates_dir``: the ``k8s/`` templates (also the pod template of a multi-node LeaderWorkerSet and of the
    probe: the one home of the hardened pod spec)."""

    plan: ResolvedPlan
    profile: Any
    model_repository: Path
    repo_root: str
    image: str = DEFAULT_IMAGE
    namespace: str = "default"
    pvc_name: str = DEFAULT_PVC
    gpu_products: Optional[list[str]] = None
    shm_size: Optional[str] = None
    startup_failure_threshold: int = STARTUP_FAILURE_THRESHOLD
    k8s_version: str = K8S_VERSION
    templates_dir: Path = TEMPLATES_DIR

    @property
    def profile_name(self) -> str:
        return self.plan.profile.name or self.profile.name


@dataclass(frozen=True)
class Layout:
    """How one replica's engine ranks sit on GPUs and pods."""

    gpu: Any            # the plan's catalog GPU
    world: int          # GPUs per replica = tp_size x pp_size
    tp: int
    pp: int
    group: int          # pods per replica (> 1: a LeaderWorkerSet)
    pod_gpus: int       # GPUs per pod
    products: list[str]  # accepted nvidia.com/gpu.product values


def _check_inputs(i: ManifestInputs) -> None:
    check_repo_root(i.repo_root)
    check_image(i.image, "image")
    _check_pod_spec_inputs(i.namespace, "namespace", DNS_LABEL, "a DNS-1123 label", 63)
    _check_pod_spec_inputs(i.pvc_name, "pvc_name", DNS_SUBDOMAIN, "a DNS-1123 subdomain", 253)
    if not isinstance(i.startup_failure_threshold, int) or i.startup_failure_threshold < 1:
        raise UserError("startup_failure_threshold", f"is {i.startup_failure_threshold!r}.",
                        "use a positive number of probe periods.")


def _layout(i: ManifestInputs) -> Layout:
    plan, profile = i.plan, i.profile
    gpu = plan.gpu
    if gpu is None or not gpu.id or not gpu.name:
        raise UserError("target.gpu", f"plan.json has no known GPU (asked: {plan.profile.target.gpu!r}).", "resolve the profile on a catalog GPU first.")
    world, tp, pp = _gpus(plan, profile)
    group = lws_group(world, profile.deployment.gpus_per_node, profile.deployment.workload)
    products = list(i.gpu_products) if i.gpu_products else [gpu_product_label(gpu.name)]
    for p in products:
        if not isinstance(p, str) or len(p) > 63 or not p or not LABEL_VALUE.match(p):
            raise UserError("gpu_products", f"{p!r} is not a valid {GPU_PRODUCT_LABEL} label value.", "use the value GPU Feature Discovery sets, e.g. NVIDIA-H100-80GB-HBM3.")
    return Layout(gpu, world, tp, pp, group, world // group, products)


def _check_units(i: ManifestInputs, ss: ServingSet, lay: Layout) -> list[str]:
    """Every loaded engine unit fits the layout and the image (refused otherwise); returns notes."""
    model_repository, world, notes = Path(i.model_repository), lay.world, []
    for u in ss.units:
        uw = unit_world_size(model_repository, u)
        if uw != world:
            role = "current release" if u == ss.unit else "warm fallback"
            raise UserError("deployment.gpus_per_replica",
                            f"the {role} {u} in {model_repository} runs on {uw} GPU(s) but the plan needs {world} (tp {lay.tp} x pp {lay.pp}).",
                            "pack/promote an engine built from this plan" + ("" if u == ss.unit else
                            ", or set deployment.warm_fallback: false (every loaded engine must use the same GPUs)") + ".")
    for u in ss.units:
        eng = model_repository / u / "engine"
        # a built engine with provenance (every engine the pipeline packs has one): refused unless it matches
        # image, GPU and world size; one without it (hand-made repository) keeps the version note below
        if (eng / "config.json").is_file() and (eng / "provenance.json").is_file():
            from precision_pipeline.serving import skew

            notes += skew.check_engine(eng, image=i.image, sm=lay.gpu.sm, world_size=world, where=f"{u}/engine",
                                       limits=pack.unit_limits(model_repository, u))
    if ss.llm_api_units:
        from precision_pipeline.serving import images, llmapi_unit

        row = images.lookup(i.image)
        notes += llmapi_unit.triton_deployment_notes(model_repository, ss.llm_api_units, world, ss.units, lay.group,
                                                     row.tensorrt_llm if row else None, i.image)
    if ss.engine_present is False:
        notes.append(f"engine absent in {ss.unit}: the real tensorrtllm backend will fail to load it; build the engine on a GPU node and re-pack.")
    ev = _engine_version(model_repository, ss.unit)
    if ev and i.image == DEFAULT_IMAGE and ev != DEFAULT_IMAGE_TRTLLM:
        notes.append(f"engine built by TensorRT-LLM {ev} but {i.image} ships {DEFAULT_IMAGE_TRTLLM}: engines load only under the "
                     "version that built them; pass image= with the build's container.")
    return notes


def _launch(i: ManifestInputs, ss: ServingSet, lay: Layout, notes: list[str]) -> tuple[list[str], list[str], str]:
    """(command, args, launcher) of the Triton container; appends what the reader should know to ``notes``."""
    from precision_pipeline.serving.triton_server import repository_traces_url

    world = lay.world
    repo_path = pack.serving_path(i.repo_root, Path(i.model_repository).name)
    trace_url = repository_traces_url(Path(i.model_repository))  # what the BLS was packed with (deployment.otlp_endpoint)
    if ss.llm_api_units:  # one tritonserver on the overlay; the LLM API starts its own tp x pp workers
        from precision_pipeline.serving.llmapi_unit import OVERLAY_REPOSITORY

        world, repo_path = 1, OVERLAY_REPOSITORY
    command, args, launcher = triton_command(world, repo_path, ss.models, ss.units, trace_url)
    if trace_url:
        notes.append(f"traces: Triton (--trace-config mode=opentelemetry) and the BLS send spans to {trace_url}; the BLS "
                     "imports opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http (requirements.lock pins): the "
                     "serving image must have them, or the BLS refuses to load.")
    if lay.group > 1:
        command, launcher = [*LEADER_SHELL, "mpi-leader"], "mpirun-lws"
        notes.append(f"world size {world} > deployment.gpus_per_node {i.profile.deployment.gpus_per_node}: a LeaderWorkerSet "
                     f"of {lay.group} pods x {lay.pod_gpus} GPUs per replica; the leader's mpirun starts the ranks of the worker pods "
                     "through kubectl exec (the image needs kubectl; the LWS controller must be installed).")
    elif launcher == "mpirun":
        notes.append(f"world size {world}: mpirun runs {world} tritonserver ranks (tensorrtllm_backend leader mode), "
                     "the line launch_triton_server.py would build, run in the foreground.")
    return command, args, launcher


def _deployment_params(i: ManifestInputs, ss: ServingSet, lay: Layout, launch: tuple[list[str], list[str], str]) -> dict:
    """The Deployment's parameters (``triton-deployment.yaml``; also the pod template of the other workloads)."""
    command, args, launcher = launch
    profile_name = i.profile_name
    name = k8s_name(profile_name)
    h12 = ss.unit.rsplit("_", 1)[-1]
    selector = {"app.kubernetes.io/name": "triton", "app.kubernetes.io/instance": name}
    labels = {
        **selector,
        "app.kubernetes.io/component": "inference-server",
        "app.kubernetes.io/part-of": LABEL_PREFIX,
        "app.kubernetes.io/managed-by": LABEL_PREFIX,
        f"{LABEL_PREFIX}/profile": label_value(profile_name),
        f"{LABEL_PREFIX}/engine-hash": h12,
        f"{LABEL_PREFIX}/engine-unit": ss.unit,
    }
    annotations = {
        f"{LABEL_PREFIX}/engine-hash": ss.engine_hash,
        f"{LABEL_PREFIX}/engine-unit": ss.unit,
        f"{LABEL_PREFIX}/profile": profile_name,
        f"{LABEL_PREFIX}/gpu": str(lay.gpu.id),
        f"{LABEL_PREFIX}/parallel": f"tp{lay.tp}xpp{lay.pp}",
        f"{LABEL_PREFIX}/release-source": _rel_source(ss.source, Path(i.model_repository)),
        f"{LABEL_PREFIX}/launcher": launcher,
    }
    pod_gpus, threshold = lay.pod_gpus, i.startup_failure_threshold
    return {
        "name": name, "namespace": i.namespace, "labels": labels, "annotations": annotations,
        "replicas": i.profile.deployment.replicas, "selector": selector, "pod_labels": labels,
        "pod_annotations": {**annotations, "kubectl.kubernetes.io/default-container": "triton"},
        "progress_deadline_s": STARTUP_PERIOD_S * threshold + 600,
        "termination_grace_s": TERMINATION_GRACE_S, "gpu_products": lay.products,
        "image": i.image, "command": command, "args": args, "gpus": pod_gpus,
        "startup_period_s": STARTUP_PERIOD_S, "startup_failure_threshold": threshold,
        "repo_root": str(i.repo_root).rstrip("/") or "/", "shm_size": i.shm_size or f"{max(2, 1 + pod_gpus)}Gi",
        "pvc_name": i.pvc_name, "cpu_request": str(CPU_PER_GPU * pod_gpus),
        "memory_request": f"{MEMORY_GI_BASE + MEMORY_GI_PER_GPU * pod_gpus}Gi", "tmp_size": TMP_SIZE,
    }


def compute_params(i: ManifestInputs) -> tuple[dict[str, Optional[dict]], dict]:
    """Template parameters per template file (None = template not rendered) and facts for DeployResult
    (``facts["derived"]``: output file -> (template file, parameters) for objects rendered from a template a
    second time: the canary Service). Raises UserError on any refused input."""
    _check_inputs(i)
    lay = _layout(i)
    ss = serving_set(Path(i.model_repository))
    notes = _check_units(i, ss, lay)
    launch = _launch(i, ss, lay, notes)
    dep = _deployment_params(i, ss, lay, launch)
    name, labels, selector, replicas = dep["name"], dep["labels"], dep["selector"], dep["replicas"]
    gated = has_gate(Path(i.model_repository))
    pod_template = _pod_template(i.templates_dir, dep) if lay.group > 1 or gated else None
    lws = _lws_params(dep, pod_template, lay.group, lay.pod_gpus) if lay.group > 1 else {}
    serving_selector = {**selector, LWS_WORKER_INDEX_LABEL: "0"} if lws else selector
    svc = {"name": name, "namespace": i.namespace, "labels": labels, "selector": serving_selector}
    pdb = ({"name": name, "namespace": i.namespace, "labels": labels, "selector": serving_selector, "min_available": 1}
           if replicas > 1 else None)
    if pdb is None:
        notes.append("replicas = 1: no PodDisruptionBudget (minAvailable: 1 would block every drain of the node).")
    derived: dict[str, tuple[str, dict]] = {}
    canary = canary_service_name(name) if i.profile.deployment.workload == "argo-rollout" else None
    if canary is not None:
        # same ports and selector as the main Service; Argo Rollouts adds the canary ReplicaSet's
        # rollouts-pod-template-hash to this selector at runtime, so the probe reaches canary pods only
        derived[CANARY_SERVICE_FILE] = ("service.yaml", {**svc, "name": canary, "labels": {**labels, SERVICE_ROLE_LABEL: "canary"}})
    probe, monitor = (probe_params(dep, pod_template, i.profile_name, ss.unit, i.image, canary or name)
                      if gated else (None, None))
    facts = {"name": name, "replicas": replicas, "gpus_per_replica": lay.world, "gpu_products": lay.products, "serving": ss,
             "launcher": launch[2], "command": [*launch[0], *launch[1]], "notes": notes, "probe_monitor": monitor,
             "group_size": lay.group, "pod_params": dep, "derived": derived}
    rollout, analysis = argo_params(i.profile.deployment, i.profile.gate.for_model(i.plan.model.name), dep, ss.unit, canary)
    if rollout is not None:
        notes.append(f"workload argo-rollout: apply the Rollout, AnalysisTemplate and canary Service {canary} with the "
                     "Deployment; the Rollout owns releases, the probe targets the canary Service (k8s/README.md).")
    return {"triton-deployment.yaml": None if lws else dep, "service.yaml": svc, "pdb.yaml": pdb, "argo-rollout.yaml": rollout,
            "analysis-template.yaml": analysis, "triton-leaderworkerset.yaml": lws.get("lws"),
            "lws-launcher-serviceaccount.yaml": lws.get("sa"), "lws-launcher-role.yaml": lws.get("role"),
            "lws-launcher-rolebinding.yaml": lws.get("binding"), "probe-deployment.yaml": probe}, facts


# --------------------------------------------------------------------------------------------
# Stage


def _render_workload(i: ManifestInputs, params: dict[str, Optional[dict]], facts: dict) -> dict[str, str]:
    """Output file -> rendered, validated YAML of every ``k8s/*.yaml`` template with parameters (and the derived ones)."""
    templates_dir = Path(i.templates_dir)
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
        if out == "triton-deployment.yaml" and facts["serving"].llm_api_units:
            from precision_pipeline.serving.llmapi_unit import add_overlay

            add_overlay(doc["spec"]["template"], pack.serving_path(i.repo_root, Path(i.model_repository).name))
        validate_manifest(doc, where, i.k8s_version)
        header = (f"# Rendered by build/precision_pipeline/serving/deploy.py from k8s/{tname}: profile {i.profile_name}, "
                  f"engine unit {facts['serving'].unit}.\n# Validated against Kubernetes {i.k8s_version} (strict). Re-render; do not edit.\n")
        rendered[out] = header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=1000)
    return rendered


def _monitoring_params(i: ManifestInputs, tpath: Path, facts: dict) -> Optional[dict]:
    """Parameters of one ``k8s/monitoring/`` template (None: not rendered for this build)."""
    dep = facts["pod_params"]  # the Deployment's parameters (also for a LeaderWorkerSet, which replaces it)
    p = {"name": dep["name"], "namespace": dep["namespace"], "labels": dep["labels"]}
    if tpath.name == "probe-podmonitor.yaml":
        return facts["probe_monitor"]
    if tpath.name == "prometheus-rule.yaml":
        p["groups"] = alert_groups(i.profile_name, i.profile.gate.for_model(i.plan.model.name))
    elif tpath.name == "grafana-dashboard.yaml":
        from precision_pipeline.serving import dashboard

        p["name"] = f"{dep['name']}-dashboard"[:63]
        p["labels"] = {**dep["labels"], "grafana_dashboard": "1"}
        p["data"] = {f"{dep['name']}.json": dashboard.to_json(dashboard.dashboard(i.plan, i.profile, dep["name"]))}
    else:
        raise UserError(str(tpath), "is a monitoring template build/precision_pipeline/serving/deploy.py does not fill.",
                        "keep k8s/monitoring/ and deploy.py in step.")
    return p


def _render_monitoring(i: ManifestInputs, facts: dict) -> dict[str, str]:
    """``monitoring/<file>`` -> rendered, validated YAML of the ``k8s/monitoring/`` templates."""
    monitoring: dict[str, str] = {}
    mon_dir = Path(i.templates_dir) / MONITORING_SUBDIR
    for tpath in sorted(mon_dir.glob("*.yaml")) if mon_dir.is_dir() else []:
        where = f"k8s/{MONITORING_SUBDIR}/{tpath.name}"
        p = _monitoring_params(i, tpath, facts)
        if p is None:
            continue
        doc = parse_manifest(render_template(tpath.read_text(), p, where), where)
        validate_manifest(doc, where, i.k8s_version)
        monitoring[f"{MONITORING_SUBDIR}/{tpath.name}"] = (
            f"# Rendered by build/precision_pipeline/serving/deploy.py from {where}: profile {i.profile_name}.\n"
            "# For a cluster with the prometheus-operator / Grafana's sidecar. Re-render; do not edit.\n"
            + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=1000))
    return monitoring


def render_manifests(inputs: ManifestInputs, out_dir: Path, workdir: Optional[Path] = None) -> DeployResult:
    """Render and validate the manifests; write ``<out_dir>/k8s/*.yaml`` atomically (all or nothing).

    ``workdir``: write the manifests there instead of ``<out_dir>/k8s`` (the stage runner renames it into
    place). Raises UserError (exit 2) on any refused input or invalid manifest.
    """
    params, facts = compute_params(inputs)
    rendered = _render_workload(inputs, params, facts)
    monitoring = _render_monitoring(inputs, facts)
    target = Path(out_dir) / OUT_SUBDIR
    with (contextlib.nullcontext(Path(workdir)) if workdir is not None else atomic_dir(target)) as tmp:
        for tname, text in rendered.items():
            (tmp / tname).write_text(text)
        for tname, text in monitoring.items():
            (tmp / tname).parent.mkdir(parents=True, exist_ok=True)
            (tmp / tname).write_text(text)
    ss: ServingSet = facts["serving"]
    return DeployResult(
        out_dir=target, files=sorted(rendered), replicas=facts["replicas"], gpus_per_replica=facts["gpus_per_replica"],
        gpu_resource=GPU_RESOURCE, image=inputs.image, namespace=inputs.namespace, name=facts["name"],
        gpu_products=facts["gpu_products"], engine_unit=ss.unit, engine_hash=ss.engine_hash,
        engine_present=ss.engine_present, load_models=ss.models, release_source=ss.source, launcher=facts["launcher"],
        command=facts["command"], k8s_version=inputs.k8s_version, notes=facts["notes"], monitoring=sorted(monitoring))


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


__all__ = ["ManifestInputs", "render_manifests", "compute_params", "stage_inputs", "DeployResult", "DEFAULT_IMAGE",
           "DEFAULT_IMAGE_TRTLLM", "DEFAULT_IMAGE_SOURCE", "DEFAULT_PVC", "serving_set", "triton_command", "check_repo_root",
           "check_image",
           # homes in serving/k8s.py and serving/monitoring.py; here for callers not moved yet (nightly.py, pipeline.py)
           "K8S_VERSION", "GPU_RESOURCE", "GPU_PRODUCT_LABEL", "render_template", "parse_manifest", "validate_manifest",
           "gpu_product_label", "k8s_name", "alert_groups", "canary_service_name", "CANARY_SERVICE_FILE", "SOURCE_DIR"]
