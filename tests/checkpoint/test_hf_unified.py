"""ModelOpt's unified HF checkpoint (issue 28, the LLM-API route): the job's export format, the export, its
verification (``checkpoint/hf_verify.py``: one planted bad file per rule) and the gate's model of it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from precision_pipeline.checkpoint.reader import HF_QUANT_CONFIG, checkpoint_layout, safetensors_header
from precision_pipeline.core.errors import UserError
from tests.conftest import prof

# --------------------------------------------------------------------------------------------
# The job (fast)


def _plan(p, route=None):
    from precision_pipeline.resolve.plan import evaluate
    from precision_pipeline.spec.default_model import ensure_default_model

    plan = evaluate(p, ensure_default_model())
    assert plan.ok, plan.problems
    if route is None:
        return plan
    return SimpleNamespace(profile=plan.profile, model=plan.model, mapping=plan.mapping, route=route)


def test_the_route_sets_the_export_format_and_the_engine_route_keeps_its_own():
    from precision_pipeline.quantize.job import job_of

    assert job_of(_plan(prof("fp8-h100"))).export_format == "trtllm_checkpoint"  # no route attribute: engine
    assert job_of(_plan(prof("fp8-h100"), "engine")).export_format == "trtllm_checkpoint"
    hf = job_of(_plan(prof("fp8-h100"), "llm_api"))
    assert hf.export_format == "hf_unified"
    assert hf.model_copy(update={"export_format": "trtllm_checkpoint"}) == job_of(_plan(prof("fp8-h100")))


def test_int8_smoothquant_has_no_hf_export_and_is_refused_in_the_job():
    from precision_pipeline.quantize.job import job_of

    job_of(_plan(prof("int8-sq-l4"), "engine"))  # the engine route exports it
    with pytest.raises(UserError) as e:
        job_of(_plan(prof("int8-sq-l4"), "llm_api"))
    p = e.value.problems[0]
    assert p.field == "quantization.quant_algo" and "PR #345" in p.reason and "FP8" in p.fix


def test_the_export_format_is_keyed(tmp_path):
    from precision_pipeline.core.store import canonical
    from precision_pipeline.quantize.job import job_of

    job = job_of(_plan(prof("fp8-h100")))
    assert canonical(job)["export_format"] == "trtllm_checkpoint"
    assert canonical(job) != canonical(job.model_copy(update={"export_format": "hf_unified"}))


def test_checkpoint_layout_is_decided_by_hf_quant_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_layout(tmp_path) == "trtllm_checkpoint"
    (tmp_path / HF_QUANT_CONFIG).write_text("{}")
    assert checkpoint_layout(tmp_path) == "hf_unified"


def test_fused_fp8_requantization_is_the_runtimes():
    """``FP8QDQLinearMethod.load_weights_fused_qkv_linear``: max scale, parts dequantized in the model dtype and
    re-quantized; the part that has the max scale is unchanged, the other is rounded to the coarser grid."""
    import torch

    from precision_pipeline.checkpoint.codecs import fp8_e4m3_to_float, requantize_fp8_fused

    a = torch.tensor([[1.0, 0.5, 448.0]]).to(torch.float8_e4m3fn)
    b = torch.tensor([[1.125, 3.0, 0.0]]).to(torch.float8_e4m3fn)
    (qa, qb), s = requantize_fp8_fused([a, b], [torch.tensor(2.0), torch.tensor(1.0)], torch.bfloat16)
    assert s.item() == 2.0 and torch.equal(qa.view(torch.uint8), a.view(torch.uint8))
    assert (fp8_e4m3_to_float(qb) * s).tolist() == [[1.125, 3.0, 0.0]]  # 0.5625 and 1.5 are E4M3 codes
    (_, qb), _ = requantize_fp8_fused([a, torch.tensor([[1.0625]]).to(torch.float8_e4m3fn)],
                                      [torch.tensor(2.0), torch.tensor(1.0)], torch.bfloat16)
    assert fp8_e4m3_to_float(qb).item() * 2 == 1.0  # 1.0625 / 2 = 0.53125 is no E4M3 code: rounds to 0.5


# --------------------------------------------------------------------------------------------
# The export (slow: the fixture quantizes once per cache key)


@pytest.mark.slow
def test_the_hf_export_of_the_fp8_checkpoint(fp8_hf_checkpoint, fp8_checkpoint):
    from precision_pipeline.checkpoint.verify import verify_checkpoint

    d = fp8_hf_checkpoint
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "generation_config.json", HF_QUANT_CONFIG,
                                                   "model.safetensors"]
    hfq = json.loads((d / HF_QUANT_CONFIG).read_text())
    assert hfq["quantization"] == {"exclude_modules": ["lm_head", "model.embed_tokens"], "kv_cache_quant_algo": "FP8",
                                   "quant_algo": "FP8"}
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["quantization_config"]["quant_method"] == "modelopt"
    assert cfg["quantization_config"]["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    h = safetensors_header(d / "model.safetensors")
    dt = {k: v["dtype"] for k, v in h.items() if k != "__metadata__"}
    assert len(dt) == 30 * 25 + 2 and "lm_head.weight" not in dt  # tied: stored once, as the embedding
    assert dt["model.embed_tokens.weight"] == dt["model.norm.weight"] == "BF16"
    assert dt["model.layers.7.mlp.down_proj.weight"] == "F8_E4M3"
    assert dt["model.layers.7.mlp.down_proj.weight_scale"] == dt["model.layers.7.mlp.down_proj.input_scale"] == "F32"
    assert dt["model.layers.7.self_attn.k_proj.k_scale"] == dt["model.layers.7.self_attn.v_proj.v_scale"] == "F32"
    r = verify_checkpoint(d, {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"})
    assert (r["tensors"], r["scale_tensors"], r["linears"]) == (752, 30 * 7 * 2 + 60, 210)
    assert "hf.names" in r["rules"]


@pytest.mark.slow
def test_the_gate_reads_both_layouts_alike(fp8_hf_checkpoint, fp8_checkpoint, fp8_gates):
    """Same calibrated quantizers, two exports: the gate's models agree. Every activation scale is equal (q/k/v and
    gate/up take the max, as the runtime does); the weights differ in 2-7.5% of the elements by one FP8 step (measured:
    ModelOpt's TensorRT-LLM export rounds w/s from BF16 and re-quantizes the fused QKV from the float weight, the HF
    export rounds from FP32 and the runtime re-quantizes the FP8 parts), so the gate's numbers agree within their
    intervals (not to float tolerance: the two exports are different checkpoints of one calibration)."""
    import torch

    from precision_pipeline.checkpoint.hf_unified import RUNTIME_FP8_KV_SCALE, dequantize_hf_checkpoint
    from precision_pipeline.checkpoint.reader import dequantize_checkpoint

    a, b = dequantize_hf_checkpoint(fp8_hf_checkpoint), dequantize_checkpoint(fp8_checkpoint)
    assert set(a.linears) == set(b.linears) - {"lm_head"} and set(a.tensors) == set(b.tensors)
    for n, x in a.linears.items():
        y = b.linears[n]
        assert torch.equal(x.act_scale, y.act_scale) and x.quant_algo == y.quant_algo == "FP8", n
        assert (x.weight != y.weight).float().mean().item() < 0.1, n
    assert torch.equal(a.linears["transformer.layers.0.attention.qkv"].weight, b.linears["transformer.layers.0.attention.qkv"].weight)
    for i in range(30):
        assert torch.equal(a.kv_scales[i][0], b.kv_scales[i][0]) and a.kv_scales[i][1][0].item() == RUNTIME_FP8_KV_SCALE
    # the gate on a golden subset (``fp8_gates``, tests/conftest.py: ``gate_checkpoint`` of both exports on the
    # ``GATE_SUBSET`` of tests/gate/test_gate.py, HF export first): one reference (not keyed by the route), the second
    # run reads the entry of the gate's cache that the first one read or wrote; numbers within each other's intervals.
    trt, hf = fp8_gates["engine"], fp8_gates["llm_api"]
    assert trt.metrics["reference_cache"]["hit"] is True
    assert hf.metrics["reference_cache"]["key"] == trt.metrics["reference_cache"]["key"]
    assert hf.metrics["checkpoint_quantization"]["quant_algo"] == "FP8" and hf.metrics["scales"] is None
    mt, mh = trt.metrics["metrics"], hf.metrics["metrics"]
    lo, hi = mt["kl_mean"]["ci95"]
    assert lo <= mh["kl_mean"]["value"] <= hi, (mh["kl_mean"], mt["kl_mean"])
    lo, hi = mh["kl_mean"]["ci95"]
    assert lo <= mt["kl_mean"]["value"] <= hi, (mh["kl_mean"], mt["kl_mean"])
    for name in ("kl_p99", "top1"):  # a tail statistic on 1 prompt per category: the intervals overlap
        (a, b), (c, e) = mt[name]["ci95"], mh[name]["ci95"]
        assert max(a, c) <= min(b, e), (name, mt[name], mh[name])
    # held-out perplexity over 128 tokens has no interval and swings (measured here: +1.4% vs +5.5%; the full
    # held-out text: +5.25% vs +2.63%, README): not compared on this subset
    # nor the verdict: on 1 prompt per category KL P99 (a tail) crossed the fp8-h100 bar for one export and not the
    # other (measured); on the full golden set both pass (README)


# --------------------------------------------------------------------------------------------
# Verification: one planted bad file per rule (a 2-layer copy of the export)


@pytest.fixture(scope="module")
def small_hf(fp8_hf_checkpoint, tmp_path_factory) -> Path:
    """The FP8 HF export cut to its first 2 layers (config.json says so): what the rules read, small to copy."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("hf2")
    st = load_file(str(fp8_hf_checkpoint / "model.safetensors"))
    keep = {k: v for k, v in st.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2}
    save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((fp8_hf_checkpoint / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (out / "config.json").write_text(json.dumps(cfg))
    shutil.copy2(fp8_hf_checkpoint / HF_QUANT_CONFIG, out / HF_QUANT_CONFIG)
    return out


def plant(src: Path, dst: Path, tensors=None, hfq=None, cfg=None, quant_cfg=None) -> Path:
    """A copy of ``src`` with its tensors / hf_quant_config.json / config.json changed in place by the callables
    (dict -> None), and ``quant_cfg`` (a dict) written as quant_cfg.json."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for name, fn in ((HF_QUANT_CONFIG, hfq), ("config.json", cfg)):
        if fn is not None:
            doc = json.loads((dst / name).read_text())
            fn(doc)
            (dst / name).write_text(json.dumps(doc))
    if quant_cfg is not None:
        (dst / "quant_cfg.json").write_text(json.dumps(quant_cfg))
    if tensors is not None:
        st = load_file(str(dst / "model.safetensors"))
        tensors(st)
        save_file(st, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def refusal(d: Path, expect=None) -> list:
    from precision_pipeline.checkpoint.verify import verify_checkpoint

    with pytest.raises(UserError) as e:
        verify_checkpoint(d, expect)
    return [(p.rule, p.field, p.reason) for p in e.value.problems]


def _mixed(doc: dict) -> None:
    q = doc.get("quantization", doc)
    q["quant_algo"] = "MIXED_PRECISION"
    q["quantized_layers"] = {f"model.layers.{i}.{m}": {"quant_algo": "FP8"} for i in range(2) for m in
                             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def _set(t, name, value):
    import torch

    t[name] = torch.tensor(value, dtype=torch.float32)


PLANTS = {
    # rule: (what is planted, expected field fragment)
    "inline_quant_algo": ("hf.metadata", dict(cfg=lambda c: c["quantization_config"].update(quant_algo="NVFP4")),
                          "quantization_config.quant_algo"),
    "inline_kv_missing": ("hf.metadata", dict(cfg=lambda c: c["quantization_config"].pop("kv_cache_scheme")),
                          "quantization_config.kv_cache_quant_algo"),
    "inline_ignore": ("hf.metadata", dict(cfg=lambda c: c["quantization_config"].update(ignore=["lm_head"])),
                      "quantization_config.ignore"),
    "inline_missing": ("hf.metadata", dict(cfg=lambda c: c.pop("quantization_config")), "config.json: quantization_config"),
    "mixed_kv_differs": ("hf.metadata", dict(hfq=_mixed, cfg=lambda c: _mixed(c["quantization_config"]),
                                             quant_cfg={"kv_cache_quant_algo": "NVFP4", "quantized_layers": {}}),
                         "quant_cfg.json: kv_cache_quant_algo"),
    "exclude_matches_nothing": ("hf.names", dict(
        hfq=lambda d: d["quantization"]["exclude_modules"].append("model.layers.*.self_attn.qkv_proj"),
        cfg=lambda c: c["quantization_config"]["ignore"].append("model.layers.*.self_attn.qkv_proj")), "qkv_proj"),
    "layer_name_matches_nothing": ("hf.names", dict(
        hfq=lambda d: (_mixed(d), d["quantization"]["quantized_layers"].update({"model.layers.0.mlp.fc": {"quant_algo": "FP8"}})),
        cfg=lambda c: (_mixed(c["quantization_config"]),
                       c["quantization_config"]["quantized_layers"].update({"model.layers.0.mlp.fc": {"quant_algo": "FP8"}}))),
        "quantized_layers.model.layers.0.mlp.fc"),
    "leftover_buffer": ("hf.known_tensors", dict(
        tensors=lambda t: _set(t, "model.layers.0.self_attn.q_proj.input_quantizer._amax", 3.0)), "input_quantizer._amax"),
    "scale_dtype": ("hf.layout", dict(tensors=lambda t: t.update({"model.layers.1.mlp.up_proj.weight_scale":
                                                                  t["model.layers.1.mlp.up_proj.weight_scale"].bfloat16()})),
                    "mlp.up_proj.weight_scale"),
    "weight_unquantized": ("hf.layout", dict(tensors=lambda t: t.update({"model.layers.0.mlp.down_proj.weight":
                                                                         t["model.layers.0.mlp.down_proj.weight"].bfloat16()})),
                           "mlp.down_proj.weight"),
    "input_scale_missing": ("hf.layout", dict(tensors=lambda t: t.pop("model.layers.0.self_attn.o_proj.input_scale")),
                            "o_proj.input_scale"),
    "kv_scale_missing": ("hf.kv_scales", dict(tensors=lambda t: t.pop("model.layers.1.self_attn.v_proj.v_scale")),
                         "layers.1.self_attn.v_proj.v_scale"),
    "scale_nan": ("hf.scales_finite", dict(tensors=lambda t: _set(t, "model.layers.0.mlp.gate_proj.weight_scale", math.nan)),
                  "gate_proj.weight_scale"),
    "scale_zero": ("hf.scales_finite", dict(tensors=lambda t: _set(t, "model.layers.1.self_attn.k_proj.k_scale", 0.0)),
                   "k_proj.k_scale"),
    "fused_input_scales": ("hf.fused_scales", dict(tensors=lambda t: t.update({"model.layers.0.self_attn.k_proj.input_scale":
                                                                               t["model.layers.0.self_attn.k_proj.input_scale"] * 2})),
                           "model.layers.0.self_attn.q_proj.input_scale"),
}


@pytest.mark.slow
def test_the_untouched_small_copy_verifies(small_hf):
    from precision_pipeline.checkpoint.verify import verify_checkpoint

    assert verify_checkpoint(small_hf, {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"})["linears"] == 14


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(PLANTS))
def test_a_planted_bad_checkpoint_is_refused_by_its_rule(small_hf, tmp_path, case):
    rule, kw, where = PLANTS[case]
    got = refusal(plant(small_hf, tmp_path / "ck", **kw))
    assert any(r == rule and where in f for r, f, _ in got), got


@pytest.mark.slow
def test_the_plan_must_match_the_checkpoint(small_hf):
    got = refusal(small_hf, {"quant_algo": "FP8", "kv_cache_quant_algo": "NONE"})
    assert got[0][0] == "hf.metadata" and "the plan" in got[0][2]


@pytest.mark.slow
@pytest.mark.parametrize("profile,algo,group", [("nvfp4-b200", "NVFP4", 16), ("int4-awq-a100", "W4A16_AWQ", 64)])
def test_nvfp4_and_int4_awq_hf_exports_verify(smollm_2layers, tmp_path, profile, algo, group):
    """ModelOpt 0.47 exports NVFP4 (+ FP8 KV) and W4A16 AWQ as unified HF checkpoints (2-layer model, 4 x 32
    calibration): the layout the codecs describe under the HF names, metadata that agree (the export writes
    group_size into config.json's inline config, which ModelOpt's flat form leaves out), verification passes; the
    gate's reader refuses what it does not model (fused NVFP4/AWQ groups), naming the engine route."""
    from precision_pipeline.checkpoint.hf_unified import dequantize_hf_checkpoint
    from precision_pipeline.checkpoint.verify import verify_checkpoint
    from precision_pipeline.quantize.ptq import export_checkpoint, quantize_model
    from precision_pipeline.spec.profile import deep_merge, load_raw, validate_profile
    from tests.conftest import quantize_job

    p = validate_profile(deep_merge(load_raw(profile), {"calibration": {"num_samples": 4, "seq_len": 32}}))
    job = quantize_job(p, smollm_2layers).model_copy(update={"export_format": "hf_unified"})
    res = export_checkpoint(quantize_model(job, smollm_2layers, show_progress=False), tmp_path / "ck")
    d = tmp_path / "ck"
    assert res.quant_algo == algo and res.group_size == group and res.checkpoint_bytes == (d / "model.safetensors").stat().st_size
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["quantization_config"]["group_size"] == group and cfg["quantization_config"]["quant_algo"] == algo
    h = safetensors_header(d / "model.safetensors")
    w, s = h["model.layers.1.mlp.down_proj.weight"], h["model.layers.1.mlp.down_proj.weight_scale"]
    if algo == "NVFP4":
        assert (w["dtype"], w["shape"], s["dtype"], s["shape"]) == ("U8", [576, 768], "F8_E4M3", [576, 96])
        assert h["model.layers.1.mlp.down_proj.weight_scale_2"]["shape"] == [] and "model.layers.1.self_attn.k_proj.k_scale" in h
    else:  # INT4 packed along the output dim as U8; the shared-input pre-quant scales folded into the norms
        assert (w["dtype"], w["shape"], s["dtype"], s["shape"]) == ("U8", [288, 1536], "F32", [576, 24])
        assert "model.layers.1.self_attn.o_proj.pre_quant_scale" in h and "model.layers.1.self_attn.q_proj.pre_quant_scale" not in h
    r = verify_checkpoint(d, {"quant_algo": algo, "kv_cache_quant_algo": p.quantization.kv_cache_quant_algo.value})
    assert r["linears"] == 14
    with pytest.raises(UserError, match="engine route"):
        dequantize_hf_checkpoint(d)


@pytest.mark.slow
def test_the_quantize_stage_reads_an_hf_checkpoint_back(fp8_hf_checkpoint, tmp_path):
    """The stage's artifact from an HF checkpoint (here reused, ``--checkpoint``): formats from hf_quant_config.json,
    bytes of model.safetensors, the layer table by HF module."""
    from precision_pipeline.core.fingerprint import fingerprint
    from precision_pipeline.quantize.stage import QuantizeStage, ReuseInputs

    work = tmp_path / "checkpoint"
    work.mkdir()
    art = QuantizeStage().run(ReuseInputs(checkpoint=fingerprint(fp8_hf_checkpoint)), work)
    assert (art.quant_algo, art.kv_cache_quant_algo) == ("FP8", "FP8")
    assert art.checkpoint_bytes == (fp8_hf_checkpoint / "model.safetensors").stat().st_size
    rows = {r["name"]: r for r in art.layers["linears"]}
    assert len(rows) == 210 and rows["model.layers.3.mlp.up_proj"]["quant_algo"] == "FP8"
    assert rows["model.layers.3.mlp.up_proj"]["params"] == 1536 * 576
    assert art.present(tmp_path)
