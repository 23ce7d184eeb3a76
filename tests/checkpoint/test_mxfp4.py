"""The MXFP4 codec (checkpoint/codecs.py: E2M1 elements, one E8M0 power-of-two scale per 32 inputs): every code,
the scale's edge cases, ModelOpt's own MXFP4 quantizer output and gpt-oss's block layout decoded exactly."""

from __future__ import annotations

import pytest
import torch

from precision_pipeline.checkpoint import codecs as K
from precision_pipeline.core.errors import UserError
from precision_pipeline.spec.formats import GEMM, MX_BLOCK, QuantAlgo

MX_ALGOS = (QuantAlgo.W4A16_MXFP4, QuantAlgo.W4A8_MXFP4_FP8, QuantAlgo.W4A8_MXFP4_MXFP8)


def _one_block(codes: list[int], scale_code: int) -> tuple[torch.Tensor, torch.Tensor]:
    """32 E2M1 codes (element 2j in the low nibble) and one E8M0 byte, as ``[1, 16]`` / ``[1, 1]`` uint8."""
    assert len(codes) == MX_BLOCK
    packed = [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(MX_BLOCK // 2)]
    return torch.tensor([packed], dtype=torch.uint8), torch.tensor([[scale_code]], dtype=torch.uint8)


def test_every_e2m1_code_decodes_to_its_value_with_a_unit_scale():
    codes = list(range(16)) + list(range(15, -1, -1))
    w = K.dequant_mx(*_one_block(codes, 127), "w")
    expect = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert w.dtype == torch.float32 and w.shape == (1, 32)
    assert w[0, :16].tolist() == expect and w[0, 16:].tolist() == expect[::-1]
    assert torch.signbit(w[0, 8]) and not torch.signbit(w[0, 0])  # code 8 is -0.0


@pytest.mark.parametrize("scale_code,element,expect", [
    (127, 2, 1.0),                     # 2**0 x 1.0
    (128, 7, 12.0),                    # 2**1 x 6.0
    (120, 1, 0.5 * 2.0 ** -7),         # 2**-7 x 0.5
    (0, 1, 2.0 ** -128),               # the smallest scale 2**-127 x 0.5: a float32 subnormal, exact
    (0, 7, 6.0 * 2.0 ** -127),
    (254, 2, 2.0 ** 127),              # the largest scale
    (254, 7, float("inf")),            # 6 x 2**127 is past float32's range
])
def test_e8m0_scale_edge_cases(scale_code, element, expect):
    w = K.dequant_mx(*_one_block([element] * 32, scale_code), "w")
    assert w[0].tolist() == [expect] * 32


def test_e8m0_nan_code_and_bad_tiling_are_refused():
    with pytest.raises(UserError, match="E8M0 code 255"):
        K.dequant_mx(*_one_block([2] * 32, 255), "layers.0.mlp.fc.weight")
    packed, _ = _one_block([2] * 32, 127)
    with pytest.raises(UserError, match="do not tile"):
        K.dequant_mx(packed, torch.full((1, 2), 127, dtype=torch.uint8), "w")
    with pytest.raises(UserError, match="do not match"):
        K.dequant_mx_blocks(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), "w")


def _weights() -> torch.Tensor:
    g = torch.Generator().manual_seed(29)
    w = torch.randn(6, 128, generator=g) * torch.logspace(-6, 3, 6).unsqueeze(1)
    w[0, :32] = 0.0            # an all-zero block: ModelOpt writes the smallest scale (code 0)
    w[1, 32:64] = torch.tensor([6.0, -3.0, 0.25, 0.75] * 8)  # exact grid values and rounding boundaries
    return w


@pytest.mark.slow  # importing ModelOpt: ~10 s idle, 50 s on the loaded machine; the decode itself takes ms
def test_modelopt_mxfp4_quantizer_output_round_trips_exactly():
    from modelopt.torch.quantization.qtensor import MXFP4QTensor

    w = _weights()
    q, scale = MXFP4QTensor.quantize(w, MX_BLOCK)
    theirs = q.dequantize(dtype=torch.float32, scale=scale, block_sizes={-1: MX_BLOCK})
    scales = scale.reshape(w.shape[0], -1)  # what the export writes (quant_utils.get_weight_scaling_factor)
    ours = K.dequant_mx(q._quantized_data, scales, "w")
    assert torch.equal(ours, theirs)
    assert int(scales[0, 0]) == 0 and (ours[0, :32] == 0).all()
    # through the registry: every MXFP4 quant_algo decodes with the same codec
    t = {"x.weight": q._quantized_data, "x.weights_scaling_factor": scales}
    for algo in MX_ALGOS:
        assert torch.equal(K.dequantize(t, "x.", GEMM[algo], None), theirs)
        assert GEMM[algo].fixed_block == MX_BLOCK and K.codec_for(GEMM[algo]).name == "mxfp4"
    # the registry's ModelOpt presets exist in the installed ModelOpt (0.47) with MX weight quantizers:
    # E2M1 (num_bits (2, 1)) or E4M3 (MXFP8) elements, blocks of 32, E8M0 scales (scale_bits (8, 0))
    import modelopt.torch.quantization as mtq

    for algo in (QuantAlgo.W4A8_MXFP4_FP8, QuantAlgo.MXFP8):
        cfg = getattr(mtq, GEMM[algo].modelopt_preset)
        (wq,) = [e["cfg"] for e in cfg["quant_cfg"] if e.get("quantizer_name") == "*weight_quantizer"]
        assert tuple(wq["num_bits"]) == ((2, 1) if algo != QuantAlgo.MXFP8 else (4, 3))
        assert wq["block_sizes"][-1] == MX_BLOCK and tuple(wq["block_sizes"]["scale_bits"]) == (8, 0)
    assert hasattr(mtq, "MXFP4_DEFAULT_CFG") and hasattr(mtq, "MXFP4_MLP_WEIGHT_ONLY_CFG")  # no TensorRT-LLM name


def test_gpt_oss_block_layout_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(29)
    blocks = torch.randint(0, 256, (2, 3, 128 // MX_BLOCK, MX_BLOCK // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (2, 3, 128 // MX_BLOCK), generator=g, dtype=torch.uint8)  # [experts, out, in/32]
    ours = K.dequant_mx_blocks(blocks, scales, "experts")
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [experts, in, out]
    assert torch.equal(ours.transpose(1, 2), ref)


def test_mxfp4_layout_slots():
    fmt = GEMM[QuantAlgo.W4A8_MXFP4_FP8]
    slots = K.codec_for(fmt).layout(fmt, 64, 256, None)
    assert {k: v.text() for k, v in slots.items()} == {
        "weight": "U8 [64, 128]", "weights_scaling_factor": "U8 [64, 8]", "activation_scaling_factor": "F32 [] or [1]"}
    assert set(K.codec_for(GEMM[QuantAlgo.W4A16_MXFP4]).layout(GEMM[QuantAlgo.W4A16_MXFP4], 64, 256, None)) == {
        "weight", "weights_scaling_factor"}
    # bytes per linear: 0.5 per weight + one scale byte per 32 (+ the FP8 activation scale)
    assert fmt.linear_bytes(256, 64) == 64 * 256 / 2 + 64 * 256 / 32 + 4
