"""deployment.server: trtllm-serve: the trtllm-serve Deployment, Service and PodMonitor (serving/trtllm_serve.py),
hardened as the Triton Deployment and validated by the same strict Kubernetes checks."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import yaml

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import trtllm_serve as T
from precision_pipeline.spec.profile import load_profile
from tests.serving.test_pack import make_plan

IMAGE = "nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc29"
ARGS = {"max_batch_size": 8, "kv_cache_config": {"dtype": "fp8"}, "return_perf_metrics": True}


@pytest.fixture(scope="module")
def inputs():
    prof = load_profile("fp8-h100")
    prof = prof.model_copy(update={"deployment": prof.deployment.model_copy(update={"server": "trtllm-serve", "replicas": 2})})
    return T.ServeInputs(plan=make_plan(prof), profile=prof, llm_args=ARGS, repo_root="/artifacts/fp8", image=IMAGE,
                         namespace="llm")


def _docs(tmp_path, i):
    files = T.render_trtllm_serve(i, tmp_path)
    return files, {f: yaml.safe_load((tmp_path / T.OUT_SUBDIR / f).read_text()) for f in files}


def test_rendered_manifests(tmp_path, inputs):
    files, d = _docs(tmp_path, inputs)
    assert files == ["deployment.yaml", "monitoring/podmonitor.yaml", "service.yaml"]
    dep = d["deployment.yaml"]
    assert dep["metadata"]["name"] == "trtllm-serve-fp8-h100" and dep["metadata"]["namespace"] == "llm"
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["progressDeadlineSeconds"] == 10 * 180 + 600  # the startup probe's 30 minutes, then 10 more
    text = (tmp_path / T.OUT_SUBDIR / "deployment.yaml").read_text().splitlines()
    # block style, in the template's key order (metadata: name first, not sorted)
    assert text[2:6] == ["apiVersion: apps/v1", "kind: Deployment", "metadata:", "  name: trtllm-serve-fp8-h100"]
    assert "  replicas: 2" in text
    # the name comes from the plan's profile (the one it was resolved from)
    plan = inputs.plan.model_copy(update={"profile": inputs.plan.profile.model_copy(update={"name": "planned"})})
    assert T.compute_params(dataclasses.replace(inputs, plan=plan))["deployment.yaml"]["name"] == "trtllm-serve-planned"
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == IMAGE and c["command"] == ["trtllm-serve"]
    assert c["args"] == ["/artifacts/fp8/checkpoint", "--config", "/artifacts/fp8/llm_api/trtllm-serve.yaml",
                         "--host", "0.0.0.0", "--port", "8000"]
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("http", 8000)]
    assert {k: c[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")} == {
        k: {"path": "/health", "port": "http"} for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == 1
    # hardened as k8s/triton-deployment.yaml
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert pod["automountServiceAccountToken"] is False
    # otlp_traces_endpoint is rendered as an OTLP/HTTP URL; TensorRT-LLM's exporter speaks gRPC unless told
    # (tensorrt_llm/llmapi/tracing.py get_span_exporter: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, default "grpc")
    assert {e["name"]: e["value"] for e in c["env"]} == {"HOME": "/tmp", "TMPDIR": "/tmp", "HF_HUB_OFFLINE": "1",
                                                         "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    assert [v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v] == [
        {"claimName": "precision-artifacts", "readOnly": True}]
    sel = dep["spec"]["selector"]["matchLabels"]
    assert d["service.yaml"]["spec"]["selector"] == sel and d["service.yaml"]["spec"]["ports"][0]["port"] == 8000
    pm = d["monitoring/podmonitor.yaml"]
    assert pm["kind"] == "PodMonitor" and pm["spec"]["selector"]["matchLabels"] == sel
    assert pm["spec"]["podMetricsEndpoints"] == [{"port": "http", "path": "/prometheus/metrics", "interval": "30s"}]


@pytest.mark.parametrize("change, field", [
    ({"llm_args": {k: v for k, v in ARGS.items() if k != "return_perf_metrics"}}, "llm_api/trtllm-serve.yaml: return_perf_metrics"),
    ({"image": "bad image"}, "image"),
    ({"repo_root": "relative"}, "--repo-root"),
    ({"namespace": "Not_A_Label"}, "namespace"),
])
def test_refusals(tmp_path, inputs, change, field):
    import dataclasses

    with pytest.raises(UserError) as e:
        T.render_trtllm_serve(dataclasses.replace(inputs, **change), tmp_path)
    assert e.value.problems[0].field == field
    assert not (tmp_path / T.OUT_SUBDIR).exists()


def test_strict_schema_catches_a_broken_template(tmp_path, inputs, monkeypatch):
    tdir = tmp_path / "templates"
    shutil.copytree(T.TEMPLATES_DIR, tdir)
    p = tdir / "deployment.yaml"
    p.write_text(p.read_text().replace("readOnlyRootFilesystem: true", "readOnlyRootFilesystem: true\n            readOnlyRootFS: true"))
    monkeypatch.setattr(T, "TEMPLATES_DIR", tdir)
    with pytest.raises(UserError, match="readOnlyRootFS"):
        T.render_trtllm_serve(inputs, tmp_path / "out")


def test_profile_server_field():
    prof = load_profile("fp8-h100")
    assert prof.deployment.server == "triton"
    from precision_pipeline.spec.profile import Deployment

    assert Deployment(server="trtllm-serve").server == "trtllm-serve"
    with pytest.raises(ValueError, match="triton"):
        Deployment(server="vllm")


def test_traces_endpoint_must_be_the_profiles(tmp_path, inputs):
    """otlp_traces_endpoint (a TorchLlmArgs field) in the config is the profile's deployment.otlp_endpoint traces URL:
    rendered by the llm_api_config stage, checked here against the profile the manifests are rendered for."""
    import dataclasses

    from precision_pipeline.spec.llm_args import args_list

    assert {"otlp_traces_endpoint", "return_perf_metrics"} <= args_list("1.2.1").fields <= args_list("1.3.0rc29").fields
    prof = inputs.profile.model_copy(update={"deployment": inputs.profile.deployment.model_copy(
        update={"otlp_endpoint": "http://otel.obs:4318"})})
    traced = dataclasses.replace(inputs, profile=prof)
    with pytest.raises(UserError) as e:
        T.render_trtllm_serve(traced, tmp_path)
    assert e.value.problems[0].field == "llm_api/trtllm-serve.yaml: otlp_traces_endpoint"
    assert "http://otel.obs:4318/v1/traces" in e.value.problems[0].reason
    ok = dataclasses.replace(traced, llm_args={**ARGS, "otlp_traces_endpoint": "http://otel.obs:4318/v1/traces"})
    assert T.render_trtllm_serve(ok, tmp_path / "ok") == ["deployment.yaml", "monitoring/podmonitor.yaml", "service.yaml"]
    with pytest.raises(UserError, match="otlp_traces_endpoint"):  # a traced config for an untraced profile
        T.render_trtllm_serve(dataclasses.replace(inputs, llm_args=ok.llm_args), tmp_path / "no")


def test_inputs_are_frozen_and_bounded(tmp_path, inputs):
    import dataclasses as dc

    with pytest.raises(dc.FrozenInstanceError):
        inputs.image = "x"
    T.check_serve_inputs(dc.replace(inputs, namespace="n" * 63))
    with pytest.raises(UserError, match="is not a DNS-1123 label"):
        T.check_serve_inputs(dc.replace(inputs, namespace="n" * 64))
    assert T.compute_params(dc.replace(inputs, repo_root="/"))["deployment.yaml"]["repo_root"] == "/"
    assert T.compute_params(dc.replace(inputs, repo_root="/a/b/"))["deployment.yaml"]["repo_root"] == "/a/b"
