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
