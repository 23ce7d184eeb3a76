"""The quantize stage's inputs hold exactly what the run reads (``QuantizeInputs``: model, resolved job, calibration
file content, device, dtype) with no ``canonical()`` override: each keyed field changes the key, the one unkeyed
field (a calibration file's path) is declared with its reason and does not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from precision_pipeline.core import stage as stage_mod
from precision_pipeline.core.store import canonical
from precision_pipeline.quantize.job import QuantizeJob
from precision_pipeline.quantize.stage import QuantizeInputs, QuantizeStage
from precision_pipeline.resolve.plan import evaluate
from precision_pipeline.spec.device import DeviceChoice
from precision_pipeline.spec.model_arch import read_model_arch
from tests.conftest import prof


@pytest.fixture()
def key_of(tmp_path, monkeypatch, default_model_dir):
    monkeypatch.setenv("PRECISION_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    arch = read_model_arch(default_model_dir)

    def key(p, device=None) -> str:
        plan = evaluate(p, arch)
        assert plan.ok, plan.problems
        st = QuantizeStage()
        inputs = st.inputs(plan, SimpleNamespace(checkpoint=None, model_dir=model, device=device), {})
        return stage_mod.stage_key(st, inputs, {})

    return key


def test_no_canonical_override_and_the_unkeyed_field_has_its_reason():
    assert "canonical" not in QuantizeInputs.__dict__ and "canonical" not in QuantizeJob.__dict__
    unkeyed = dict(QuantizeJob.unkeyed)
    assert list(unkeyed) == ["calibration_path"] and "content is keyed" in unkeyed["calibration_path"]
    assert not dict(QuantizeInputs.unkeyed)
    job = QuantizeJob(architecture="LlamaForCausalLM", quantization=prof("fp8-h100").quantization,
                      calibration=prof("fp8-h100").calibration, calibration_path="/x/y.jsonl")
    assert set(canonical(job)) == set(QuantizeJob.model_fields) - {"calibration_path"}


def test_exclusions_and_every_keyed_field_change_the_key(key_of, tmp_path):
    base = prof("fp8-h100", quantization__exclude_modules=["lm_head"])
    k = key_of(base)
    assert key_of(prof("fp8-h100", quantization__exclude_modules=["lm_head"])) == k  # deterministic
    changed = {
        "exclude_modules": prof("fp8-h100", quantization__exclude_modules=["lm_head", "*down_proj"]),
        "keep_first_layers": prof("fp8-h100", quantization__exclude_modules=["lm_head"], quantization__keep_first_layers=1),
        "quant_algo": prof("fp8-h100", quantization__exclude_modules=["lm_head"], quantization__quant_algo="W8A16",
                           quantization__kv_cache_quant_algo="NONE", context_phase__use_fp8_context_fmha=False),
        "calibration": prof("fp8-h100", quantization__exclude_modules=["lm_head"], calibration__num_samples=17),
        "tp_size": prof("fp8-h100", quantization__exclude_modules=["lm_head"], parallel__tp_size=3,
                        deployment__gpus_per_replica=3),
        "logits_dtype": prof("fp8-h100", quantization__exclude_modules=["lm_head"], build__logits_dtype="float16"),
    }
    keys = {name: key_of(p) for name, p in changed.items()}
    assert all(v != k for v in keys.values()), keys
    assert len(set(keys.values())) == len(keys)
    # where it runs is keyed too (numbers differ between FP32 on the CPU and BF16 on CUDA)
    cuda = DeviceChoice(asked="cuda", device="cuda", reason="test", host_available_bytes=1 << 40, host_total_bytes=1 << 40)
    assert key_of(base, device=cuda) != k
    # a deployment-only change does not re-quantize
    assert key_of(prof("fp8-h100", quantization__exclude_modules=["lm_head"], deployment__replicas=5)) == k


def test_a_calibration_file_edit_changes_the_key_its_path_does_not(key_of, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "moved" / "a.jsonl"
    b.parent.mkdir()
    for f in (a, b):
        f.write_text('{"text": "one"}\n{"text": "two"}\n')
    k = key_of(prof("fp8-h100", calibration__dataset=str(a), calibration__num_samples=2))
    assert key_of(prof("fp8-h100", calibration__dataset=str(b), calibration__num_samples=2)) == k
    a.write_text('{"text": "one"}\n{"text": "three"}\n')
    assert key_of(prof("fp8-h100", calibration__dataset=str(a), calibration__num_samples=2)) != k


def test_the_export_format_is_keyed_and_the_route_sets_it(key_of, monkeypatch):
    """Issue 28: ``QuantizeJob.export_format`` (the llm_api route's unified HF checkpoint) is keyed: the same profile
    on the two routes makes two checkpoints; the engine route's job is what it was."""
    from precision_pipeline.quantize import job as job_mod

    k = key_of(prof("fp8-h100"))
    real = job_mod.job_of
    monkeypatch.setattr("precision_pipeline.quantize.stage.job_of",
                        lambda plan: real(SimpleNamespace(profile=plan.profile, model=plan.model, mapping=plan.mapping,
                                                          route="llm_api")))
    assert key_of(prof("fp8-h100")) != k
