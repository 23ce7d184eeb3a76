"""serving/stage.py's survivors of the session-12 mutation run (issue 26): the frozen stage inputs (their keys are
computed once, from the values they hold) and the LLM-API pack stage's paths (only the slow LLM-API builds reached
them): its inputs put the repository in ``<out>/model_repository`` and its run reads ``model.yaml`` from the
llm_api_config stage's folder and hands pack_llm_api_repository exactly these paths."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from precision_pipeline.serving import stage as S


@pytest.mark.parametrize("cls", [S.PackInputs, S.LlmApiPackInputs, S.DeployInputs, S.LlmApiDeployInputs])
def test_stage_inputs_are_frozen(cls):
    """A stage's inputs are its cache key's material: set once, never assigned after (pydantic's frozen)."""
    assert cls.model_config["frozen"] is True and cls.model_config["extra"] == "forbid"
    fields = {k: None for k in cls.model_fields}
    inst = cls.model_construct(**fields)
    with pytest.raises(ValidationError, match="frozen"):
        setattr(inst, next(iter(cls.model_fields)), None)


def test_llm_api_pack_stage_paths(tmp_path, default_model_dir, monkeypatch):
    from precision_pipeline.engine.llm_api_config import MODEL_YAML_FILE
    from precision_pipeline.resolve import plan as P
    from precision_pipeline.serving import llmapi_unit
    from precision_pipeline.spec.profile import load_profile

    plan = P.evaluate(load_profile("fp8-h100-llmapi"), default_model_dir)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / MODEL_YAML_FILE).write_text("backend: pytorch\nmax_batch_size: 7\n")
    request = SimpleNamespace(model_dir=default_model_dir, out_dir=str(tmp_path / "out"), repo_root="/models/x")
    upstream = {"quantize": SimpleNamespace(key="1" * 64, dir=str(tmp_path / "ckpt")),
                "llm_api_config": SimpleNamespace(key="2" * 64, dir=str(tmp_path / "cfg"))}
    st = S.LlmApiPackStage()
    inputs = st.inputs(plan, request, upstream)
    assert inputs.repo_dir == str(tmp_path / "out" / "model_repository")
    assert (inputs.checkpoint.path, inputs.llm_api_config.path) == (tmp_path / "ckpt", tmp_path / "cfg")
    seen = []

    def pack(plan_, model_dir, ckpt, model_yaml, repo_dir, repo_root, version, workdir):
        seen.append((model_dir, ckpt, model_yaml, repo_dir, repo_root, version, workdir))
        return {"models": ["ensemble", "llm_api_" + "a" * 12], "engine_unit": "llm_api_" + "a" * 12, "unit_key": "k" * 64}

    monkeypatch.setattr(llmapi_unit, "pack_llm_api_repository", pack)
    art = st.run(inputs, tmp_path / "work")
    assert seen == [(Path(default_model_dir), tmp_path / "ckpt", {"backend": "pytorch", "max_batch_size": 7},
                     tmp_path / "out" / "model_repository", "/models/x", plan.trtllm_version, tmp_path / "work")]
    assert (art.models, art.engine_present, art.engine_unit, art.engine_hash) == (
        ("ensemble", "llm_api_" + "a" * 12), False, "llm_api_" + "a" * 12, "k" * 64)


@pytest.mark.parametrize("server, version, refused", [("triton", "1.3.0rc29", True), ("triton", "1.2.1", False),
                                                      ("trtllm-serve", "1.3.0rc29", False), ("trtllm-serve", "1.2.1", False)])
def test_llm_api_deploy_preflight_refuses_triton_only_without_a_triton_image(server, version, refused, default_model_dir):
    """Only ``deployment.server: triton`` with a TensorRT-LLM line no Triton image ships (1.3) is refused."""
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.resolve import plan as P
    from precision_pipeline.spec.profile import load_profile

    plan = P.evaluate(load_profile("fp8-h100-llmapi"), default_model_dir)
    dep = plan.profile.deployment.model_copy(update={"server": server})
    plan = plan.model_copy(update={"profile": plan.profile.model_copy(update={"deployment": dep}), "trtllm_version": version})
    if refused:
        with pytest.raises(UserError, match="is .triton. with target.trtllm_version 1.3.0rc29"):
            S.LlmApiDeployStage().preflight(plan, None)
    else:
        assert S.LlmApiDeployStage().preflight(plan, None) is None


@pytest.mark.parametrize("image, passed", [("", None), ("nvcr.io/x/y:1", "nvcr.io/x/y:1")])
def test_pack_stage_passes_the_image_or_none(image, passed, tmp_path, monkeypatch):
    """An empty ``--image`` is "not given" (None: pack reads the catalog's), a given one is passed as it is."""
    from precision_pipeline.serving import pack

    seen = []
    monkeypatch.setattr(pack, "pack_repository", lambda *a, **k: seen.append((a, k)) or SimpleNamespace(
        models=["ensemble"], engine_unit="tensorrt_llm_" + "a" * 12, engine_hash="h"))
    inputs = S.PackInputs.model_construct(plan=SimpleNamespace(profile="P"), model=SimpleNamespace(path="m"),
                                          checkpoint=SimpleNamespace(path="c"), engine=SimpleNamespace(path="e"),
                                          engine_built=True, repo_dir=str(tmp_path / "r"), repo_root="/models/x", image=image)
    art = S.PackStage().run(inputs, tmp_path / "w")
    (args, kw), = seen
    assert args[1:] == ("P", "m", "c", "e", True, tmp_path / "r", "/models/x") and kw == {"workdir": tmp_path / "w",
                                                                                          "image": passed}
    assert (art.models, art.engine_present, art.engine_unit, art.engine_hash) == (("ensemble",), True,
                                                                                   "tensorrt_llm_" + "a" * 12, "h")


def test_llm_api_deploy_stage_reads_the_rendered_trtllm_serve_yaml(tmp_path, monkeypatch):
    """deployment.server trtllm-serve: the stage renders from ``<llm_api_config>/trtllm-serve.yaml`` as parsed."""
    from precision_pipeline.engine.llm_api_config import TRTLLM_SERVE_FILE
    from precision_pipeline.serving import trtllm_serve

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / TRTLLM_SERVE_FILE).write_text("max_batch_size: 5\nkv_cache_config: {dtype: fp8}\n")
    seen = []
    monkeypatch.setattr(trtllm_serve, "ServeInputs", lambda **k: seen.append(k) or "si")
    monkeypatch.setattr(trtllm_serve, "render_trtllm_serve", lambda si, out, workdir: [f"{si}.yaml"])
    plan = SimpleNamespace(profile=SimpleNamespace(deployment=SimpleNamespace(server="trtllm-serve", replicas=3)),
                           mapping=SimpleNamespace(world_size=2))
    inputs = S.LlmApiDeployInputs.model_construct(plan=plan, llm_api_config=SimpleNamespace(path=str(tmp_path / "cfg")),
                                                  repo_root="/models/x", image="img")
    art = S.LlmApiDeployStage().run(inputs, tmp_path / "w")
    assert seen[0]["llm_args"] == {"max_batch_size": 5, "kv_cache_config": {"dtype": "fp8"}}
    assert (art.files, art.gpus_per_replica, art.replicas, art.image) == (("si.yaml",), 2, 3, "img")
