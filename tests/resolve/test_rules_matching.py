"""The memoised ``exclude_modules`` matching of resolve/rules.py (``_excluded_kinds``, ``_kept_kinds``,
``_lm_head_excluded``, ``_decoder_linears_kept``) gives the same answers as matching every name directly,
on the default model's and the config-only Llama-3.1-70B's module names, for every shipped profile's
patterns (and a few wildcard ones that hit many names)."""

from __future__ import annotations

import fnmatch
from pathlib import Path
from types import SimpleNamespace

import pytest

from precision_pipeline.resolve import rules as R
from precision_pipeline.spec.model_arch import read_model_arch
from precision_pipeline.spec.names import llama_linear_names, resolve_exclusions
from precision_pipeline.spec.profile import load_profile, shipped_profiles
from tests.conftest import prof

M70_DIR = Path(__file__).resolve().parents[1] / "data" / "models" / "Llama-3.1-70B"
EXTRA_PATTERNS = [("*mlp*",), ("*.0.*", "qkv"), ("*q_proj",), ("gate",), ("fc", "*experts.w2"), ("*layers.1?.*dense",),
                  ("*",), ("lm_head",), ("model.layers.7?.self_attn.*", "down_proj")]


def _pattern_sets() -> list[tuple[str, ...]]:
    shipped = {tuple(load_profile(n).quantization.exclude_modules) for n in shipped_profiles()}
    return sorted(shipped | set(EXTRA_PATTERNS))


@pytest.fixture(scope="module")
def layer_counts(default_model_dir) -> dict[str, int]:
    return {"default": read_model_arch(default_model_dir).num_layers, "70B": read_model_arch(M70_DIR).num_layers}


def _direct(patterns, i: int, kind: str) -> bool:
    """The matching as written out: every pattern against the TensorRT-LLM full/short and HF full/short names."""
    trt, hf = R._KIND_NAMES[kind]
    names = [f"transformer.layers.{i}.{trt}", trt.split(".")[-1]]
    names += [f"model.layers.{i}.{h}" for h in hf] + [h.split(".")[-1] for h in hf]
    return any(fnmatch.fnmatchcase(n, p) for p in patterns for n in names)


def test_layer_counts(layer_counts):
    assert layer_counts == {"default": 30, "70B": 80}
    assert len(_pattern_sets()) >= len(EXTRA_PATTERNS) + 4  # the shipped profiles add their own sets


def test_memoised_kinds_equal_direct_matching(layer_counts):
    hits = 0
    for n in layer_counts.values():
        for pats in _pattern_sets():
            per_layer = R._excluded_kinds(pats, n)
            assert len(per_layer) == n
            for i in range(n):
                for kind in R._KIND_NAMES:
                    want = _direct(pats, i, kind)
                    assert (kind in per_layer[i]) == want, (pats, n, i, kind)
                    hits += want
                    for kf, kl in ((0, 0), (2, 1)):
                        q = SimpleNamespace(exclude_modules=list(pats), keep_first_layers=kf, keep_last_layers=kl)
                        keep = i < kf or i >= n - kl
                        assert R._layer_excluded(q, i, kind, n) == (keep or want), (pats, n, i, kind, kf, kl)
                        assert (kind in R._kept_kinds(pats, kf, kl, n)[i]) == (keep or want)
            assert R._lm_head_excluded(pats) == any(fnmatch.fnmatchcase("lm_head", p) for p in pats)
    assert hits > 1000  # the wildcard sets match many names, the comparison is not all-False


def test_memoised_decoder_linears_kept_equal_resolve_exclusions(layer_counts):
    for n in layer_counts.values():
        decoder = [x for x in llama_linear_names(n) if x != "lm_head"]
        for pats in _pattern_sets():
            for kf, kl in ((0, 0), (1, 2)):
                kept, _ = resolve_exclusions(decoder, list(pats), kf, kl, n)
                assert R._decoder_linears_kept(pats, kf, kl, n) == (len(kept), 7 * n)


def test_weight_bytes_equal_layer_by_layer(layer_counts, default_model_dir, monkeypatch):
    """weight_bytes computes one layer per distinct kept-kinds set; layer by layer with the direct matcher
    gives the same bytes for every shipped profile and the wildcard sets, at tp 1 and 8, on both models."""
    models = [read_model_arch(default_model_dir), read_model_arch(M70_DIR)]
    profiles = [load_profile(n) for n in shipped_profiles()]
    profiles += [prof("fp8-h100", quantization__exclude_modules=list(p)) for p in EXTRA_PATTERNS]
    cases = [(m, p, tp) for m in models for p in profiles for tp in (1, 8)]
    memo = [R.weight_bytes(m, p, {"tp_size": tp, "pp_size": 1, "moe_tp_size": tp, "moe_ep_size": 1}) for m, p, tp in cases]

    def direct_layer_excluded(q, i, kind, num_layers):
        return i < q.keep_first_layers or i >= num_layers - q.keep_last_layers or _direct(q.exclude_modules, i, kind)

    monkeypatch.setattr(R, "_layer_excluded", direct_layer_excluded)
    monkeypatch.setattr(R, "_kept_kinds", lambda pats, kf, kl, n: tuple(range(n)))  # key = the layer index
    direct = [R.weight_bytes(m, p, {"tp_size": tp, "pp_size": 1, "moe_tp_size": tp, "moe_ep_size": 1}) for m, p, tp in cases]
    assert memo == direct
    assert len({w["total"] for w in memo}) > len(cases) // 4  # the cases differ


# weight_bytes totals (bytes, tp 1) computed by the code before the matching was memoised (commit 5ee926e, one
# layer per index): profiles whose exclusions differ layer by layer.
WEIGHT_BYTES_BEFORE = {
    ("default", "int4-awq-a100-smollm2", None): 188345856,
    ("default", "int8-sq-l4-smollm2", None): 222096592,
    ("default", "nvfp4-b200-smollm2", None): 216119832,
    ("default", "fp8-h100", ("*layers.1?.*dense",)): 194492496,
    ("default", "fp8-h100", ("*.0.*", "qkv")): 210749328,
    ("default", "fp8-h100", ("model.layers.7?.self_attn.*", "down_proj")): 217716656,
    ("70B", "int4-awq-a100-smollm2", None): 45612580864,
    ("70B", "int8-sq-l4-smollm2", None): 73162655288,
    ("70B", "nvfp4-b200-smollm2", None): 51584192192,
    ("70B", "fp8-h100", ("*layers.1?.*dense",)): 72276791288,
    ("70B", "fp8-h100", ("*.0.*", "qkv")): 79088340392,
    ("70B", "fp8-h100", ("model.layers.7?.self_attn.*", "down_proj")): 91906133288,
}


def test_weight_bytes_as_before(default_model_dir):
    models = {"default": read_model_arch(default_model_dir), "70B": read_model_arch(M70_DIR)}
    for (mk, base, pats), want in WEIGHT_BYTES_BEFORE.items():
        p = load_profile(base) if pats is None else prof(base, quantization__exclude_modules=list(pats))
        got = R.weight_bytes(models[mk], p, {"tp_size": 1, "pp_size": 1, "moe_tp_size": 1, "moe_ep_size": 1})["total"]
        assert got == want, (mk, base, pats)
