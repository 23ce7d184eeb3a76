"""Per-layer precision search (build/precision_pipeline/quantize/search.py).

The slow test runs ModelOpt's auto_quantize on the real default model (SmolLM2-135M-Instruct),
truncated to its first 2 decoder layers to keep it to about a minute on 2 cores, calibrated on
REAL text from the builtin calibration set (precision_pipeline.quantize.calibration: news, Python docs prose, Python
source), and exports a MIXED_PRECISION TensorRT-LLM checkpoint.
"""

from __future__ import annotations

import json

import pytest
import torch

from precision_pipeline.quantize.search import FORMAT_BITS, _as_batches, check_bits, choose_group_size, normalize_formats
from precision_pipeline.core.errors import UserError

# --------------------------------------------------------------------------------------------
# Fast checks (no ModelOpt search)


def test_formats_normalized_and_aliases():
    assert normalize_formats(["fp8", "INT4_AWQ", "W4A16_AWQ"], cuda_available=False) == ["FP8", "W4A16_AWQ"]
    from precision_pipeline.spec.profile import QuantAlgo

    assert normalize_formats([QuantAlgo.FP8, QuantAlgo.W4A16_AWQ], cuda_available=False) == ["FP8", "W4A16_AWQ"]


def test_nvfp4_refused_on_cpu():
    with pytest.raises(UserError) as ei:
        normalize_formats(["FP8", "NVFP4"], cuda_available=False)
    p = ei.value.problems[0]
    assert p.field == "quantization.auto_quantize_formats"
    assert "CUDA" in p.reason and "NVFP4" in p.reason
    assert normalize_formats(["NVFP4"], cuda_available=True) == ["NVFP4"]
    if not torch.cuda.is_available():  # the default looks at torch.cuda
        with pytest.raises(UserError):
            normalize_formats(["NVFP4"])


@pytest.mark.parametrize("fmts", [["W8A8_SQ_PER_CHANNEL"], ["bogus"], []])
def test_unsupported_or_empty_formats_refused(fmts):
    with pytest.raises(UserError) as ei:
        normalize_formats(fmts, cuda_available=False)
    assert ei.value.problems[0].field == "quantization.auto_quantize_formats"


def test_budget_checks():
    assert check_bits(6.0, ["FP8", "W4A16_AWQ"]) == 6.0
    for bad, fmts in [(3.5, ["FP8", "W4A16_AWQ"]), (7.0, ["FP8"]), (0, ["FP8"]), (17, ["FP8"]), ("x", ["FP8"])]:
        with pytest.raises(UserError) as ei:
            check_bits(bad, fmts)
        assert ei.value.problems[0].field == "quantization.auto_quantize_bits"
    assert FORMAT_BITS == {"NO_QUANT": 16, "FP8": 8, "W4A16_AWQ": 4, "NVFP4": 4}


def test_group_size_choice():
    m = torch.nn.Sequential()
    m.add_module("a", torch.nn.Linear(576, 1536))
    m.add_module("b", torch.nn.Linear(1536, 576))
    m.add_module("lm_head", torch.nn.Linear(100, 7))  # disabled: its width does not count
    assert choose_group_size(m, ["*lm_head*"]) == 64
    assert choose_group_size(m, ["*lm_head*"], 32) == 32
    with pytest.raises(UserError) as ei:
        choose_group_size(m, ["*lm_head*"], 128)
    assert ei.value.problems[0].field == "quantization.group_size" and "use 64" in ei.value.problems[0].fix


def test_calibration_batches_validated():
    out = _as_batches([[[1, 2, 3], [4, 5, 6]], torch.tensor([[7, 8]])], vocab_size=10)
    assert [tuple(b.shape) for b in out] == [(2, 3), (1, 2)]
    for bad in ([], [[[1]]], [[[1, 99]]]):
        with pytest.raises(UserError) as ei:
            _as_batches(bad, vocab_size=10)
        assert ei.value.problems[0].field == "calibration.dataset"


# --------------------------------------------------------------------------------------------
# Real model, real text


@pytest.mark.slow
def test_auto_quantize_export_mixed_precision(smollm_2layers, tmp_path):
    from precision_pipeline.quantize.search import auto_quantize_export
    from precision_pipeline.quantize.calibration import build_calibration_set, load_tokenizer
    from precision_pipeline.spec.profile import Calibration

    tok = load_tokenizer(smollm_2layers)
    calib = build_calibration_set(Calibration(num_samples=6, seq_len=48, seed=0), tok)  # real text
    assert {k.split("/")[0] for k in calib.kinds} == {"news", "docs", "code"}

    out = tmp_path / "ckpt"
    res = auto_quantize_export(smollm_2layers, calib.batches(3), 6.0, ["FP8", "W4A16_AWQ"], out)

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["quant_algo"] == "MIXED_PRECISION"
    assert cfg["logits_dtype"] == "float32"
    assert cfg["mapping"]["tp_size"] == 1 and cfg["num_hidden_layers"] == 2
    qcfg = json.loads((out / "quant_cfg.json").read_text())
    assert qcfg["quant_algo"] == "MIXED_PRECISION"
    layers = qcfg["quantized_layers"]
    assert layers and all(k.startswith("transformer.layers.") for k in layers)
    algos = {v["quant_algo"] for v in layers.values()}
    assert algos <= {"FP8", "W4A16_AWQ"}
    # a 6-bit budget between FP8 (8) and INT4 (4) cannot be met by one format alone
    assert algos == {"FP8", "W4A16_AWQ"}
    for v in layers.values():
        if v["quant_algo"] == "W4A16_AWQ":
            assert v["group_size"] == 64 and v["pre_quant_scale"] is True
    # fused GEMMs share one format: every TRT-LLM module appears once (qkv, dense, fc, gate, proj)
    assert set(layers) <= {f"transformer.layers.{i}.{m}" for i in range(2)
                           for m in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")}

    assert res["quant_algo"] == "MIXED_PRECISION"
    assert res["effective_bits_achieved"] <= 6.0 + 1e-9 and res["constraint_satisfied"]
    assert res["effective_bits_budget"] == 6.0 and res["group_size"] == 64
    assert res["per_layer"]["lm_head"] == "NO_QUANT" and res["per_layer_hf"]["lm_head"] == "NO_QUANT"
    for trt, entry in layers.items():
        assert res["per_layer"][trt] == entry["quant_algo"]
    assert json.loads((out / "autoquant.json").read_text())["per_layer"] == res["per_layer"]

    # achieved bits recomputed from the checkpoint's own table and the HF weight shapes
    from transformers import AutoConfig

    hc = AutoConfig.from_pretrained(str(smollm_2layers))
    h, i, kv = hc.hidden_size, hc.intermediate_size, hc.num_key_value_heads * (hc.hidden_size // hc.num_attention_heads)
    numel = {"attention.qkv": h * (h + 2 * kv), "attention.dense": h * h, "mlp.fc": h * i, "mlp.gate": h * i,
             "mlp.proj": h * i}
    total = bits = 0
    for li in range(2):
        for m, n in numel.items():
            fmt = layers.get(f"transformer.layers.{li}.{m}", {}).get("quant_algo", "NO_QUANT")
            bits += FORMAT_BITS[fmt] * n
            total += n
    assert abs(bits / total - res["effective_bits_achieved"]) < 1e-9

    from safetensors import safe_open

    with safe_open(str(out / "rank0.safetensors"), "pt") as f:
        for trt, entry in layers.items():
            dt = f.get_slice(f"{trt}.weight").get_dtype()
            assert dt == {"FP8": "F8_E4M3", "W4A16_AWQ": "I8"}[entry["quant_algo"]], trt
        assert f.get_slice("lm_head.weight").get_dtype() == "BF16"
