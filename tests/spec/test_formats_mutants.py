"""Format-registry facts pinned down by mutation testing (tests/mutate.py survivors on spec/formats.py)."""

from __future__ import annotations

import dataclasses

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.resolve import derive as DER
from precision_pipeline.spec import formats as F
from tests.conftest import prof

Q, K = F.QuantAlgo, F.KVCacheQuantAlgo


def test_sm_text():
    assert F.sm_text(((80, 99), (120, F.ANY))) == "SM 80-99 or >= 120"
    assert F.sm_text(((100, 100), (103, 103), (120, 121))) == "SM 100, 103 or 120-121"
    assert F.sm_text(((89, F.ANY),)) == "SM >= 89"
    assert F.sm_text(()) == "no SM"


@pytest.mark.parametrize("table, algo", [(F.GEMM, Q.NVFP4), (F.KV, K.NVFP4)])
def test_nvfp4_is_blackwell_only(table, algo):
    e = table[algo]
    assert [sm for sm in range(80, 130) if e.supports(sm)] == [100, 103, 120, 121]


def test_int_formats_on_sm120_build_but_warn():
    for algo in (Q.W8A16, Q.W4A16_AWQ, Q.W8A8_SQ_PER_CHANNEL):
        e = F.GEMM[algo]
        assert e.supports(120) and e.untested(120) and not e.untested(90), algo
    assert F.KV[K.INT8].supports(120) and not F.KV[K.INT8].supports(100)


def test_constants():
    assert F.AWQ_DEFAULT_GROUP == 128           # INT4_AWQ_CFG block_sizes[-1] (ModelOpt 0.47)
    assert F.FP8_CONTEXT_FMHA_MIN_SM == 89      # builder.py: FP8 context FMHA on Ada/Hopper and later
    assert F.RUNTIME_RESERVE_BYTES == 2 ** 30   # ~1 GiB estimate
    assert F.MAX_NUM_TOKENS_ADVISED == 16384


def test_awq_default_group_sizes_the_scales():
    e = F.GEMM[Q.W4A16_AWQ]
    assert e.linear_bytes(1024, 256, None, 2, None) == e.linear_bytes(1024, 256, 128, 2, None)
    assert e.linear_bytes(1024, 256, None, 2, None) != e.linear_bytes(1024, 256, 64, 2, None)


@pytest.mark.parametrize("sm, kept", [(89, True), (90, True), (88, False), (86, False)])
def test_fp8_context_fmha_min_sm(sm, kept):
    p = prof("fp8-h100", context_phase__use_fp8_context_fmha=True, context_phase__use_paged_context_fmha=True)
    eff, _ = DER.derive_effective(p, sm)
    assert eff["use_fp8_context_fmha"] is kept


def test_format_entries_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        F.KV[K.FP8].paged_context_fmha = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        F.GEMM[Q.FP8].fp8_context_fmha = False


def test_kv_and_gemm_lookups_default_to_unquantized():
    assert F.kv(None) is F.KV[K.NONE] and F.kv("FP8") is F.KV[K.FP8] and F.kv(K.INT8) is F.KV[K.INT8]
    assert F.gemm(None) is F.GEMM[Q.NO_QUANT] and F.gemm("FP8") is F.GEMM[Q.FP8]


def test_search_candidates_on_cpu_and_cuda():
    assert F.normalize_candidates(["fp8", "INT4_AWQ", "FP8"], cuda_available=False) == ["FP8", "W4A16_AWQ"]
    assert F.normalize_candidates(["NVFP4", "FP8"], cuda_available=True) == ["NVFP4", "FP8"]
    with pytest.raises(UserError) as e:
        F.normalize_candidates(["FP8", "NVFP4"], cuda_available=False)
    assert e.value.problems[0].fix == "search over FP8 and W4A16_AWQ on CPU, or run the search on a GPU machine."
    assert e.value.problems[0].reason.startswith("NVFP4 cannot be a search candidate without a CUDA GPU")
