"""The verify stage (checkpoint/verify.py): every exported format passes; damaged copies of the test
checkpoints are refused with exit 2 naming the tensor or file and the rule, before the gate runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from precision_pipeline.checkpoint.verify import RULES, verify_checkpoint
from precision_pipeline.core.errors import EXIT_INVALID, UserError

FORMATS = ["fp8_checkpoint", "bf16_checkpoint", "int4_awq_checkpoint", "nvfp4_checkpoint", "int8_sq_checkpoint",
           "w8a16_checkpoint", "w4a8_awq_checkpoint", "fp8_tp3_checkpoint"]


def damaged(ckpt: Path, dst: Path, edit_tensors=None, edit_config=None, files: dict | None = None) -> Path:
    """A copy of checkpoint ``ckpt`` (every rank file and metadata file) with rank 0's tensors and
    config.json edited in place, and ``files`` ({name: JSON}) written beside them."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    for p in Path(ckpt).iterdir():
        if p.name != "rank0.safetensors" or edit_tensors is None:
            shutil.copy(p, dst / p.name)
    if edit_tensors is not None:
        t = load_file(str(Path(ckpt) / "rank0.safetensors"))
        edit_tensors(t)
        save_file(t, str(dst / "rank0.safetensors"))
    if edit_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    for name, doc in (files or {}).items():
        (dst / name).write_text(json.dumps(doc))
    return dst


def refusal(ckpt: Path, expect=None) -> UserError:
    with pytest.raises(UserError) as e:
        verify_checkpoint(ckpt, expect)
    assert e.value.exit_code == EXIT_INVALID
    return e.value


@pytest.mark.parametrize("fixture", FORMATS)
def test_every_exported_format_verifies(request, fixture):
    ckpt = request.getfixturevalue(fixture)
    cfg = json.loads((ckpt / "config.json").read_text())
    r = verify_checkpoint(ckpt, cfg["quantization"])
    assert r["linears"] == 151 * cfg["mapping"]["tp_size"]  # 30 layers x 5 + lm_head, per rank
    assert r["rules"] == sorted(RULES)


def test_fp8_counts_and_cost(fp8_checkpoint):
    r = verify_checkpoint(fp8_checkpoint, {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"})
    # 30 layers x (5 linears x (weight + 2 scales) + 2 norms + 3 KV scales) + embedding, ln_f, lm_head
    assert (r["tensors"], r["scale_tensors"], r["scale_values"], r["scale_bytes"]) == (603, 390, 390, 1560)
    assert r["seconds"] < 1.0


def test_block_scale_cut_to_half_is_refused(nvfp4_checkpoint, tmp_path):
    name = "transformer.layers.3.attention.qkv.weights_scaling_factor"

    def cut(t):
        assert list(t[name].shape) == [960, 36]
        t[name] = t[name][:480].clone()
    e = refusal(damaged(nvfp4_checkpoint, tmp_path / "c", cut))
    [p] = e.problems
    assert p.field == f"{name} (rank0.safetensors)" and p.rule == "verify.layout"
    assert "is F8_E4M3 [480, 36]; NVFP4 stores F8_E4M3 [960, 36] for this rank's [960, 576] slice" in p.reason
    assert "one FP8 scale per 16 inputs" in p.reason and p.fix


def test_awq_group_scale_and_packing_are_checked(int4_awq_checkpoint, tmp_path):
    w = "transformer.layers.0.mlp.proj.weight"

    def unpack(t):  # a weight stored unpacked ([out, in] instead of [out/2, in]) and a scale of another group size
        t[w] = t[w].repeat(2, 1).contiguous()
        t["transformer.layers.1.mlp.proj.weights_scaling_factor"] = t["transformer.layers.1.mlp.proj.weights_scaling_factor"][:, :12].clone()
    e = refusal(damaged(int4_awq_checkpoint, tmp_path / "c", unpack))
    got = {p.field: p.reason for p in e.problems}
    assert "is I8 [576, 1536]; W4A16_AWQ stores I8 [288, 1536]" in got[f"{w} (rank0.safetensors)"]
    assert "(group_size 64)" in got["transformer.layers.1.mlp.proj.weights_scaling_factor (rank0.safetensors)"]


def test_disagreeing_scales_in_a_fused_group_are_refused(fp8_checkpoint, tmp_path):
    name = "transformer.layers.2.mlp.gate.weights_scaling_factor"

    def scale(t):
        t[name] = t[name] * 2
    e = refusal(damaged(fp8_checkpoint, tmp_path / "c", scale))
    [p] = e.problems
    assert p.field == f"{name} (rank0.safetensors)" and p.rule == "verify.fused_scales"
    assert "but transformer.layers.2.mlp.fc.weights_scaling_factor is" in p.reason and "fuse_gate_mlp" in p.reason


def test_qkv_activation_scale_must_agree_over_ranks(fp8_tp3_checkpoint, tmp_path):
    name = "transformer.layers.4.attention.qkv.activation_scaling_factor"

    def scale(t):
        t[name] = t[name] * 1.5
    e = refusal(damaged(fp8_tp3_checkpoint, tmp_path / "c", scale))
    assert [(p.field, p.rule) for p in e.problems] == [(name, "verify.fused_scales")]
    assert "differs over the 3 ranks" in e.problems[0].reason


def test_metadata_files_disagreeing_about_the_kv_format_are_refused(fp8_checkpoint, tmp_path):
    c = damaged(fp8_checkpoint, tmp_path / "c", files={"quant_cfg.json": {"quant_algo": "FP8", "kv_cache_quant_algo": None,
                                                                          "quantized_layers": {}}})
    [p] = refusal(c).problems
    assert p.field == "quant_cfg.json: kv_cache_quant_algo" and p.rule == "verify.metadata"
    assert "says NONE but config.json quantization.kv_cache_quant_algo says FP8" in p.reason


def test_config_without_the_kv_format_its_tensors_carry_is_refused(fp8_checkpoint, tmp_path):
    c = damaged(fp8_checkpoint, tmp_path / "c", edit_config=lambda cfg: cfg["quantization"].update(kv_cache_quant_algo=None))
    e = refusal(c)
    assert {p.rule for p in e.problems[:-1]} == {"verify.metadata"} and len(e.problems) == 13
    assert e.problems[0].field == "transformer.layers.0.attention.k_cache_scaling_factor (rank0.safetensors)"
    assert "kv_cache_quant_algo NONE" in e.problems[0].reason
    assert "more problems" in e.problems[-1].reason  # 90 KV tensors: the first 12 are listed, then the count


def test_checkpoint_and_plan_disagreeing_are_refused(fp8_checkpoint):
    [p] = refusal(fp8_checkpoint, {"quant_algo": "FP8", "kv_cache_quant_algo": "NONE"}).problems
    assert p.field == "config.json: quantization.kv_cache_quant_algo"
    assert "is FP8 but the plan (profile quantization.kv_cache_quant_algo) is NONE" in p.reason


def test_leftover_modelopt_buffer_and_excluded_scale_are_named(fp8_checkpoint, tmp_path):
    import torch

    def add(t):
        t["transformer.layers.0.mlp.fc.input_quantizer._amax"] = torch.ones(1)
        t["lm_head.weights_scaling_factor"] = torch.ones(1)  # lm_head is in exclude_modules
    got = {p.field: (p.rule, p.reason) for p in refusal(damaged(fp8_checkpoint, tmp_path / "c", add)).problems}
    rule, reason = got["transformer.layers.0.mlp.fc.input_quantizer._amax (rank0.safetensors)"]
    assert rule == "verify.known_tensors" and "ModelOpt internal buffer" in reason
    rule, reason = got["lm_head.weights_scaling_factor (rank0.safetensors)"]
    assert rule == "verify.exclusions" and "excluded" in reason


def test_nonfinite_and_zero_scales_are_refused(fp8_checkpoint, tmp_path):
    def bad(t):
        t["transformer.layers.5.mlp.proj.activation_scaling_factor"][0] = float("nan")
        t["transformer.layers.6.attention.dense.weights_scaling_factor"][0] = 0.0
    got = {p.field: (p.rule, p.reason) for p in refusal(damaged(fp8_checkpoint, tmp_path / "c", bad)).problems}
    assert got["transformer.layers.5.mlp.proj.activation_scaling_factor (rank0.safetensors)"] == (
        "verify.scales_finite", "has 1 NaN/inf of 1 values.")
    assert got["transformer.layers.6.attention.dense.weights_scaling_factor (rank0.safetensors)"][1].startswith("is 0;")


def test_verify_stage_sits_between_quantize_and_gate_and_refuses(fp8_checkpoint, tmp_path):
    from precision_pipeline.checkpoint.stage import VerifyInputs, VerifyStage
    from precision_pipeline.core.fingerprint import Fingerprint
    from precision_pipeline.pipeline import ROUTES

    names = [s.name for s in ROUTES["engine"].stages]
    assert names.index("quantize") + 1 == names.index("verify") == names.index("gate") - 1
    ok = VerifyStage().run(VerifyInputs(checkpoint=Fingerprint(sha256="0" * 64, path=fp8_checkpoint), quant_algo="FP8",
                                        kv_cache_quant_algo="FP8"), None)
    assert ok.summary()["linears"] == 151 and ok.status == "done"
    with pytest.raises(UserError, match="kv_cache_quant_algo"):
        VerifyStage().run(VerifyInputs(checkpoint=Fingerprint(sha256="0" * 64, path=fp8_checkpoint), quant_algo="FP8",
                                       kv_cache_quant_algo="NONE"), None)


@pytest.mark.slow
def test_build_with_a_damaged_checkpoint_exits_2_naming_the_tensor(fp8_checkpoint, tmp_path):
    from tests.test_cli import run_task

    name = "transformer.layers.2.mlp.gate.activation_scaling_factor"

    def scale(t):
        t[name] = t[name] * 3
    c = damaged(fp8_checkpoint, tmp_path / "c", scale)
    out = tmp_path / "out"
    r = run_task("build", "--profile", "fp8-h100", "--checkpoint", str(c), "--out", str(out), "--golden-limit", "1")
    text = r.stdout + r.stderr
    assert r.returncode == 2, text
    assert name in text and "verify.fused_scales" in text and "fix:" in text and "Traceback" not in text
    assert not (out / "gate").exists()


def test_layout_table_per_exported_format():
    """The layouts verify checks (codecs.Codec.layout), for a linear [out 256, in 128] at the default group
    (128): shared/reference/trtllm-1.2-build-reference.md section 7 (ModelOpt 0.47 export, measured)."""
    from precision_pipeline.checkpoint.codecs import CODECS
    from precision_pipeline.spec.formats import GEMM

    def table(algo):
        f = GEMM[algo]
        return {k: s.text() for k, s in CODECS[f.codec].layout(f, 256, 128, None).items()}

    assert table("FP8") == {"weight": "F8_E4M3 [256, 128]", "weights_scaling_factor": "F32 [] or [1] or [256]",
                            "activation_scaling_factor": "F32 [] or [1]"}
    assert table("NVFP4") == {"weight": "U8 [256, 64]", "weights_scaling_factor": "F8_E4M3 [256, 8]",
                              "weights_scaling_factor_2": "F32 [] or [1]", "activation_scaling_factor": "F32 [] or [1]"}
    assert table("W4A16_AWQ") == {"weight": "I8 [128, 128]", "weights_scaling_factor": "F32 [256, 1]",
                                  "prequant_scaling_factor": "BF16/F16/F32 [128]"}
    assert table("W4A8_AWQ") == {**table("W4A16_AWQ"), "weights_scaling_factor_2": "F32 [] or [1]",
                                 "activation_scaling_factor": "F32 [] or [1]"}
    assert table("W8A8_SQ_PER_CHANNEL") == {"weight": "I8 [256, 128]", "weights_scaling_factor": "F32 [256]",
                                            "activation_scaling_factor": "F32 [] or [1]",
                                            "prequant_scaling_factor": "BF16/F16/F32 [128]"}
    assert table("W8A16") == {"weight": "I8 [256, 128]", "weights_scaling_factor": "F32 [256]"}
    assert table("NO_QUANT") == {"weight": "BF16/F16/F32 [256, 128]"}


def _mixed(fp8: Path, awq: Path, dst: Path, gate_awq_layer: int | None = None) -> Path:
    """A MIXED_PRECISION checkpoint made of two exported ones (no quantization run): layers 0-14 from the
    FP8 checkpoint, 15-29 from the W4A16_AWQ one (group 64), FP8 KV scales everywhere, lm_head unquantized.
    ``gate_awq_layer``: that FP8 layer's mlp.gate taken from the AWQ checkpoint (a split fused group)."""
    from safetensors.torch import load_file, save_file

    a, b = load_file(str(fp8 / "rank0.safetensors")), load_file(str(awq / "rank0.safetensors"))
    out, layers = {}, {}
    for name, t in a.items():
        if not name.startswith("transformer.layers.") or "cache_scaling_factor" in name or "layernorm" in name:
            out[name] = t
    for i in range(30):
        src, algo = (a, {"quant_algo": "FP8"}) if i < 15 else (b, {"quant_algo": "W4A16_AWQ", "group_size": 64})
        for lin in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"):
            stem = f"transformer.layers.{i}.{lin}"
            s, al = (b, {"quant_algo": "W4A16_AWQ", "group_size": 64}) if (i == gate_awq_layer and lin == "mlp.gate") else (src, algo)
            out.update({k: v for k, v in s.items() if k.startswith(stem + ".")})
            layers[stem] = al
    dst.mkdir()
    save_file(out, str(dst / "rank0.safetensors"))
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization"] = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "quant_cfg.json").write_text(json.dumps({"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8",
                                                    "quantized_layers": layers}))
    return dst


def test_mixed_precision_checkpoint_verifies_and_a_split_fused_group_is_refused(fp8_checkpoint, int4_awq_checkpoint, tmp_path):
    r = verify_checkpoint(_mixed(fp8_checkpoint, int4_awq_checkpoint, tmp_path / "m"),
                          {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8"})
    assert r["linears"] == 151 and "quant_cfg.json" in r["files"]
    e = refusal(_mixed(fp8_checkpoint, int4_awq_checkpoint, tmp_path / "bad", gate_awq_layer=3))
    assert [(p.field, p.rule) for p in e.problems] == [("transformer.layers.3.mlp.gate (rank0.safetensors)", "verify.fused_scales")]
    assert "is W4A16_AWQ but transformer.layers.3.mlp.fc is FP8" in e.problems[0].reason
