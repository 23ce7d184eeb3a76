"""The quantize stage's cache key covers every section the quantizer reads (planted-bug tests).

A second build that only adds ``quantization.keep_first_layers: 1`` must not reuse the first
build's checkpoint (layer 0 would stay FP8). Keys are computed with ``core.stage.stage_key`` on the
stage's own ``inputs()`` (no quantization runs).
"""

from __future__ import annotations


import pytest

from precision_pipeline.core import stage as stage_mod
from precision_pipeline.quantize.stage import QuantizeInputs, QuantizeStage
from precision_pipeline.spec.default_model import ensure_default_model
from tests.conftest import prof, request


def _plan(profile):
    """The resolved plan (refusals or not: ``job_of`` reads its fields) for the default model."""
    from precision_pipeline.resolve.plan import evaluate
    from precision_pipeline.spec.model_arch import read_model_arch

    return evaluate(profile, read_model_arch(ensure_default_model()))


def _key(profile) -> str:
    plan = _plan(profile)
    req = request(profile, model_dir=ensure_default_model())
    inputs = QuantizeStage().inputs(plan, req, {})
    assert isinstance(inputs, QuantizeInputs)
    return stage_mod.stage_key(QuantizeStage(), inputs, {})


BASE = "fp8-h100"

# one change per section the quantizer reads: each must change the key
CHANGES = {
    "keep_first_layers": {"quantization__keep_first_layers": 1},
    "keep_last_layers": {"quantization__keep_last_layers": 1},
    "exclude_modules": {"quantization__exclude_modules": ["lm_head", "*mlp.fc"]},
    "kv_cache_quant_algo": {"quantization__kv_cache_quant_algo": "NONE"},
    "quant_algo": {"quantization__quant_algo": "NO_QUANT", "quantization__kv_cache_quant_algo": "NONE"},
    "dtype": {"quantization__dtype": "float16"},
    "num_samples": {"calibration__num_samples": 7},
    "seq_len": {"calibration__seq_len": 65},
    "seed": {"calibration__seed": 1},
    "tp_size": {"parallel__tp_size": 2},
    "logits_dtype": {"build__logits_dtype": "float16"},
}

# what the quantizer does not read: the checkpoint is reused
SAME = {
    "max_batch_size": {"build__max_batch_size": 8},
    "gate": {"gate__kl_mean_max": 0.5},
    "gpu": {"target__gpu": "h200"},
    "replicas": {"deployment__replicas": 2},
    "context_fmha": {"context_phase__use_fp8_context_fmha": False},
}


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_quantizer_inputs_change_the_key(name):
    assert _key(prof(BASE, **CHANGES[name])) != _key(prof(BASE))


@pytest.mark.parametrize("name", sorted(SAME))
def test_other_sections_keep_the_key(name):
    assert _key(prof(BASE, **SAME[name])) == _key(prof(BASE))


def test_canonical_form_holds_the_quantization_section():
    from precision_pipeline.core.store import canonical

    p = prof(BASE, quantization__keep_first_layers=1)
    inputs = QuantizeStage().inputs(_plan(p), request(p, model_dir=ensure_default_model()), {})
    assert canonical(inputs)["job"]["quantization"]["keep_first_layers"] == 1
