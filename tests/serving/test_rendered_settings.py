"""Every runtime and deployment setting of a profile reaches what pack and deploy render (issue 26).

A property over the profile's fields: each field of ``runtime`` and ``deployment`` is set to a value
different from its default AND from every shipped profile's value, and that value must appear in
the rendered Triton configs (pack) or Kubernetes manifests (deploy). A knob hard-coded in pack or
deploy (the default written in place of the profile's value) fails here. Every field is classified:
a new field without a row below fails ``test_every_field_is_classified``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from precision_pipeline.serving import deploy, pack
from precision_pipeline.spec.profile import Deployment, Runtime
from tests.serving.test_deploy import load_out, make_plan as deploy_plan, make_profile, make_repo
from tests.serving.test_pack import make_plan as pack_plan

# runtime field -> (non-default value, {model: {what: rendered value}}); "param:X" is parameters[X],
# other keys are attributes of the parsed ModelConfig
RUNTIME = {
    "kv_cache_free_gpu_mem_fraction": (0.55, {"tensorrt_llm": {"param:kv_cache_free_gpu_mem_fraction": "0.55"}}),
    "enable_kv_cache_reuse": (False, {"tensorrt_llm": {"param:enable_kv_cache_reuse": "false"}}),
    "batch_scheduler_policy": ("max_utilization", {"tensorrt_llm": {"param:batch_scheduler_policy": "max_utilization"}}),
    "decoupled_mode": (True, {"tensorrt_llm": {"decoupled": True}, "tensorrt_llm_bls": {"decoupled": True}}),
    "max_queue_delay_microseconds": (2500, {"tensorrt_llm": {"queue_delay": 2500}, "preprocessing": {"queue_delay": 2500}}),
    "instance_count": (3, {"preprocessing": {"instances": 3}, "postprocessing": {"instances": 3},
                           "tensorrt_llm_bls": {"instances": 3}}),
}
RUNTIME_NOT_RENDERED = {
    "streaming": "a per-request choice of the client (the ensemble's / BLS's `streaming` input); the profile field "
                 "only requires decoupled_mode (pack refuses streaming without it: test_pack.py test_streaming_needs_decoupled)",
}
# deployment fields rendered by deploy (checked one by one below) or by pack (otlp_endpoint)
DEPLOYMENT = {"replicas", "workload", "canary_steps", "canary_pause_s", "gpus_per_replica", "gpus_per_node", "otlp_endpoint"}
DEPLOYMENT_NOT_RENDERED = {
    "fallback": "read by `invoke promote` (the fallback's packed repository into releases.json), not a manifest",
    "warm_fallback": "read by `invoke promote` (releases.json via release_recover.init_serving_repo), not a manifest",
    "keep_releases": "read by `invoke promote` (releases.json via release_recover.init_serving_repo), not a manifest",
    "server": "chooses which manifests deploy renders on route llm_api (serving/stage.py LlmApiDeployStage): trtllm-serve "
              "(tests/serving/test_trtllm_serve.py) or the Triton Deployment with the LLM-API overlay "
              "(tests/serving/test_deploy_llmapi.py, rendered with non-default replicas, tp, namespace, PVC), not a "
              "value inside them",
}


def test_every_field_is_classified():
    assert set(Runtime.model_fields) == set(RUNTIME) | set(RUNTIME_NOT_RENDERED)
    assert set(Deployment.model_fields) == DEPLOYMENT | set(DEPLOYMENT_NOT_RENDERED)


def test_test_values_differ_from_defaults_and_the_base_profile():
    """A value equal to the default (or to what the base profile, fp8-h100, already sets) proves nothing."""
    base = make_profile()
    for field, (value, _) in RUNTIME.items():
        assert value != Runtime.model_fields[field].default, field
        if field != "batch_scheduler_policy":  # two values: the test sets the default first (below)
            assert getattr(base.runtime, field) != value, field


def _rendered(runtime: dict):
    prof = make_profile(runtime=runtime)
    for k, v in runtime.items():
        assert getattr(prof.runtime, k) == v
    from precision_pipeline.spec.default_model import ensure_default_model

    params, _ = pack.compute_params(pack_plan(prof), prof, Path(ensure_default_model()), "ab" * 32, "/r")
    return {m: pack.parse_model_config(t, m) for m, t in pack.render_all(params).items()}


def _what(cfg, what):
    if what.startswith("param:"):
        return pack.config_params(cfg)[what[len("param:"):]]
    if what == "decoupled":
        return cfg.model_transaction_policy.decoupled
    if what == "queue_delay":
        return cfg.dynamic_batching.max_queue_delay_microseconds
    if what == "instances":
        return cfg.instance_group[0].count
    raise AssertionError(what)


@pytest.mark.parametrize("field", sorted(RUNTIME))
def test_runtime_field_reaches_the_triton_configs(field):
    value, where = RUNTIME[field]
    base = {"batch_scheduler_policy": "guaranteed_no_evict"} if field == "batch_scheduler_policy" else {}
    cfgs = _rendered({**base, field: value})
    for model, checks in where.items():
        for what, want in checks.items():
            assert _what(cfgs[model], what) == want, (field, model, what)
    # and the profile's default gives the default: the value comes from the field, not a constant
    default = Runtime.model_fields[field].default
    cfgs = _rendered({**base, field: default} if field != "batch_scheduler_policy" else {field: "guaranteed_no_evict"})
    for model, checks in where.items():
        for what, want in checks.items():
            assert _what(cfgs[model], what) != want, (field, model, what)


# --------------------------------------------------------------------------------------------
# Deployment fields -> manifests


def _deploy(tmp_path, tp=1, gate=False, **dep):
    prof = make_profile("fp8-h100", parallel={"tp_size": tp}, deployment={"gpus_per_replica": tp, **dep})
    repo = make_repo(tmp_path / "b", world=tp)
    return deploy.render_manifests(deploy.ManifestInputs(deploy_plan(prof, tp=tp), prof, repo, "/srv/b"), tmp_path / "b")


def test_replicas(tmp_path):
    assert Deployment.model_fields["replicas"].default == 1
    docs = load_out(_deploy(tmp_path, replicas=7))
    assert docs["triton-deployment.yaml"]["spec"]["replicas"] == 7


def test_workload_canary_steps_and_pause(tmp_path):
    d = Deployment.model_fields
    assert (d["workload"].default, d["canary_steps"].default, d["canary_pause_s"].default) == ("deployment", (5, 20, 50, 100), 300)
    res = _deploy(tmp_path, workload="argo-rollout", canary_steps=[10, 40, 100], canary_pause_s=45, replicas=3)
    docs = load_out(res)
    ro = docs["argo-rollout.yaml"]
    assert ro["spec"]["replicas"] == 3
    assert ro["spec"]["strategy"]["canary"]["steps"] == [
        {"setWeight": 10}, {"pause": {"duration": "45s"}}, {"setWeight": 40}, {"pause": {"duration": "45s"}}, {"setWeight": 100}]
    assert "argo-rollout.yaml" not in _deploy(tmp_path / "plain").files


def test_gpus_per_replica_and_gpus_per_node(tmp_path):
    assert Deployment.model_fields["gpus_per_replica"].default is None
    assert Deployment.model_fields["gpus_per_node"].default is None
    c = load_out(_deploy(tmp_path / "one", tp=2))["triton-deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    res = _deploy(tmp_path / "lws", tp=2, gpus_per_node=1)
    lws = yaml.safe_load((res.out_dir / "triton-leaderworkerset.yaml").read_text())
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2  # 2 GPUs, 1 per node: two pods
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_otlp_endpoint_reaches_the_bls(default_model_dir):
    prof = make_profile(deployment={"otlp_endpoint": "http://collector.obs:4318"})
    params, _ = pack.compute_params(pack_plan(prof), prof, Path(default_model_dir), "ab" * 32, "/r")
    bls = pack.parse_model_config(pack.render_all(params)["tensorrt_llm_bls"], "bls")
    assert pack.config_params(bls)["otlp_traces_url"] == "http://collector.obs:4318/v1/traces"
