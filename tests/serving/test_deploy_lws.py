"""Multi-node engines as a LeaderWorkerSet, and the in-cluster probe Deployment (build/precision_pipeline/serving/deploy.py).

Synthetic plans and repositories (tests/serving/test_deploy.py helpers): tp 16 on nodes of 8 GPUs, a tiny
repository; no cluster. The leader's shell runs for real under /bin/sh with stand-in mpirun and kubectl.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import deploy
from precision_pipeline.serving.probe import PROBE_LAST_RUN, PROBE_METRIC_NAMES
from tests.serving.test_deploy import load_out, make_plan, make_profile, make_repo

UNIT = "tensorrt_llm_abababababab"


def render_multinode(tmp_path, tp=16, per_node=8, replicas=2, gate=False, **dep):
    prof = make_profile(f"fp8-h100-tp{tp}", parallel={"tp_size": tp},
                        deployment={"gpus_per_replica": tp, "gpus_per_node": per_node, "replicas": replicas, **dep})
    repo = make_repo(tmp_path / "b", world=tp)
    if gate:
        (tmp_path / "b" / "gate").mkdir()
        (tmp_path / "b" / "gate" / "metrics.json").write_text("{}")
    return deploy.render_manifests(deploy.ManifestInputs(make_plan(prof, tp=tp), prof, repo, "/srv/b", namespace="llm-serving"), tmp_path / "b")


def app_contexts(args: list[str]) -> list[list[str]]:
    """mpirun's MPMD app contexts (split at ':'), each after the global options."""
    out, cur = [], []
    for a in args:
        if a == ":":
            out.append(cur)
            cur = []
        else:
            cur.append(a)
    return [*out, cur]


def test_world_over_node_renders_a_leaderworkerset_instead_of_the_deployment(tmp_path):
    res = render_multinode(tmp_path)
    assert res.files == ["lws-launcher-role.yaml", "lws-launcher-rolebinding.yaml", "lws-launcher-serviceaccount.yaml",
                         "pdb.yaml", "service.yaml", "triton-leaderworkerset.yaml"]
    assert res.launcher == "mpirun-lws" and res.gpus_per_replica == 16
    docs = load_out(res)
    lws = docs["triton-leaderworkerset.yaml"]
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    assert lws["metadata"]["name"] == "triton-fp8-h100-tp16-lws"
    assert lws["spec"]["replicas"] == 2
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] == 2 and lwt["restartPolicy"] == "RecreateGroupOnPodRestart"

    leader = lwt["leaderTemplate"]["spec"]["containers"][0]
    assert leader["command"] == [*deploy.LEADER_SHELL, "mpi-leader"]
    ctx = app_contexts(leader["args"])
    assert ctx[0][0] == "--allow-run-as-root"
    ctx[0] = ctx[0][1:]
    assert len(ctx) == 16 and all(c[:3] == ["-n", "1", deploy.TRITONSERVER] for c in ctx)  # one rank per GPU: np = world
    loads = [[a.split("=", 1)[1] for a in c if a.startswith("--load-model=")] for c in ctx]
    assert loads[0] == ["preprocessing", "postprocessing", UNIT, "ensemble", "tensorrt_llm_bls"]
    assert all(x == [UNIT] for x in loads[1:])
    assert [c[-1] for c in ctx] == [f"--backend-config=python,shm-region-prefix-name=prefix{r}_" for r in range(16)]
    env = {e["name"]: e["value"] for e in leader["env"]}
    assert env == {"HOME": "/tmp", "TMPDIR": "/tmp", "MPI_SLOTS_PER_POD": "8"}
    for c in (leader, lwt["workerTemplate"]["spec"]["containers"][0]):
        r = c["resources"]
        assert r["requests"]["nvidia.com/gpu"] == r["limits"]["nvidia.com/gpu"] == 8  # GPUs per pod, not per engine
        assert (r["requests"]["cpu"], r["requests"]["memory"]) == ("32", "144Gi")
    worker = lwt["workerTemplate"]["spec"]["containers"][0]
    assert worker["command"] == deploy.WORKER_COMMAND and "args" not in worker
    assert not {"startupProbe", "livenessProbe", "readinessProbe"} & set(worker)
    assert {"startupProbe", "livenessProbe", "readinessProbe"} <= set(leader)


def test_leader_and_worker_are_hardened_exactly_like_the_single_node_pod(tmp_path):
    one = make_profile("fp8-h100-tp8", parallel={"tp_size": 8}, deployment={"gpus_per_replica": 8, "gpus_per_node": 8})
    single = load_out(deploy.render_manifests(deploy.ManifestInputs(make_plan(one, tp=8), one, make_repo(tmp_path / "one", world=8), "/srv/b", namespace="llm-serving"), tmp_path / "one"))
    pod = single["triton-deployment.yaml"]["spec"]["template"]
    lwt = load_out(render_multinode(tmp_path))["triton-leaderworkerset.yaml"]["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
        t = lwt[key]
        assert t["spec"]["securityContext"] == pod["spec"]["securityContext"]
        assert t["spec"]["automountServiceAccountToken"] is False
        assert t["spec"]["containers"][0]["securityContext"] == pod["spec"]["containers"][0]["securityContext"]
        assert t["spec"]["affinity"]["nodeAffinity"] == pod["spec"]["affinity"]["nodeAffinity"]
        assert t["spec"]["tolerations"] == pod["spec"]["tolerations"]
        assert [v for v in t["spec"]["volumes"] if v["name"] != "launcher-token"] == pod["spec"]["volumes"]
    # only the leader holds a token (projected, short-lived), for kubectl exec into its own workers
    leader = lwt["leaderTemplate"]["spec"]
    assert leader["serviceAccountName"] == "triton-fp8-h100-tp16-mpi-launcher"
    assert "serviceAccountName" not in lwt["workerTemplate"]["spec"]
    vol = {v["name"]: v for v in leader["volumes"]}["launcher-token"]["projected"]["sources"]
    assert vol[0] == {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}}
    assert {"name": "launcher-token", "mountPath": deploy.SA_TOKEN_DIR, "readOnly": True} in leader["containers"][0]["volumeMounts"]


def test_service_selects_the_leaders_and_rbac_names_the_workers(tmp_path):
    docs = load_out(render_multinode(tmp_path))
    sel = {"app.kubernetes.io/name": "triton", "app.kubernetes.io/instance": "triton-fp8-h100-tp16",
           "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    assert docs["service.yaml"]["spec"]["selector"] == sel
    assert docs["pdb.yaml"]["spec"]["selector"]["matchLabels"] == sel
    role = docs["lws-launcher-role.yaml"]
    workers = ["triton-fp8-h100-tp16-lws-0-1", "triton-fp8-h100-tp16-lws-1-1"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"], "resourceNames": workers},
                             {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create"], "resourceNames": workers}]
    rb = docs["lws-launcher-rolebinding.yaml"]
    assert rb["roleRef"]["name"] == role["metadata"]["name"]
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": docs["lws-launcher-serviceaccount.yaml"]["metadata"]["name"],
                               "namespace": "llm-serving"}]


def test_three_pods_of_four_gpus(tmp_path):
    docs = load_out(render_multinode(tmp_path, tp=12, per_node=4, replicas=1))
    lwt = docs["triton-leaderworkerset.yaml"]["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] == 3
    assert {e["name"]: e["value"] for e in lwt["leaderTemplate"]["spec"]["containers"][0]["env"]}["MPI_SLOTS_PER_POD"] == "4"
    assert docs["lws-launcher-role.yaml"]["rules"][1]["resourceNames"] == ["triton-fp8-h100-tp12-lws-0-1", "triton-fp8-h100-tp12-lws-0-2"]
    assert "pdb.yaml" not in docs


def test_refused_when_ranks_do_not_split_evenly_or_with_argo(tmp_path):
    with pytest.raises(UserError, match="split evenly"):
        render_multinode(tmp_path / "a", tp=10, per_node=4)
    with pytest.raises(UserError, match="deployment.workload.*argo-rollout cannot own a multi-node"):
        render_multinode(tmp_path / "b", workload="argo-rollout")
    assert deploy.lws_group(8, 8) == 1 and deploy.lws_group(16, None) == 1 and deploy.lws_group(16, 8) == 2


def test_leader_shell_writes_the_hostfile_and_runs_mpirun_through_kubectl_exec(tmp_path):
    lwt = load_out(render_multinode(tmp_path, tp=12, per_node=4, replicas=1))["triton-leaderworkerset.yaml"]["spec"]["leaderWorkerTemplate"]
    c = lwt["leaderTemplate"]["spec"]["containers"][0]
    mpi = tmp_path / "mpi"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("mpirun", "kubectl"):  # stand-ins: record their argv, one argument per line
        (bin_dir / tool).write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {tmp_path}/{tool}.argv\n')
        (bin_dir / tool).chmod(0o755)
    command = [c["command"][0], c["command"][1], c["command"][2].replace(deploy.MPI_DIR, str(mpi)), *c["command"][3:]]
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LWS_LEADER_ADDRESS": "triton-x-lws-3.triton-x-lws.llm",
           "LWS_GROUP_SIZE": "3", **{e["name"]: e["value"] for e in c["env"]}}
    subprocess.run([*command, *c["args"]], env=env, check=True, timeout=30)
    assert (mpi / "hostfile").read_text().splitlines() == ["triton-x-lws-3 slots=4", "triton-x-lws-3-1 slots=4", "triton-x-lws-3-2 slots=4"]
    argv = (tmp_path / "mpirun.argv").read_text().splitlines()
    assert argv[:7] == ["--hostfile", f"{mpi}/hostfile", "--mca", "plm_rsh_agent", f"{mpi}/kubexec", "--mca", "plm_rsh_no_tree_spawn"]
    assert argv[8:] == c["args"] and sum(1 for a in app_contexts(argv) if deploy.TRITONSERVER in a) == 12
    # OpenMPI calls its rsh agent as `agent <host> <daemon command>`: the agent execs it in that worker pod
    subprocess.run([str(mpi / "kubexec"), "triton-x-lws-3-2", "orted", "-mca", "x"], env=env, check=True, timeout=30)
    assert (tmp_path / "kubectl.argv").read_text().splitlines() == [
        "exec", "-i", "triton-x-lws-3-2", "-c", "triton", "--", "/bin/sh", "-c", "orted -mca x"]


def test_lws_schema_refuses_unknown_fields_and_bad_pod_templates(tmp_path):
    lws = load_out(render_multinode(tmp_path))["triton-leaderworkerset.yaml"]
    deploy.validate_manifest(lws, "triton-leaderworkerset.yaml")
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["sizee"] = 2
    with pytest.raises(UserError, match="sizee"):
        deploy.validate_manifest(bad, "triton-leaderworkerset.yaml")
    bad = copy.deepcopy(lws)
    bad["spec"]["rolloutStrategy"]["type"] = "Recreate"
    with pytest.raises(UserError, match="rolloutStrategy.type"):
        deploy.validate_manifest(bad, "triton-leaderworkerset.yaml")
    bad = copy.deepcopy(lws)  # inside a pod template: the Kubernetes PodTemplateSpec schema, strict
    bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(UserError, match=r"workerTemplate\.spec\.containers\[0\].*readinesProbe"):
        deploy.validate_manifest(bad, "triton-leaderworkerset.yaml")
    bad = copy.deepcopy(lws)  # API-server rules: GPU requests = limits in each template
    bad["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] = 4
    with pytest.raises(UserError, match="leaderTemplate.spec.containers.0..resources.requests"):
        deploy.validate_manifest(bad, "triton-leaderworkerset.yaml")
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["size"] = 1
    with pytest.raises(UserError, match="size"):
        deploy.validate_manifest(bad, "triton-leaderworkerset.yaml")


def test_probe_deployment_and_podmonitor_when_the_build_has_a_gate(tmp_path):
    res = render_multinode(tmp_path, gate=True)
    assert "probe-deployment.yaml" in res.files and "monitoring/probe-podmonitor.yaml" in res.monitoring
    docs = load_out(res)
    probe = docs["probe-deployment.yaml"]
    pod = probe["spec"]["template"]
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["./run.sh", "probe", "--url", "triton-fp8-h100-tp16.llm-serving.svc:8000", "--gate", "/srv/b/gate",
                            "--prompts", "4", "--every", "600", "--metrics-port", "8004", "--unit", UNIT,
                            "--profile", "fp8-h100-tp16"]
    assert c["workingDir"] == deploy.SOURCE_DIR
    assert c["ports"] == [{"name": "probe-metrics", "containerPort": 8004, "protocol": "TCP"}]
    leader = docs["triton-leaderworkerset.yaml"]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    assert pod["spec"]["securityContext"] == leader["securityContext"]
    assert c["securityContext"] == leader["containers"][0]["securityContext"]
    assert {"name": "artifacts", "mountPath": "/srv/b", "readOnly": True} in c["volumeMounts"]
    assert {e["name"]: e["value"] for e in c["env"]}["PRECISION_CACHE_DIR"] == "/srv/b/.cache"
    # the probe pod is not a serving pod: the Triton Service must not select it
    svc = docs["service.yaml"]["spec"]["selector"]
    assert any(pod["metadata"]["labels"].get(k) != v for k, v in svc.items())
    mon = yaml.safe_load((res.out_dir / "monitoring" / "probe-podmonitor.yaml").read_text())
    assert mon["kind"] == "PodMonitor"
    assert all(pod["metadata"]["labels"][k] == v for k, v in mon["spec"]["selector"]["matchLabels"].items())
    assert mon["spec"]["podMetricsEndpoints"][0]["port"] == c["ports"][0]["name"]
    # the rules query exactly the names the probe exports
    rules = (res.out_dir / "monitoring" / "prometheus-rule.yaml").read_text()
    assert all(n in rules for n in (*PROBE_METRIC_NAMES.values(), PROBE_LAST_RUN))
    bad = json.loads(json.dumps(mon))
    bad["spec"]["podMetricsEndpoints"][0]["intervall"] = "1m"
    with pytest.raises(UserError, match="intervall"):
        deploy.validate_manifest(bad, "probe-podmonitor.yaml")


def test_no_probe_without_a_gate(tmp_path):
    res = render_multinode(tmp_path)
    assert "probe-deployment.yaml" not in res.files and "monitoring/probe-podmonitor.yaml" not in res.monitoring
    assert not (Path(res.out_dir) / "probe-deployment.yaml").exists()
