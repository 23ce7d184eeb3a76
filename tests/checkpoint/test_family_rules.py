"""Per-family verification rules (issue 29): ``verify.family`` (TensorRT-LLM checkpoint) and ``hf.biases`` (unified HF
checkpoint) on Qwen2 relabellings of the cached FP8 test checkpoints (config says Qwen2, zero q/k/v biases added:
what the Qwen2 export of the same weights stores), each planted fault refused naming the tensor or field and rule."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from precision_pipeline.checkpoint.verify import verify_checkpoint
from precision_pipeline.core.errors import UserError
from precision_pipeline.spec.families import FAMILIES

QWEN2 = FAMILIES["Qwen2ForCausalLM"]
EXPECT = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}


def _as_qwen2_trt(ckpt: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    """``ckpt`` (a Llama TensorRT-LLM checkpoint, tp 1) as its Qwen2 export: architecture, the family's
    ``trtllm_config`` fields and a BF16 zero ``attention.qkv.bias`` per layer; then the edits."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpt, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update({"architecture": QWEN2.architecture, **QWEN2.trtllm_config})
    t = load_file(str(dst / "rank0.safetensors"))
    for i in range(int(cfg["num_hidden_layers"])):
        w = t[f"transformer.layers.{i}.attention.qkv.weight"]
        t[f"transformer.layers.{i}.attention.qkv.bias"] = torch.zeros(w.shape[0], dtype=torch.bfloat16)
    for edit, obj in ((edit_tensors, t), (edit_config, cfg)):
        if edit is not None:
            edit(obj)
    save_file(t, str(dst / "rank0.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _problems(ckpt: Path) -> list[tuple[str, str]]:
    with pytest.raises(UserError) as e:
        verify_checkpoint(ckpt, EXPECT)
    return [(p.field, p.rule) for p in e.value.problems]


def test_qwen2_checkpoint_verifies_and_its_faults_are_named(fp8_checkpoint, tmp_path):
    ok = _as_qwen2_trt(fp8_checkpoint, tmp_path / "ok")
    assert "verify.family" in verify_checkpoint(ok, EXPECT)["rules"]
    # without qwen_type TensorRT-LLM builds Qwen 1 (half-width MLP): refused
    no_type = _as_qwen2_trt(fp8_checkpoint, tmp_path / "no-type", edit_config=lambda c: c.pop("qwen_type"))
    assert _problems(no_type) == [("config.json: qwen_type", "verify.family")]
    # a layer without its bias would run without it; a bias stored quantized is not what TensorRT-LLM adds
    gone = _as_qwen2_trt(fp8_checkpoint, tmp_path / "gone",
                         edit_tensors=lambda t: t.pop("transformer.layers.3.attention.qkv.bias"))
    assert _problems(gone) == [("transformer.layers.3.attention.qkv.bias (rank0.safetensors)", "verify.family")]

    def fp8_bias(t):
        t["transformer.layers.0.attention.qkv.bias"] = t["transformer.layers.0.attention.qkv.bias"].to(torch.float8_e4m3fn)
    assert _problems(_as_qwen2_trt(fp8_checkpoint, tmp_path / "fp8-bias", edit_tensors=fp8_bias)) == [
        ("transformer.layers.0.attention.qkv.bias (rank0.safetensors)", "verify.family")]
    # a bias where the family has none (o_proj: dense_bias=False) is not a tensor of the layout
    dense = _as_qwen2_trt(fp8_checkpoint, tmp_path / "dense", edit_tensors=lambda t: t.__setitem__(
        "transformer.layers.1.attention.dense.bias", torch.zeros(576, dtype=torch.bfloat16)))
    assert _problems(dense) == [("transformer.layers.1.attention.dense.bias (rank0.safetensors)", "verify.known_tensors")]


def test_qwen2_hf_checkpoint_biases(fp8_hf_checkpoint, tmp_path):
    """hf.biases: a Qwen2 HF export stores q/k/v biases in every layer, unquantized [out]."""
    from safetensors.torch import load_file, save_file

    def qwen2(name: str, drop: str = "", dtype=torch.bfloat16) -> Path:
        dst = tmp_path / name
        shutil.copytree(fp8_hf_checkpoint, dst)
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update({"architectures": [QWEN2.architecture], "model_type": QWEN2.model_type})
        (dst / "config.json").write_text(json.dumps(cfg))
        t = load_file(str(dst / "model.safetensors"))
        for i in range(int(cfg["num_hidden_layers"])):
            for rel in QWEN2.bias_linears:
                t[f"model.layers.{i}.{rel}.bias"] = torch.zeros(t[f"model.layers.{i}.{rel}.weight"].shape[0], dtype=dtype)
        t.pop(drop, None)
        save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
        return dst

    assert "hf.biases" in verify_checkpoint(qwen2("ok"), EXPECT)["rules"]
    assert _problems(qwen2("gone", drop="model.layers.2.self_attn.v_proj.bias")) == [
        ("model.layers.2.self_attn.v_proj.bias", "hf.biases")]
    got = _problems(qwen2("fp8", dtype=torch.float8_e4m3fn))
    assert got[0] == ("model.layers.0.self_attn.k_proj.bias (model.safetensors)", "hf.biases")
    assert len(got) == 13 and {r for _, r in got[:12]} == {"hf.biases"} and got[12][0] == "checkpoint"  # 90: 12 shown


def test_gate_model_refuses_a_qwen2_checkpoint_without_its_biases(fp8_checkpoint, default_model_dir, tmp_path):
    """The gate builds the family's HF class: a checkpoint whose q/k/v carry no bias is not gated as a Qwen2 (its
    HF class has q/k/v biases), and its zero biases are read into that class when present."""
    from precision_pipeline.gate.model import load_checkpoint_model

    hf = tmp_path / "qwen2-config"
    hf.mkdir()
    cfg = json.loads((Path(default_model_dir) / "config.json").read_text())
    cfg.update({"architectures": [QWEN2.architecture], "model_type": QWEN2.model_type})
    (hf / "config.json").write_text(json.dumps(cfg))
    plain = tmp_path / "no-bias"
    shutil.copytree(fp8_checkpoint, plain)
    conf = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**conf, "architecture": QWEN2.architecture, **QWEN2.trtllm_config}))
    with pytest.raises(UserError, match=r"attention.qkv \(q_proj\) has no bias but the Qwen2Attention's q_proj has one"):
        load_checkpoint_model(plain, hf)
    model = load_checkpoint_model(_as_qwen2_trt(fp8_checkpoint, tmp_path / "biased"), hf)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.model.layers[0].self_attn.v_proj.bias.shape == (192,)
