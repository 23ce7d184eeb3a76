"""Pack details that mutation testing found unpinned (issue 12): fixed parameter values, the pad id
fallback, truthy parsing of rendered values, the engine mapping's world size."""

from __future__ import annotations

import json

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import pack
from precision_pipeline.spec.profile import load_profile
from tests.serving.test_pack import make_plan


@pytest.fixture
def params(default_model_dir):
    prof = load_profile("bf16-h100")
    return pack.compute_params(make_plan(prof), prof, default_model_dir, "ab" * 32, "/r")[0]


def test_fixed_parameters(params):
    assert params["tensorrt_llm"]["cpu_reference_threads"] == 1
    assert params["postprocessing"]["skip_special_tokens"] is True


def test_pad_falls_back_to_the_first_eos(tmp_path, default_model_dir):
    import shutil

    m = tmp_path / "m"
    shutil.copytree(default_model_dir, m)
    gen = json.loads((m / "generation_config.json").read_text())
    cfg = json.loads((m / "config.json").read_text())
    gen.pop("pad_token_id", None)
    cfg.pop("pad_token_id", None)
    gen["eos_token_id"] = [2, 1]
    (m / "generation_config.json").write_text(json.dumps(gen))
    (m / "config.json").write_text(json.dumps(cfg))
    end_id, pad_id, stops = pack.token_ids(m)
    assert (end_id, pad_id) == (2, 2) and len(stops) == 1


@pytest.mark.parametrize("v, want", [(True, True), ("true", True), ("1", True), ("YES", True), (False, False),
                                     ("false", False), (0, False), (None, False)])
def test_truthy(v, want):
    assert pack._truthy(v) is want


def test_engine_world_size_from_tp_and_pp_when_not_given():
    cfg = {"pretrained_config": {"mapping": {"tp_size": 2, "pp_size": 2}}, "build_config": {}}
    probs = pack.cross_check_engine(cfg, {"gpu_device_ids": "0,1"})
    assert [p.rule for p in probs if p.rule == "pack.world_size"] == ["pack.world_size"]
    assert "is 4 but gpu_device_ids lists 2" in next(p.reason for p in probs if p.rule == "pack.world_size")
    assert not [p for p in pack.cross_check_engine(cfg, {"gpu_device_ids": "0,1,2,3"}) if p.rule == "pack.world_size"]


def test_bls_does_not_accumulate_tokens(params):
    assert params["tensorrt_llm_bls"]["accumulate_tokens"] is False


def test_link_tree_links_every_file_and_skips(tmp_path):
    import os

    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "f.txt").write_text("x")
    (src / "a" / "g.txt").write_text("y")
    (src / "skipped").mkdir()
    (src / "skipped" / "h.txt").write_text("z")
    pack.link_tree(src, tmp_path / "dst", skip=("skipped",))
    dst = tmp_path / "dst"
    assert (dst / "a" / "b" / "f.txt").read_text() == "x" and (dst / "a" / "g.txt").read_text() == "y"
    assert not (dst / "skipped").exists()
    assert os.stat(dst / "a" / "g.txt").st_ino == os.stat(src / "a" / "g.txt").st_ino  # a hard link, not a copy


def test_unit_limits_of_a_rendered_unit(params, tmp_path):
    text = pack.render_all(params)["tensorrt_llm"]
    unit = params["tensorrt_llm"]["model_name"]
    (tmp_path / unit).mkdir()
    (tmp_path / unit / "config.pbtxt").write_text(text)
    assert pack.unit_limits(tmp_path, unit) == {"max_batch_size": params["tensorrt_llm"]["triton_max_batch_size"],
                                                "max_beam_width": params["tensorrt_llm"]["max_beam_width"]}
    assert pack.unit_gpus(tmp_path, unit) == 1


@pytest.mark.parametrize("ids, gpus", [("0,1", 2), ("0, 1, 2,3", 4), ("3", 1), ("", 1), (" , ", 1)])
def test_unit_gpus_counts_its_device_ids(tmp_path, ids, gpus):
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / "config.pbtxt").write_text(
        f'name: "u"\nparameters {{ key: "gpu_device_ids" value {{ string_value: "{ids}" }} }}\n')
    assert pack.unit_gpus(tmp_path, "u") == gpus


def test_check_repository_skips_hidden_folders(tmp_path):
    """A hidden folder (a staged unit, ``.releases.json.lock`` beside) is no model: a half-written one there with
    another name is not read."""
    for d, name in (("a", "a"), (".staged-a", "b")):
        (tmp_path / d).mkdir()
        (tmp_path / d / "config.pbtxt").write_text(f'name: "{name}"\n')
    (tmp_path / "notes.txt").write_text("x")
    assert list(pack.check_repository(tmp_path)) == ["a"]
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.pbtxt").write_text('name: "d"\n')
    with pytest.raises(UserError, match="names the model 'd', not its directory 'c'"):
        pack.check_repository(tmp_path)


@pytest.mark.parametrize("paged, kv_type, refused", [(True, None, False), (False, None, True), (None, None, False),
                                                     (False, "PAGED", False)])
def test_kv_cache_type_from_the_plugin_when_the_build_config_has_none(paged, kv_type, refused):
    """An engine config without ``build_config.kv_cache_type`` (older TensorRT-LLM) is paged when its plugin config
    says ``paged_kv_cache`` (default true); KV-cache reuse then needs nothing more."""
    from tests.serving.test_pack import engine_config

    cfg = engine_config()
    del cfg["build_config"]["kv_cache_type"]
    if kv_type:
        cfg["build_config"]["kv_cache_type"] = kv_type
    plug = cfg["build_config"]["plugin_config"]
    plug.pop("paged_kv_cache")
    if paged is not None:
        plug["paged_kv_cache"] = paged
    rules = [p.rule for p in pack.cross_check_engine(cfg, {"enable_kv_cache_reuse": "true"})]
    assert ("pack.enable_kv_cache_reuse" in rules) is refused


def test_python_models_copied_again_into_the_same_repository(tmp_path):
    pack.copy_python_models(tmp_path)
    pack.copy_python_models(tmp_path)  # a re-pack into the same output
    assert sorted(p.name for p in (tmp_path / "tensorrt_llm_bls" / "1").iterdir()) == ["model.py", "precision_routing.py"]
