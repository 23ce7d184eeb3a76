"""Boundaries of the Kubernetes checks that mutation testing found unpinned (issue 12): name and
namespace lengths, port range, one object per template, the PDB's minAvailable."""

from __future__ import annotations

import json

import pytest
import yaml

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import deploy, k8s, monitoring
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


# ---- issue 26: the deploy mutants that survived a seeded run (seed 0, 20 sampled: 9 killed)


def _labelled(labels, kind="Service"):
    return {"apiVersion": "v1", "kind": kind, "metadata": {"name": "s", "labels": labels}, "spec": {}}


def _label_fields(labels):
    return [p.field for p in k8s.semantic_problems(_labelled(labels), "svc")]


def test_label_keys_name_63_prefix_253():
    """Kubernetes label keys: an optional DNS-subdomain prefix of <= 253 characters, a name of <= 63."""
    assert _label_fields({"n" * 63: "v", ("p" * 253) + "/k": "v"}) == []
    assert _label_fields({"n" * 64: "v"}) == [f"svc: metadata.labels.{'n' * 64}"]
    assert _label_fields({("p" * 254) + "/k": "v"}) == [f"svc: metadata.labels.{'p' * 254}/k"]
    assert _label_fields({"Bad_/k": "v", "-k": "v"}) == ["svc: metadata.labels.Bad_/k", "svc: metadata.labels.-k"]


def test_label_values_at_most_63_of_the_label_alphabet():
    assert _label_fields({"a": "v" * 63, "b": "", "c": "A.b-c_9"}) == []
    assert _label_fields({"a": "v" * 64}) == ["svc: metadata.labels.a"]
    assert _label_fields({"a": "-v"}) == ["svc: metadata.labels.a"]      # alphanumeric ends
    assert _label_fields({"a": 5}) == ["svc: metadata.labels.a"]         # a number is not a label value
    [p] = k8s.semantic_problems(_labelled({"a": "v" * 64}), "svc")
    assert p.reason.startswith(f"value {'v' * 64!r} is not a valid label value")


def test_a_service_name_is_a_dns_1035_label_other_names_dns_1123_subdomains():
    """A Service name must start with a letter and has no dots (DNS-1035); a Deployment's may (DNS-1123 subdomain)."""
    for name in ("1abc", "a.b"):
        assert [p.field for p in k8s.semantic_problems(_service(name), "svc")] == ["svc: metadata.name"], name
        assert not [p for p in k8s.semantic_problems(_deployment(name), "dep") if p.field.endswith("metadata.name")], name
    [p] = k8s.semantic_problems(_service("1abc"), "svc")
    assert p.reason == "'1abc' is not a DNS-1035 label."


def test_probe_command_exact():
    assert monitoring.probe_command("triton-x", "llm", "/srv/b/", "tensorrt_llm_abababababab", "fp8-h100") == [
        "./run.sh", "probe", "--url", "triton-x.llm.svc:8000", "--gate", "/srv/b/gate", "--prompts", "4",
        "--every", "600", "--metrics-port", "8004", "--unit", "tensorrt_llm_abababababab", "--profile", "fp8-h100"]


def test_stage_inputs_name_the_plans_profile():
    prof = make_profile("fp8-h100")
    renamed = prof.model_copy(update={"name": "another-name"})
    assert deploy.stage_inputs(make_plan(prof), renamed, "/srv")["profile"] == "fp8-h100"


def test_serving_set_of_a_repository_with_one_unit_and_no_records(tmp_path):
    """No releases.json, no pack.json: the only engine unit, its hash and presence from its CPU-reference file."""
    repo = make_repo(tmp_path / "b", engine_hash="cd" * 32)
    (repo / "pack.json").unlink()
    s = deploy.serving_set(repo)
    assert (s.unit, s.engine_hash, s.engine_present) == ("tensorrt_llm_cdcdcdcdcdcd", "cd" * 32, False)
    assert s.models == ["preprocessing", "postprocessing", "tensorrt_llm_cdcdcdcdcdcd", "ensemble", "tensorrt_llm_bls"]
    assert s.units == ["tensorrt_llm_cdcdcdcdcdcd"] and s.source == f"{repo} (the only engine unit)"
    (repo / "tensorrt_llm_cdcdcdcdcdcd" / "engine" / "cpu_reference.json").unlink()  # no record at all: the unit's name
    s = deploy.serving_set(repo)
    assert (s.engine_hash, s.engine_present) == ("cdcdcdcdcdcd", None)
    (repo / "tensorrt_llm_000000000000").mkdir()
    with pytest.raises(UserError, match="has no releases.json or pack.json and 2 engine units"):
        deploy.serving_set(repo)


def test_serving_set_takes_the_hash_from_the_cpu_reference_when_pack_json_has_none(tmp_path):
    repo = make_repo(tmp_path / "b")
    (repo / "pack.json").write_text(json.dumps({"engine_unit": "tensorrt_llm_abababababab"}))
    s = deploy.serving_set(repo)
    assert (s.engine_hash, s.engine_present) == ("ab" * 32, False)


def test_an_lws_with_wrong_crd_fields_reports_those_before_its_pod_templates(tmp_path):
    """The pod templates (strict PodTemplateSpec) are checked once the LeaderWorkerSet's own schema passes."""
    from tests.serving.test_deploy_lws import render_multinode

    lws = load_out(render_multinode(tmp_path))["triton-leaderworkerset.yaml"]
    lws["spec"]["leaderWorkerTemplate"]["sizee"] = 2
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(UserError) as e:
        deploy.validate_manifest(lws, "lws.yaml")
    assert [p.field for p in e.value.problems] == ["lws.yaml: spec.leaderWorkerTemplate"]


def test_rendered_manifests_keep_the_templates_key_order(tmp_path):
    """Rendered YAML reads like its template (``yaml.safe_dump(sort_keys=False, default_flow_style=False)``): a
    reviewer diffs one against the other."""
    res = render(tmp_path)
    text = (res.out_dir / "triton-deployment.yaml").read_text()
    dep = yaml.safe_load(text)
    body = [ln for ln in text.splitlines() if not ln.startswith("#")]
    assert body[:3] == ["apiVersion: apps/v1", "kind: Deployment", "metadata:"]  # block style, not {flow: style}
    assert list(dep) == ["apiVersion", "kind", "metadata", "spec"]
    assert list(dep["spec"]) == ["replicas", "revisionHistoryLimit", "progressDeadlineSeconds", "selector", "strategy",
                                 "template"]


def test_repo_root_parts_of_at_most_255_bytes():
    deploy.check_repo_root("/" + "p" * 255 + "/b")
    with pytest.raises(UserError, match="a part of it 256"):
        deploy.check_repo_root("/" + "p" * 256 + "/b")


def test_manifests_are_named_after_the_plans_profile(tmp_path):
    prof = make_profile("fp8-h100")
    res = deploy.render_manifests(deploy.ManifestInputs(make_plan(prof), prof.model_copy(update={"name": "another-name"}),
                                                        make_repo(tmp_path / "b"), "/srv"), tmp_path / "b")
    assert load_out(res)["triton-deployment.yaml"]["metadata"]["name"] == deploy.k8s_name("fp8-h100") == "triton-fp8-h100"


def test_semantic_check_of_a_namespace_of_at_most_63():
    """The API-server rule itself (a rendered manifest's namespace), apart from the --namespace input check."""
    def ns(n):
        return [p.field for p in k8s.semantic_problems({**_service("s"), "metadata": {"name": "s", "namespace": n}}, "svc")]

    assert ns("n" * 63) == [] and ns("n" * 64) == ["svc: metadata.namespace"] and ns("N") == ["svc: metadata.namespace"]


@pytest.mark.parametrize("image, why", [
    ("nvcr.io/nvidia/tritonserver@sha256:xyz", "is not a container image reference"),   # hostile s12 F-G
    ("NVCR.io/Nvidia/Triton:tag", "is not a container image reference"),                # upper-case path
    ("bad image;x", "is not a container image reference"),
    ("a/b:.tag", "is not a container image reference"),                                # a tag starts with a word char
    ("x@sha256:" + "a" * 63, "is a sha256 digest whose hex is not 64 digits"),
    ("a" * 256, "is a name longer than 255 characters"),
])
def test_image_references_follow_the_distribution_grammar(image, why):
    """``check_image`` takes what containerd and the kubelet parse (distribution/reference) and nothing else: the pod
    would otherwise fail with InvalidImageName after it was scheduled."""
    from precision_pipeline.serving.deploy import DEFAULT_IMAGE, check_image

    with pytest.raises(UserError) as ei:
        check_image(image)
    assert ei.value.problems[0].reason.startswith(f"{image[:200]!r} {why}"), ei.value.problems[0].reason
    for ok in (DEFAULT_IMAGE, "localhost:5000/a/b", "ubuntu", "a/b@sha256:" + "0" * 64, "NVCR.io/nvidia/x:T_1",
               "[::1]:5000/x:y", "registry.example.com/ns/img__x-y.z:1.0", "a" * 255):
        check_image(ok)


def test_schema_messages_are_cut_at_300_characters():
    """A Kubernetes schema validation message longer than 300 characters is cut to 297 and "..." (serving/k8s.py)."""
    from precision_pipeline.serving import k8s

    assert k8s._short("x" * 300) == "x" * 300
    assert k8s._short("x" * 301) == "x" * 297 + "..." and len(k8s._short("y" * 5000)) == 300
    assert k8s._short("abcdef", 5) == "ab..."
