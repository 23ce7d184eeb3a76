"""checkpoint/scales.py on the session's real test checkpoints (FP8, FP8 tp 3, NVFP4, INT4 AWQ, INT8
SmoothQuant): counts per kind against the checkpoint's quantized linears x ranks, numbers against an
independent read of the same tensors (safetensors + numpy), and planted bad scales (a copy of the
checkpoint's scale tensors with one tensor x1000, zero, NaN or an FP8 KV scale of 2) flagged by name."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from precision_pipeline.checkpoint.reader import KV_SCALE_NAMES, SCALE_SUFFIXES, layer_table
from precision_pipeline.checkpoint.scales import RATIO, scale_report
from precision_pipeline.spec.formats import GEMM, KV

W, W2, ACT, PRE = SCALE_SUFFIXES
KVF = KV_SCALE_NAMES[-1]


def _raw(ckpt: Path) -> dict[str, np.ndarray]:
    """Every scale tensor of every rank as float64, keyed ``rank:name`` (independent of the module)."""
    out = {}
    for f in sorted(Path(ckpt).glob("rank*.safetensors")):
        r = int(f.stem[4:])
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                if k.rsplit(".", 1)[-1] in SCALE_SUFFIXES + KV_SCALE_NAMES:
                    out[f"{r}:{k}"] = st.get_tensor(k).float().reshape(-1).numpy().astype(np.float64)
    return out


def _quantized_linears(ckpt: Path) -> int:
    return sum(1 for row in layer_table(ckpt)["linears"] if GEMM[row["quant_algo"]].is_quantized)


def _kind(rep: dict, family: str, algo) -> dict:
    return rep["kinds"][f"{family}:{algo.value if hasattr(algo, 'value') else algo}"]


def _check_numbers(rep: dict, raw: dict, family: str, key: str, exact: bool = True) -> None:
    """min/max exact; p1/median/p99 the inverted-CDF order statistic (exact, or within the 1.2% bin)."""
    vals = np.concatenate([v for k, v in raw.items() if k.rsplit(".", 1)[-1] in
                           ((family,) if family != KVF else KV_SCALE_NAMES)])
    k = rep["kinds"][key]
    assert k["elements"] == vals.size
    assert k["min"] == pytest.approx(vals.min(), rel=1e-5) and k["max"] == pytest.approx(vals.max(), rel=1e-5)
    assert k["quantiles_exact"] is exact
    for q, name in ((0.01, "p1"), (0.5, "median"), (0.99, "p99")):
        want = float(np.quantile(vals, q, method="inverted_cdf"))
        assert k[name] == pytest.approx(want, rel=1e-5 if exact else 0.0116), (key, name)
    assert sum(k["histogram"]["counts"]) == vals.size  # every positive value is in the plotted histogram


def test_fp8_counts_numbers_and_the_real_outliers(fp8_checkpoint):
    rep = scale_report(fp8_checkpoint)
    raw = _raw(fp8_checkpoint)
    cfg = json.loads((fp8_checkpoint / "config.json").read_text())
    layers, ranks = cfg["num_hidden_layers"], cfg["mapping"]["world_size"]
    n_lin = _quantized_linears(fp8_checkpoint)
    assert n_lin == 5 * layers  # lm_head stays BF16
    assert set(rep["kinds"]) == {f"{W}:FP8", f"{ACT}:FP8", f"{KVF}:FP8"}
    fp8 = GEMM["FP8"].algo
    assert _kind(rep, W, fp8)["count"] == _kind(rep, ACT, fp8)["count"] == n_lin * ranks
    assert _kind(rep, KVF, KV["FP8"].algo)["count"] == len(KV_SCALE_NAMES) * layers * ranks
    assert rep["tensors"] == len(raw) == 2 * n_lin + 3 * layers
    for fam in (W, ACT, KVF):
        _check_numbers(rep, raw, fam, f"{fam}:FP8")
    w = _kind(rep, W, fp8)
    assert w["granularity"] == "per_tensor" and w["stored_dtype"] == "F32"
    assert w["implied_amax"] == pytest.approx(w["max"] * 448, rel=1e-5)
    # ModelOpt exports FP8 KV scales clamped to >= 1: all 1.0 here, none flagged as large
    assert _kind(rep, KVF, KV["FP8"].algo)["max"] == 1.0
    # SmolLM2's massive activations: layers 11 and 28 down_proj inputs reach ~3400 (FP8 scale ~7.5)
    high = {o["tensor"] for o in rep["outliers"] if o["rule"] == "high"}
    assert "transformer.layers.11.mlp.proj.activation_scaling_factor" in high
    assert all(o["ratio"] > RATIO for o in rep["outliers"] if o["rule"] == "high")
    assert not [o for o in rep["outliers"] if o["rule"] in ("nonpositive", "nonfinite", "kv_large", "low")]
    assert rep["read_s"] < 2


def test_fp8_tp3_counts_every_rank(fp8_tp3_checkpoint):
    rep = scale_report(fp8_tp3_checkpoint)
    assert _kind(rep, W, GEMM["FP8"].algo)["count"] == _quantized_linears(fp8_tp3_checkpoint) * 3 == 450
    ranks = {o["rank"] for o in rep["outliers"] if o["tensor"] == "transformer.layers.11.mlp.proj.activation_scaling_factor"}
    assert ranks == {0, 1, 2}  # row-parallel: each rank has the layer's activation scale


def test_nvfp4_block_scales_are_counted_per_code(nvfp4_checkpoint):
    rep = scale_report(nvfp4_checkpoint)
    raw = _raw(nvfp4_checkpoint)
    nv = GEMM["NVFP4"].algo
    assert set(rep["kinds"]) == {f"{W}:NVFP4", f"{W2}:NVFP4", f"{ACT}:NVFP4", f"{KVF}:FP8"}
    blocks = _kind(rep, W, nv)
    assert blocks["granularity"] == "per_block" and blocks["stored_dtype"] == "F8_E4M3" and blocks["implied_amax"] is None
    hdr = json.loads((nvfp4_checkpoint / "config.json").read_text())
    # one FP8 scale per 16 inputs: elements = sum over linears of out * in / 16 (weights are [out, in/2] bytes)
    with safe_open(str(nvfp4_checkpoint / "rank0.safetensors"), framework="pt") as st:
        want = sum(st.get_slice(k).get_shape()[0] * st.get_slice(k).get_shape()[1] * 2 // 16
                   for k in st.keys() if k.endswith(".weight") and str(st.get_slice(k).get_dtype()) == "U8")
    assert blocks["elements"] == want and blocks["count"] == 5 * hdr["num_hidden_layers"]
    for fam, key in ((W, f"{W}:NVFP4"), (W2, f"{W2}:NVFP4"), (ACT, f"{ACT}:NVFP4")):
        _check_numbers(rep, raw, fam, key)
    assert blocks["max"] == 448.0  # the block holding a tensor's amax is scaled to E4M3's max
    act = _kind(rep, ACT, nv)
    assert act["implied_amax"] == pytest.approx(act["max"] * 6 * 448, rel=1e-5)


def test_int4_awq_per_group_and_bf16_prequant(int4_awq_checkpoint):
    rep = scale_report(int4_awq_checkpoint)
    raw = _raw(int4_awq_checkpoint)
    a = GEMM["W4A16_AWQ"].algo
    assert set(rep["kinds"]) == {f"{W}:W4A16_AWQ", f"{PRE}:W4A16_AWQ"}
    w, pre = _kind(rep, W, a), _kind(rep, PRE, a)
    assert (w["granularity"], pre["granularity"], pre["stored_dtype"]) == ("per_group", "per_input_channel", "BF16")
    assert w["count"] == pre["count"] == _quantized_linears(int4_awq_checkpoint)
    _check_numbers(rep, raw, W, f"{W}:W4A16_AWQ", exact=False)  # > 4096 distinct F32 group scales: binned
    _check_numbers(rep, raw, PRE, f"{PRE}:W4A16_AWQ")
    assert w["implied_amax"] == pytest.approx(w["max"] * 7, rel=1e-5)  # INT4 group scale = amax / 7


def test_int8_sq_per_channel(int8_sq_checkpoint):
    rep = scale_report(int8_sq_checkpoint)
    sq = GEMM["W8A8_SQ_PER_CHANNEL"].algo
    w = _kind(rep, W, sq)
    assert w["granularity"] == "per_channel" and w["count"] == _quantized_linears(int8_sq_checkpoint)
    assert w["implied_amax"] == pytest.approx(w["max"] * 127, rel=1e-5)
    assert _kind(rep, ACT, sq)["count"] == w["count"] and _kind(rep, PRE, sq)["count"] == w["count"]


# ------------------------------------------------------------------------------------------------
# Planted bad scales


def _scales_copy(ckpt: Path, dst: Path, change: dict) -> Path:
    """``dst``: config.json + a rank0.safetensors with only ``ckpt``'s scale tensors (what
    scale_report reads), ``change[name](tensor) -> tensor`` applied."""
    dst.mkdir()
    shutil.copy(ckpt / "config.json", dst / "config.json")
    tensors = {}
    with safe_open(str(ckpt / "rank0.safetensors"), framework="pt") as st:
        for k in st.keys():
            if k.rsplit(".", 1)[-1] in SCALE_SUFFIXES + KV_SCALE_NAMES:
                tensors[k] = st.get_tensor(k)
    for k, fn in change.items():
        assert k in tensors, k
        tensors[k] = fn(tensors[k].clone()).contiguous()
    save_file(tensors, str(dst / "rank0.safetensors"))
    return dst


def _flags(rep: dict) -> set[tuple[str, str]]:
    return {(o["tensor"], o["rule"]) for o in rep["outliers"]}


def test_planted_bad_fp8_scales_are_flagged_by_name(fp8_checkpoint, tmp_path):
    base = _flags(scale_report(_scales_copy(fp8_checkpoint, tmp_path / "same", {})))
    assert base == _flags(scale_report(fp8_checkpoint))  # the scales-only copy reads as the checkpoint
    big = "transformer.layers.5.mlp.fc.weights_scaling_factor"
    zero = "transformer.layers.7.attention.dense.activation_scaling_factor"
    nan = "transformer.layers.9.attention.qkv.weights_scaling_factor"
    kv = "transformer.layers.3.attention.k_cache_scaling_factor"
    small = "transformer.layers.12.mlp.gate.weights_scaling_factor"
    rep = scale_report(_scales_copy(fp8_checkpoint, tmp_path / "bad", {
        big: lambda t: t * 1000, zero: lambda t: t * 0, nan: lambda t: t * float("nan"),
        kv: lambda t: t * 2, small: lambda t: t / 1000}))
    new = _flags(rep) - base
    assert new == {(big, "high"), (zero, "nonpositive"), (nan, "nonfinite"), (kv, "kv_large"), (small, "low")}
    o = next(o for o in rep["outliers"] if o["tensor"] == big)
    assert o["rank"] == 0 and o["ratio"] > 500 and o["kind"] == f"{W}:FP8"
    kv_o = next(o for o in rep["outliers"] if o["tensor"] == kv)
    assert "amax 896" in kv_o["reason"]
    k = rep["kinds"][f"{W}:FP8"]
    assert (k["nonfinite"], rep["kinds"][f"{ACT}:FP8"]["zeros"]) == (1, 1)
    assert k["count"] == 150  # a NaN tensor is still counted
    assert not math.isnan(k["max"])


def test_planted_zero_nvfp4_block_scale(nvfp4_checkpoint, tmp_path):
    name = "transformer.layers.4.mlp.proj.weights_scaling_factor"

    def zero_one_block(t: torch.Tensor) -> torch.Tensor:
        b = t.view(torch.uint8)
        b[3, 5] = 0
        return b.view(torch.float8_e4m3fn)

    rep = scale_report(_scales_copy(nvfp4_checkpoint, tmp_path / "bad", {name: zero_one_block}))
    hit = [o for o in rep["outliers"] if o["tensor"] == name]
    assert [o["rule"] for o in hit] == ["nonpositive"] and "1 zero" in hit[0]["reason"]
    assert rep["kinds"][f"{W}:NVFP4"]["zeros"] == 1


def test_no_quant_checkpoint_has_no_scales(bf16_checkpoint):
    rep = scale_report(bf16_checkpoint)
    assert rep["kinds"] == {} and rep["outliers"] == [] and rep["tensors"] == 0
