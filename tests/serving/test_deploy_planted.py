"""Manifest facts a cluster pays for when they drift (planted-bug tests; synthetic plans, milliseconds).

* ``nvidia.com/gpu`` requests = limits = GPUs per replica (tp_size x pp_size): the device plugin
  schedules extended resources only with requests equal to limits, and a pod that requests one GPU
  for a tp 2 engine starts one MPI rank short.
* ``strategy.rollingUpdate``: ``maxSurge: 1, maxUnavailable: 0``: a rollout never drops below the
  serving count (k8s/README.md, Rollout).
"""

from __future__ import annotations

import shutil

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import deploy, k8s
from tests.serving.test_deploy import container, load_out, make_plan, make_profile, make_repo


def _render(tmp_path, tp=1, replicas=1, templates_dir=deploy.TEMPLATES_DIR):
    prof = make_profile(f"fp8-h100-tp{tp}", parallel={"tp_size": tp},
                        deployment={"replicas": replicas, "gpus_per_replica": tp})
    return deploy.render_manifests(deploy.ManifestInputs(make_plan(prof, tp=tp), prof, make_repo(tmp_path / "b", world=tp), "/srv/b", templates_dir=templates_dir), tmp_path / "b")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpu_requests_equal_limits_equal_gpus_per_replica(tmp_path, tp):
    res = _render(tmp_path, tp=tp)
    c = container(load_out(res))
    mem = f"{16 + 16 * tp}Gi"  # deploy.MEMORY_GI_BASE + MEMORY_GI_PER_GPU x GPUs; CPU_PER_GPU x GPUs cores
    assert c["resources"] == {"requests": {"nvidia.com/gpu": tp, "cpu": str(4 * tp), "memory": mem},
                              "limits": {"nvidia.com/gpu": tp, "memory": mem}}
    assert res.gpus_per_replica == tp


def test_semantic_check_refuses_requests_unequal_to_limits():
    doc = {"kind": "Deployment", "metadata": {"name": "t"},
           "spec": {"replicas": 1, "selector": {"matchLabels": {"a": "b"}},
                    "template": {"metadata": {"labels": {"a": "b"}},
                                 "spec": {"containers": [{"name": "c", "resources": {"requests": {"nvidia.com/gpu": 1},
                                                                                      "limits": {"nvidia.com/gpu": 2}}}]}}}}
    probs = k8s.semantic_problems(doc, "k8s/x.yaml")
    assert [(p.field, p.reason) for p in probs] == [
        ("k8s/x.yaml: spec.template.spec.containers[0].resources.requests.nvidia.com/gpu",
         "is 1 but the limit is 2; extended resources need requests = limits.")]
    doc["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] = 2
    assert k8s.semantic_problems(doc, "k8s/x.yaml") == []


def test_a_template_that_hard_codes_one_gpu_is_refused_for_tp2(tmp_path):
    tdir = tmp_path / "templates"
    shutil.copytree(deploy.TEMPLATES_DIR, tdir)
    dep = tdir / "triton-deployment.yaml"
    text = dep.read_text()
    head, sep, tail = text.partition("requests:\n              nvidia.com/gpu: ${gpus}")
    assert sep, "the template's GPU request moved; update this test"
    dep.write_text(head + "requests:\n              nvidia.com/gpu: 1" + tail)
    _render(tmp_path / "tp1", tp=1, templates_dir=tdir)  # one GPU: requests = limits = 1, accepted
    with pytest.raises(UserError) as e:
        _render(tmp_path / "tp2", tp=2, templates_dir=tdir)
    assert "requests = limits" in str(e.value) and "is 1 but the limit is 2" in str(e.value)
    assert not (tmp_path / "tp2" / "b" / "k8s").exists()


@pytest.mark.parametrize("replicas", [1, 3])
def test_rolling_update_never_drops_below_the_serving_count(tmp_path, replicas):
    dep = load_out(_render(tmp_path, replicas=replicas))["triton-deployment.yaml"]
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
