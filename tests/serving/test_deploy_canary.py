"""The Rollout's canary Service and where the in-cluster probe sends its requests (build/precision_pipeline/serving/deploy.py).

With ``deployment.workload: argo-rollout`` the deploy stage renders ``service.yaml`` a second time as
``service-canary.yaml`` (``<name>-canary``), names it as the Rollout's ``strategy.canary.canaryService`` and points
the probe's ``--url`` at it; Argo Rollouts adds the canary ReplicaSet's ``rollouts-pod-template-hash`` to that
Service's selector, so probe requests reach canary pods only. Synthetic plans and repositories; milliseconds each.
"""

from __future__ import annotations

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import deploy
from tests.serving.test_deploy import load_out, make_plan, make_profile, make_repo

NS = "llm-serving"


def render(tmp_path, name="fp8-h100", gate=True, **dep):
    prof = make_profile(name, deployment={"replicas": 4, **dep})
    root = tmp_path / "b"
    repo = make_repo(root)
    if gate:
        (root / "gate").mkdir()
        (root / "gate" / "metrics.json").write_text("{}")
    return deploy.render_manifests(deploy.ManifestInputs(make_plan(prof), prof, repo, "/srv/b", namespace=NS), root)


def probe_url(docs) -> str:
    cmd = docs["probe-deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]["command"]
    return cmd[cmd.index("--url") + 1]


def test_argo_rollout_names_a_canary_service_that_the_probe_targets(tmp_path):
    res = render(tmp_path, workload="argo-rollout")
    assert res.files == ["analysis-template.yaml", "argo-rollout.yaml", "pdb.yaml", "probe-deployment.yaml",
                         "service-canary.yaml", "service.yaml", "triton-deployment.yaml"]
    docs = load_out(res)
    main, canary = docs["service.yaml"], docs["service-canary.yaml"]
    ro = docs["argo-rollout.yaml"]["spec"]
    assert canary["metadata"]["name"] == "triton-fp8-h100-canary" != main["metadata"]["name"]
    assert ro["strategy"]["canary"]["canaryService"] == canary["metadata"]["name"]
    assert "stableService" not in ro["strategy"]["canary"]  # nothing would use one (k8s/README.md)
    assert canary["metadata"]["namespace"] == NS
    # same pods and ports as the main Service; Argo narrows the selector with rollouts-pod-template-hash at runtime
    assert canary["spec"]["selector"] == main["spec"]["selector"] == ro["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "triton", "app.kubernetes.io/instance": "triton-fp8-h100"}
    assert "rollouts-pod-template-hash" not in canary["spec"]["selector"]
    assert canary["spec"]["ports"] == main["spec"]["ports"]
    assert [p["port"] for p in canary["spec"]["ports"]] == [8000, 8001, 8002]
    assert canary["metadata"]["labels"] == {**main["metadata"]["labels"], "precision-pipeline/service-role": "canary"}
    pod_labels = docs["triton-deployment.yaml"]["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels[k] == v for k, v in canary["spec"]["selector"].items())
    # the probe asks the canary Service only, by its cluster DNS name, on Triton's HTTP port
    assert probe_url(docs) == f"triton-fp8-h100-canary.{NS}.svc:8000"
    probe_labels = docs["probe-deployment.yaml"]["spec"]["template"]["metadata"]["labels"]
    assert any(probe_labels.get(k) != v for k, v in canary["spec"]["selector"].items())  # never selects the probe
    assert "k8s/service.yaml" in (res.out_dir / "service-canary.yaml").read_text().splitlines()[0]


def test_without_argo_the_probe_targets_the_main_service_and_no_canary_service(tmp_path):
    res = render(tmp_path)
    assert res.files == ["pdb.yaml", "probe-deployment.yaml", "service.yaml", "triton-deployment.yaml"]
    docs = load_out(res)
    assert probe_url(docs) == f"{docs['service.yaml']['metadata']['name']}.{NS}.svc:8000" == f"triton-fp8-h100.{NS}.svc:8000"


def test_argo_without_a_gate_still_renders_the_canary_service(tmp_path):
    res = render(tmp_path, gate=False, workload="argo-rollout")
    assert "service-canary.yaml" in res.files and "probe-deployment.yaml" not in res.files
    assert load_out(res)["argo-rollout.yaml"]["spec"]["strategy"]["canary"]["canaryService"] == "triton-fp8-h100-canary"


def test_canary_service_name_of_a_long_profile_is_a_dns_1035_label(tmp_path):
    res = render(tmp_path, name="p" * 64, workload="argo-rollout")
    docs = load_out(res)
    name = docs["service-canary.yaml"]["metadata"]["name"]
    assert name == "triton-" + "p" * 49 + "-canary" and len(name) == 63
    assert name != docs["service.yaml"]["metadata"]["name"]
    assert probe_url(docs) == f"{name}.{NS}.svc:8000"


def test_the_canary_service_goes_through_validate_manifest(tmp_path, monkeypatch):
    monkeypatch.setattr(deploy, "canary_service_name", lambda name: f"{name}-Canary")
    with pytest.raises(UserError, match=r"k8s/service.yaml \(as service-canary.yaml\): metadata.name.*DNS-1035"):
        render(tmp_path, workload="argo-rollout")


def test_every_analysis_metric_aborts_at_its_first_failure(tmp_path):
    """The AnalysisTemplate's metrics have ``failureLimit: 0`` (Argo Rollouts: the analysis fails, and the rollout
    aborts, once failures exceed it: the first failed measurement)."""
    docs = load_out(render(tmp_path, workload="argo-rollout"))
    metrics = docs["analysis-template.yaml"]["spec"]["metrics"]
    assert metrics and [m["failureLimit"] for m in metrics] == [0] * len(metrics)
