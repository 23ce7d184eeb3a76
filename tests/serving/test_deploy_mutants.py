"""Boundaries of the Kubernetes checks that mutation testing found unpinned (issue 12): name and
namespace lengths, port range, one object per template, the PDB's minAvailable."""

from __future__ import annotations

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import deploy, k8s
from tests.serving.test_deploy import load_out, make_plan, make_profile, make_repo


def render(tmp_path, **kw):
    import uuid

    prof = make_profile("fp8-h100")
    root = tmp_path / uuid.uuid4().hex[:8]
    return deploy.render_manifests(deploy.ManifestInputs(make_plan(prof), prof, make_repo(root), "/srv", **kw), root)


def test_namespace_is_a_dns_label_of_at_most_63(tmp_path):
    render(tmp_path, namespace="n" * 63)
    with pytest.raises(UserError, match="<= 63 characters"):
        render(tmp_path, namespace="n" * 64)


def test_pvc_name_is_a_dns_subdomain_of_at_most_253(tmp_path):
    render(tmp_path, pvc_name="p" * 253)
    with pytest.raises(UserError, match="<= 253 characters"):
        render(tmp_path, pvc_name="p" * 254)


def _service(name):
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": {}}


def _deployment(name, port=8000):
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"template": {"spec": {"containers": [{"name": "c", "ports": [{"containerPort": port}]}]}}}}


def test_service_names_63_other_names_253():
    assert not k8s.semantic_problems(_service("s" * 63), "svc")
    assert [p.field for p in k8s.semantic_problems(_service("s" * 64), "svc")] == ["svc: metadata.name"]
    assert not [p for p in k8s.semantic_problems(_deployment("d" * 253), "dep") if p.field.endswith("metadata.name")]
    assert [p.field for p in k8s.semantic_problems(_deployment("d" * 254), "dep")
            if p.field.endswith("metadata.name")] == ["dep: metadata.name"]


@pytest.mark.parametrize("port, ok", [(1, True), (65535, True), (0, False), (65536, False)])
def test_container_port_range(port, ok):
    bad = [p for p in k8s.semantic_problems(_deployment("d", port), "dep") if p.field.endswith("containerPort")]
    assert (not bad) is ok


def test_one_object_per_template():
    assert deploy.parse_manifest("apiVersion: v1\nkind: Service\n", "t")["kind"] == "Service"
    with pytest.raises(UserError, match="renders 2 YAML documents"):
        deploy.parse_manifest("apiVersion: v1\nkind: Service\n---\napiVersion: v1\nkind: Service\n", "t")
    with pytest.raises(UserError, match="renders 1 YAML documents"):
        deploy.parse_manifest("- a\n- b\n", "t")


def test_pdb_keeps_one_replica_available(tmp_path):
    prof = make_profile("fp8-h100-r3", deployment={"replicas": 3})
    res = deploy.render_manifests(deploy.ManifestInputs(make_plan(prof), prof, make_repo(tmp_path / "b"), "/srv"), tmp_path / "b")
    assert load_out(res)["pdb.yaml"]["spec"]["minAvailable"] == 1


def _with_claim(name):
    d = _deployment("d")
    d["spec"]["template"]["spec"]["volumes"] = [{"name": "v", "persistentVolumeClaim": {"claimName": name}}]
    return d


def test_claim_name_at_most_253():
    field = "dep: spec.template.spec.volumes[0].persistentVolumeClaim.claimName"
    assert field not in {p.field for p in k8s.semantic_problems(_with_claim("c" * 253), "dep")}
    assert field in {p.field for p in k8s.semantic_problems(_with_claim("c" * 254), "dep")}


def test_startup_failure_threshold_of_one_is_allowed(tmp_path):
    render(tmp_path, startup_failure_threshold=1)
    with pytest.raises(UserError):
        render(tmp_path, startup_failure_threshold=0)


def test_pdb_min_available_zero_is_allowed_negative_is_not():
    def pdb(ma):
        return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "p"}, "spec": {"minAvailable": ma}}

    assert not [p for p in k8s.semantic_problems(pdb(0), "pdb") if p.field.endswith("minAvailable")]
    assert [p.field for p in k8s.semantic_problems(pdb(-1), "pdb") if p.field.endswith("minAvailable")] == [
        "pdb: spec.minAvailable"]
