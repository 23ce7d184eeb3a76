"""gate/moe_model.py's HF reader on a tiny random Qwen3-MoE, with ``checkpoint.hf_unified.dequantize_hf_moe`` replaced by
the model's own tensors (issue 26: its only tests were the slow ModelOpt builds, which never planted a disagreeing
checkpoint): an unquantized checkpoint of the model gives the model's own logits; another architecture, other sizes, a
tensor of another shape, a linear with a bias the model lacks are refused; only ``device="cuda"`` places the model on
GPUs."""

from __future__ import annotations

import json

import pytest
import torch

from precision_pipeline.checkpoint.reader import LinearSpec
from precision_pipeline.core.errors import UserError
from precision_pipeline.gate import moe_model as MM


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, vocab_size=64, max_position_embeddings=64, decoder_sparse_step=1, mlp_only_layers=[],
                         tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])
    model = Qwen3MoeForCausalLM(cfg).eval()
    root = tmp_path_factory.mktemp("moe")
    cfg.save_pretrained(root / "hf")
    return model, root / "hf"


def _stored(model):
    """What dequantize_hf_moe returns for an unquantized export of ``model``: (config, linears, plain tensors)."""
    linears, used = {}, set()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and not name.endswith("mlp.gate"):
            linears[name] = LinearSpec(weight=mod.weight.detach().float().clone(), quantized=False)
            used.add(name + ".weight")
    plain = {n: p.detach().float().clone() for n, p in model.state_dict().items() if n not in used}
    return json.loads(model.config.to_json_string()), linears, plain


@pytest.fixture
def stored(tiny, monkeypatch):
    from precision_pipeline.checkpoint import hf_unified

    model, _ = tiny
    box = {"v": _stored(model)}
    monkeypatch.setattr(hf_unified, "dequantize_hf_moe", lambda d: box["v"])
    return box


def test_an_unquantized_checkpoint_gives_the_models_own_logits(tiny, stored, tmp_path):
    model, hf = tiny
    got = MM.load_hf_moe_model(tmp_path, hf)
    toks = torch.tensor([[1, 5, 9, 33, 2, 60]])
    with torch.no_grad():
        torch.testing.assert_close(got(toks).logits, model(toks).logits, rtol=1e-5, atol=1e-5)
    assert type(got.model.layers[0].mlp.gate) is torch.nn.Linear  # the router as stored


def test_another_architecture_is_refused(tiny, stored, tmp_path):
    cfg, linears, plain = stored["v"]
    stored["v"] = ({**cfg, "architectures": ["MixtralForCausalLM"]}, linears, plain)  # same sizes
    with pytest.raises(UserError, match=r"architectures \['MixtralForCausalLM'\] vs \['Qwen3MoeForCausalLM'\]"):
        MM.load_hf_moe_model(tmp_path, tiny[1])


def test_other_sizes_are_refused(tiny, stored, tmp_path):
    cfg, linears, plain = stored["v"]
    stored["v"] = ({**cfg, "num_experts": 8}, linears, plain)
    with pytest.raises(UserError, match="disagree: num_experts 8 vs 4"):
        MM.load_hf_moe_model(tmp_path, tiny[1])


def test_a_tensor_of_another_shape_is_refused(tiny, stored, tmp_path):
    cfg, linears, plain = stored["v"]
    plain = {**plain, "model.norm.weight": torch.ones(31)}
    stored["v"] = (cfg, linears, plain)
    with pytest.raises(UserError, match=r"model.norm.weight has shape \(31,\); the model expects \(32,\)"):
        MM.load_hf_moe_model(tmp_path, tiny[1])


def test_a_linear_with_a_bias_the_model_lacks_is_refused(tiny, stored, tmp_path):
    cfg, linears, plain = stored["v"]
    name = "model.layers.0.self_attn.o_proj"
    w = linears[name].weight
    linears = {**linears, name: LinearSpec(weight=w, quantized=False, bias=torch.zeros(w.shape[0]))}
    stored["v"] = (cfg, linears, plain)
    with pytest.raises(UserError, match=rf"{name} is \(32, 32\) \(bias True\); the model expects \(32, 32\) \(bias False\)"):
        MM.load_hf_moe_model(tmp_path, tiny[1])


@pytest.mark.parametrize("device, placed", [("cpu", False), ("cuda", True)])
def test_only_cuda_places_the_model_on_gpus(tiny, stored, tmp_path, monkeypatch, device, placed):
    from precision_pipeline.checkpoint import reader
    from precision_pipeline.gate import model as gm

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"]}))
    monkeypatch.setattr(reader, "checkpoint_layout", lambda d: "hf_unified")
    seen = []
    monkeypatch.setattr(gm, "place_on_cuda", lambda m: seen.append(m) or m)
    got = MM.load_gate_model(tmp_path, tiny[1], device=device)
    assert isinstance(got, torch.nn.Module) and (seen == [got]) is placed and (seen == []) is (not placed)


def test_a_dense_familys_hf_checkpoint_goes_to_the_dense_reader(tmp_path, monkeypatch):
    """A unified HF checkpoint of a family without ``hf_read`` (Llama) is read by gate.model's reader, not the MoE one."""
    from precision_pipeline.checkpoint import reader
    from precision_pipeline.gate import model as gm

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    monkeypatch.setattr(reader, "checkpoint_layout", lambda d: "hf_unified")
    used = []
    monkeypatch.setattr(MM, "load_hf_moe_model", lambda *a, **k: used.append("moe"))
    monkeypatch.setattr(gm, "load_checkpoint_model", lambda *a, **k: used.append("dense"))
    MM.load_gate_model(tmp_path, tmp_path)
    assert used == ["dense"]
