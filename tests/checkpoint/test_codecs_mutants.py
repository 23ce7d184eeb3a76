"""Codec facts pinned down by mutation testing (tests/mutate.py survivors on checkpoint/codecs.py).

All by hand on tiny tensors (E2M1 grid 0, 0.5, 1, 1.5, 2, 3, 4, 6; E4M3 min subnormal 2**-9).
"""

from __future__ import annotations

import torch

from precision_pipeline.checkpoint import codecs as C
from precision_pipeline.checkpoint.reader import dequantize_weight

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e2m1_nearest_even(v: float) -> float:
    """Nearest E2M1 magnitude, ties to the even code (index), saturating at 6: an independent reference."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda i: (abs(GRID[i] - a), i % 2))
    return -GRID[best] if v < 0 else GRID[best]


def test_fake_quant_nvfp4_by_hand():
    # block amax 12, global scale 1 -> block scale fp8(12 / 6) = 2: x_q = e2m1(x / 2) * 2
    x = torch.tensor([[12.0, 5.0, -3.2, 1.4, 0.6, 0.25, -7.0, 2.2, 9.0, 0.0, 4.4, -0.9, 1.0, 3.0, 6.1, -11.0]])
    want = torch.tensor([[_e2m1_nearest_even(v / 2.0) * 2.0 for v in x[0].tolist()]])
    assert torch.equal(C.fake_quant_nvfp4(x, torch.tensor(1.0)), want)
    # global scale 0.5: block scale fp8(12 / 3) = 4, total scale 2: the same values
    assert torch.equal(C.fake_quant_nvfp4(x, torch.tensor(0.5)), want)


def test_fake_quant_nvfp4_zero_and_tiny_blocks():
    z = torch.zeros(1, 32)
    z[0, 16:] = torch.linspace(-12.0, 12.0, 16)
    out = C.fake_quant_nvfp4(z, torch.tensor(1.0))
    assert torch.equal(out[0, :16], torch.zeros(16))           # an all-zero block stays zero (no 0/0)
    assert torch.isfinite(out).all() and out[0, 16:].abs().max() == 12.0
    tiny = torch.full((1, 16), 1e-6)
    # block scale 1e-6/6 clamps up to 2**-9 (the smallest E4M3 subnormal): 1e-6 / 2**-9 rounds to 0
    assert torch.equal(C.fake_quant_nvfp4(tiny, torch.tensor(1.0)), torch.zeros(1, 16))
    # amax 6e-4: block scale 1e-4 clamps up to 2**-9; 6e-4 / 2**-9 = 0.31 -> 0.5, so 0.5 * 2**-9 (not 0)
    small = torch.full((1, 16), 6e-4)
    assert torch.equal(C.fake_quant_nvfp4(small, torch.tensor(1.0)), torch.full((1, 16), 0.5 * 2.0 ** -9))


def test_fp8_per_channel_scales():
    w = torch.tensor([[0x38, 0xB8], [0x40, 0x38]], dtype=torch.uint8).view(torch.float8_e4m3fn)  # 1, -1 / 2, 1
    t = {"a.weight": w, "a.weights_scaling_factor": torch.tensor([0.5, 4.0])}
    assert dequantize_weight(t, "a.", "FP8", None).tolist() == [[0.5, -0.5], [8.0, 4.0]]


def test_int4_scales_in_either_layout():
    w = torch.tensor([[0x9F, 0x21, 0x70, 0x08]], dtype=torch.uint8).view(torch.int8)  # [out/2=1, in=4]
    s = torch.tensor([[0.5, 2.0], [1.0, 0.25]])                                         # [out=2, in/group=2]
    want = [[-0.5, 0.5, 0.0, -16.0], [-7.0, 2.0, 1.75, 0.0]]
    assert C.dequant_int4({"a.weight": w, "a.weights_scaling_factor": s}, "a.", 2).tolist() == want
    w3 = torch.tensor([[0x9F, 0x21, 0x70, 0x08, 0x11, 0x22]], dtype=torch.uint8).view(torch.int8)  # in=6, group 2
    s3 = torch.tensor([[0.5, 2.0, 1.0], [1.0, 0.25, 1.0]])
    a = C.dequant_int4({"a.weight": w3, "a.weights_scaling_factor": s3}, "a.", 2)
    b = C.dequant_int4({"a.weight": w3, "a.weights_scaling_factor": s3.T.contiguous()}, "a.", 2)  # [in/group, out]
    assert torch.equal(a, b) and a.shape == (2, 6)


def test_int4_header_layout_check():
    codec = C.Int4Awq()
    from precision_pipeline.spec.formats import GEMM, QuantAlgo

    awq = GEMM[QuantAlgo.W4A16_AWQ]
    packed = {"dtype": "I8", "shape": [2, 8]}
    assert codec.header_problem("a", awq, packed, {"dtype": "F32", "shape": [4, 1]}) is None
    assert codec.header_problem("a", awq, packed, None) is None
    msg = codec.header_problem("a", awq, packed, {"dtype": "F32", "shape": [2]})
    assert msg == "a is declared W4A16_AWQ but stored as INT8 with per-channel scales [2] (W8A16 / SmoothQuant layout)."
    assert codec.header_problem("a", awq, packed, {"dtype": "F32", "shape": [6, 1]}) is not None
    assert C._int4_packed(packed, {"shape": [4, 2]}) and not C._int4_packed(packed, {"shape": [4]})
