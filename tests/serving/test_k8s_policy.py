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
    return deploy.render_manifests(deploy.ManifestInputs(make_plan(prof, tp=tp), prof, make_repo(tmp_path / "b", world=tp), "/srv/b", namespace="llm-serving"), tmp_path / "b")


def test_pod_is_hardened(tmp_path):
    res = _render(tmp_path)
    docs = load_out(res)
    pod = docs["triton-deployment.yaml"]["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["automountServiceAccountToken"] is False
    c = container(docs)
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                    "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    for path in ("/tmp", "/dev/shm"):  # writable places on a read-only root filesystem
        assert "emptyDir" in vols[mounts[path]], path
    assert {e["name"]: e["value"] for e in c["env"]} == {"HOME": "/tmp", "TMPDIR": "/tmp"}
    assert c["resources"]["requests"]["cpu"] == "8" and c["resources"]["requests"]["memory"] == "48Gi"


def test_checkov_kubernetes_checks_pass(tmp_path, default_model_dir):
    """The Deployment build (tp 2, 2 replicas) and, in the same scan, an argo-rollout build with a gate run: its
    canary Service and the probe Deployment that targets it (checkov has no checks of Argo's kinds), and both
    Deployments of the llm_api route (Triton with the LLM-API init container; trtllm-serve)."""
    exe = checkov_bin()
    if exe is None:
        pytest.skip(f"checkov {CHECKOV_VERSION} is not installed: python3 -m venv .cache/checkov-{CHECKOV_VERSION} && "
                    f".cache/checkov-{CHECKOV_VERSION}/bin/pip install -r requirements-checkov.txt")
    res = _render(tmp_path)
    argo = _render_argo(tmp_path / "argo", gate=True)
    assert {"service-canary.yaml", "probe-deployment.yaml"} <= set(argo.files)
    scan = tmp_path / "scan"
    scan.mkdir()
    for f in res.files:
        shutil.copy(res.out_dir / f, scan / f)
    for f in argo.files:
        shutil.copy(argo.out_dir / f, scan / f"argo-{f}")
    from tests.serving.test_deploy_llmapi import render_llm_api_deployments

    for name, text in render_llm_api_deployments(tmp_path / "llmapi", default_model_dir).items():
        (scan / name).write_text(text)
    failed, passed, err = run_checkov(exe, scan)
    print(f"\n[checkov {CHECKOV_VERSION}, Deployment + argo-rollout + llm_api Triton/trtllm-serve] passed {passed}, failed {failed}")
    assert failed == [] and passed > 250, err


WORKER_SKIPPED = {
    "CKV_K8S_8": "no liveness probe in an LWS worker: nothing listens there (its ranks > 0 serve no HTTP); a failed rank "
                 "ends the leader's mpirun and the group is recreated (RecreateGroupOnPodRestart).",
    "CKV_K8S_9": "no readiness probe in an LWS worker: the leader's readiness (/v2/health/ready, every rank loaded) is "
                 "the group's; the Service selects leaders only.",
}
"""Skipped for the LeaderWorkerSet's worker pod template only (checkov suppression annotations on it)."""
__doc__ += "\nSkipped for the LeaderWorkerSet's worker template only:" + "".join(f"\n* {k}: {v}" for k, v in WORKER_SKIPPED.items()) + "\n"


def run_checkov(exe: str, directory: Path) -> tuple[list, int, str]:
    p = subprocess.run([exe, "-d", str(directory), "--framework", "kubernetes", "--skip-download",
                        "--compact", "-o", "json", "--skip-check", ",".join(SKIPPED)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})
    out = json.loads(p.stdout or "{}")
    reports = out if isinstance(out, list) else [out]
    failed = [(c["check_id"], c.get("resource")) for r in reports for c in r.get("results", {}).get("failed_checks", [])]
    passed = sum(len(r.get("results", {}).get("passed_checks", [])) for r in reports)
    return failed, passed, p.stderr[-2000:]


def test_checkov_passes_the_leaderworkerset_and_probe(tmp_path):
    """checkov knows no LeaderWorkerSet: its two pod templates are checked as v1 PodTemplates, with every other
    rendered object (Service, PDB, launcher RBAC, probe Deployment) as rendered."""
    import yaml

    exe = checkov_bin()
    if exe is None:
        pytest.skip(f"checkov {CHECKOV_VERSION} is not installed (see the module docstring)")
    from tests.serving.test_deploy_lws import render_multinode

    res = render_multinode(tmp_path, gate=True)
    scan = tmp_path / "scan"
    scan.mkdir()
    for f in res.files:
        doc = yaml.safe_load((res.out_dir / f).read_text())
        if doc["kind"] != "LeaderWorkerSet":
            (scan / f).write_text(yaml.safe_dump(doc))
            continue
        for key in ("leaderTemplate", "workerTemplate"):
            meta = {"name": f"{doc['metadata']['name']}-{key.lower()}", "namespace": doc["metadata"]["namespace"]}
            if key == "workerTemplate":
                meta["annotations"] = {f"checkov.io/skip{i}": f"{k}={v[:60]}" for i, (k, v) in enumerate(WORKER_SKIPPED.items(), 1)}
            tmpl = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": meta, "template": doc["spec"]["leaderWorkerTemplate"][key]}
            (scan / f"{key}.yaml").write_text(yaml.safe_dump(tmpl))
    failed, passed, err = run_checkov(exe, scan)
    print(f"\n[checkov {CHECKOV_VERSION}, LWS + probe] passed {passed}, failed {failed}")
    assert failed == [] and passed > 80, err


def _render_argo(tmp_path, gate=False, **dep):
    prof = make_profile("fp8-h100", deployment={"workload": "argo-rollout", "canary_steps": [5, 20, 50, 100],
                                                "canary_pause_s": 120, "replicas": 4, **dep})
    repo = make_repo(tmp_path / "b")
    if gate:
        (tmp_path / "b" / "gate").mkdir()
        (tmp_path / "b" / "gate" / "metrics.json").write_text("{}")
    from precision_pipeline.core.fingerprint import model_fingerprint
    from precision_pipeline.spec.default_model import ensure_default_model

    # the profile as it applies to the default model (its gate.overrides bar, keyed by content): what the deploy stage passes
    applied = prof.for_model(model_fingerprint(ensure_default_model()).sha256)
    return deploy.render_manifests(deploy.ManifestInputs(make_plan(prof), applied, repo, "/srv/b", namespace="llm-serving"), tmp_path / "b")


def test_argo_rollout_and_analysis_template(tmp_path):
    import yaml

    res = _render_argo(tmp_path)
    assert res.files == ["analysis-template.yaml", "argo-rollout.yaml", "pdb.yaml", "service-canary.yaml", "service.yaml",
                         "triton-deployment.yaml"]
    ro = yaml.safe_load((res.out_dir / "argo-rollout.yaml").read_text())
    dep = yaml.safe_load((res.out_dir / "triton-deployment.yaml").read_text())
    assert ro["kind"] == "Rollout" and ro["spec"]["workloadRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                                     "name": dep["metadata"]["name"], "scaleDown": "progressively"}
    assert ro["spec"]["selector"] == dep["spec"]["selector"] and ro["spec"]["replicas"] == 4
    c = ro["spec"]["strategy"]["canary"]
    assert c["steps"] == [{"setWeight": 5}, {"pause": {"duration": "120s"}}, {"setWeight": 20}, {"pause": {"duration": "120s"}},
                          {"setWeight": 50}, {"pause": {"duration": "120s"}}, {"setWeight": 100}]
    assert c["analysis"]["templates"] == [{"templateName": "triton-fp8-h100"}]
    at = yaml.safe_load((res.out_dir / "analysis-template.yaml").read_text())
    m = {x["name"]: x for x in at["spec"]["metrics"]}
    assert set(m) == {"probe-kl-p99", "probe-top1", "error-rate"}
    # thresholds: the profile's gate section for the plan's model (fp8-h100's SmolLM2 override)
    assert m["probe-kl-p99"]["successCondition"] == "len(result) > 0 && result[0] <= 0.55"
    assert m["probe-top1"]["successCondition"] == "len(result) > 0 && result[0] >= 0.85"
    assert f'engine_unit="{res.engine_unit}"' in m["probe-kl-p99"]["provider"]["prometheus"]["query"]
    assert 'rollouts_pod_template_hash="{{args.canary-hash}}"' in m["error-rate"]["provider"]["prometheus"]["query"]
    assert all(x["failureLimit"] == 0 for x in m.values())
    # the probe's first result of the canary comes after a retry + a run + a scrape; the error rate is read at once
    assert m["probe-kl-p99"]["initialDelay"] == m["probe-top1"]["initialDelay"] == "180s"
    assert "initialDelay" not in m["error-rate"]


def test_crd_schema_refuses_unknown_fields_and_bad_values(tmp_path):
    import yaml

    from precision_pipeline.core.errors import UserError

    res = _render_argo(tmp_path)
    ro = yaml.safe_load((res.out_dir / "argo-rollout.yaml").read_text())
    deploy.validate_manifest(ro, "argo-rollout.yaml")
    bad = json.loads(json.dumps(ro))
    bad["spec"]["strategy"]["canary"]["steps"][0] = {"setWeigth": 5}
    with pytest.raises(UserError, match="setWeigth"):
        deploy.validate_manifest(bad, "argo-rollout.yaml")
    bad = json.loads(json.dumps(ro))
    bad["spec"]["strategy"]["canary"]["steps"][0] = {"setWeight": 150}
    with pytest.raises(UserError, match="schema"):
        deploy.validate_manifest(bad, "argo-rollout.yaml")
    at = yaml.safe_load((res.out_dir / "analysis-template.yaml").read_text())
    del at["spec"]["metrics"][0]["provider"]["prometheus"]["query"]
    with pytest.raises(UserError, match="query"):
        deploy.validate_manifest(at, "analysis-template.yaml")


def test_canary_steps_are_checked_by_the_profile():
    from precision_pipeline.core.errors import UserError

    with pytest.raises((UserError, ValueError)):
        make_profile("fp8-h100", deployment={"canary_steps": [20, 5, 100]})


def test_engine_larger_than_a_node_runs_as_a_leaderworkerset(tmp_path):
    prof = make_profile("fp8-h100-tp2", parallel={"tp_size": 2}, deployment={"gpus_per_replica": 2, "gpus_per_node": 1})
    res = deploy.render_manifests(deploy.ManifestInputs(make_plan(prof, tp=2), prof, make_repo(tmp_path / "b", world=2), "/srv/b"), tmp_path / "b")
    assert "triton-deployment.yaml" not in res.files and "triton-leaderworkerset.yaml" in res.files
    prof = make_profile("fp8-h100-tp2", parallel={"tp_size": 2}, deployment={"gpus_per_replica": 2, "gpus_per_node": 2})
    res = deploy.render_manifests(deploy.ManifestInputs(make_plan(prof, tp=2), prof, make_repo(tmp_path / "c", world=2), "/srv/c"), tmp_path / "c")
    assert "triton-deployment.yaml" in res.files and "triton-leaderworkerset.yaml" not in res.files
