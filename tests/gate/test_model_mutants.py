"""gate/model.py's small rules pinned (issue 26): which linears share one input fake-quant, which KV caches are
fake-quantized in place, and that only ``device="cuda"`` places a checkpoint model on GPUs."""

from __future__ import annotations

import types

import pytest
import torch

from precision_pipeline.checkpoint.reader import LinearSpec
from precision_pipeline.gate import model as M

W = torch.ones(2, 2)


def spec(act=None, pre=None, algo="FP8", rows=()):
    return LinearSpec(weight=W, quantized=True, act_scale=act, pre=pre, quant_algo=algo, act_scale_rows=list(rows))


@pytest.mark.parametrize("specs, shared", [
    ([spec(), spec()], True),
    ([spec(torch.tensor(0.5)), spec(torch.tensor(0.5))], True),
    ([spec(None), spec(torch.tensor(0.5))], False),            # one has an input scale, the other none
    ([spec(torch.tensor(0.5)), spec(None)], False),
    ([spec(torch.tensor(0.5)), spec(torch.tensor(0.25))], False),
    ([spec(torch.tensor([0.5, 0.5])), spec(torch.tensor(0.5))], False),  # same values, other shape
    ([spec(pre=torch.ones(2)), spec(pre=None)], False),
    ([spec(), spec(algo="NVFP4")], False),
    ([spec(rows=[(0, 1, torch.tensor(1.0))]), spec(rows=[(0, 1, torch.tensor(1.0))])], False),  # per-row scales
])
def test_shares_input_quant(specs, shared):
    assert M._shares_input_quant(specs) is shared


def test_only_an_appending_dynamic_cache_is_quantized_in_place():
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class OtherLayer(DynamicLayer):  # a DynamicLayer subclass (e.g. a sliding window) may not append in place
        pass

    module = types.SimpleNamespace(layer_idx=0)
    k, v = torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4)

    def storage(layer):
        cache = DynamicCache()
        layer.keys, layer.values = k, v
        cache.layers = [layer]
        M._KV_CACHE.by_module = {id(module): cache}
        with torch.no_grad():
            return cache, M._appending_storage(module, k, v)

    cache, got = storage(DynamicLayer())
    assert got is cache
    assert storage(OtherLayer())[1] is None
    cache, _ = storage(DynamicLayer())
    M._KV_CACHE.by_module = {id(module): cache}
    with torch.no_grad():
        assert M._appending_storage(module, k.clone(), v) is None  # not that storage: out of place
    M._KV_CACHE.by_module = {}


@pytest.mark.parametrize("device, placed", [("cpu", False), ("cuda", True)])
def test_only_cuda_places_a_checkpoint_model(bf16_checkpoint, default_model_dir, monkeypatch, device, placed):
    seen = []
    monkeypatch.setattr(M, "place_on_cuda", lambda m: seen.append(m) or m)
    got = M.load_checkpoint_model(bf16_checkpoint, default_model_dir, device=device)
    assert isinstance(got, torch.nn.Module) and len(seen) == int(placed)


@pytest.fixture(scope="module")
def fp8_model(fp8_checkpoint, default_model_dir):
    return M.load_checkpoint_model(fp8_checkpoint, default_model_dir)


def test_shared_input_quants_hold_nothing_after_a_forward(fp8_model):
    """q/k/v share one input fake-quant (3 consumers), gate/up another (2): after a forward none holds a tensor
    (nothing is kept between layers), and the weights need no gradient."""
    with torch.inference_mode():
        fp8_model(torch.tensor([[1, 2, 3, 4]]))
    shared = {id(m.shared): m.shared for m in fp8_model.modules() if isinstance(m, M.QuantLinear) and m.shared is not None}
    layers = len(fp8_model.model.layers)
    assert sorted(s.consumers for s in shared.values()) == [2] * layers + [3] * layers
    assert all(s._x is None and s._y is None and s._left == 0 for s in shared.values())
    assert not any(p.requires_grad for p in fp8_model.parameters())


def _copy_with_config(src, dst, **changes):
    import json

    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    for k, v in changes.items():
        if isinstance(v, dict):
            cfg[k] = {**cfg.get(k, {}), **v}
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_the_checkpoints_head_size_decides_the_qkv_split(bf16_checkpoint, default_model_dir, tmp_path):
    """``head_size`` of the checkpoint's config wins over hidden_size / heads (models whose head size is not that
    quotient, e.g. Mistral-Nemo's 128 for 5120 / 32): here 48 instead of SmolLM2's 64, so the fused qkv rows no
    longer split and the checkpoint is refused."""
    from precision_pipeline.core.errors import UserError

    bad = _copy_with_config(bf16_checkpoint, tmp_path / "ck", head_size=48)
    with pytest.raises(UserError, match="rows; expected"):
        M.load_checkpoint_model(bad, default_model_dir)


def test_an_unmodelled_kv_cache_format_is_refused_naming_the_modelled_ones(fp8_checkpoint, default_model_dir, tmp_path):
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.spec import formats as FMT

    modelled = [k.value for k in FMT.KV.values() if k.is_quantized and k.cpu_model]
    assert modelled  # FP8 (and INT8) caches are modelled
    nv = _copy_with_config(fp8_checkpoint, tmp_path / "ck", quantization={"kv_cache_quant_algo": "NVFP4"})
    with pytest.raises(UserError) as e:
        M.load_checkpoint_model(nv, default_model_dir)
    assert e.value.problems[0].reason == (f"kv_cache_quant_algo NVFP4 is not modelled by this reader "
                                          f"({' and '.join(modelled)} are).")
