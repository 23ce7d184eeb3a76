"""Deploy stage (build/precision_pipeline/serving/deploy.py): Kubernetes manifests from a plan, a profile and a packed repository.

Synthetic plans and repositories only (no quantization, no server): each test takes milliseconds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from precision_pipeline.serving import deploy
from precision_pipeline.core.errors import UserError
from precision_pipeline.spec.profile import deep_merge, load_raw, validate_profile

REPO_ROOT_IN_POD = "/artifacts/fp8-h100"
H100_NAME = "NVIDIA H100 80GB HBM3"


def make_profile(name: str = "fp8-h100", **over):
    data = deep_merge(load_raw("fp8-h100"), over)
    data["name"] = name
    return validate_profile(data)


def make_plan(profile, tp: int = 1, pp: int = 1, gpu_id: str = "h100-sxm", gpu_name: str = H100_NAME):
    """A typed ResolvedPlan of ``profile`` on the default model, with the mapping and GPU given
    (the parts deploy reads; they may disagree with the profile on purpose)."""
    import dataclasses

    from precision_pipeline.resolve import plan as P
    from precision_pipeline.spec.default_model import ensure_default_model
    from precision_pipeline.spec.hardware import resolve_gpu

    base = P.evaluate(profile, ensure_default_model())
    return base.model_copy(update={
        "gpu": dataclasses.replace(resolve_gpu(gpu_id), name=gpu_name),
        "mapping": P.Mapping(world_size=tp * pp, tp_size=tp, pp_size=pp, moe_tp_size=tp, moe_ep_size=1),
    })


def make_repo(root: Path, world: int = 1, engine_hash: str = "ab" * 32, *, releases: dict | None = None,
              extra_units: dict[str, int] | None = None, engine_version: str | None = None) -> Path:
    """A packed model repository as build/precision_pipeline/serving/pack.py lays it out (configs minimal but parseable)."""
    repo = root / "model_repository"
    unit = f"tensorrt_llm_{engine_hash[:12]}"
    for m in ("ensemble", "preprocessing", "postprocessing", "tensorrt_llm_bls"):
        (repo / m / "1").mkdir(parents=True)
        (repo / m / "config.pbtxt").write_text(f'name: "{m}"\n')

    def write_unit(u: str, w: int, h: str) -> None:
        (repo / u / "engine").mkdir(parents=True)
        ids = ",".join(str(i) for i in range(w))
        (repo / u / "config.pbtxt").write_text(
            f'name: "{u}"\nbackend: "tensorrtllm"\nparameters: {{ key: "gpu_device_ids" value: {{ string_value: "{ids}" }} }}\n')
        (repo / u / "engine" / "cpu_reference.json").write_text(json.dumps({"engine_hash": h, "engine_present": False}))

    write_unit(unit, world, engine_hash)
    if engine_version:
        (repo / unit / "engine" / "config.json").write_text(json.dumps({"version": engine_version}))
    for u, w in (extra_units or {}).items():
        write_unit(u, w, u[-12:] * 5)
    (repo / "pack.json").write_text(json.dumps({"engine_unit": unit, "engine_hash": engine_hash, "engine_present": True}))
    if releases is not None:
        (root / "releases.json").write_text(json.dumps(releases))
    return repo


def load_out(res) -> dict[str, dict]:
    return {f: yaml.safe_load((res.out_dir / f).read_text()) for f in res.files}


def container(docs) -> dict:
    return docs["triton-deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]


# --------------------------------------------------------------------------------------------


def test_fp8_h100_single_gpu(tmp_path):
    prof = make_profile()
    plan = make_plan(prof)
    repo = make_repo(tmp_path / "build")
    res = deploy.render_manifests(deploy.ManifestInputs(plan, prof, repo, REPO_ROOT_IN_POD), tmp_path / "build")

    assert res.out_dir == tmp_path / "build" / "k8s"
    assert res.files == ["service.yaml", "triton-deployment.yaml"]  # replicas 1: no PDB
    assert (res.replicas, res.gpus_per_replica, res.gpu_resource) == (1, 1, "nvidia.com/gpu")
    assert res.image == deploy.DEFAULT_IMAGE and "trtllm-python-py3" in res.image
    assert res.launcher == "tritonserver"
    unit = "tensorrt_llm_abababababab"
    assert res.engine_unit == unit and res.engine_hash == "ab" * 32

    docs = load_out(res)
    dep = docs["triton-deployment.yaml"]
    assert dep["kind"] == "Deployment" and dep["apiVersion"] == "apps/v1"
    assert dep["metadata"]["name"] == "triton-fp8-h100" and dep["metadata"]["namespace"] == "default"
    assert dep["spec"]["replicas"] == 1
    c = container(docs)
    assert c["image"] == deploy.DEFAULT_IMAGE
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert c["command"] == ["/opt/tritonserver/bin/tritonserver"]
    args = c["args"]
    assert args[0] == f"--model-repository={REPO_ROOT_IN_POD}/model_repository"
    assert "--model-control-mode=explicit" in args
    loads = [a.split("=", 1)[1] for a in args if a.startswith("--load-model=")]
    assert loads == ["preprocessing", "postprocessing", unit, "ensemble", "tensorrt_llm_bls"]
    assert {"--http-port=8000", "--grpc-port=8001", "--metrics-port=8002"} <= set(args)

    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("http", 8000), ("grpc", 8001), ("metrics", 8002)]
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    sp = c["startupProbe"]
    assert sp["failureThreshold"] * sp["periodSeconds"] >= 20 * 60  # engine loads take minutes
    assert dep["spec"]["progressDeadlineSeconds"] > sp["failureThreshold"] * sp["periodSeconds"]

    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    assert mounts["artifacts"] == {"name": "artifacts", "mountPath": REPO_ROOT_IN_POD, "readOnly": True}
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert vols["artifacts"]["persistentVolumeClaim"] == {"claimName": deploy.DEFAULT_PVC, "readOnly": True}

    term = dep["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    expr = term["nodeSelectorTerms"][0]["matchExpressions"][0]
    assert expr == {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}

    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["precision-pipeline/profile"] == "fp8-h100"
    assert pod_labels["precision-pipeline/engine-hash"] == "abababababab"
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["precision-pipeline/engine-hash"] == "ab" * 32
    assert ann["precision-pipeline/release-source"] == "model_repository/pack.json"  # no build-machine paths
    assert str(tmp_path) not in (res.out_dir / "triton-deployment.yaml").read_text()
    sel = dep["spec"]["selector"]["matchLabels"]
    assert "precision-pipeline/engine-hash" not in sel  # a new engine must not orphan the ReplicaSets
    assert all(pod_labels[k] == v for k, v in sel.items())

    svc = docs["service.yaml"]
    assert svc["spec"]["type"] == "ClusterIP" and svc["spec"]["selector"] == sel
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [
        ("http", 8000, "http"), ("grpc", 8001, "grpc"), ("metrics", 8002, "metrics")]

    # what was written passes kubernetes-validate (strict) again, read back from disk
    import kubernetes_validate as kv
    for doc in docs.values():
        assert kv.validate(doc, deploy.K8S_VERSION, strict=True) == deploy.K8S_VERSION


def test_tp2_renders_mpi_launch_and_pdb(tmp_path):
    prof = make_profile("fp8-h100-tp2", parallel={"tp_size": 2}, deployment={"replicas": 3, "gpus_per_replica": 2})
    plan = make_plan(prof, tp=2)
    repo = make_repo(tmp_path / "b", world=2)
    res = deploy.render_manifests(deploy.ManifestInputs(plan, prof, repo, "/srv/b", namespace="llm"), tmp_path / "b")
    assert res.gpus_per_replica == 2 and res.replicas == 3 and res.launcher == "mpirun"
    assert res.files == ["pdb.yaml", "service.yaml", "triton-deployment.yaml"]
    docs = load_out(res)
    c = container(docs)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert c["command"] == ["mpirun"]
    args = c["args"]
    assert args[0] == "--allow-run-as-root"
    ranks = " ".join(args).split(" : ")
    assert len(ranks) == 2
    unit = "tensorrt_llm_abababababab"
    r0, r1 = ranks[0].split(), ranks[1].split()
    assert r0[1:4] == ["-n", "1", "/opt/tritonserver/bin/tritonserver"] and r1[:3] == ["-n", "1", "/opt/tritonserver/bin/tritonserver"]
    assert [a for a in r0 if a.startswith("--load-model=")] == [
        "--load-model=preprocessing", "--load-model=postprocessing", f"--load-model={unit}",
        "--load-model=ensemble", "--load-model=tensorrt_llm_bls"]
    assert [a for a in r1 if a.startswith("--load-model=")] == [f"--load-model={unit}"]
    assert "--backend-config=python,shm-region-prefix-name=prefix0_" in r0
    assert "--backend-config=python,shm-region-prefix-name=prefix1_" in r1
    vols = {v["name"]: v for v in docs["triton-deployment.yaml"]["spec"]["template"]["spec"]["volumes"]}
    assert vols["dshm"]["emptyDir"]["sizeLimit"] == "3Gi"
    pdb = docs["pdb.yaml"]
    assert pdb["kind"] == "PodDisruptionBudget" and pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == docs["triton-deployment.yaml"]["spec"]["selector"]["matchLabels"]
    assert all(d["metadata"]["namespace"] == "llm" for d in docs.values())


def test_gpu_count_mismatches_are_refused(tmp_path):
    prof = make_profile("tp2", parallel={"tp_size": 2}, deployment={"gpus_per_replica": 4})
    with pytest.raises(UserError) as e:
        deploy.render_manifests(deploy.ManifestInputs(make_plan(prof, tp=2), prof, make_repo(tmp_path / "a", world=2), "/x"), tmp_path / "a")
    assert "deployment.gpus_per_replica" in str(e.value) and "4" in str(e.value)
    # the repository's engine was packed for 1 GPU but the plan needs 2
    prof = make_profile("tp2", parallel={"tp_size": 2}, deployment={"gpus_per_replica": None})
    with pytest.raises(UserError) as e:
        deploy.render_manifests(deploy.ManifestInputs(make_plan(prof, tp=2), prof, make_repo(tmp_path / "b", world=1), "/x"), tmp_path / "b")
    assert "runs on 1 GPU(s) but the plan needs 2" in str(e.value)
    # plan and profile disagree
    with pytest.raises(UserError, match="parallel"):
        deploy.render_manifests(deploy.ManifestInputs(make_plan(prof, tp=1), prof, make_repo(tmp_path / "c", world=1), "/x"), tmp_path / "c")
    assert not (tmp_path / "a" / "k8s").exists()


def test_releases_json_names_current_and_warm_fallback(tmp_path):
    fb = "tensorrt_llm_cdcdcdcdcdcd"
    cur = "tensorrt_llm_abababababab"
    state = {"current": cur, "fallback": fb, "warm_fallback": True,
             "releases": [{"unit": cur, "engine_hash": "ab" * 32, "engine_present": True, "kind": "release"}]}
    repo = make_repo(tmp_path / "srv", releases=state, extra_units={fb: 1})
    prof = make_profile()
    res = deploy.render_manifests(deploy.ManifestInputs(make_plan(prof), prof, repo, "/srv"), tmp_path / "srv")
    assert res.load_models == ["preprocessing", "postprocessing", cur, fb, "ensemble", "tensorrt_llm_bls"]
    assert res.release_source.endswith("releases.json") and res.engine_present is True
    docs = load_out(res)
    assert f"--load-model={fb}" in container(docs)["args"]
    ann = docs["triton-deployment.yaml"]["spec"]["template"]["metadata"]["annotations"]
    assert ann["precision-pipeline/release-source"] == "releases.json"


def test_misspelt_and_unfilled_placeholders_are_errors(tmp_path):
    prof = make_profile()
    plan = make_plan(prof)
    repo = make_repo(tmp_path / "b")
    tdir = tmp_path / "tpl"
    shutil.copytree(deploy.TEMPLATES_DIR, tdir)
    svc = tdir / "service.yaml"
    svc.write_text(svc.read_text().replace("${selector}", "${selectr}"))
    with pytest.raises(UserError) as e:
        deploy.render_manifests(deploy.ManifestInputs(plan, prof, repo, "/x", templates_dir=tdir), tmp_path / "b")
    msg = str(e.value)
    assert "k8s/service.yaml: parameter 'selector'" in msg and "did you mean 'selectr'" in msg
    assert "k8s/service.yaml: ${selectr}: is not filled" in msg
    assert not (tmp_path / "b" / "k8s").exists()

    # a placeholder inside a larger string cannot be quoted safely
    shutil.copy(deploy.TEMPLATES_DIR / "service.yaml", svc)
    svc.write_text(svc.read_text().replace("name: ${name}", "name: svc-${name}"))
    with pytest.raises(UserError, match="whole YAML value"):
        deploy.render_manifests(deploy.ManifestInputs(plan, prof, repo, "/x", templates_dir=tdir), tmp_path / "b")

    # a template deploy.py does not know
    shutil.copy(deploy.TEMPLATES_DIR / "service.yaml", svc)
    (tdir / "ingress.yaml").write_text("apiVersion: v1\nkind: ConfigMap\n")
    with pytest.raises(UserError, match="ingress.yaml"):
        deploy.render_manifests(deploy.ManifestInputs(plan, prof, repo, "/x", templates_dir=tdir), tmp_path / "b")


def test_kubernetes_validate_catches_a_misspelt_field(tmp_path):
    """Strict schemas: an unknown field (here a typo in the template) names the file and the path."""
    prof = make_profile()
    tdir = tmp_path / "tpl"
    shutil.copytree(deploy.TEMPLATES_DIR, tdir)
    dep = tdir / "triton-deployment.yaml"
    dep.write_text(dep.read_text().replace("readinessProbe:", "readinesProbe:"))
    with pytest.raises(UserError) as e:
        deploy.render_manifests(deploy.ManifestInputs(make_plan(prof), prof, make_repo(tmp_path / "b"), "/x", templates_dir=tdir), tmp_path / "b")
    msg = str(e.value)
    assert msg.startswith("k8s/triton-deployment.yaml: spec.template.spec.containers[0]")
    assert "readinesProbe" in msg and "Kubernetes 1.30" in msg


def test_kubernetes_validate_catches_a_wrong_type():
    """A value of the wrong type (replicas as a string) is reported with its path; all errors are listed."""
    doc = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"replicas": "two", "selector": {"matchLabels": {"a": "b"}},
                    "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [], "nodeSelectr": {}}}}}
    with pytest.raises(UserError) as e:
        deploy.validate_manifest(doc, "k8s/triton-deployment.yaml")
    fields = [p.field for p in e.value.problems]
    assert fields == ["k8s/triton-deployment.yaml: spec.replicas", "k8s/triton-deployment.yaml: spec.template.spec"]
    assert "nodeSelectr" in e.value.problems[1].reason


def test_negative_replicas_from_a_bad_input(tmp_path):
    """replicas: -1 has no JSON-schema bound (int32 only); the API server refuses it, and so does deploy."""
    prof = make_profile()
    bad = prof.model_copy(update={"deployment": prof.deployment.model_construct(**{**prof.deployment.model_dump(), "replicas": -1})})
    with pytest.raises(UserError) as e:
        deploy.render_manifests(deploy.ManifestInputs(make_plan(bad), bad, make_repo(tmp_path / "b"), "/x"), tmp_path / "b")
    assert "k8s/triton-deployment.yaml: spec.replicas: is -1" in str(e.value)


def test_bad_names_and_paths(tmp_path):
    prof = make_profile()
    plan = make_plan(prof)
    repo = make_repo(tmp_path / "b")
    for kw, field in [({"namespace": "Bad_NS"}, "namespace"), ({"pvc_name": "PVC!"}, "pvc_name"),
                      ({"image": "two words"}, "image"), ({"gpu_products": ["has space"]}, "gpu_products")]:
        with pytest.raises(UserError) as e:
            deploy.render_manifests(deploy.ManifestInputs(plan, prof, repo, "/x", **kw), tmp_path / "b")
        assert str(e.value).startswith(field), (kw, str(e.value))
    with pytest.raises(UserError, match="--repo-root"):
        deploy.render_manifests(deploy.ManifestInputs(plan, prof, repo, "relative/path"), tmp_path / "b")
    unknown = plan.model_copy(update={"gpu": None})
    with pytest.raises(UserError, match="target.gpu"):
        deploy.render_manifests(deploy.ManifestInputs(unknown, prof, repo, "/x"), tmp_path / "b")
    with pytest.raises(UserError, match="model_repository"):
        deploy.render_manifests(deploy.ManifestInputs(plan, prof, tmp_path / "nowhere", "/x"), tmp_path / "b")


def test_rerender_replaces_atomically_and_keeps_previous_on_failure(tmp_path):
    prof3 = make_profile(deployment={"replicas": 3})
    repo = make_repo(tmp_path / "b")
    res = deploy.render_manifests(deploy.ManifestInputs(make_plan(prof3), prof3, repo, "/x"), tmp_path / "b")
    assert "pdb.yaml" in res.files
    def files(d):  # every file, the monitoring/ sub-folder's included
        return {str(p.relative_to(d)): p.read_text() for p in d.rglob("*") if p.is_file()}

    before = files(res.out_dir)
    assert "monitoring/prometheus-rule.yaml" in before
    # a failing render leaves the previous manifests untouched
    with pytest.raises(UserError):
        deploy.render_manifests(deploy.ManifestInputs(make_plan(prof3), prof3, repo, "/x", namespace="BAD"), tmp_path / "b")
    assert files(res.out_dir) == before
    # one replica: the stale pdb.yaml is gone
    prof1 = make_profile()
    res1 = deploy.render_manifests(deploy.ManifestInputs(make_plan(prof1), prof1, repo, "/x"), tmp_path / "b")
    assert sorted(p.name for p in res1.out_dir.iterdir()) == ["monitoring", "service.yaml", "triton-deployment.yaml"]
    assert not [p for p in (tmp_path / "b").iterdir() if p.name.startswith(".k8s")]


def test_gpu_product_labels_and_names():
    assert deploy.gpu_product_label("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
    assert deploy.gpu_product_label("NVIDIA A100-SXM4-80GB") == "NVIDIA-A100-SXM4-80GB"
    assert deploy.k8s_name("int4-awq-a100") == "triton-int4-awq-a100"
    assert deploy.k8s_name("my_profile.v2") == "triton-my-profile-v2"
    assert len(deploy.k8s_name("a" * 64)) <= 63


def test_engine_version_note_and_override_gpu_products(tmp_path):
    prof = make_profile()
    repo = make_repo(tmp_path / "b", engine_version="1.2.0")
    res = deploy.render_manifests(deploy.ManifestInputs(make_plan(prof), prof, repo, "/x", gpu_products=["NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-80GB-HBM3-SHARED"]), tmp_path / "b")
    assert any("1.2.0" in n and deploy.DEFAULT_IMAGE_TRTLLM in n for n in res.notes)
    assert res.gpu_products == ["NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-80GB-HBM3-SHARED"]
    res2 = deploy.render_manifests(deploy.ManifestInputs(make_plan(prof), prof, repo, "/x", image="registry.local/triton:build-1"), tmp_path / "b")
    assert not any("ships" in n for n in res2.notes)


def test_stage_inputs_change_with_what_the_manifests_depend_on():
    prof = make_profile()
    plan = make_plan(prof)
    a = deploy.stage_inputs(plan, prof, "/x", deploy.DEFAULT_IMAGE)
    assert json.dumps(a, sort_keys=True)  # JSON-serialisable for hash_obj
    assert a == deploy.stage_inputs(plan, prof, "/x", deploy.DEFAULT_IMAGE)
    assert a != deploy.stage_inputs(plan, prof, "/y", deploy.DEFAULT_IMAGE)
    assert a != deploy.stage_inputs(plan, prof, "/x", "other/image:1")
    prof3 = make_profile(deployment={"replicas": 3})
    assert a != deploy.stage_inputs(make_plan(prof3), prof3, "/x", deploy.DEFAULT_IMAGE)
    assert set(a["templates"]) == {"triton-deployment.yaml", "service.yaml", "pdb.yaml", "argo-rollout.yaml",
                                   "analysis-template.yaml", "triton-leaderworkerset.yaml", "lws-launcher-serviceaccount.yaml",
                                   "lws-launcher-role.yaml", "lws-launcher-rolebinding.yaml", "probe-deployment.yaml"}
    assert set(a["monitoring_templates"]) == {"prometheus-rule.yaml", "grafana-dashboard.yaml", "probe-podmonitor.yaml"}
    prof4 = make_profile(deployment={"workload": "argo-rollout"})
    assert a != deploy.stage_inputs(make_plan(prof4), prof4, "/x", deploy.DEFAULT_IMAGE)


def test_shipped_profiles_render(tmp_path):
    """Every shipped profile renders valid manifests for its own GPU (catalog names -> GFD labels)."""
    from precision_pipeline.spec.hardware import resolve_gpu
    from precision_pipeline.spec.profile import load_profile, shipped_profiles

    for name in shipped_profiles():
        prof = load_profile(name)
        gpu = resolve_gpu(prof.target.gpu)
        plan = make_plan(prof, tp=prof.parallel.tp_size, pp=prof.parallel.pp_size, gpu_id=gpu.id, gpu_name=gpu.name)
        repo = make_repo(tmp_path / name, world=prof.world_size)
        res = deploy.render_manifests(deploy.ManifestInputs(plan, prof, repo, f"/artifacts/{name}"), tmp_path / name)
        assert res.gpus_per_replica == prof.world_size
        assert res.gpu_products == [gpu.name.replace(" ", "-")]


def test_warm_fallback_with_another_world_size_is_refused(tmp_path):
    """Leader-mode MPI ranks serve every loaded engine: a 1-GPU fallback cannot ride along a 2-GPU release."""
    fb, cur = "tensorrt_llm_cdcdcdcdcdcd", "tensorrt_llm_abababababab"
    state = {"current": cur, "fallback": fb, "warm_fallback": True, "releases": [{"unit": cur, "engine_hash": "ab" * 32}]}
    repo = make_repo(tmp_path / "srv", world=2, releases=state, extra_units={fb: 1})
    prof = make_profile("tp2", parallel={"tp_size": 2}, deployment={"gpus_per_replica": 2})
    with pytest.raises(UserError) as e:
        deploy.render_manifests(deploy.ManifestInputs(make_plan(prof, tp=2), prof, repo, "/srv"), tmp_path / "srv")
    assert "warm fallback" in str(e.value) and "warm_fallback: false" in str(e.value)
    # cold fallback: kept on disk, not loaded, so no conflict
    (tmp_path / "srv" / "releases.json").write_text(json.dumps({**state, "warm_fallback": False}))
    res = deploy.render_manifests(deploy.ManifestInputs(make_plan(prof, tp=2), prof, repo, "/srv"), tmp_path / "srv")
    assert fb not in res.load_models


def _bls_with_traces(repo: Path, url: str) -> None:
    (repo / "tensorrt_llm_bls" / "config.pbtxt").write_text(
        f'name: "tensorrt_llm_bls"\nparameters: {{ key: "otlp_traces_url" value: {{ string_value: "{url}" }} }}\n')


def test_triton_tracing_follows_the_bls_otlp_url(tmp_path):
    prof = make_profile()
    plan = make_plan(prof)
    repo = make_repo(tmp_path / "a")
    args = container(load_out(deploy.render_manifests(deploy.ManifestInputs(plan, prof, repo, REPO_ROOT_IN_POD), tmp_path / "a")))["args"]
    assert not [a for a in args if a.startswith("--trace")]  # no endpoint: Triton does not trace
    url = "http://otel-collector.monitoring:4318/v1/traces"
    _bls_with_traces(repo, url)
    res = deploy.render_manifests(deploy.ManifestInputs(plan, prof, repo, REPO_ROOT_IN_POD), tmp_path / "a")
    args = container(load_out(res))["args"]
    assert [a for a in args if a.startswith("--trace")] == [
        "--trace-config=mode=opentelemetry", "--trace-config=rate=1", "--trace-config=level=TIMESTAMPS",
        f"--trace-config=opentelemetry,url={url}", "--trace-config=opentelemetry,resource=service.name=precision-pipeline",
        "--trace-config=opentelemetry,bsp_schedule_delay=5000"]
    assert any(url in n and "serving image must have them" in n for n in res.notes)
    # tp 2: only rank 0 (the one taking requests) traces
    prof2 = make_profile(parallel={"tp_size": 2}, deployment={"gpus_per_replica": 2})
    repo2 = make_repo(tmp_path / "b", world=2)
    _bls_with_traces(repo2, url)
    args2 = container(load_out(deploy.render_manifests(deploy.ManifestInputs(make_plan(prof2, tp=2), prof2, repo2, REPO_ROOT_IN_POD), tmp_path / "b")))["args"]
    ranks = " ".join(args2).split(" : ")
    assert len(ranks) == 2 and f"opentelemetry,url={url}" in ranks[0] and "--trace" not in ranks[1]


def test_server_traces_when_the_repository_names_an_otlp_url(tmp_path):
    from precision_pipeline.serving.triton_server import TritonServer, repository_traces_url, trace_args

    (tmp_path / "tensorrt_llm_bls").mkdir()
    cfg = tmp_path / "tensorrt_llm_bls" / "config.pbtxt"
    cfg.write_text('name: "tensorrt_llm_bls"\nparameters: { key: "otlp_traces_url" value: { string_value: "" } }\n')
    assert repository_traces_url(tmp_path) is None and trace_args(None) == []
    assert not [a for a in TritonServer(tmp_path, trace_url=None).argv() if a.startswith("--trace")]
    cfg.write_text(cfg.read_text().replace('string_value: ""', 'string_value: "http://127.0.0.1:4318/v1/traces"'))
    url = repository_traces_url(tmp_path)
    assert url == "http://127.0.0.1:4318/v1/traces"
    argv = TritonServer(tmp_path, trace_url=url).argv()
    assert [a for a in argv if a.startswith("--trace")] == trace_args(url)
    assert "--trace-config=mode=opentelemetry" in argv and f"--trace-config=opentelemetry,url={url}" in argv
