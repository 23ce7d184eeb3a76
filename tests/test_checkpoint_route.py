"""``invoke build --checkpoint DIR`` on either serving route (issue 28): a unified HF checkpoint (ModelOpt
export_hf_checkpoint: config.json, safetensors, hf_quant_config.json) is reused by an llm_api profile -- verified by the
hf.* rules before anything is copied, compared with the profile at resolve, then gated and packed as a quantized one;
a checkpoint of the other route's layout is refused with the field, the reason and the fix. The HF checkpoint is the
session fixture ``fp8_hf_checkpoint`` (tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.pipeline import build_request


def _linked_copy(src: Path, dst: Path) -> Path:
    """``src`` as symlinks, but for its JSON files (copied, to be edited)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".json":
            (dst / f.name).write_text(f.read_text())
        else:
            (dst / f.name).symlink_to(f)
    return dst


def test_an_hf_checkpoint_is_accepted_by_an_llm_api_profile(tmp_path, fp8_hf_checkpoint):
    from precision_pipeline.resolve.plan import resolve

    req = build_request("fp8-h100-llmapi", out=str(tmp_path / "out"), checkpoint=str(fp8_hf_checkpoint))
    assert req.checkpoint == Path(fp8_hf_checkpoint).resolve()
    plan = resolve(req.profile, req.model_dir, checkpoint_dir=req.checkpoint)  # rule layout.checkpoint_mapping: no refusal
    assert plan.route == "llm_api"


@pytest.mark.parametrize("profile, fixture, found, serves", [
    ("fp8-h100", "fp8_hf_checkpoint", "a unified HF checkpoint", "a TensorRT-LLM checkpoint (config.json + rank*.safetensors): "
     "trtllm-build reads TensorRT-LLM checkpoints only"),
    ("fp8-h100-llmapi", "fp8_checkpoint", "a TensorRT-LLM checkpoint", "a unified HF checkpoint (ModelOpt "
     "export_hf_checkpoint: config.json, *.safetensors, hf_quant_config.json): LLM(...) loads HF checkpoints"),
])
def test_the_other_routes_layout_is_refused(tmp_path, request, invoke_here, profile, fixture, found, serves):
    ck = request.getfixturevalue(fixture)
    with pytest.raises(UserError) as e:
        build_request(profile, out=str(tmp_path / "out"), checkpoint=str(ck))
    p = e.value.problems[0]
    route = "llm_api" if "llmapi" in profile else "engine"
    assert p.field == "--checkpoint" and p.reason.startswith(f"{ck} is {found}")
    assert f"the profile's route {route} serves {serves}" in p.reason
    assert p.fix == (f"give the checkpoint/ folder of a previous route-{route} build, use a profile with the route this "
                     "checkpoint was exported for, or leave --checkpoint out to quantize.")
    if profile == "fp8-h100":  # the command line: exit 2, the field, no traceback, nothing written
        r = invoke_here("build", "--profile", profile, "--checkpoint", str(ck), "--out", str(tmp_path / "cli"))
        assert r.returncode == 2 and "--checkpoint" in r.stdout + r.stderr and "Traceback" not in r.stderr + r.stdout
        assert not (tmp_path / "cli").exists()


def test_a_broken_hf_checkpoint_is_refused_before_anything_is_copied(tmp_path, fp8_hf_checkpoint):
    """The hf.* rules run on --checkpoint: metadata that disagrees with the tensors, and a cut safetensors file."""
    bad = _linked_copy(Path(fp8_hf_checkpoint), tmp_path / "meta")
    q = json.loads((bad / "hf_quant_config.json").read_text())
    q["quantization"]["quant_algo"] = "NVFP4"
    (bad / "hf_quant_config.json").write_text(json.dumps(q))
    with pytest.raises(UserError) as e:
        build_request("fp8-h100-llmapi", out=str(tmp_path / "out"), checkpoint=str(bad))
    assert any(p.rule and p.rule.startswith("hf.") for p in e.value.problems), e.value.problems
    cut = _linked_copy(Path(fp8_hf_checkpoint), tmp_path / "cut")
    (cut / "model.safetensors").unlink()
    (cut / "model.safetensors").write_bytes((Path(fp8_hf_checkpoint) / "model.safetensors").read_bytes()[:4096])
    with pytest.raises(UserError) as e:
        build_request("fp8-h100-llmapi", out=str(tmp_path / "out"), checkpoint=str(cut))
    assert e.value.problems[0].field == "--checkpoint" and "is not a complete safetensors file" in e.value.problems[0].reason
    assert not (tmp_path / "out").exists()


def test_resolve_compares_the_hf_checkpoints_quantization_not_a_mapping(fp8_hf_checkpoint):
    """rule layout.checkpoint_mapping on a unified HF checkpoint: its hf_quant_config.json quantization against the
    profile's; no rank split, so tp_size 2 is no refusal (TensorRT-LLM's LLM API shards at load)."""
    from precision_pipeline.resolve.reuse import checkpoint_mapping_findings
    from tests.conftest import prof

    assert checkpoint_mapping_findings(prof("fp8-h100-llmapi", parallel={"tp_size": 2}), Path(fp8_hf_checkpoint)) == []
    (f,) = checkpoint_mapping_findings(prof("fp8-h100-llmapi", quantization__kv_cache_quant_algo="NONE"),
                                       Path(fp8_hf_checkpoint))
    assert (f.status, f.field) == ("refused", "quantization.quant_algo")
    assert "holds quant_algo FP8 / kv_cache_quant_algo FP8, the profile asks for FP8 / NONE" in f.message


@pytest.mark.slow
def test_build_with_an_hf_checkpoint(tmp_path, fp8_hf_checkpoint, small_gate):
    """``invoke build --profile fp8-h100-llmapi --checkpoint HF``: the checkpoint reused (copied), verified by the
    hf.* rules, gated, its LLM-API configuration rendered, packed as an LLM-API unit, the manifests rendered."""
    from precision_pipeline.core.fingerprint import model_fingerprint
    from precision_pipeline.pipeline import run_build
    from precision_pipeline.spec.default_model import model_dir

    out = tmp_path / "out"
    prof = tmp_path / "loose-llmapi.yaml"  # one golden prompt per category: the bar loosened (the model's own bar too)
    bar = {"kl_mean_max": 5.0, "kl_p99_max": 50.0, "top1_min": 0.1, "ppl_delta_pct_max": 500.0}
    prof.write_text(json.dumps({"extends": "fp8-h100-llmapi", "gate": {**bar, "greedy_same_min": 0.0, "overrides": {
        model_fingerprint(model_dir(None)).sha256: {**bar, "categories": {"non_english": bar}}}}}))
    res = run_build(str(prof), out=str(out), golden_limit=1, checkpoint=str(fp8_hf_checkpoint))
    st = {k: v["status"] for k, v in json.loads((out / "manifest.json").read_text())["stages"].items()}
    assert st == {"resolve": "done", "quantize": "done", "verify": "done", "gate": "done", "llm_api_config": "done",
                  "pack": "done", "deploy": "done"}, (st, res)
    assert (out / "checkpoint" / "hf_quant_config.json").read_bytes() == (Path(fp8_hf_checkpoint) / "hf_quant_config.json").read_bytes()
    verify = json.loads((out / "manifest.json").read_text())["stages"]["verify"]["numbers"]  # the hf.* rules' counts
    assert (verify["tensors"], verify["scale_tensors"], verify["linears"]) == (752, 480, 210)
    pj = json.loads((out / "model_repository" / "pack.json").read_text())
    assert pj["route"] == "llm_api" and pj["engine_unit"].startswith("llm_api_")
    assert (out / "k8s" / "deployment.yaml").is_file()  # deployment.server: trtllm-serve (the shipped profile)
