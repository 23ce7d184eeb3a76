"""Quantize stage: ModelOpt configs per profile, refusals before heavy work, exported checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from precision_pipeline.core.errors import UserError
from precision_pipeline.spec.profile import deep_merge, load_raw, validate_profile
from precision_pipeline.quantize.ptq import (
    QuantizeResult,
    make_forward_loop,
    modelopt_config_for,
    run_quantize,
)
from precision_pipeline.spec.families import resolve_exclusions, trtllm_name
from tests.conftest import quantize_job


def profile(base: str, **sections):
    return validate_profile(deep_merge(load_raw(base), sections))


def _entry(cfg: dict, name: str) -> dict:
    hits = [e for e in cfg["quant_cfg"] if e.get("quantizer_name") == name]
    assert hits, name
    return hits[-1]


# --------------------------------------------------------------------------------------------
# Names and exclusions (no model needed)

LLAMA_NAMES = [f"model.layers.{i}.{p}" for i in range(4) for p in
               ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")] + ["lm_head"]


def test_trtllm_names():
    assert trtllm_name("model.layers.3.self_attn.k_proj") == "transformer.layers.3.attention.qkv"
    assert trtllm_name("model.layers.3.self_attn.o_proj") == "transformer.layers.3.attention.dense"
    assert trtllm_name("model.layers.0.mlp.gate_proj") == "transformer.layers.0.mlp.fc"
    assert trtllm_name("model.layers.0.mlp.up_proj") == "transformer.layers.0.mlp.gate"
    assert trtllm_name("model.layers.0.mlp.down_proj") == "transformer.layers.0.mlp.proj"
    assert trtllm_name("lm_head") == "lm_head"
    assert trtllm_name("model.embed_tokens") == "transformer.vocab_embedding"


def test_resolve_exclusions_patterns_layers_and_fused_groups():
    ex, unmatched = resolve_exclusions(LLAMA_NAMES, ["lm_head", "*router*", "transformer.layers.2.attention.qkv", "*.mlp.gate"],
                                       keep_first=1, keep_last=0, num_layers=4)
    assert unmatched == ["*router*"]
    assert "lm_head" in ex
    assert {n for n in ex if n.startswith("model.layers.0.")} == {n for n in LLAMA_NAMES if n.startswith("model.layers.0.")}
    # TRT-LLM name of the fused qkv -> q, k, v of layer 2 (and nothing else of layer 2 but the MLP up/gate)
    assert {"model.layers.2.self_attn.q_proj", "model.layers.2.self_attn.k_proj", "model.layers.2.self_attn.v_proj"} <= set(ex)
    assert "model.layers.2.self_attn.o_proj" not in ex
    # '*.mlp.gate' (TRT-LLM name of up_proj) pulls in gate_proj too: one fused GEMM in TRT-LLM
    for i in (1, 2, 3):
        assert f"model.layers.{i}.mlp.up_proj" in ex and f"model.layers.{i}.mlp.gate_proj" in ex
        assert f"model.layers.{i}.mlp.down_proj" not in ex
    ex2, _ = resolve_exclusions(LLAMA_NAMES, ["model.layers.1.self_attn.k_proj"], 0, 1, 4)
    assert {n for n in ex2 if ".layers.1." in n} == {f"model.layers.1.self_attn.{p}_proj" for p in "qkv"}
    assert len([n for n in ex2 if ".layers.3." in n]) == 7


# --------------------------------------------------------------------------------------------
# ModelOpt configs


def test_config_fp8_with_fp8_kv():
    name, cfg = modelopt_config_for(quantize_job(profile("fp8-h100")), linear_names=LLAMA_NAMES, num_hidden_layers=4)
    assert name == "FP8_DEFAULT_CFG+FP8_KV_CFG"
    assert _entry(cfg, "*weight_quantizer")["cfg"] == {"num_bits": (4, 3), "axis": None}
    assert _entry(cfg, "*input_quantizer")["cfg"] == {"num_bits": (4, 3), "axis": None}
    assert _entry(cfg, "*[kv]_bmm_quantizer")["cfg"]["num_bits"] == (4, 3)
    assert _entry(cfg, "lm_head.weight_quantizer") == {"quantizer_name": "lm_head.weight_quantizer", "enable": False}
    assert cfg["algorithm"] == "max"


def test_config_awq_group_size_and_w4a8():
    name, cfg = modelopt_config_for(quantize_job(profile("int4-awq-a100")), linear_names=LLAMA_NAMES, num_hidden_layers=4)
    assert name == "INT4_AWQ_CFG(group_size=64)"
    assert _entry(cfg, "*weight_quantizer")["cfg"]["block_sizes"][-1] == 64
    assert _entry(cfg, "*weight_quantizer")["cfg"]["num_bits"] == 4
    import modelopt.torch.quantization as mtq

    assert _entry(mtq.INT4_AWQ_CFG, "*weight_quantizer")["cfg"]["block_sizes"][-1] == 128  # preset untouched
    p = profile("int4-awq-a100", quantization={"quant_algo": "W4A8_AWQ", "group_size": 32, "kv_cache_quant_algo": "FP8"},
                target={"gpu": "h100-sxm"})  # W4A8 AWQ runs on SM 89-90 (resolve rule format.gemm_sm)
    name, cfg = modelopt_config_for(quantize_job(p), linear_names=LLAMA_NAMES, num_hidden_layers=4)
    assert name == "W4A8_AWQ_BETA_CFG(group_size=32)+FP8_KV_CFG"
    int4, fp8 = _entry(cfg, "*weight_quantizer")["cfg"]
    assert int4["block_sizes"][-1] == 32 and int4["num_bits"] == 4 and fp8["num_bits"] == (4, 3)


def test_config_smoothquant_alpha_w8a16_nvfp4_noquant():
    name, cfg = modelopt_config_for(quantize_job(profile("int8-sq-l4", quantization={"smoothquant_alpha": 0.8})),
                                    linear_names=LLAMA_NAMES, num_hidden_layers=4)
    assert name == "INT8_SMOOTHQUANT_CFG(alpha=0.8)"
    assert cfg["algorithm"] == {"method": "smoothquant", "alpha": 0.8}
    name, cfg = modelopt_config_for(quantize_job(profile("int8-sq-l4", quantization={"quant_algo": "W8A16"})),
                                    linear_names=LLAMA_NAMES, num_hidden_layers=4)
    assert name == "INT8_WEIGHT_ONLY_CFG" and _entry(cfg, "*input_quantizer")["enable"] is False
    name, cfg = modelopt_config_for(quantize_job(profile("nvfp4-b200")), linear_names=LLAMA_NAMES, num_hidden_layers=4)
    assert name == "NVFP4_DEFAULT_CFG+FP8_KV_CFG"
    assert _entry(cfg, "*weight_quantizer")["cfg"]["block_sizes"][-1] == 16
    assert modelopt_config_for(quantize_job(profile("bf16-h100")), linear_names=LLAMA_NAMES, num_hidden_layers=4) == ("NONE", None)


def test_config_exclusion_entries():
    p = profile("fp8-h100", quantization={"keep_last_layers": 1, "exclude_modules": ["lm_head", "*down_proj"]})
    _, cfg = modelopt_config_for(quantize_job(p), linear_names=LLAMA_NAMES, num_hidden_layers=4)
    disabled = {e["quantizer_name"] for e in cfg["quant_cfg"] if e.get("enable") is False and e["quantizer_name"].startswith(("model.", "lm_head"))}
    assert "model.layers.3.self_attn.q_proj.weight_quantizer" in disabled
    assert "model.layers.3.self_attn.q_proj.input_quantizer" in disabled
    assert "model.layers.0.mlp.down_proj.input_quantizer" in disabled
    assert "model.layers.0.mlp.up_proj.weight_quantizer" not in disabled
    assert len(disabled) == 2 * (7 + 3 + 1)  # layer 3 (7 linears), down_proj of layers 0-2, lm_head


@pytest.mark.parametrize("sections,field,text", [
    ({"quantization": {"kv_cache_quant_algo": "INT8"}}, "quantization.kv_cache_quant_algo", "no INT8 KV-cache config"),
    ({"quantization": {"quant_algo": "NO_QUANT"}}, "quantization.kv_cache_quant_algo", "NO_QUANT with a FP8 KV cache"),
])
def test_config_refusals(sections, field, text):
    """The config lookups' own guards (resolve refuses these profiles before a build makes a job: the job is made
    by hand here)."""
    from precision_pipeline.quantize.job import QuantizeJob

    p = profile("fp8-h100", **sections)
    job = QuantizeJob(architecture="LlamaForCausalLM", quantization=p.quantization, calibration=p.calibration)
    with pytest.raises(UserError) as e:
        modelopt_config_for(job, linear_names=LLAMA_NAMES, num_hidden_layers=4)
    assert e.value.problems[0].field == field
    assert text in e.value.message


def test_config_from_model_dir(default_model_dir):
    """Without explicit names, exclusions resolve against a meta-device model of the HF config."""
    name, cfg = modelopt_config_for(quantize_job(profile("fp8-h100", quantization={"keep_first_layers": 2})), default_model_dir)
    disabled = [e["quantizer_name"] for e in cfg["quant_cfg"] if e["quantizer_name"].startswith("model.layers.")]
    assert len(disabled) == 2 * 7 * 2


@pytest.mark.parametrize("name, sections, rule, field, text", [
    ("fp8-h100", {"parallel": {"tp_size": 2}}, "layout.attention_heads", "parallel.tp_size", "use tp_size 1, 3 or 9."),
    ("int4-awq-a100", {"quantization": {"group_size": 128}}, "format.group_size", "quantization.group_size",
     "hidden (qkv/fc/gate input) 576"),
    ("int4-awq-a100", {"parallel": {"tp_size": 3}, "quantization": {"group_size": 128}}, "format.group_size",
     "quantization.group_size", "does not divide"),
    ("fp8-h100", {"quantization": {"group_size": 64}}, "format.group_size", "quantization.group_size", "no per-group scales"),
    ("fp8-h100", {"quantization": {"quant_algo": "NVFP4", "group_size": 32}, "target": {"gpu": "b200"}},
     "format.group_size", "quantization.group_size", "fixed block of 16"),
    ("fp8-h100", {"parallel": {"pp_size": 2}, "deployment": {"gpus_per_replica": 2}}, "quantize.modelopt_inputs",
     "parallel.pp_size", "not exported by the quantize stage"),
])
def test_layout_and_group_refusals_are_resolve_rules(default_model_dir, name, sections, rule, field, text):
    """The quantize stage re-checks nothing itself: it receives a job only from a plan the resolve rules passed."""
    with pytest.raises(UserError) as e:
        quantize_job(profile(name, **sections), default_model_dir)
    mine = [p for p in e.value.problems if p.rule == rule]
    assert mine and mine[0].field == field and text in mine[0].reason + mine[0].fix, e.value.message
    job = quantize_job(profile("int4-awq-a100", parallel={"tp_size": 3}, deployment={"gpus_per_replica": 3}),
                       default_model_dir)  # 576/3 = 192, 1536/3 = 512: whole groups of 64
    assert (job.tp_size, job.group_size, job.moe_layout, job.architecture) == (3, 64, None, "LlamaForCausalLM")


def test_bad_inputs_are_refused_at_resolve_before_a_job_exists(default_model_dir, tmp_path):
    """INT8 KV, a group size that does not divide, a short calibration file: refused by the resolve rules (what
    ``job_of`` needs a passed plan for); the quantize stage never sees them."""
    with pytest.raises(UserError, match="INT8 KV"):
        quantize_job(profile("fp8-h100", quantization={"kv_cache_quant_algo": "INT8"}), default_model_dir)
    with pytest.raises(UserError, match="does not divide"):
        quantize_job(profile("int4-awq-a100", quantization={"group_size": 128}), default_model_dir)
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"text": "only one"}\n')
    p = profile("fp8-h100", calibration={"dataset": str(bad), "num_samples": 4})
    from precision_pipeline.resolve.plan import evaluate

    plan = evaluate(p, default_model_dir, for_build=True)
    assert any("1 usable sample" in pr.reason for pr in plan.problems), [pr.reason for pr in plan.problems]


def test_forward_loop_passes_and_batches():
    from precision_pipeline.quantize.calibration import CalibrationSet

    calls = []

    class Dummy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x, use_cache=False):
            calls.append(tuple(x.shape))

    cs = CalibrationSet(samples=[[1] * 4, [2] * 4, [3] * 8, [4] * 4], composition={})
    passes = []
    loop = make_forward_loop(cs, batch_size=2, show_progress=True, on_pass=passes.append)
    loop(Dummy())
    loop(Dummy())
    assert passes == [1, 2]
    assert calls == [(2, 4), (1, 4), (1, 8)] * 2


# --------------------------------------------------------------------------------------------
# Exported checkpoints


def _result(ckpt: Path) -> dict:
    return json.loads((Path(ckpt).parent / "result.json").read_text())


def test_fp8_export(fp8_checkpoint):
    from safetensors import safe_open

    cfg = json.loads((fp8_checkpoint / "config.json").read_text())
    q = cfg["quantization"]
    assert q["quant_algo"] == "FP8" and q["kv_cache_quant_algo"] == "FP8"
    assert q["exclude_modules"] == ["lm_head"]
    assert cfg["logits_dtype"] == "float32"  # ModelOpt writes float16; the profile says float32
    assert cfg["dtype"] == "bfloat16" and cfg["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    assert sorted(p.name for p in fp8_checkpoint.iterdir()) == ["calibration.json", "config.json", "quantize_warnings.json", "rank0.safetensors"]
    with safe_open(str(fp8_checkpoint / "rank0.safetensors"), "pt") as f:
        keys = set(f.keys())
        for i in (0, 17, 29):
            top = {}
            for lin, shape in (("attention.qkv", (960, 576)), ("attention.dense", (576, 576)), ("mlp.fc", (1536, 576)),
                               ("mlp.gate", (1536, 576)), ("mlp.proj", (576, 1536))):
                p = f"transformer.layers.{i}.{lin}."
                w = f.get_tensor(p + "weight")
                assert w.dtype == torch.float8_e4m3fn and tuple(w.shape) == shape
                for s in ("weights_scaling_factor", "activation_scaling_factor"):
                    t = f.get_tensor(p + s)
                    assert t.dtype == torch.float32 and tuple(t.shape) == (1,)
                    assert torch.isfinite(t).all() and (t > 0).all()
                # the scale covers the weight: amax maps to the top code 448; fc and gate share
                # one scale (the larger amax of the two: one fused GEMM in TRT-LLM)
                top[lin] = w.float().abs().max().item()
            assert top["attention.qkv"] == top["attention.dense"] == top["mlp.proj"] == 448.0
            assert max(top["mlp.fc"], top["mlp.gate"]) == 448.0 and min(top["mlp.fc"], top["mlp.gate"]) <= 448.0
            assert torch.equal(f.get_tensor(f"transformer.layers.{i}.mlp.fc.weights_scaling_factor"),
                               f.get_tensor(f"transformer.layers.{i}.mlp.gate.weights_scaling_factor"))
            for kv in ("k_cache_scaling_factor", "v_cache_scaling_factor", "kv_cache_scaling_factor"):
                t = f.get_tensor(f"transformer.layers.{i}.attention.{kv}")
                assert tuple(t.shape) == (1,) and t.item() >= 1.0  # ModelOpt clamps FP8 KV scales to >= 1
        # fc and gate share the input (one fused GEMM in TRT-LLM): same activation scale
        assert torch.equal(f.get_tensor("transformer.layers.4.mlp.fc.activation_scaling_factor"),
                           f.get_tensor("transformer.layers.4.mlp.gate.activation_scaling_factor"))
        for n in ("lm_head.weight", "transformer.vocab_embedding.weight", "transformer.ln_f.weight",
                  "transformer.layers.0.input_layernorm.weight"):
            assert f.get_tensor(n).dtype == torch.bfloat16
        assert tuple(f.get_tensor("lm_head.weight").shape) == (49152, 576)
        assert not any(k.startswith("lm_head.") and "scaling" in k for k in keys)
    r = _result(fp8_checkpoint)
    assert r["modelopt_config_name"] == "FP8_DEFAULT_CFG+FP8_KV_CFG"
    assert r["checkpoint_bytes"] == (fp8_checkpoint / "rank0.safetensors").stat().st_size
    assert r["calibration"]["num_samples"] == 8 and r["calibration"]["seq_len"] == 64
    calib = json.loads((fp8_checkpoint / "calibration.json").read_text())
    assert calib["sha256"] == r["calibration"]["sha256"] and len(calib["sha256"]) == 64


def test_fp8_lm_head_and_embedding_are_the_hf_weights(fp8_checkpoint, default_model_dir):
    from safetensors.torch import load_file

    hf = load_file(str(default_model_dir / "model.safetensors"))
    ck = load_file(str(fp8_checkpoint / "rank0.safetensors"))
    assert torch.equal(ck["transformer.vocab_embedding.weight"], hf["model.embed_tokens.weight"])
    assert torch.equal(ck["lm_head.weight"], hf["model.embed_tokens.weight"])  # tied in HF, written twice


def test_bf16_export(bf16_checkpoint):
    from precision_pipeline.checkpoint.reader import checkpoint_info

    info = checkpoint_info(bf16_checkpoint)
    assert info["quant_algo"] == "NO_QUANT" and info["kv_cache_quant_algo"] == "NONE"
    assert list(info["dtypes"]) == ["BF16"]
    # every parameter once, plus lm_head written separately from the tied embedding: 2 bytes each
    assert info["dtypes"]["BF16"]["bytes"] == 2 * (134_515_008 + 49152 * 576)
    cfg = json.loads((bf16_checkpoint / "config.json").read_text())
    assert cfg["logits_dtype"] == "float32" and cfg["quantization"]["quant_algo"] is None
    assert not (bf16_checkpoint / "calibration.json").exists()


@pytest.mark.slow
def test_export_with_kept_layers_and_patterns(default_model_dir, tmp_path):
    from precision_pipeline.checkpoint.reader import checkpoint_info
    from precision_pipeline.gate.model import load_checkpoint_model
    from precision_pipeline.checkpoint.reader import safetensors_header

    p = profile("fp8-h100", calibration={"num_samples": 3, "seq_len": 16},
                quantization={"keep_first_layers": 1, "keep_last_layers": 1, "exclude_modules": ["lm_head", "model.layers.5.mlp.down_proj"]})
    r = run_quantize(quantize_job(p), default_model_dir, tmp_path / "ck", show_progress=False)
    assert isinstance(r, QuantizeResult)
    from precision_pipeline.quantize.ptq import read_quantize_warnings  # run_quantize records ModelOpt's warnings

    rec = read_quantize_warnings(tmp_path / "ck")
    assert rec is not None and any("lm_head" in w["message"] and w["expected"] for w in rec["warnings"])
    assert r.quant_algo == "FP8" and r.kv_cache_quant_algo == "FP8"
    for i in (0, 29):
        for lin in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"):
            assert f"transformer.layers.{i}.{lin}" in r.exclude_modules
    assert "transformer.layers.5.mlp.proj" in r.exclude_modules and "lm_head" in r.exclude_modules
    assert "transformer.layers.5.mlp.fc" not in r.exclude_modules
    h = safetensors_header(tmp_path / "ck" / "rank0.safetensors")
    assert h["transformer.layers.0.attention.qkv.weight"]["dtype"] == "BF16"
    assert h["transformer.layers.29.mlp.proj.weight"]["dtype"] == "BF16"
    assert h["transformer.layers.5.mlp.proj.weight"]["dtype"] == "BF16"
    assert h["transformer.layers.5.mlp.fc.weight"]["dtype"] == "F8_E4M3"
    assert h["transformer.layers.1.attention.qkv.weight"]["dtype"] == "F8_E4M3"
    assert "transformer.layers.0.attention.k_cache_scaling_factor" in h  # KV cache stays FP8 (one dtype per engine)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["quantization"]["exclude_modules"] == r.exclude_modules == sorted(r.exclude_modules)
    assert checkpoint_info(tmp_path / "ck")["total_bytes"] == r.checkpoint_bytes
    m = load_checkpoint_model(tmp_path / "ck", default_model_dir)  # the reader accepts the exclusions
    assert m.model.layers[0].self_attn.q_proj.act_format is None
    assert m.model.layers[1].self_attn.q_proj.act_format == "fp8"
    assert m.model.layers[5].mlp.down_proj.act_format is None


@pytest.mark.slow
def test_up_proj_export_keeps_the_fused_pair_and_matches_the_memory_plan(default_model_dir, fp8_checkpoint, tmp_path):
    """A real FP8 export with ``exclude_modules: [lm_head, "*up_proj"]`` writes both GEMMs of every fused gate/up
    pair (mlp.gate = up_proj and its partner mlp.fc = gate_proj) in BF16 without scales, and its tensors exceed the
    FP8 test checkpoint's (lm_head only) by exactly what the memory plan adds: 60 x (576 x 1536 - 8) bytes."""
    from precision_pipeline.checkpoint.reader import safetensors_header
    from precision_pipeline.resolve.memory import weight_bytes
    from precision_pipeline.spec.model_arch import read_model_arch
    from tests.conftest import checkpoint_profile

    p = profile("fp8-h100", calibration={"num_samples": 3, "seq_len": 16},
                quantization={"exclude_modules": ["lm_head", "*up_proj"]})
    r = run_quantize(quantize_job(p), default_model_dir, tmp_path / "ck", show_progress=False)
    h = safetensors_header(tmp_path / "ck" / "rank0.safetensors")
    for i in range(30):
        for g in ("mlp.fc", "mlp.gate"):
            assert h[f"transformer.layers.{i}.{g}.weight"]["dtype"] == "BF16"
            assert f"transformer.layers.{i}.{g}.weights_scaling_factor" not in h
            assert f"transformer.layers.{i}.{g}" in r.exclude_modules
        assert h[f"transformer.layers.{i}.mlp.proj.weight"]["dtype"] == "F8_E4M3"

    def tensor_bytes(hdr: dict) -> int:
        return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in hdr.items() if k != "__metadata__")

    grown = tensor_bytes(h) - tensor_bytes(safetensors_header(fp8_checkpoint / "rank0.safetensors"))
    m = read_model_arch(default_model_dir)
    one = {"tp_size": 1, "pp_size": 1, "moe_tp_size": 1, "moe_ep_size": 1}
    planned = weight_bytes(m, p, one)["total"] - weight_bytes(m, checkpoint_profile("fp8"), one)["total"]
    assert grown == planned == 60 * (576 * 1536 - 8)


@pytest.mark.slow
def test_awq_export_layout(int4_awq_checkpoint):
    from precision_pipeline.checkpoint.reader import safetensors_header

    cfg = json.loads((int4_awq_checkpoint / "config.json").read_text())
    q = cfg["quantization"]
    assert q["quant_algo"] == "W4A16_AWQ" and q["group_size"] == 64 and q["pre_quant_scale"] is True
    assert q["has_zero_point"] is False
    h = safetensors_header(int4_awq_checkpoint / "rank0.safetensors")
    p = "transformer.layers.0.attention.qkv."
    assert h[p + "weight"] == {**h[p + "weight"], "dtype": "I8", "shape": [480, 576]}        # [out/2, in]
    assert h[p + "weights_scaling_factor"]["shape"] == [960, 9]                             # [out, in/64]
    assert h[p + "prequant_scaling_factor"]["shape"] == [576]
    assert h["transformer.layers.0.mlp.proj.weights_scaling_factor"]["shape"] == [576, 24]  # 1536/64


def test_nan_weights_are_refused_before_modelopt_naming_the_tensor(default_model_dir, tmp_path):
    """Issue 25 item 17: NaN weights in the model ended in ModelOpt's assertion (a traceback)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from precision_pipeline.quantize.ptq import load_model, quantize_model

    m = tmp_path / "tiny"
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(m, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default_model_dir / f, m / f)
    load_model(m)  # intact: loads
    sd = load_file(m / "model.safetensors")
    sd["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    sd["model.layers.1.mlp.down_proj.weight"][0, 0] = float("inf")
    save_file(sd, m / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError) as e:
        load_model(m)
    pr = e.value.problems[0]
    assert pr.field == "--model" and "model.layers.1.mlp.down_proj.weight (1 NaN, 1 infinite of 4,096)" in pr.reason
    with pytest.raises(UserError, match="non-finite weights: model.layers.1.mlp.down_proj.weight"):
        quantize_model(quantize_job(profile("fp8-h100", calibration={"num_samples": 2, "seq_len": 16, "batch_size": 2}), m), m,
                       show_progress=False)
