"""The trtllm-build argv is a function of the plan's EFFECTIVE settings only.

Real plans (``resolve.plan.evaluate`` on the default model) whose effective settings differ from
what the profile asked for: the builder's own overrides (``rules.derive_effective``, after
``tensorrt_llm/builder.py build()``) must reach the command line, and the profile's requested
values must not. Also: ``build.gather_context_logits`` reaches the argv through the engine stage,
and the memory plan reserves context logits exactly when the argv asks for them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from precision_pipeline.engine.trtllm_build import build_args, run_engine
from precision_pipeline.engine.toolchain import Toolchain
from precision_pipeline.resolve import plan as P
from precision_pipeline.resolve import memory as MEM
from precision_pipeline.spec import formats as F
from precision_pipeline.spec.default_model import ensure_default_model
from tests.engine.test_engine import _argmap  # one argv parser for the engine tests
from tests.conftest import prof

CK, OUT = Path("/ckpt"), Path("/eng")
PLUGIN_FLAGS = {"context_fmha": "--context_fmha", "use_paged_context_fmha": "--use_paged_context_fmha",
                "use_fp8_context_fmha": "--use_fp8_context_fmha"}


def _plan(base: str, **dotted) -> P.ResolvedPlan:
    return P.evaluate(prof(base, **dotted), ensure_default_model())


def _mixed_fp8kv_paged():
    """MIXED_PRECISION + FP8 KV asking for paged context FMHA: the builder turns it off."""
    return _plan("mixed-fp8-int4-h100", context_phase__use_paged_context_fmha=True)


def _fp8_paged_without_fp8_fmha():
    """FP8 + FP8 KV + paged context FMHA with use_fp8_context_fmha false: the builder turns it on."""
    return _plan("fp8-h100", context_phase__use_paged_context_fmha=True, context_phase__use_fp8_context_fmha=False)


def test_builder_turns_paged_context_fmha_off_and_the_argv_follows():
    p = _mixed_fp8kv_paged()
    assert p.profile.quantization.quant_algo == F.QuantAlgo.MIXED_PRECISION
    assert p.profile.quantization.kv_cache_quant_algo == F.KVCacheQuantAlgo.FP8
    assert p.profile.context_phase.use_paged_context_fmha is True         # asked
    assert p.effective.use_paged_context_fmha is False                    # the builder's override
    assert any(o.field == "context_phase.use_paged_context_fmha" and o.asked is True and o.effective is False
               for o in p.effective.overrides)
    a = _argmap(build_args(p, CK, OUT))
    assert a["--use_paged_context_fmha"] == "disable"
    assert a["--use_fp8_context_fmha"] == "disable"


def test_builder_turns_fp8_context_fmha_on_and_the_argv_follows():
    p = _fp8_paged_without_fp8_fmha()
    assert p.profile.context_phase.use_fp8_context_fmha is False          # asked
    assert p.effective.use_fp8_context_fmha is True                       # the builder's override
    a = _argmap(build_args(p, CK, OUT))
    assert a["--use_fp8_context_fmha"] == "enable"
    assert a["--use_paged_context_fmha"] == "enable"


def test_int8_kv_cache_turns_paged_context_fmha_off():
    p = _plan("int8-sq-l4", quantization__kv_cache_quant_algo="INT8", context_phase__use_paged_context_fmha=True,
              runtime__enable_kv_cache_reuse=False, context_phase__enable_chunked_context=False)
    assert p.profile.context_phase.use_paged_context_fmha is True and p.effective.use_paged_context_fmha is False
    assert _argmap(build_args(p, CK, OUT))["--use_paged_context_fmha"] == "disable"


@pytest.mark.parametrize("make", [_mixed_fp8kv_paged, _fp8_paged_without_fp8_fmha])
def test_argv_ignores_the_requested_settings(make):
    """Same effective settings, a profile that asks for the opposite of everything: same argv."""
    p = make()
    cp = p.profile.context_phase
    flipped = p.profile.model_copy(update={
        "context_phase": cp.model_copy(update={k: not getattr(cp, k) for k in PLUGIN_FLAGS}),
        "build": p.profile.build.model_copy(update={"gather_context_logits": not p.effective.gather_context_logits}),
    })
    assert build_args(p.model_copy(update={"profile": flipped}), CK, OUT) == build_args(p, CK, OUT)


@pytest.mark.parametrize("field", [*PLUGIN_FLAGS, "gather_context_logits"])
def test_each_effective_flag_reaches_the_argv(field):
    p = _fp8_paged_without_fp8_fmha()
    for value in (True, False):
        q = p.model_copy(update={"effective": p.effective.model_copy(update={field: value})})
        a = _argmap(build_args(q, CK, OUT))
        if field == "gather_context_logits":
            assert ("--gather_context_logits" in a) is value
        else:
            assert a[PLUGIN_FLAGS[field]] == ("enable" if value else "disable")


def test_gather_context_logits_reaches_trtllm_build_through_the_engine_stage(tmp_path):
    """The real bug: build.gather_context_logits: true never reached the command line."""
    from precision_pipeline.core.stage import Done, StageRecord
    from precision_pipeline.engine.stage import EngineStage
    from tests.conftest import request

    off = _plan("fp8-h100")
    on = _plan("fp8-h100", build__gather_context_logits=True)
    assert off.effective.gather_context_logits is False and on.effective.gather_context_logits is True
    assert on.gather_context_logits is True
    q = Done(artifact=None, key="0" * 64, dir=tmp_path / "checkpoint", record=StageRecord("quantize", "done"))
    for plan, want in ((off, False), (on, True)):
        inputs = EngineStage().inputs(plan, request(plan.profile, tmp_path / "out"), {"quantize": q})
        (tmp_path / f"w{want}").mkdir()
        res = run_engine(inputs, inputs.checkpoint.path, Path(inputs.engine_dir), inputs.sm,
                         Toolchain(False, None, []), workdir=tmp_path / f"w{want}")
        assert ("--gather_context_logits" in res.argv) is want
        assert plan.to_json()["effective"]["gather_context_logits"] is want


def test_memory_plan_reserves_context_logits_exactly_when_the_argv_gathers_them():
    off = _plan("fp8-h100")
    on = _plan("fp8-h100", build__gather_context_logits=True)
    lim, m = on.limits, on.model
    rows_on, rows_off = lim.max_num_tokens, lim.max_batch_size * lim.max_beam_width
    want = (rows_on - rows_off) * m.vocab_size * F.DTYPE_BYTES[on.effective.logits_dtype]
    assert want > 0
    assert on.memory.activation_bytes_estimate - off.memory.activation_bytes_estimate == want
    for p in (on, off):
        gathers = "--gather_context_logits" in build_args(p, CK, OUT)
        assert gathers is p.effective.gather_context_logits
        ctx_rows = MEM.activation_bytes(m, p.profile, p.mapping.model_dump(), p.limits.model_dump(), gathers)
        assert ctx_rows == p.memory.activation_bytes_estimate
