"""Per-layer mixed precision through the quantize stage, the checkpoint reader, the plan and the build.

The shipped ``mixed-fp8-int4-h100`` profile (mtq.auto_quantize over FP8 and W4A16_AWQ at a 6-bit
budget, FP8 KV cache, AWQ group 64) runs on SmolLM2-135M-Instruct cut to 2 decoder layers
(``smollm_2layers``), calibrated on real text (``mixed_export`` in conftest).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from precision_pipeline.core.errors import UserError

pytestmark = pytest.mark.slow

H, INTER, KV = 576, 1536, 192  # hidden, intermediate, kv heads x head_dim of the default model
OUT_IN = {"attention.qkv": (H + 2 * KV, H), "attention.dense": (H, H), "mlp.fc": (INTER, H),
          "mlp.gate": (INTER, H), "mlp.proj": (H, INTER)}
LINEARS = [f"transformer.layers.{i}.{m}" for i in range(2) for m in OUT_IN]


def _layers(ckpt: Path) -> dict:
    return json.loads((ckpt / "quant_cfg.json").read_text())["quantized_layers"]


def test_mixed_export_config_and_quant_cfg(mixed_export):
    _, ck, _, res = mixed_export
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["quantization"]["quant_algo"] == "MIXED_PRECISION"
    assert cfg["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert cfg["logits_dtype"] == "float32"
    qc = json.loads((ck / "quant_cfg.json").read_text())
    assert qc["quant_algo"] == "MIXED_PRECISION" and qc["kv_cache_quant_algo"] == "FP8"
    layers = qc["quantized_layers"]
    # every decoder GEMM got a format; the 6-bit budget needs both 8- and 4-bit layers; lm_head excluded
    assert set(layers) == set(LINEARS)
    assert {e["quant_algo"] for e in layers.values()} == {"FP8", "W4A16_AWQ"}
    for e in layers.values():
        if e["quant_algo"] == "W4A16_AWQ":
            assert e["group_size"] == 64 and e["pre_quant_scale"] is True and e["has_zero_point"] is False
    assert res.quant_algo == "MIXED_PRECISION" and res.kv_cache_quant_algo == "FP8"
    assert res.per_layer == {**{n: e["quant_algo"] for n, e in layers.items()}, "lm_head": "NO_QUANT"}
    assert res.search["effective_bits_budget"] == 6.0
    assert res.search["effective_bits_achieved"] <= 6.0 + 1e-9 and res.search["constraint_satisfied"] is True
    assert res.search["group_size"] == 64 and res.search["disabled_layers"] == ["lm_head"]
    assert res.modelopt_config_name == ("auto_quantize(FP8_DEFAULT_CFG, INT4_AWQ_CFG(group_size=64); "
                                        "effective_bits=6.0)+FP8_KV_CFG")
    assert json.loads((ck / "autoquant.json").read_text())["per_layer"] == res.per_layer
    assert res.calibration["num_samples"] == 6 and len(res.calibration["sha256"]) == 64
    assert {k.split("/")[0] for k in res.calibration["strata"]} == {"news", "docs", "code"}


def test_mixed_export_tensors_per_layer_format(mixed_export):
    from safetensors import safe_open

    _, ck, _, _ = mixed_export
    layers = _layers(ck)
    with safe_open(str(ck / "rank0.safetensors"), "pt") as f:
        keys = set(f.keys())
        for name in LINEARS:
            out, inp = OUT_IN[name.split(".", 3)[3]]
            w = f.get_tensor(name + ".weight")
            algo = layers[name]["quant_algo"]
            if algo == "FP8":
                assert w.dtype == torch.float8_e4m3fn and tuple(w.shape) == (out, inp)
                scales = {"weights_scaling_factor": (1,), "activation_scaling_factor": (1,)}
                assert name + ".prequant_scaling_factor" not in keys
            else:
                assert w.dtype == torch.int8 and tuple(w.shape) == (out // 2, inp)  # two int4 per byte, rows
                scales = {"weights_scaling_factor": (out, inp // 64), "prequant_scaling_factor": (inp,)}
                assert name + ".activation_scaling_factor" not in keys  # weight-only: BF16 activations
            for s, shape in scales.items():
                t = f.get_tensor(f"{name}.{s}").float()
                assert tuple(t.shape) == shape, (name, s)
                assert torch.isfinite(t).all() and (t > 0).all(), (name, s)
        for i in range(2):
            for kv in ("k_cache_scaling_factor", "v_cache_scaling_factor"):
                t = f.get_tensor(f"transformer.layers.{i}.attention.{kv}")
                assert tuple(t.shape) == (1,) and torch.isfinite(t).all() and t.item() > 0
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16


def test_reader_uses_each_layers_format(mixed_export, smollm_2layers):
    from precision_pipeline.checkpoint.reader import checkpoint_info, dequantize_checkpoint
    from precision_pipeline.gate.model import load_checkpoint_model

    _, ck, _, _ = mixed_export
    layers = _layers(ck)
    d = dequantize_checkpoint(ck)
    assert d.kv_cache_quant_algo == "FP8"
    assert {n: s.quant_algo for n, s in d.linears.items()} == {**{n: e["quant_algo"] for n, e in layers.items()},
                                                               "lm_head": "NO_QUANT"}
    info = checkpoint_info(ck)
    assert info["quant_algo"] == "MIXED_PRECISION" and info["kv_cache_quant_algo"] == "FP8"
    assert info["layers"] == {n: e["quant_algo"] for n, e in layers.items()}

    m = load_checkpoint_model(ck, smollm_2layers)
    hf = {"attention.qkv": "self_attn.q_proj", "attention.dense": "self_attn.o_proj", "mlp.fc": "mlp.gate_proj",
          "mlp.gate": "mlp.up_proj", "mlp.proj": "mlp.down_proj"}
    for name, e in layers.items():
        i, short = int(name.split(".")[2]), name.split(".", 3)[3]
        mod = m.model.layers[i].get_submodule(hf[short])
        if e["quant_algo"] == "FP8":  # FP8 input fake-quant, no AWQ pre-scale
            assert mod.act_format == "fp8" and mod.pre is None and mod.act_scale is not None
        else:  # weight-only INT4: BF16 input times the AWQ pre-quant scale
            assert mod.act_format is None and mod.pre is not None and mod.pre.shape == (mod.in_features,)
    assert m.lm_head.act_format is None
    assert all(layer.self_attn.kv_format == "fp8" for layer in m.model.layers)


def test_reader_logits_track_modelopt_and_fp32(mixed_export, smollm_2layers):
    """The checkpoint model computes what ModelOpt's searched fake-quant model computes (up to the
    export's rounding and its KV scales, which are given to ModelOpt's model here), and stays close
    to the FP32 model; an unquantized (all-BF16) read would agree with FP32 far better."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from precision_pipeline.gate.model import load_checkpoint_model

    qm, ck, _, _ = mixed_export
    tok = AutoTokenizer.from_pretrained(str(smollm_2layers))
    ids = tok("The committee said on Monday that the new rules would take effect next year, after a long "
              "consultation with industry groups and unions.\n\ndef read_config(path):\n    with open(path) as f:"
              "\n        return json.load(f)\n", return_tensors="pt").input_ids
    raw = load_file(str(ck / "rank0.safetensors"))
    mo = qm.model
    with torch.no_grad():
        for i, layer in enumerate(mo.model.layers):
            for kv in "kv":
                q = getattr(layer.self_attn, f"{kv}_bmm_quantizer")
                q.amax = 448.0 * raw[f"transformer.layers.{i}.attention.{kv}_cache_scaling_factor"].reshape(()).float()
        a = mo(ids).logits
        b = load_checkpoint_model(ck, smollm_2layers)(ids).logits
        ref = AutoModelForCausalLM.from_pretrained(str(smollm_2layers), dtype=torch.float32).eval()(ids).logits
    agree_mo = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    agree_ref = (ref.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert agree_mo >= 0.9, agree_mo
    assert agree_ref >= 0.8, agree_ref
    rel = ((a - b).norm() / a.norm()).item()
    assert rel < 0.05, rel
    assert ((ref - b).norm() / ref.norm()).item() > 1e-3  # it is quantized


def test_tp3_mixed_export_reassembles_to_tp1(mixed_export):
    from precision_pipeline.checkpoint.reader import dequantize_checkpoint

    _, ck1, ck3, _ = mixed_export
    cfg = json.loads((ck3 / "config.json").read_text())
    assert cfg["mapping"]["tp_size"] == 3 and sorted(p.name for p in ck3.glob("rank*.safetensors")) == [
        "rank0.safetensors", "rank1.safetensors", "rank2.safetensors"]
    assert _layers(ck3) == _layers(ck1)
    a, b = dequantize_checkpoint(ck1), dequantize_checkpoint(ck3)
    for n in a.linears:
        assert a.linears[n].quant_algo == b.linears[n].quant_algo
        assert torch.equal(a.linears[n].weight, b.linears[n].weight), n
    for i in a.kv_scales:
        assert torch.equal(a.kv_scales[i][0], b.kv_scales[i][0])


def test_layer_table_is_the_plan_layer_by_layer(mixed_export):
    from precision_pipeline.checkpoint.reader import layer_table, safetensors_header

    _, ck, ck3, res = mixed_export
    t = layer_table(ck, json.loads((ck / "autoquant.json").read_text()))
    names = [r["name"] for r in t["linears"]]
    assert names == LINEARS + ["lm_head"]  # layer order, then the head
    layers = _layers(ck)
    h = safetensors_header(ck / "rank0.safetensors")
    for r in t["linears"]:
        assert r["quant_algo"] == layers.get(r["name"], {}).get("quant_algo", "NO_QUANT")
        want = sum(m["data_offsets"][1] - m["data_offsets"][0] for k, m in h.items()
                   if k.startswith(r["name"] + ".") and "cache_scaling" not in k)
        assert r["bytes"] == want
        if r["name"] != "lm_head":
            out, inp = OUT_IN[r["name"].split(".", 3)[3]]
            assert r["params"] == out * inp
            lo, hi = {"FP8": (8.0, 8.01), "W4A16_AWQ": (4.4, 4.6)}[r["quant_algo"]]  # INT4 + BF16 scales / 64
            assert lo <= r["bits_per_weight"] <= hi, r
    assert t["by_format"]["NO_QUANT"] == {"linears": 1, "params": 49152 * H, "bytes": 49152 * H * 2}
    assert t["search"]["effective_bits_budget"] == 6.0 and t["search"]["constraint_satisfied"] is True
    # the same table from the tp 3 export (sums over ranks; replicated KV rows make qkv bigger)
    t3 = layer_table(ck3)
    assert [(r["name"], r["quant_algo"]) for r in t3["linears"]] == [(r["name"], r["quant_algo"]) for r in t["linears"]]


def _copy(ck: Path, tmp: Path) -> Path:
    out = tmp / "ck"
    shutil.copytree(ck, out)
    return out


@pytest.mark.parametrize("case", ["no-quant-cfg", "bad-algo", "declared-fp8-stored-bf16", "unknown-layer",
                                  "not-a-table", "entry-not-object", "bad-group", "kv-disagrees", "fp8-declared-awq",
                                  "awq-declared-w8"])
def test_reader_refuses_broken_mixed_checkpoints(mixed_export, tmp_path, case):
    from precision_pipeline.checkpoint.reader import dequantize_checkpoint

    _, ck, _, _ = mixed_export
    c = _copy(ck, tmp_path)
    qpath = c / "quant_cfg.json"
    qc = json.loads(qpath.read_text())
    first = LINEARS[0]
    if case == "no-quant-cfg":
        qpath.unlink()
        words = "quant_cfg.json is missing"
    elif case == "bad-algo":
        qc["quantized_layers"][first]["quant_algo"] = "INT2"
        qpath.write_text(json.dumps(qc))
        words = "'INT2'"
    elif case == "declared-fp8-stored-bf16":
        qc["quantized_layers"].pop(first)
        qpath.write_text(json.dumps(qc))
        words = "is stored as I8 in rank0.safetensors but declared NO_QUANT"
    elif case == "unknown-layer":
        qc["quantized_layers"]["transformer.layers.7.mlp.fc"] = {"quant_algo": "FP8"}
        qpath.write_text(json.dumps(qc))
        words = "transformer.layers.7.mlp.fc"
    elif case == "not-a-table":
        qpath.write_text("[1, 2]")
        words = "has no quantized_layers table"
    elif case == "entry-not-object":
        qc["quantized_layers"][first] = "W4A16_AWQ"
        qpath.write_text(json.dumps(qc))
        words = "not an object with quant_algo"
    elif case == "bad-group":
        awq = next(n for n, e in qc["quantized_layers"].items() if e["quant_algo"] == "W4A16_AWQ")
        qc["quantized_layers"][awq]["group_size"] = "abc"
        qpath.write_text(json.dumps(qc))
        words = "group_size 'abc'"
    elif case == "kv-disagrees":
        qc["kv_cache_quant_algo"] = "INT8"
        qpath.write_text(json.dumps(qc))
        words = "kv_cache_quant_algo INT8 but config.json says FP8"
    elif case == "fp8-declared-awq":
        fp8 = next(n for n, e in qc["quantized_layers"].items() if e["quant_algo"] == "FP8")
        qc["quantized_layers"][fp8] = {"quant_algo": "W4A16_AWQ", "group_size": 64}
        qpath.write_text(json.dumps(qc))
        words = f"{fp8} is stored as F8_E4M3 in rank0.safetensors but declared W4A16_AWQ"
    else:
        awq = next(n for n, e in qc["quantized_layers"].items() if e["quant_algo"] == "W4A16_AWQ")
        qc["quantized_layers"][awq] = {"quant_algo": "W8A16"}
        qpath.write_text(json.dumps(qc))
        words = f"{awq} is declared W8A16 but stored as packed INT4"
    with pytest.raises(UserError) as ei:
        dequantize_checkpoint(c)
    p = ei.value.problems[0]
    assert p.field == "checkpoint" and words in p.reason, p.reason


def test_build_runs_mixed_precision_end_to_end(smollm_2layers, tmp_path, small_gate):
    """invoke build's pipeline on the mixed profile: the search runs in the quantize stage, the gate
    reads the MIXED_PRECISION checkpoint, the plan lists every GEMM's format, engine is skipped here."""
    from precision_pipeline.pipeline import run_build

    prof = tmp_path / "mixed-small.yaml"
    prof.write_text("extends: mixed-fp8-int4-h100\ncalibration:\n  num_samples: 6\n  seq_len: 48\n  batch_size: 3\n"
                    "gate:\n  kl_mean_max: 5.0\n  kl_p99_max: 50.0\n  top1_min: 0.1\n  ppl_delta_pct_max: 500.0\n"
                    "  overrides: {}\n")
    out = tmp_path / "out"
    r = run_build(str(prof), model=str(smollm_2layers), out=str(out), golden_limit=1)
    st = {s.name: s.status for s in r.stages}
    assert st == {"resolve": "done", "quantize": "done", "verify": "done", "gate": "done", "engine": "skipped", "engine_gate": "skipped", "pack": "done",
                  "deploy": "done"}
    q = next(s for s in r.stages if s.name == "quantize").numbers
    assert q["quant_algo"] == "MIXED_PRECISION" and q["kv_cache_quant_algo"] == "FP8"
    assert q["effective_bits"] <= 6.0 and set(q["per_layer_counts"]) == {"FP8", "W4A16_AWQ", "NO_QUANT"}
    plan = json.loads((out / "plan.json").read_text())
    rows = plan["layers"]["linears"]
    assert [x["name"] for x in rows] == LINEARS + ["lm_head"]
    assert {x["name"]: x["quant_algo"] for x in rows if x["name"] != "lm_head"} == {
        n: e["quant_algo"] for n, e in _layers(out / "checkpoint").items()}
    assert plan["layers"]["search"]["effective_bits_budget"] == 6.0
    metrics = json.loads((out / "gate" / "metrics.json").read_text())
    assert metrics["passed"] is True
    # the engine stage wrote the trtllm-build command for the MIXED_PRECISION checkpoint
    args = (out / "engine").glob("*")
    assert any(p.is_file() for p in args)


def test_sensitivity_prices_each_layer_in_its_own_format(mixed_export, smollm_2layers, tmp_path):
    """invoke sensitivity on a MIXED_PRECISION checkpoint: each cell is measured with its own format
    (FP8 input fake-quant or weight-only INT4) and its cost uses that format's bytes."""
    from precision_pipeline.spec.formats import linear_weight_bytes
    from precision_pipeline.spec.profile import deep_merge, load_raw, validate_profile
    from precision_pipeline.analysis.sensitivity import SensitivityOptions, SensitivityRuntime, run_sensitivity

    _, ck, _, _ = mixed_export
    golden = tmp_path / "golden.jsonl"
    golden.write_text(json.dumps({"id": "facts-t1", "category": "facts", "prompt": "What is the capital of France?",
                                  "answer": "The capital of France is Paris."}) + "\n")
    prof = validate_profile(deep_merge(load_raw("mixed-fp8-int4-h100"), {}))
    res = run_sensitivity(prof, smollm_2layers, tmp_path / "out", SensitivityOptions(golden_path=golden),
                          SensitivityRuntime(threads=1, progress=False), checkpoint_dir=ck, layers=[0, 1],
                          kinds=["attention.qkv", "mlp.proj"], verify=False)
    layers = _layers(ck)
    cells = res.data["cells"]
    for i in (0, 1):
        for kind, short in (("attention.qkv", "attention.qkv"), ("mlp.proj", "mlp.proj")):
            algo = layers[f"transformer.layers.{i}.{short}"]["quant_algo"]
            out, inp = OUT_IN[short]
            row = next(r for r in cells.values() if r["layer"] == i and r["kind"] == kind)
            assert row["quantized"] is True
            assert row["quantized_bytes"] == linear_weight_bytes(algo, inp, out, 64, dtype_bytes=2), (i, kind, algo)
            assert row["bf16_bytes"] == 2 * inp * out
            assert 0 <= row["kl_mean"] < 5
