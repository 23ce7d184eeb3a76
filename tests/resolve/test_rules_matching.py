"""The memory plan's ``exclude_modules`` matching is the export's (``spec.families.resolve_exclusions``, memoised
by ``kept_linears``), on the default model's and the config-only Llama-3.1-70B's module names, for every shipped
profile's patterns and a few wildcard ones; and the plan's weight bytes agree with what the export keeps in BF16
for every exclude-pattern kind (q/k/v/o, gate/up/down, lm_head, a whole layer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from precision_pipeline.resolve import memory as MEM
from precision_pipeline.spec import formats as F
from precision_pipeline.spec.families import LLAMA, kept_linears, resolve_exclusions
from precision_pipeline.spec.model_arch import read_model_arch
from precision_pipeline.spec.profile import load_profile, shipped_profiles
from tests.conftest import prof

M70_DIR = Path(__file__).resolve().parents[1] / "data" / "models" / "Llama-3.1-70B"
EXTRA_PATTERNS = [("*mlp*",), ("*.0.*", "qkv"), ("*q_proj",), ("gate",), ("fc", "*experts.w2"), ("*layers.1?.*dense",),
                  ("*",), ("lm_head",), ("model.layers.7?.self_attn.*", "down_proj"), ("*up_proj",), ("*.mlp.gate",)]
ONE = {"tp_size": 1, "pp_size": 1, "moe_tp_size": 1, "moe_ep_size": 1}


def _pattern_sets() -> list[tuple[str, ...]]:
    shipped = {tuple(load_profile(n).quantization.exclude_modules) for n in shipped_profiles()}
    return sorted(shipped | set(EXTRA_PATTERNS))


@pytest.fixture(scope="module")
def layer_counts(default_model_dir) -> dict[str, int]:
    return {"default": read_model_arch(default_model_dir).num_layers, "70B": read_model_arch(M70_DIR).num_layers}


def test_layer_counts(layer_counts):
    assert layer_counts == {"default": 30, "70B": 80}
    assert len(_pattern_sets()) >= len(EXTRA_PATTERNS) + 4  # the shipped profiles add their own sets


def test_memoised_kept_linears_equal_the_export_matching(layer_counts):
    hits = 0
    for n in layer_counts.values():
        names = LLAMA.linear_names(n)
        for pats in _pattern_sets():
            for kf, kl in ((0, 0), (2, 1)):
                excluded, _ = resolve_exclusions(names, list(pats), kf, kl, n)
                per_layer, head = kept_linears("LlamaForCausalLM", pats, kf, kl, n)
                assert len(per_layer) == n
                got = {f"model.layers.{i}.{rel}" for i, kept in enumerate(per_layer) for rel in kept}
                assert got | ({"lm_head"} if head else set()) == set(excluded), (pats, n, kf, kl)
                hits += len(got)
    assert hits > 1000  # the wildcard sets match many names, the comparison is not all-empty


def test_decoder_linears_kept_count(default_model_dir):
    m = read_model_arch(default_model_dir)
    q = prof("fp8-h100", quantization__exclude_modules=["*up_proj"]).quantization
    assert MEM.decoder_linears_kept(m, q) == (2 * 30, 7 * 30)  # up_proj and its fused partner gate_proj
    q = prof("fp8-h100", quantization__exclude_modules=["*k_proj"], quantization__keep_first_layers=1).quantization
    assert MEM.decoder_linears_kept(m, q) == (3 * 29 + 7, 7 * 30)  # q/k/v of every layer + all of layer 0


# weight_bytes totals (bytes, tp 1) of the code before the plan used the export's matching (commit 5ee926e), and
# the one set that changed because the plan now keeps what the export keeps: fp8-h100 + ("*.0.*", "qkv") was
# 210749328 (default) / 79088340392 (70B): the plan matched "qkv" against the short TensorRT-LLM name and kept
# every layer's QKV, but the export matches HF name, TensorRT-LLM full name and HF short name, so "qkv" matches
# nothing and only layer 0 (*.0.*) stays BF16: 194713720 / 72461340704 (the no-exclusion totals 191174816 /
# 71605702728 plus one whole layer).
WEIGHT_BYTES = {
    ("default", "int4-awq-a100-smollm2", None): 188345856,
    ("default", "int8-sq-l4-smollm2", None): 222096592,
    ("default", "nvfp4-b200-smollm2", None): 216119832,
    ("default", "fp8-h100", ("*layers.1?.*dense",)): 194492496,
    ("default", "fp8-h100", ("model.layers.7?.self_attn.*", "down_proj")): 217716656,
    ("default", "fp8-h100", ("*.0.*", "qkv")): 194713720,
    ("70B", "int4-awq-a100-smollm2", None): 45612580864,
    ("70B", "int8-sq-l4-smollm2", None): 73162655288,
    ("70B", "nvfp4-b200-smollm2", None): 51584192192,
    ("70B", "fp8-h100", ("*layers.1?.*dense",)): 72276791288,
    ("70B", "fp8-h100", ("model.layers.7?.self_attn.*", "down_proj")): 91906133288,
    ("70B", "fp8-h100", ("*.0.*", "qkv")): 72461340704,
}


def test_weight_bytes_pinned(default_model_dir):
    models = {"default": read_model_arch(default_model_dir), "70B": read_model_arch(M70_DIR)}
    for (mk, base, pats), want in WEIGHT_BYTES.items():
        p = load_profile(base) if pats is None else prof(base, quantization__exclude_modules=list(pats))
        got = MEM.weight_bytes(models[mk], p, ONE)["total"]
        assert got == want, (mk, base, pats, got)


# --------------------------------------------------------------------------------------------------------------
# The plan and the export agree for every exclude-pattern kind

PATTERN_KINDS = {
    "q": ["*q_proj"], "k": ["*k_proj"], "v": ["*v_proj"], "o": ["*o_proj"],
    "gate": ["*gate_proj"], "up": ["*up_proj"], "down": ["*down_proj"],
    "trt_gate": ["*.mlp.gate"], "trt_fc": ["*.mlp.fc"], "lm_head": ["lm_head"], "layer": ["model.layers.3.*"],
}


def _export_bf16_gemms(m, patterns: list[str]) -> set[str]:
    """TensorRT-LLM GEMMs the export writes in BF16 for ``patterns`` (the names it lists in config.json
    ``exclude_modules``: ``quantize.ptq`` maps ``resolve_exclusions``'s HF names with ``trtllm_name``)."""
    excluded, _ = resolve_exclusions(LLAMA.linear_names(m.num_layers), patterns, 0, 0, m.num_layers)
    return {LLAMA.trtllm_name(n) for n in excluded}


def _gemm_shape(m, trt: str) -> tuple[int, int]:
    """(n_in, n_out) of a GEMM of the default model at tp 1, written out by hand."""
    h, hd = m.hidden_size, m.head_dim
    return {"attention.qkv": (h, (m.num_heads + 2 * m.num_kv_heads) * hd), "attention.dense": (m.num_heads * hd, h),
            "mlp.fc": (h, m.intermediate_size), "mlp.gate": (h, m.intermediate_size),
            "mlp.proj": (m.intermediate_size, h), "lm_head": (h, m.vocab_size)}[trt.split(".", 3)[-1]]


@pytest.mark.parametrize("kind", sorted(PATTERN_KINDS))
def test_memory_plan_weight_bytes_equal_the_export(default_model_dir, kind):
    """FP8: a GEMM the export keeps costs its BF16 weight instead of FP8 weight + scales; the plan's weight bytes
    differ from the no-exclusion plan by exactly the GEMMs the export keeps (fused partners included)."""
    m = read_model_arch(default_model_dir)
    base = prof("fp8-h100", quantization__exclude_modules=[])
    with_pats = prof("fp8-h100", quantization__exclude_modules=PATTERN_KINDS[kind])
    fmt = F.GEMM[base.quantization.quant_algo]
    kept = _export_bf16_gemms(m, PATTERN_KINDS[kind])
    assert kept, kind
    extra = sum(n_in * n_out * 2 - fmt.linear_bytes(n_in, n_out) for n_in, n_out in (_gemm_shape(m, g) for g in kept))
    got = MEM.weight_bytes(m, with_pats, ONE)["total"] - MEM.weight_bytes(m, base, ONE)["total"]
    assert got == int(round(extra)), (kind, sorted(kept)[:4])


def test_up_proj_keeps_both_halves_of_the_fused_pair(default_model_dir):
    """``*up_proj`` keeps mlp.gate and its fused partner mlp.fc (gate_proj) in every layer: 60 GEMMs of 576 x 1536,
    each BF16 (2 bytes/weight) instead of FP8 (1 byte/weight + 2 F32 scales): 60 x (884736 - 8) bytes more.
    Before the fix the plan counted one of the two (30 GEMMs)."""
    m = read_model_arch(default_model_dir)
    base = MEM.weight_bytes(m, prof("fp8-h100", quantization__exclude_modules=[]), ONE)["total"]
    up = MEM.weight_bytes(m, prof("fp8-h100", quantization__exclude_modules=["*up_proj"]), ONE)["total"]
    assert F.GEMM["FP8"].linear_bytes(576, 1536) == 576 * 1536 + 8
    assert up - base == 60 * (576 * 1536 - 8)
    assert {g.split(".", 3)[-1] for g in _export_bf16_gemms(m, ["*up_proj"])} == {"mlp.fc", "mlp.gate"}
