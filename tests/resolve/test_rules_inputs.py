"""Inputs that used to be accepted without a word (issue 11 items 10 and 15): each is now refused by a
named rule, with the field that is wrong and a fix that helps."""

from __future__ import annotations

import json
import shutil

import pytest

from precision_pipeline.resolve import plan as P
from tests.conftest import prof


def refusals(profile, model):
    return {p.rule: p for p in P.evaluate(profile, model).problems}


def test_exclude_everything_is_refused(default_model_dir):
    pr = refusals(prof("fp8-h100", quantization__exclude_modules=["*"]), default_model_dir)["quantize.modelopt_inputs"]
    assert pr.field == "quantization.exclude_modules"
    assert "keep every one of the 210 decoder linears" in pr.reason
    # the same patterns the export applies: HF short names cover every layer too
    pr = refusals(prof("fp8-h100", quantization__exclude_modules=["*proj", "lm_head"]), default_model_dir)
    assert pr["quantize.modelopt_inputs"].field == "quantization.exclude_modules"
    # leaving one kind of linear quantized is fine
    ok = refusals(prof("fp8-h100", quantization__exclude_modules=["*q_proj", "*k_proj", "*v_proj", "lm_head"]),
                  default_model_dir)
    assert "quantize.modelopt_inputs" not in ok
    assert "quantize.modelopt_inputs" not in refusals(prof("bf16-h100", quantization__exclude_modules=["*"]),
                                                      default_model_dir)


def test_calibration_longer_than_the_positions(default_model_dir):
    pr = refusals(prof("fp8-h100", calibration__seq_len=9000), default_model_dir)["calibration.seq_len"]
    assert pr.field == "calibration.seq_len" and "9,000 tokens per sample is more than" in pr.reason
    assert "8,192 positions" in pr.reason and "seq_len <= 8,192" in pr.fix
    assert "calibration.seq_len" not in refusals(prof("fp8-h100", calibration__seq_len=8192), default_model_dir)


def test_cold_fallback_needing_more_gpus_than_a_replica(default_model_dir, tmp_path, monkeypatch):
    from precision_pipeline.spec import profile as profile_mod

    shipped = tmp_path / "profiles"
    shutil.copytree(profile_mod.PROFILES_DIR, shipped)
    (shipped / "bf16-tp3.yaml").write_text("extends: bf16-h100\nparallel:\n  tp_size: 3\ndeployment:\n  gpus_per_replica: 3\n"
                                           "  fallback: null\n")
    monkeypatch.setattr(profile_mod, "PROFILES_DIR", shipped)
    p = prof("fp8-h100", deployment__fallback="bf16-tp3", deployment__warm_fallback=False)
    pr = refusals(p, default_model_dir)["deployment.fallback"]
    assert "the cold fallback 'bf16-tp3' needs 3 GPUs per engine; a replica has 1" in pr.reason


def test_prequantized_model_is_refused(default_model_dir, tmp_path):
    m = tmp_path / "prequant"
    m.mkdir()
    cfg = json.loads((default_model_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (m / "config.json").write_text(json.dumps(cfg))
    pr = refusals(prof("fp8-h100"), m)["model.unquantized"]
    assert pr.field == "--model" and "quant_method 'fp8'" in pr.reason and "BF16/FP16" in pr.fix


def test_tiny_kv_fraction_is_blamed_on_the_fraction(default_model_dir):
    from precision_pipeline.spec.model_arch import read_model_arch

    arch = read_model_arch(default_model_dir).model_copy(update={"num_layers": 30, "max_position_embeddings": 1_000_000})
    big = prof("bf16-h100", build__max_seq_len=1_000_000, runtime__kv_cache_free_gpu_mem_fraction=0.001)
    pr = refusals(big, arch)
    assert "runtime.kv_cache_free_gpu_mem_fraction" in {p.field for p in pr.values()}
    assert "at 0.9 it would hold" in pr["memory.fit"].reason
    # a sequence the whole GPU cannot hold is still the sequence length's fault
    huge = prof("bf16-h100", build__max_seq_len=9_000_000, runtime__kv_cache_free_gpu_mem_fraction=0.5)
    arch2 = arch.model_copy(update={"max_position_embeddings": 9_000_000})
    assert refusals(huge, arch2)["memory.fit"].field == "build.max_seq_len"


@pytest.mark.parametrize("warm", [True, False])
def test_memory_refusal_suggests_a_cold_fallback_only_when_warm(default_model_dir, warm):
    from precision_pipeline.spec.model_arch import read_model_arch

    # ~31B parameters: BF16 alone (~61 GB) and FP8 alone (~31 GB) fit an H100, both together do not
    arch = read_model_arch(default_model_dir).model_copy(update={"num_layers": 30, "hidden_size": 576 * 17,
                                                                  "intermediate_size": 1536 * 17, "head_dim": 64 * 17})
    p = prof("fp8-h100", deployment__warm_fallback=warm)
    pr = refusals(p, arch).get("memory.fit")
    if not warm:
        assert pr is None  # fits without the warm fallback's share
        return
    assert pr is not None and pr.field == "target.gpu" and "warm fallback" in pr.reason
    assert "deployment.warm_fallback: false" in pr.fix


def test_multi_node_layout_is_refused_by_check_not_only_at_deploy(default_model_dir):
    """tp 3 over 2-GPU nodes (3 ranks on 2 pods) and argo-rollout with a multi-node engine used to pass
    `invoke check` and fail only when the serving stage rendered the manifests, after quantize and gate."""
    over = dict(parallel__tp_size=3, deployment__gpus_per_replica=3, deployment__fallback=None,
                deployment__warm_fallback=False)
    pr = refusals(prof("fp8-h100", deployment__gpus_per_node=2, **over), default_model_dir)["layout.nodes"]
    assert pr.field == "deployment.gpus_per_node" and "do not split evenly over 2 pods" in pr.reason
    pr = refusals(prof("fp8-h100", deployment__gpus_per_node=1, deployment__workload="argo-rollout", **over),
                  default_model_dir)["layout.nodes"]
    assert pr.field == "deployment.workload" and "argo-rollout cannot own a multi-node engine (3 GPUs over 3 pods)" in pr.reason
    for ok in (1, 3, None):
        fits = refusals(prof("fp8-h100", deployment__gpus_per_node=ok, **over), default_model_dir)
        assert "layout.nodes" not in fits


def test_an_exclude_pattern_that_matches_no_linear_is_refused_naming_the_closest(default_model_dir, tmp_path):
    """Hostile s15b F1: ``exclude_modules: [lm_haed]`` (a typo) kept nothing in high precision and quantized the
    logits projection with no word. A pattern matching none of the model's linears (HF, TensorRT-LLM and short names)
    is refused on a dense model, with the closest name when it is no glob; on an MoE model (only expert 0 is named to
    the matcher) it is a warning."""
    pr = refusals(prof("fp8-h100", quantization__exclude_modules=["lm_haed"]), default_model_dir)["quantize.modelopt_inputs"]
    assert pr.field == "quantization.exclude_modules"
    assert pr.reason == ("the pattern 'lm_haed' matches none of the 211 quantizable linears of SmolLM2-135M-Instruct "
                         "(matched against HF, TensorRT-LLM and short names), so it keeps nothing in high precision.")
    assert pr.fix.startswith("did you mean 'lm_head'? fix or remove the pattern")
    pr = refusals(prof("fp8-h100", quantization__exclude_modules=["lm_head", "model.layers.99.*"]),
                  default_model_dir)["quantize.modelopt_inputs"]
    assert "'model.layers.99.*' matches none" in pr.reason and pr.fix.startswith("fix or remove the pattern")
    for ok in (["lm_head", "transformer.layers.29.mlp.proj", "*q_proj"], ["model.layers.0.self_attn.*"]):
        assert "quantize.modelopt_inputs" not in refusals(prof("fp8-h100", quantization__exclude_modules=ok), default_model_dir)
    assert "quantize.modelopt_inputs" not in refusals(prof("bf16-h100", quantization__exclude_modules=["lm_haed"]),
                                                      default_model_dir)   # nothing is quantized: nothing to keep
    cfg = json.loads((default_model_dir / "config.json").read_text())
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({**cfg, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                                                 "num_local_experts": 8, "num_experts_per_tok": 2}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, moe / name)
    plan = P.evaluate(prof("fp8-h100", quantization__exclude_modules=["lm_head", "*experts.7.w1"]), moe)
    assert not [p for p in plan.problems if p.field == "quantization.exclude_modules"], plan.problems
    assert [w for w in plan.warnings if "'*experts.7.w1' matches none of the" in w], plan.warnings
