"""The Triton Deployment of an LLM-API repository (issue 28; serving/deploy.py + serving/llmapi_unit.py add_overlay):
an init container builds a writable overlay of the read-only repository with the image's LLM-API model.py/helpers.py,
tritonserver serves the overlay; rendered with non-default values and checked by the same strict schema and policy
checks as the engine route's Deployment. The init script itself runs here (dash) on a read-only copy."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import deploy, llmapi_contract as C, llmapi_unit as U
from tests.serving.test_deploy import load_out, make_plan, make_profile
from tests.serving.test_llmapi_contract import MODEL_YAML

ROOT = "/srv/llm"
IMAGE = "nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3"  # TensorRT-LLM 1.2.1 (serving/images.py)


def _ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "checkpoint"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    return d


def _repo(tmp_path: Path, default_model_dir, tp: int = 1, **yml) -> tuple[Path, str]:
    """A packed LLM-API repository (pack_llm_api_repository) whose model.yaml asks for ``tp`` GPUs."""
    prof = make_profile(parallel={"tp_size": tp}, deployment={"gpus_per_replica": tp})
    out = tmp_path / "b" / "model_repository"
    rec = U.pack_llm_api_repository(make_plan(prof, tp=tp), Path(default_model_dir), _ckpt(tmp_path),
                                    {**MODEL_YAML, "tensor_parallel_size": tp, **yml}, out, ROOT, version="1.2.1")
    return out, rec["engine_unit"]


def _inputs(repo: Path, tp: int = 1, **dep) -> deploy.ManifestInputs:
    prof = make_profile("fp8-h100-llmapi-triton", parallel={"tp_size": tp},
                        deployment={"gpus_per_replica": tp, **dep})
    return deploy.ManifestInputs(make_plan(prof, tp=tp), prof, repo, ROOT, image=IMAGE, namespace="llm-serving",
                                 pvc_name="llm-artifacts")


def test_triton_deployment_of_an_llm_api_unit(tmp_path, default_model_dir):
    repo, unit = _repo(tmp_path, default_model_dir, tp=2)
    res = deploy.render_manifests(_inputs(repo, tp=2, replicas=3), tmp_path / "b")
    docs = load_out(res)
    assert res.files == ["pdb.yaml", "service.yaml", "triton-deployment.yaml"]
    dep = docs["triton-deployment.yaml"]
    assert dep["spec"]["replicas"] == 3 and dep["metadata"]["namespace"] == "llm-serving"
    pod = dep["spec"]["template"]["spec"]
    (main,) = pod["containers"]
    (init,) = pod["initContainers"]
    # one tritonserver (the LLM API starts its own 2 workers), on the overlay, loading the llm_api repository's models
    assert res.launcher == "tritonserver" and main["command"] == [deploy.TRITONSERVER]
    assert main["args"][0] == "--model-repository=/serving/model_repository"
    assert [a for a in main["args"] if a.startswith("--load-model=")] == [
        f"--load-model={m}" for m in ("preprocessing", "postprocessing", unit, "tensorrt_llm_bls")]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert dep["metadata"]["labels"]["precision-pipeline/engine-unit"] == unit
    assert dep["metadata"]["labels"]["precision-pipeline/engine-hash"] == unit[len("llm_api_"):]
    # the init step: the same image and hardening, the repository read-only, the overlay its only writable place
    assert init["image"] == main["image"] == IMAGE and init["name"] == U.INIT_CONTAINER
    assert init["command"] == U.overlay_command(f"{ROOT}/model_repository")
    assert init["command"][5:] == [U.OVERLAY_REPOSITORY, *C.IMAGE_MODEL_DIRS]
    assert init["securityContext"] == main["securityContext"] == {
        "allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    assert init["volumeMounts"] == [{"name": "artifacts", "mountPath": ROOT, "readOnly": True},
                                    {"name": "serving-repository", "mountPath": "/serving"}]
    assert {"name": "serving-repository", "mountPath": "/serving", "readOnly": True} in main["volumeMounts"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["serving-repository"] == {"name": "serving-repository", "emptyDir": {"sizeLimit": "64Mi"}}
    assert vols["artifacts"]["persistentVolumeClaim"] == {"claimName": "llm-artifacts", "readOnly": True}
    assert init["resources"] == {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "256Mi"}}
    # model.yaml's otlp_traces_endpoint is an OTLP/HTTP URL; TensorRT-LLM's exporter defaults to gRPC (tracing.py)
    assert {e["name"]: e["value"] for e in main["env"]} == {"HOME": "/tmp", "TMPDIR": "/tmp",
                                                            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    assert {e["name"]: e["value"] for e in init["env"]} == {"HOME": "/tmp", "TMPDIR": "/tmp"}
    assert any("llm-api-model-code" in n for n in res.notes)


def test_the_rendered_init_script_builds_the_overlay(tmp_path, default_model_dir):
    """The script of the rendered manifest, run by dash (POSIX sh) on a read-only copy of the repository: every entry
    linked, the unit's model.py/helpers.py copied from the first image folder that has both; none: exit 1."""
    repo, unit = _repo(tmp_path, default_model_dir)
    script = load_out(deploy.render_manifests(_inputs(repo), tmp_path / "b"))["triton-deployment.yaml"][
        "spec"]["template"]["spec"]["initContainers"][0]["command"][2]
    assert script == U.OVERLAY_SCRIPT
    image = tmp_path / "image"
    (image / "b").mkdir(parents=True)
    (image / "b" / "model.py").write_text("# image model.py\n")
    (image / "b" / "helpers.py").write_text("# image helpers.py\n")
    (image / "a").mkdir()
    (image / "a" / "model.py").write_text("# no helpers next to me\n")
    (repo / unit / "1" / "model.py").write_text("# a stand-in left in the repository\n")
    subprocess.run(["chmod", "-R", "a-w", str(repo)], check=True)
    try:
        dst = tmp_path / "serving" / "model_repository"
        sh = shutil.which("dash") or "/bin/sh"
        run = subprocess.run([sh, "-c", script, "x", str(repo), str(dst), str(image / "a"), str(image / "b")],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in repo.iterdir())
        assert os.readlink(dst / "tensorrt_llm_bls") == str(repo / "tensorrt_llm_bls")
        assert os.readlink(dst / "pack.json") == str(repo / "pack.json")
        assert os.readlink(dst.parent / "releases.json") == str(repo.parent / "releases.json")  # the BLS's fallback
        u = dst / unit
        assert not u.is_symlink() and os.readlink(u / "checkpoint") == str(repo / unit / "checkpoint")
        assert os.readlink(u / "1" / "model.yaml") == str(repo / unit / "1" / "model.yaml")
        assert not (u / "1" / "model.py").is_symlink() and (u / "1" / "model.py").read_text() == "# image model.py\n"
        assert (u / "1" / "helpers.py").read_text() == "# image helpers.py\n"
        again = subprocess.run([sh, "-c", script, "x", str(repo), str(dst), str(image / "b")], capture_output=True)
        assert again.returncode == 0  # a restarted pod's init step on the kept emptyDir
        none = subprocess.run([sh, "-c", script, "x", str(repo), str(tmp_path / "d2"), str(image / "a")],
                              capture_output=True, text=True)
        assert none.returncode == 1 and f"no model.py + helpers.py of TensorRT-LLM's LLM-API model in: {image / 'a'}" in none.stderr
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(repo)], check=True)


@pytest.mark.parametrize("case, field, why", [
    ("decoupled", "runtime.decoupled_mode", "--disable-auto-complete-config"),
    ("lws", "deployment.gpus_per_node", "inside the one tritonserver"),
    ("image", "image", "ships TensorRT-LLM 1.1.0"),
    ("tp", "model.yaml", "asks for tp 1 x pp 1 = 1 GPU(s), the plan for 2"),
])
def test_refusals(tmp_path, default_model_dir, case, field, why):
    repo, _ = _repo(tmp_path, default_model_dir, tp=1 if case == "tp" else 2,
                    **({"triton_config": {"max_batch_size": 0, "decoupled": True}} if case == "decoupled" else {}))
    i = _inputs(repo, tp=2, **({"gpus_per_node": 1} if case == "lws" else {}))
    if case == "image":
        i = dataclasses.replace(i, image="nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3")
    with pytest.raises(UserError) as e:
        deploy.render_manifests(i, tmp_path / "b")
    assert field in e.value.problems[0].field and why in e.value.problems[0].reason
    assert not (tmp_path / "b" / "k8s").exists()


def test_the_stage_renders_triton_or_trtllm_serve_and_refuses_triton_on_1_3(tmp_path, default_model_dir):
    from types import SimpleNamespace

    from precision_pipeline.core.fingerprint import Fingerprint
    from precision_pipeline.serving.stage import LlmApiDeployInputs, LlmApiDeployStage

    prof = make_profile("p", route="llm_api", target={"gpu": "h100-sxm", "trtllm_version": "1.3.0rc29"},
                        deployment={"server": "triton"})
    with pytest.raises(UserError) as e:
        LlmApiDeployStage().preflight(make_plan(prof), SimpleNamespace())
    assert e.value.problems[0].field == "deployment.server" and "#8805" in e.value.problems[0].reason
    LlmApiDeployStage().preflight(make_plan(make_profile("p", route="llm_api", deployment={"server": "trtllm-serve"})),
                                  SimpleNamespace())
    # deployment.server: triton on 1.2.1: the stage renders the Triton Deployment of the packed repository
    repo, unit = _repo(tmp_path, default_model_dir)
    plan = make_plan(make_profile("p", route="llm_api", deployment={"server": "triton"}))
    fp = Fingerprint(sha256="ab" * 32, path=repo)
    work = tmp_path / "work"
    work.mkdir()
    art = LlmApiDeployStage().run(LlmApiDeployInputs(plan=plan, llm_api_config=fp, repository=fp, repo_root=ROOT,
                                                     image=IMAGE), work)
    assert art.launcher == "tritonserver" and "triton-deployment.yaml" in art.files and art.image == IMAGE
    pod = yaml.safe_load((work / "triton-deployment.yaml").read_text())["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["name"] == U.INIT_CONTAINER
    assert f"--load-model={unit}" in pod["containers"][0]["args"]


def render_llm_api_deployments(tmp_path: Path, default_model_dir) -> dict[str, str]:
    """File name -> text of both llm_api Deployments' manifests (Triton with the init container, tp 2, 2 replicas; and
    trtllm-serve), for tests/serving/test_k8s_policy.py's one checkov scan."""
    from precision_pipeline.serving import trtllm_serve as T

    repo, _ = _repo(tmp_path, default_model_dir, tp=2)
    i = _inputs(repo, tp=2, replicas=2)
    res = deploy.render_manifests(i, tmp_path / "b")
    assert yaml.safe_load((res.out_dir / "triton-deployment.yaml").read_text())["spec"]["template"]["spec"]["initContainers"]
    out = {f"llmapi-triton-{f}": (res.out_dir / f).read_text() for f in res.files}
    serve = T.ServeInputs(plan=i.plan, profile=i.profile, llm_args={"return_perf_metrics": True}, repo_root=ROOT,
                          image="nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc29", namespace="llm-serving")
    for rel in T.render_trtllm_serve(serve, tmp_path / "serve"):
        out[f"trtllm-serve-{rel.replace('/', '-')}"] = (tmp_path / "serve" / T.OUT_SUBDIR / rel).read_text()
    return out


def test_a_model_yaml_without_parallel_sizes_runs_on_one_gpu(tmp_path):
    """model.yaml without tensor_parallel_size / pipeline_parallel_size: the LLM API's defaults, 1 x 1."""
    import yaml

    from precision_pipeline.serving import llmapi_unit as LU

    unit = "llm_api_aaaaaaaaaaaa"
    (tmp_path / unit / "1").mkdir(parents=True)
    (tmp_path / unit / LU.MODEL_YAML_FILE).write_text(yaml.safe_dump({"model": "/m", "backend": "pytorch"}))
    notes = LU.triton_deployment_notes(tmp_path, [unit], 1, [], 1, None, "img")
    assert notes and notes[0].startswith(f"LLM-API unit(s) {unit}: the init container")
    with pytest.raises(UserError, match="asks for tp 1 x pp 1 = 1 GPU"):
        LU.triton_deployment_notes(tmp_path, [unit], 2, [], 1, None, "img")
