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
