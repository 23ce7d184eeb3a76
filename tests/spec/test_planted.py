"""Format registry facts that a user pays for when they drift (planted-bug tests).

SmoothQuant (W8A8_SQ_PER_CHANNEL) is refused by trtllm-build on SM 100-119 only
(``tensorrt_llm/builder.py``: 'SmoothQuant is not supported on SM>=100', with SM 120 consumer
Blackwell re-admitted); on SM 120 it builds and the plan warns that the support matrix does not list
it. A registry entry whose refusal message names a range must refuse exactly that range.
"""

from __future__ import annotations

import re

import pytest

from precision_pipeline.resolve import plan as P
from precision_pipeline.spec import formats as F
from precision_pipeline.spec.default_model import ensure_default_model
from tests.conftest import prof

SQ = F.QuantAlgo.W8A8_SQ_PER_CHANNEL


@pytest.mark.parametrize("sm, ok", [(75, False), (80, True), (86, True), (89, True), (90, True), (99, True),
                                    (100, False), (103, False), (110, False), (119, False), (120, True), (121, True)])
def test_smoothquant_sm_range(sm, ok):
    assert F.GEMM[SQ].supports(sm) is ok


def test_smoothquant_on_sm120_builds_with_a_warning_not_a_refusal():
    p = P.evaluate(prof("int8-sq-l4", target={"gpu": "rtx5090"}), ensure_default_model())
    assert p.gpu.sm == 120
    assert not [x for x in p.problems if x.field == "quantization.quant_algo"], p.problems
    assert any("W8A8_SQ_PER_CHANNEL on SM 120" in w and "format.gemm_sm" in w for w in p.warnings), p.warnings


def test_smoothquant_on_sm100_is_refused_with_the_builders_reason():
    p = P.evaluate(prof("int8-sq-l4", target={"gpu": "b200"}), ensure_default_model())
    (pr,) = [x for x in p.problems if x.field == "quantization.quant_algo"]
    assert pr.rule == "format.gemm_sm" and "SM 100-119" in pr.reason and "is SM 100" in pr.reason


def _ranges_named(message: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(r"SM (\d+)-(\d+)", message)]


@pytest.mark.parametrize("table", [F.GEMM, F.KV], ids=["GEMM", "KV"])
def test_refusal_messages_agree_with_the_sm_ranges(table):
    """A message 'refused ... on SM A-B' means: refused on A..B, accepted just outside it (>= 80)."""
    checked = 0
    for fmt in table.values():
        for lo, hi in _ranges_named(fmt.needs):
            checked += 1
            for sm in range(lo, hi + 1):
                assert not fmt.supports(sm), (fmt, sm)
            for sm in (lo - 1, hi + 1):
                if sm >= 80:
                    assert fmt.supports(sm), (fmt.algo, sm, fmt.needs)
    assert checked >= 1
