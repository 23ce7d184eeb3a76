"""The rendered manifests pass checkov's Kubernetes policy checks, and the pod is hardened.

checkov (pinned in requirements-checkov.txt) lives in its own virtual environment so its many pinned
dependencies never move the pipeline's: ``python3 -m venv .cache/checkov-3.2.495 &&
.cache/checkov-3.2.495/bin/pip install -r requirements-checkov.txt``. The test looks for it there, at
``$PRECISION_CHECKOV`` or on PATH, and is skipped (saying how to install it) when it is absent.

Deliberately skipped checks (each with the reason; everything else must pass):
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from precision_pipeline.serving import deploy
from tests.serving.test_deploy import container, load_out, make_plan, make_profile, make_repo

REPO_ROOT = Path(__file__).resolve().parents[2]
CHECKOV_VERSION = "3.2.495"
SKIPPED = {
    "CKV_K8S_11": "CPU limits: a CFS quota throttles the tokenizer / BLS threads mid-request; CPU and memory "
                  "requests are set, and memory limit = request.",
    "CKV_K8S_43": "image digest: the tag names the TensorRT-LLM version the engine was built with; pass image= "
                  "with @sha256:... to pin a digest of your registry's copy.",
    "CKV_K8S_15": "imagePullPolicy Always: the TensorRT-LLM image is >20 GB and its tag is immutable; "
                  "IfNotPresent avoids a pull per pod start.",
    "CKV_K8S_40": "UID > 10000: NGC's tritonserver image runs as its own user triton-server (uid 1000), which owns "
                  "its files; another uid would need a rebuilt image.",
    "CKV2_K8S_6": "NetworkPolicy: which namespaces may reach Triton (ingress, Prometheus) is the cluster's; not "
                  "rendered here.",
}
__doc__ += "".join(f"\n* {k}: {v}" for k, v in SKIPPED.items()) + "\n"


def checkov_bin() -> str | None:
    for cand in (os.environ.get("PRECISION_CHECKOV"), str(REPO_ROOT / ".cache" / f"checkov-{CHECKOV_VERSION}" / "bin" / "checkov"),
                 shutil.which("checkov")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def _render(tmp_path, tp=2, replicas=2):
    prof = make_profile(f"fp8-h100-tp{tp}", parallel={"tp_size": tp}, deployment={"replicas": replicas, "gpus_per_replica": tp})
    return deploy.render_manifests(make_plan(prof, tp=tp), prof, make_repo(tmp_path / "b", world=tp), tmp_path / "b",
                                   "/srv/b", namespace="llm-serving")


def test_pod_is_hardened(tmp_path):
    res = _render(tmp_path)
    dep = load_out(res)
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["automountServiceAccountToken"] is False
    c = container(dep)
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                    "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    for path in ("/tmp", "/dev/shm"):  # writable places on a read-only root filesystem
        assert "emptyDir" in vols[mounts[path]], path
    assert {e["name"]: e["value"] for e in c["env"]} == {"HOME": "/tmp", "TMPDIR": "/tmp"}
    assert c["resources"]["requests"]["cpu"] == "8" and c["resources"]["requests"]["memory"] == "48Gi"


def test_checkov_kubernetes_checks_pass(tmp_path):
    exe = checkov_bin()
    if exe is None:
        pytest.skip(f"checkov {CHECKOV_VERSION} is not installed: python3 -m venv .cache/checkov-{CHECKOV_VERSION} && "
                    f".cache/checkov-{CHECKOV_VERSION}/bin/pip install -r requirements-checkov.txt")
    res = _render(tmp_path)
    p = subprocess.run([exe, "-d", str(res.out_dir), "--framework", "kubernetes", "--skip-download",
                        "--compact", "-o", "json", "--skip-check", ",".join(SKIPPED)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})
    out = json.loads(p.stdout or "{}")
    reports = out if isinstance(out, list) else [out]
    failed = [(c["check_id"], c.get("resource")) for r in reports for c in r.get("results", {}).get("failed_checks", [])]
    passed = sum(len(r.get("results", {}).get("passed_checks", [])) for r in reports)
    print(f"\n[checkov {CHECKOV_VERSION}] passed {passed}, failed {failed}")
    assert failed == [] and passed > 50, p.stderr[-2000:]
