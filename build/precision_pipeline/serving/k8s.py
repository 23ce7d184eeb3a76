"""Kubernetes facts and checks shared by the manifests this project renders (serving/deploy.py, the engine-build
Job in serving/build_job.py, nightly's CronJob): names, labels, ports, the templates' rendering and strict
validation.

Checks (each failure is a ``UserError``, exit 2, naming the file and the path in it): every manifest passes
``kubernetes_validate`` against Kubernetes ``K8S_VERSION`` in strict mode (unknown fields are errors; custom
resources against the schemas in ``CRD_DIR``), plus the API-server rules the JSON schemas do not carry
(``semantic_problems``: DNS names, label syntax, replicas >= 1, selector matching the pod labels, GPU requests =
limits).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Mapping

import yaml
from packaging.version import Version

from precision_pipeline.core.errors import Problem, UserError
from precision_pipeline.serving import templates

K8S_VERSION = "1.30"
"""Kubernetes version the manifests are validated against (kubernetes-validate's bundled schemas)."""

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
"""GPU Feature Discovery label (now part of NVIDIA/k8s-device-plugin): the NVML device name with spaces
replaced by '-' (``productLabel`` in internal/lm/resource.go), e.g. ``NVIDIA-H100-80GB-HBM3``. Time-sliced
GPUs get a ``-SHARED`` suffix and MIG devices ``-MIG-<profile>`` (mixed strategy): pass ``gpu_products=``."""

HTTP_PORT, GRPC_PORT, METRICS_PORT = 8000, 8001, 8002
TMP_SIZE = "4Gi"
LABEL_PREFIX = "precision-pipeline"

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


def k8s_name(profile_name: str, prefix: str = "triton-") -> str:
    """A DNS-1035 label (<= 63 characters) for the profile: ``triton-<profile>``, '.'/'_' -> '-'."""
    s = re.sub(r"[^a-z0-9-]+", "-", f"{prefix}{profile_name}".lower())
    s = re.sub(r"-+", "-", s)[:63].strip("-")
    if not DNS_1035.match(s):
        raise UserError("profile.name", f"cannot make a Kubernetes name from {profile_name!r}.",
                        "use a profile name made of lower-case letters, digits and '-'.")
    return s


def gpu_product_label(gpu_name: str) -> str:
    """The ``nvidia.com/gpu.product`` value GPU Feature Discovery sets for an NVML device name."""
    return str(gpu_name).strip().replace(" ", "-")


def label_value(v: str, max_len: int = 63) -> str:
    """``v`` made a valid label value: other characters -> '-', at most ``max_len``, alphanumeric ends."""
    s = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(v))[:max_len]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", s)


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
        if (prefix and (len(prefix) > 253 or not DNS_SUBDOMAIN.match(prefix))) or len(name) > 63 or not LABEL_NAME.match(name):
            out.append(Problem(f"{where}: {path}.{k}", "is not a valid label key ([prefix/]name, name <= 63 characters).", "rename it."))
        if not isinstance(v, str) or len(v) > 63 or not LABEL_VALUE.match(v):
            out.append(Problem(f"{where}: {path}.{k}", f"value {v!r} is not a valid label value (<= 63 of [A-Za-z0-9._-], alphanumeric ends).",
                               "shorten or sanitise it."))
    return out


def semantic_problems(doc: dict, where: str) -> list[Problem]:
    """Rules the API server enforces that the OpenAPI JSON schemas do not express."""
    probs: list[Problem] = []
    kind = doc.get("kind")
    meta = doc.get("metadata") or {}
    name = str(meta.get("name", ""))
    name_re, what = (DNS_1035, "a DNS-1035 label") if kind == "Service" else (DNS_SUBDOMAIN, "a DNS-1123 subdomain")
    if not name_re.match(name) or len(name) > (63 if kind == "Service" else 253):
        probs.append(Problem(f"{where}: metadata.name", f"{name!r} is not {what}.", "use lower-case letters, digits and '-'."))
    ns = meta.get("namespace")
    if ns is not None and (not DNS_LABEL.match(str(ns)) or len(str(ns)) > 63):
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
        if size is not None and not QUANTITY.match(str(size)):
            probs.append(Problem(f"{where}: {path}.spec.volumes[{i}].emptyDir.sizeLimit", f"{size!r} is not a quantity.", "e.g. 2Gi."))
        claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
        if claim is not None and (not DNS_SUBDOMAIN.match(str(claim)) or len(str(claim)) > 253):
            probs.append(Problem(f"{where}: {path}.spec.volumes[{i}].persistentVolumeClaim.claimName",
                                 f"{claim!r} is not a DNS-1123 subdomain.", "pass a valid PVC name."))
    return probs



__all__ = ["K8S_VERSION", "GPU_RESOURCE", "GPU_PRODUCT_LABEL", "HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "TMP_SIZE",
           "LABEL_PREFIX", "DNS_LABEL", "DNS_1035", "DNS_SUBDOMAIN", "LABEL_NAME", "LABEL_VALUE", "QUANTITY", "k8s_name",
           "gpu_product_label", "label_value", "render_template", "parse_manifest", "CRD_DIR", "validate_manifest",
           "semantic_problems"]
