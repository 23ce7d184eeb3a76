"""The gate's torch model (gate/model.py): the one q/k/v split, by hand with GQA."""

from __future__ import annotations

import pytest
import torch

from precision_pipeline.checkpoint.reader import LinearSpec
from precision_pipeline.core.errors import UserError
from precision_pipeline.gate.model import split_qkv
from precision_pipeline.spec.families import qkv_rows


def test_split_qkv_by_hand_with_gqa():
    """4 heads, 2 KV heads, head_dim 2: rows [q 0..7; k 8..11; v 12..15]. Two column ranks with different
    activation scales (rows 0..5 and 6..15): q gets (0, 6, s0) and (6, 8, s1); k and v (0, 4, s1). Every part
    keeps the fused GEMM's format, group size and input scales (the copy in the sensitivity analysis dropped
    quant_algo and group_size)."""
    q_rows, kv_rows = qkv_rows(4, 2, 2)
    assert (q_rows, kv_rows) == (8, 4)
    w = torch.arange(16, dtype=torch.float32)[:, None].expand(16, 3).clone()
    s0, s1, pre = torch.tensor(0.5), torch.tensor(2.0), torch.ones(3)
    spec = LinearSpec(weight=w, quantized=True, act_scale_rows=[(0, 6, s0), (6, 16, s1)], pre=pre,
                      quant_algo="W4A8_AWQ", group_size=64)
    parts = split_qkv(spec, q_rows, kv_rows)
    assert [n for n, _ in parts] == ["q_proj", "k_proj", "v_proj"]
    (_, q), (_, k), (_, v) = parts
    assert q.weight[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert k.weight[:, 0].tolist() == [8, 9, 10, 11] and v.weight[:, 0].tolist() == [12, 13, 14, 15]
    assert [(a, b, float(s)) for a, b, s in q.act_scale_rows] == [(0, 6, 0.5), (6, 8, 2.0)]
    assert [(a, b, float(s)) for a, b, s in k.act_scale_rows] == [(0, 4, 2.0)]
    assert [(a, b, float(s)) for a, b, s in v.act_scale_rows] == [(0, 4, 2.0)]
    for _, p in parts:
        assert p.quantized and p.quant_algo == "W4A8_AWQ" and p.group_size == 64 and p.pre is pre
    with pytest.raises(UserError, match="15 rows; expected 8 \\+ 2 x 4"):
        split_qkv(LinearSpec(weight=w[:15], quantized=False), q_rows, kv_rows)
