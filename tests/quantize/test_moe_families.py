"""Issue 29, tiny random-initialised MoE models built from each family's config (no download): structure and
refusals, not quality. Random weights and random tokens are acceptable ONLY here (layout tests).

* Qwen3-MoE: ModelOpt 0.47 quantizes and exports it (unified HF, FP8) on CPU with the router kept BF16 and excluded;
  verification passes it (experts' FP8 layout, router unquantized), the gate's MoE reader (gate/moe_model.py) loads it
  and the gate's metrics against the unquantized model are finite and small; verification refuses the same
  checkpoint with the router planted quantized.
* Qwen3 (dense, QK-norm), Mixtral, Qwen2-MoE (shared expert and its gate), like Qwen3-MoE: built through ``invoke
  build`` on route llm_api with FP8 (``Family.hf_read``: unified HF export, hf_verify, the gate's HF reader), a kept
  module planted FP8 refused, the engine route refused.
* gpt-oss: experts stored as MXFP4 in gpt-oss's own layout (``*_blocks`` / ``*_scales``, made by ModelOpt's
  ``MXFP4QTensor``), decoded on CPU by the codec and compared with the unquantized model by the gate's metrics; that
  checkpoint (as gpt-oss ships it) built through ``invoke build`` on route llm_api with W4A16_MXFP4 (``--checkpoint``),
  planted bad ones refused (checkpoint/mxfp4_verify.py)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from precision_pipeline.core.errors import UserError
from precision_pipeline.spec import families as FAM

pytestmark = pytest.mark.slow  # ModelOpt + transformers imports and a calibration pass: ~10-60 s on a loaded machine


def _tokens(vocab: int, n: int = 4, seq: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(29)
    return [torch.randint(0, vocab, (1, seq), generator=g) for _ in range(n)]


def test_tiny_qwen3_moe_exports_with_the_router_bf16_and_verification_refuses_a_quantized_one(tmp_path):
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from precision_pipeline.checkpoint.hf_unified import hf_headers
    from precision_pipeline.checkpoint.hf_verify import verify_hf_checkpoint

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=256, max_position_embeddings=128, decoder_sparse_step=1,
                         mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"])
    model = Qwen3MoeForCausalLM(cfg).eval()
    ref = copy.deepcopy(model)
    cfg.save_pretrained(tmp_path / "hf")
    batches = _tokens(256)

    def loop(m):
        with torch.no_grad():
            for b in batches:
                m(b)

    mtq.quantize(model, copy.deepcopy(mtq.FP8_DEFAULT_CFG), loop)
    out = tmp_path / "qwen3moe_fp8"
    export_hf_checkpoint(model, export_dir=out)
    sd = load_file(str(next(out.glob("*.safetensors"))))
    routers = sorted(n for n in sd if n.endswith("mlp.gate.weight"))
    assert routers == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    assert {sd[n].dtype for n in routers} != {torch.float8_e4m3fn}  # the router kept in the model dtype
    assert not [n for n in sd if ".mlp.gate." in n and not n.endswith("gate.weight")]  # no router scales
    assert sd["model.layers.0.mlp.experts.0.up_proj.weight"].dtype == torch.float8_e4m3fn  # experts quantized
    hf_q = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hf_q["quant_algo"] == "FP8" and any("mlp.gate" in p for p in hf_q["exclude_modules"])
    header = {n: meta["dtype"] for n, (_, meta) in hf_headers(out).items()}
    assert header["model.layers.0.mlp.gate.weight"] in ("BF16", "F32") and FAM.router_problems(FAM.QWEN3_MOE, header) == []
    # the verifier passes it: 2 layers x (4 attention + 4 experts x 3) linears + lm_head; the router is no linear
    rep = verify_hf_checkpoint(out, {"quant_algo": "FP8", "kv_cache_quant_algo": None})
    assert (rep["linears"], rep["tensors"]) == (33, len(sd))
    # the gate's MoE reader: FP8 experts dequantized, the router as stored; the gate's metrics vs the BF16-free reference
    from precision_pipeline.gate.metrics import kl_summary, token_metrics
    from precision_pipeline.gate.model import QuantLinear
    from precision_pipeline.gate.moe_model import load_hf_moe_model

    cand = load_hf_moe_model(out, tmp_path / "hf")
    e0 = cand.model.layers[0].mlp.experts[0].up_proj
    assert isinstance(e0, QuantLinear) and e0.act_format == "fp8"
    assert type(cand.model.layers[0].mlp.gate) is torch.nn.Linear  # the router: a plain linear, stored weights
    assert torch.equal(cand.model.layers[0].mlp.gate.weight, sd["model.layers.0.mlp.gate.weight"].float())
    toks = torch.cat(_tokens(256, n=2, seq=24), dim=1)
    with torch.no_grad():
        tm = token_metrics(ref(toks).logits[0], cand(toks).logits[0])
    s = kl_summary(tm.kl)
    assert all(math.isfinite(v) for v in s.values()) and 0 < s["kl_mean"] < 0.05 and tm.top1.mean() > 0.8, s
    print(f"tiny Qwen3-MoE FP8 vs FP32: KL mean {s['kl_mean']:.4g}, P99 {s['kl_p99']:.4g}, top-1 {tm.top1.mean():.3f}")
    # planted: the router stored FP8 with a scale beside it
    f = next(out.glob("*.safetensors"))
    sd["model.layers.1.mlp.gate.weight"] = sd["model.layers.1.mlp.gate.weight"].float().to(torch.float8_e4m3fn)
    sd["model.layers.1.mlp.gate.weight_scale"] = torch.tensor(1.0)
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(UserError) as e:
        verify_hf_checkpoint(out)
    found = {(p.field, p.rule) for p in e.value.problems}
    assert found == {("model.layers.1.mlp.gate.weight", "hf.router"), ("model.layers.1.mlp.gate.weight_scale", "hf.router")}
    assert "*mlp.gate" in e.value.problems[0].fix


def _mxfp4_blocks(w_out_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gpt-oss's stored layout of ``[E, out, in]`` weights: (blocks [E, out, in/32, 16], scales [E, out, in/32]), made
    by ModelOpt's MXFP4 quantizer, and ModelOpt's own dequantization."""
    from modelopt.torch.quantization.qtensor import MXFP4QTensor

    e, o, i = w_out_in.shape
    q, s = MXFP4QTensor.quantize(w_out_in, 32)
    theirs = q.dequantize(dtype=torch.float32, scale=s, block_sizes={-1: 32})
    return q._quantized_data.reshape(e, o, i // 32, 16), s.reshape(e, o, i // 32), theirs


def test_tiny_gpt_oss_with_mxfp4_experts_is_gated_through_the_codec(tmp_path):
    from transformers import GptOssConfig, GptOssForCausalLM

    from precision_pipeline.checkpoint.codecs import dequant_mx_blocks
    from precision_pipeline.gate.metrics import kl_summary, token_metrics

    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                       sliding_window=8, max_position_embeddings=128, architectures=["GptOssForCausalLM"])
    assert cfg.layer_types == ["sliding_attention", "full_attention"]  # alternating sliding window
    ref = GptOssForCausalLM(cfg).eval()
    cand = copy.deepcopy(ref)
    n_codes = 0
    shipped = {}  # gpt-oss's checkpoint as shipped: expert projections as <stem>_blocks / <stem>_scales
    for i, layer in enumerate(cand.model.layers):
        assert layer.self_attn.sinks.shape == (4,)  # attention sinks: one logit per head
        ex = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(ex, name)  # [E, in, out]
            blocks, scales, theirs = _mxfp4_blocks(p.data.transpose(1, 2).contiguous())
            w = dequant_mx_blocks(blocks, scales, f"mlp.experts.{name}")  # [E, out, in]
            assert torch.equal(w, theirs)
            shipped[f"model.layers.{i}.mlp.experts.{name}_blocks"] = blocks
            shipped[f"model.layers.{i}.mlp.experts.{name}_scales"] = scales
            p.data = w.transpose(1, 2).contiguous()
            n_codes += blocks.numel() * 2
    assert n_codes == 2 * 4 * (64 * 128 + 64 * 64)  # every expert weight went through MXFP4
    toks = torch.cat(_tokens(256, n=2, seq=24), dim=1)
    with torch.no_grad():
        lr, lc = ref(toks).logits[0], cand(toks).logits[0]
    tm = token_metrics(lr, lc)
    s = kl_summary(tm.kl)
    assert 0 < s["kl_mean"] < 1.0 and tm.top1.mean() > 0.5, (s, tm.top1.mean())
    print(f"tiny gpt-oss MXFP4 experts vs FP32: KL mean {s['kl_mean']:.4g}, P99 {s['kl_p99']:.4g}, "
          f"top-1 {tm.top1.mean():.3f}")
    # the gate's reader of the shipped layout (gate/moe_model.py load_gpt_oss_mxfp4): the same model, the same logits
    from safetensors.torch import save_file

    from precision_pipeline.gate.moe_model import load_gpt_oss_mxfp4

    sd = {k: v.contiguous() for k, v in ref.state_dict().items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    sd.update(shipped)
    ck = tmp_path / "gpt-oss"
    cfg.save_pretrained(ck)
    raw = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**raw, "quantization_config": {"quant_method": "mxfp4"}}))
    save_file(sd, str(ck / "model.safetensors"), metadata={"format": "pt"})
    read = load_gpt_oss_mxfp4(ck)
    gu = read.model.layers[1].mlp.experts.gate_up_proj
    assert torch.equal(gu, cand.model.layers[1].mlp.experts.gate_up_proj) and gu.shape == (4, 64, 128)
    with torch.no_grad():
        lr2 = read(toks).logits[0]
    assert torch.allclose(lr2, lc, atol=1e-5, rtol=0), (lr2 - lc).abs().max()
    tm2 = token_metrics(lr, lr2)
    assert abs(kl_summary(tm2.kl)["kl_mean"] - s["kl_mean"]) < 1e-6 and math.isfinite(kl_summary(tm2.kl)["kl_p99"])
    del sd["model.layers.0.mlp.experts.down_proj_scales"]  # a block without its scales: refused, named
    save_file(sd, str(ck / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match="down_proj_blocks has no model.layers.0.mlp.experts.down_proj_scales"):
        load_gpt_oss_mxfp4(ck)


_TINY = {  # the tiny models' sizes (2 layers, hidden 64, 4 heads / 2 KV heads of 16; MoE: 4 experts, top-2) by family
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                                   num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(intermediate_size=128)),
    "MixtralForCausalLM": ("MixtralConfig", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", dict(intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                                   num_experts_per_tok=2, shared_expert_intermediate_size=48,
                                                   decoder_sparse_step=1, mlp_only_layers=[])),
}


def _tiny_model_dir(root, vocab_from, arch="Qwen3MoeForCausalLM"):
    """A tiny random HF folder of family ``arch`` (``_TINY``: 2 layers, hidden 64; a MoE with 4 experts, top-2; BF16,
    ~13 MB, mostly the 49152-token embedding and lm_head) with the default model's tokenizer, chat template and
    eos/bos ids (the gate's golden prompts and the pack need them)."""
    import shutil

    import transformers

    ids = {k: json.loads((vocab_from / "config.json").read_text())[k] for k in ("bos_token_id", "eos_token_id")}
    torch.manual_seed(0)
    cfg_cls, sizes = _TINY[arch]
    cfg = getattr(transformers, cfg_cls)(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, vocab_size=49152, max_position_embeddings=2048,
                                         tie_word_embeddings=False, architectures=[arch], **sizes, **ids)
    md = root / arch.lower()
    model = getattr(transformers, arch)(cfg)
    with torch.no_grad():  # norms (QK-norm included) away from their init of ones: a reader that drops one is seen
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.to(torch.bfloat16).save_pretrained(md)
    for p in vocab_from.iterdir():
        if p.is_file() and not (md / p.name).exists():
            shutil.copy2(p, md / p.name)
    return md


TINY_BAR = {"kl_mean_max": 5.0, "kl_p99_max": 50.0, "top1_min": 0.1, "ppl_delta_pct_max": 500.0, "greedy_same_min": 0.0}
"""The gate's bar for the tiny random models: loosened (random weights: structure, not quality)."""


def test_tiny_qwen3_moe_builds_on_the_llm_api_route(tmp_path, default_model_dir, invoke_here, small_gate, monkeypatch):
    """``invoke build`` of a tiny Qwen3-MoE on the llm_api route with FP8 (no KV quantization: the MoE reader reads an
    unquantized KV cache only): exit 0, every stage done; the router excluded in hf_quant_config.json and stored BF16;
    the verify stage's counts; the gate's numbers finite with its verdict. The engine route is still refused at resolve
    (rule model.gate_reads: no TensorRT-LLM export, no reader of that checkpoint)."""
    from safetensors import safe_open

    md = _tiny_model_dir(tmp_path, Path(default_model_dir))
    prof = tmp_path / "tiny-moe.yaml"  # random weights: the bar loosened; structure, not quality
    prof.write_text(json.dumps({"extends": "fp8-h100-llmapi", "quantization": {"kv_cache_quant_algo": "NONE"},
                                "calibration": {"num_samples": 4, "seq_len": 32, "batch_size": 2}, "gate": TINY_BAR}))
    out = tmp_path / "out"
    r = invoke_here("build", "--profile", str(prof), "--model", str(md), "--out", str(out), "--golden-limit", "1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    man = json.loads((out / "manifest.json").read_text())["stages"]
    assert {k: v["status"] for k, v in man.items()} == {s: "done" for s in (
        "resolve", "quantize", "verify", "gate", "llm_api_config", "pack", "deploy")}
    q = json.loads((out / "checkpoint" / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "FP8" and q["kv_cache_quant_algo"] is None
    assert {p for p in q["exclude_modules"] if "mlp.gate" in p} and "lm_head" in q["exclude_modules"], q
    with safe_open(str(out / "checkpoint" / "model.safetensors"), framework="pt") as st:
        keys = set(st.keys())
        assert st.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16  # the router as the model holds it
        assert st.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight").dtype == torch.float8_e4m3fn
    assert not [k for k in keys if ".mlp.gate." in k and not k.endswith(".weight")]
    # verify: 2 layers x (4 attention + 4 experts x 3) linears + lm_head; 2 FP8 scales each of the 32 quantized ones
    v = man["verify"]["numbers"]
    assert (v["tensors"], v["scale_tensors"], v["linears"]) == (len(keys), 64, 33)
    g = man["gate"]["numbers"]
    assert all(math.isfinite(g[k]) for k in ("kl_mean", "kl_p95", "kl_p99", "kl_max", "top1", "ppl_delta_pct"))
    assert 0 < g["kl_mean"] < 1e-3 and g["top1"] > 0.8 and g["passed"] is True and g["eval_tokens"] > 0, g
    assert json.loads((out / "model_repository" / "pack.json").read_text())["route"] == "llm_api"
    # the same build with the router quantized (an FP8 weight quantizer enabled on *mlp.gate): verification refuses it
    from precision_pipeline.quantize import ptq

    plain = ptq.modelopt_config_for

    def router_quantized(*a, **kw):
        name, cfg = plain(*a, **kw)
        cfg["quant_cfg"].append({"quantizer_name": "*mlp.gate.weight_quantizer", "enable": True,
                                 "cfg": {"num_bits": (4, 3), "axis": None}})
        return name, cfg

    monkeypatch.setattr(ptq, "modelopt_config_for", router_quantized)
    r = invoke_here("build", "--profile", str(prof), "--model", str(md), "--out", str(tmp_path / "rq"), "--golden-limit", "1")
    assert r.returncode == 2 and "hf.router" in r.stdout + r.stderr and "model.layers.1.mlp.gate.weight" in r.stdout + r.stderr
    st_rq = {k: v["status"] for k, v in json.loads((tmp_path / "rq" / "manifest.json").read_text())["stages"].items()}
    assert st_rq.get("quantize") == "done" and "verify" not in st_rq and "gate" not in st_rq, st_rq  # stopped at verify
    monkeypatch.setattr(ptq, "modelopt_config_for", plain)
    # the engine route: refused at resolve, exit 2, nothing written
    eng = tmp_path / "engine.yaml"
    eng.write_text(json.dumps({"extends": "fp8-h100", "quantization": {"kv_cache_quant_algo": "NONE"}}))
    r = invoke_here("build", "--profile", str(eng), "--model", str(md), "--out", str(tmp_path / "eng"))
    assert r.returncode == 2 and "model.gate_reads" in r.stdout + r.stderr and not (tmp_path / "eng").exists(), r.stdout


def _plant_fp8(tensors: dict, name: str) -> dict:
    """``tensors`` with ``name`` stored as FP8 E4M3 and a ``weight_scale`` beside it (a module quantized that the
    export keeps in the model dtype)."""
    tensors[name] = tensors[name].float().to(torch.float8_e4m3fn)
    tensors[name.rsplit(".", 1)[0] + ".weight_scale"] = torch.tensor(1.0)
    return tensors


# arch -> (verify's (tensors, scale_tensors, linears), the module planted FP8 in a copy of the built checkpoint and the
# rule that refuses it, the engine route's refusal: rule and what it says)
FAMILY_BUILDS = {
    # 2 layers x (2 norms + q_norm + k_norm + 7 FP8 linears x 3 tensors) + embedding, final norm, lm_head (BF16)
    "Qwen3ForCausalLM": ((53, 28, 15), ("model.layers.1.self_attn.q_norm.weight", "hf.layout"),
                         ("model.family_serves", "not served on the engine route")),
    # 2 layers x (2 norms + router + (4 attention + 4 experts x 3) FP8 linears x 3) + 3
    "MixtralForCausalLM": ((105, 64, 33), ("model.layers.1.block_sparse_moe.gate.weight", "hf.router"),
                           ("model.gate_reads", "Stages missing for MixtralForCausalLM: gate:")),
    # 2 layers x (2 norms + router + shared-expert gate + 3 q/k/v biases + (4 + 12 + 3 shared) FP8 linears x 3) + 3
    "Qwen2MoeForCausalLM": ((131, 76, 39), ("model.layers.0.mlp.shared_expert_gate.weight", "hf.router"),
                            ("model.gate_reads", "Stages missing for Qwen2MoeForCausalLM: quantize:")),
}


@pytest.mark.parametrize("arch", sorted(FAMILY_BUILDS))
def test_tiny_family_builds_on_the_llm_api_route(arch, tmp_path, default_model_dir, invoke_here, small_gate):
    """``invoke build`` of a tiny random Qwen3 (dense, QK-norm), Mixtral and Qwen2-MoE (shared expert and its gate) on
    route llm_api with FP8 (unquantized KV cache: what the gate's HF reader reads): exit 0, every stage done; the router,
    a shared-expert gate and the QK-norm stored BF16 (not quantized, no scales); verify's exact counts; the gate (HF class
    fed the dequantized checkpoint, gate/moe_model.py) within bounds; packed as an LLM-API unit. The checkpoint with one
    kept module planted FP8 is refused with exit 2 before anything is written (``--checkpoint``); the engine route is
    refused at resolve/check, naming why."""
    from safetensors.torch import load_file, save_file

    (n_tensors, n_scales, n_linears), (planted, rule), (eng_rule, eng_why) = FAMILY_BUILDS[arch]
    md = _tiny_model_dir(tmp_path, Path(default_model_dir), arch)
    prof = tmp_path / "tiny.yaml"  # no fallback: fp8-h100-llmapi's (bf16-h100) is on the engine route
    prof.write_text(json.dumps({"extends": "fp8-h100-llmapi", "quantization": {"kv_cache_quant_algo": "NONE"},
                                "deployment": {"fallback": None, "warm_fallback": False},
                                "calibration": {"num_samples": 4, "seq_len": 32, "batch_size": 2}, "gate": TINY_BAR}))
    out = tmp_path / "out"
    args = ("--profile", str(prof), "--model", str(md), "--golden-limit", "1")
    r = invoke_here("build", *args, "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    man = json.loads((out / "manifest.json").read_text())["stages"]
    assert {k: v["status"] for k, v in man.items()} == {s: "done" for s in (
        "resolve", "quantize", "verify", "gate", "llm_api_config", "pack", "deploy")}
    q = json.loads((out / "checkpoint" / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "FP8" and q["kv_cache_quant_algo"] is None and "lm_head" in q["exclude_modules"], q
    sd = load_file(str(out / "checkpoint" / "model.safetensors"))
    fam = FAM.FAMILIES[arch]
    kept = [n for n in sd if n.rsplit(".", 2)[-2] in ("q_norm", "k_norm", "gate", "shared_expert_gate")]
    assert kept and {sd[n].dtype for n in kept} == {torch.bfloat16}, {n: sd[n].dtype for n in kept}
    for pat in fam.moe.router_patterns if fam.moe else ():  # ModelOpt excludes each router module by name
        assert sorted(p for p in q["exclude_modules"] if p.endswith(pat[1:])) == [
            f"model.layers.{i}.{pat[1:]}" for i in range(2)], q["exclude_modules"]
    v = man["verify"]["numbers"]
    assert (v["tensors"], v["scale_tensors"], v["linears"]) == (len(sd), n_scales, n_linears) == (n_tensors, n_scales,
                                                                                                   n_linears), v
    g = man["gate"]["numbers"]
    assert all(math.isfinite(g[k]) for k in ("kl_mean", "kl_p95", "kl_p99", "kl_max", "top1", "ppl_delta_pct"))
    # measured (SMALL_GATE, 1 prompt per category, 395 tokens; kl_mean / kl_p99 / top-1): see README "MoE families"
    assert 1e-6 < g["kl_mean"] < 5e-5 and g["kl_p99"] < 1e-4 and g["top1"] > 0.85 and g["passed"] is True, g
    assert g["eval_tokens"] == 395, g
    assert json.loads((out / "model_repository" / "pack.json").read_text())["route"] == "llm_api"
    # the built checkpoint with one kept module planted FP8: refused before anything is written
    bad = tmp_path / "planted"
    bad.mkdir()
    for f in (out / "checkpoint").iterdir():
        if f.suffix == ".json":
            (bad / f.name).write_text(f.read_text())
    save_file(_plant_fp8(dict(sd), planted), str(bad / "model.safetensors"), metadata={"format": "pt"})
    got = invoke_here("build", *args, "--checkpoint", str(bad), "--out", str(tmp_path / "out-planted"))
    text = got.stdout + got.stderr
    assert got.returncode == 2 and rule in text and planted in text, text[-3000:]
    assert not (tmp_path / "out-planted").exists()
    # the engine route: refused (Qwen3: not served there; Mixtral: no gate reader; Qwen2-MoE: no export, no reader)
    eng = tmp_path / "engine.yaml"
    eng.write_text(json.dumps({"extends": "fp8-h100", "quantization": {"kv_cache_quant_algo": "NONE"}}))
    got = invoke_here("build", "--profile", str(eng), "--model", str(md), "--out", str(tmp_path / "eng"))
    text = got.stdout + got.stderr
    assert got.returncode == 2 and eng_rule in text and eng_why in text and not (tmp_path / "eng").exists(), text[-3000:]


def _tiny_gpt_oss_dirs(root, vocab_from):
    """A tiny random gpt-oss (2 layers: sliding then full attention, 4 experts, top-2, hidden 64, intermediate 64; the
    default model's tokenizer and eos/bos ids) as two HF folders: ``ref`` its BF16 weights (``--model``: the gate's
    reference), ``mx`` the same weights in gpt-oss's shipped layout (``--checkpoint``: config.json ``quant_method``
    mxfp4; each expert projection as ``*_blocks`` / ``*_scales`` made by ModelOpt's ``MXFP4QTensor`` from the BF16
    weights, everything else as in ``ref``)."""
    import shutil

    from safetensors.torch import save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    ids = {k: json.loads((vocab_from / "config.json").read_text())[k] for k in ("bos_token_id", "eos_token_id")}
    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=49152, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                       max_position_embeddings=2048, tie_word_embeddings=False, architectures=["GptOssForCausalLM"], **ids)
    model = GptOssForCausalLM(cfg).to(torch.bfloat16)
    ref, mx = root / "gpt-oss-bf16", root / "gpt-oss-mxfp4"
    model.save_pretrained(ref)
    for p in vocab_from.iterdir():
        if p.is_file() and not (ref / p.name).exists():
            shutil.copy2(p, ref / p.name)
    sd = {}
    for k, v in model.state_dict().items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):  # HF [E, in, out] -> gpt-oss's [E, out, in] codes
            sd[k + "_blocks"], sd[k + "_scales"], _ = _mxfp4_blocks(v.float().transpose(1, 2).contiguous())
        else:
            sd[k] = v.contiguous()
    mx.mkdir()
    raw = json.loads((ref / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # openai/gpt-oss-20b's
    (mx / "config.json").write_text(json.dumps(raw))
    save_file(sd, str(mx / "model.safetensors"), metadata={"format": "pt"})
    return ref, mx, sd


def test_tiny_gpt_oss_builds_from_its_mxfp4_checkpoint_on_the_llm_api_route(tmp_path, default_model_dir, invoke_here,
                                                                               small_gate):
    """``invoke build`` of a tiny gpt-oss on route llm_api with W4A16_MXFP4 from its MXFP4 checkpoint as shipped
    (``--checkpoint``; ``--model`` the BF16 weights it was made from, the gate's reference): exit 0, every stage done;
    the quantize stage adopts the checkpoint as is; verification's counts (checkpoint/mxfp4_verify.py); the gate reads
    it through load_gate_model -> load_gpt_oss_mxfp4 (codec decode) and its numbers against the BF16 weights are small
    (random weights: structure, not quality); packed as an LLM-API unit. Planted bad checkpoints are refused with exit 2
    before anything is written: the router stored quantized (hf.router), a scales tensor of the wrong shape (mx.layout),
    an E8M0 NaN code (mx.scales); and formats the gate does not read of it (W4A8_MXFP4_FP8, NO_QUANT) at resolve."""
    from safetensors.torch import save_file

    ref, mx, sd = _tiny_gpt_oss_dirs(tmp_path, Path(default_model_dir))
    prof = tmp_path / "tiny-gpt-oss.yaml"  # random weights: the bar loosened; attention and router kept BF16
    spec = {"extends": "fp8-h100-llmapi", "deployment": {"fallback": None, "warm_fallback": False}, "gate": TINY_BAR,
            "quantization": {"quant_algo": "W4A16_MXFP4", "kv_cache_quant_algo": "NONE",
                             "exclude_modules": ["*self_attn*", *FAM.GPT_OSS.moe.router_patterns, "lm_head"]}}
    prof.write_text(json.dumps(spec))
    out = tmp_path / "out"
    args = ("--profile", str(prof), "--model", str(ref), "--golden-limit", "1")
    r = invoke_here("build", *args, "--checkpoint", str(mx), "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    man = json.loads((out / "manifest.json").read_text())["stages"]
    assert {k: v["status"] for k, v in man.items()} == {s: "done" for s in (
        "resolve", "quantize", "verify", "gate", "llm_api_config", "pack", "deploy")}
    assert man["quantize"]["numbers"]["quant_algo"] == "W4A16_MXFP4"
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == ["config.json", "model.safetensors"]  # as shipped
    # verify: 2 layers x (4 attention + 4 experts x 2 projections) linears + lm_head; 2 scales tensors a layer
    v = man["verify"]["numbers"]
    assert (v["tensors"], v["scale_tensors"], v["linears"], v["scale_bytes"]) == (len(sd), 4, 25, 2 * 4 * (128 + 64) * 2), v
    g = man["gate"]["numbers"]
    assert all(math.isfinite(g[k]) for k in ("kl_mean", "kl_p95", "kl_p99", "kl_max", "top1", "ppl_delta_pct"))
    # measured (1 prompt per category, SMALL_GATE): KL mean 2.02e-4, P99 1.95e-3, max 2.63e-3, top-1 0.782, 395 tokens
    assert 1e-4 < g["kl_mean"] < 4e-4 and 1e-3 < g["kl_p99"] < 4e-3 and 0.7 < g["top1"] < 0.9, g
    assert g["passed"] is True and g["eval_tokens"] == 395, g
    assert json.loads((out / "model_repository" / "pack.json").read_text())["route"] == "llm_api"

    def planted(name, change):
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_text((mx / "config.json").read_text())
        save_file(change(dict(sd)), str(bad / "model.safetensors"), metadata={"format": "pt"})
        got = invoke_here("build", *args, "--checkpoint", str(bad), "--out", str(tmp_path / f"out-{name}"))
        assert got.returncode == 2 and not (tmp_path / f"out-{name}").exists(), got.stdout[-2000:] + got.stderr[-2000:]
        return got.stdout + got.stderr

    def router_fp8(t):
        t["model.layers.1.mlp.router.weight"] = t["model.layers.1.mlp.router.weight"].float().to(torch.float8_e4m3fn)
        t["model.layers.1.mlp.router.weight_scale"] = torch.tensor(1.0)
        return t

    text = planted("router", router_fp8)
    assert "hf.router" in text and "model.layers.1.mlp.router.weight_scale" in text and "*mlp.router" in text, text
    text = planted("scales", lambda t: {**t, "model.layers.0.mlp.experts.down_proj_scales":
                                        t["model.layers.0.mlp.experts.down_proj_scales"][:, :, :1].contiguous()})
    assert "mx.layout" in text and "down_proj_scales: is U8 [4, 64, 1]; config.json's sizes give U8 [4, 64, 2]" in text
    nan = sd["model.layers.1.mlp.experts.gate_up_proj_scales"].clone()
    nan[2, 5, 1] = 255
    text = planted("nan", lambda t: {**t, "model.layers.1.mlp.experts.gate_up_proj_scales": nan})
    assert "mx.scales" in text and "gate_up_proj_scales: holds 1 E8M0 code(s) above 252 (max 255" in text, text
    # formats the gate does not read of gpt-oss: refused at resolve (model.gate_reads), naming what it reads
    for algo in ("W4A8_MXFP4_FP8", "NO_QUANT"):
        p2 = tmp_path / f"{algo.lower()}.yaml"
        p2.write_text(json.dumps({**spec, "target": {"gpu": "b200"} if algo == "W4A8_MXFP4_FP8" else {},
                                  "quantization": {**spec["quantization"], "quant_algo": algo}}))
        got = invoke_here("build", "--profile", str(p2), "--model", str(ref), "--checkpoint", str(mx),
                          "--out", str(tmp_path / f"out-{algo}"))
        text = got.stdout + got.stderr
        assert got.returncode == 2 and "model.gate_reads" in text and "reads W4A16_MXFP4 only" in text, text[-2000:]
