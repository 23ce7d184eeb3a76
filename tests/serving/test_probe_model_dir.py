"""The probe's reference model folder: taken from the gate's metrics.json unless --model /
PRECISION_PROBE_MODEL_DIR names it (a pod, another machine); a missing one is a UserError."""

from __future__ import annotations

import json

import numpy as np
import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.gate import reference as gate_reference
from precision_pipeline.serving import probe


def test_missing_reference_model_is_refused_with_the_fix(tmp_path, monkeypatch):
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "per_token.npz").write_bytes(b"")
    (gate / "metrics.json").write_text(json.dumps({"reference_cache": {"key": "k" * 64},
                                                   "reference_model_dir": str(tmp_path / "gone" / "SmolLM2-135M-Instruct"),
                                                   "prompts": [], "thresholds": {}}))
    monkeypatch.setattr(gate_reference, "cached_reference", lambda key, root=None: object())  # the stored reference is there
    monkeypatch.delenv("PRECISION_PROBE_MODEL_DIR", raising=False)
    with pytest.raises(UserError, match="SmolLM2-135M-Instruct, on this machine") as e:
        probe.load_probe_set(gate, 2)
    assert e.value.problems[0].field == "--model"
    monkeypatch.setenv("PRECISION_PROBE_MODEL_DIR", str(tmp_path / "also-gone"))
    with pytest.raises(UserError, match="also-gone"):
        probe.load_probe_set(gate, 2)


def _gate(tmp_path, **over):
    gate = tmp_path / "gate"
    gate.mkdir(exist_ok=True)
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")  # a folder that looks like a model; never loaded here
    np.savez(gate / "per_token.npz", prompt_index=np.zeros(1, np.int32), kl=np.zeros(1), top1=np.ones(1))
    met = {"reference_cache": {"key": "k" * 64}, "reference_model_dir": str(tmp_path / "model"), "prompts": [],
           "thresholds": {}, **over}
    (gate / "metrics.json").write_text(json.dumps({k: v for k, v in met.items() if v is not None}))
    return gate


@pytest.mark.parametrize("damage, says", [
    (lambda g: (g / "metrics.json").write_text("{bad json"), "not a gate run's metrics.json"),
    (lambda g: (g / "metrics.json").write_text("[1, 2]"), "not a gate run's metrics.json"),
    (lambda g: (g / "per_token.npz").write_bytes(b"junk"), "per_token.npz"),
])
def test_damaged_gate_folder_is_a_user_error(tmp_path, monkeypatch, damage, says):
    monkeypatch.setattr(gate_reference, "cached_reference", lambda key, root=None: object())
    gate = _gate(tmp_path)
    damage(gate)
    with pytest.raises(UserError, match=says) as e:
        probe.load_probe_set(gate, 2)
    assert e.value.problems[0].field == "gate" and "invoke build" in e.value.problems[0].fix


def test_gate_path_that_is_a_file_or_lacks_keys_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setattr(gate_reference, "cached_reference", lambda key, root=None: object())
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="has no metrics.json"):
        probe.load_probe_set(tmp_path / "afile", 2)
    with pytest.raises(UserError, match="reference_model_dir, prompts"):
        probe.load_probe_set(_gate(tmp_path, reference_model_dir=None, prompts=None), 2)


def test_garbage_or_other_reference_model_is_a_user_error(tmp_path, monkeypatch, default_model_dir):
    class Ref:
        hidden = [np.zeros((3, 64), np.float32)]  # a model with hidden size 64, not the default model's 576

    monkeypatch.setattr(gate_reference, "cached_reference", lambda key, root=None: Ref())
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "config.json").write_text("{}")
    monkeypatch.setenv("PRECISION_PROBE_MODEL_DIR", str(junk))
    gate = _gate(tmp_path)
    with pytest.raises(UserError, match="cannot load its tokenizer and lm_head") as e:
        probe.load_probe_set(gate, 2)
    assert e.value.problems[0].field == "PRECISION_PROBE_MODEL_DIR"
    with pytest.raises(UserError, match="hidden size 576, the gate's reference 64") as e:
        probe.load_probe_set(gate, 2, model_dir=default_model_dir)
    assert e.value.problems[0].field == "--model"


def test_an_errored_run_is_retried_sooner_than_the_period():
    assert probe.next_wait_s(600, {"error": "unit not loaded"}) == probe.RETRY_AFTER_ERROR_S == 30
    assert probe.next_wait_s(600, {"passed": False, "kl_p99": 9.0}) == 600  # a failed check waits the period
    assert probe.next_wait_s(10, {"error": "x"}) == 10  # never later than the period


def test_a_reference_missing_from_the_cache_names_a_fix_that_works(tmp_path, monkeypatch):
    """Hostile s17c F2: a build output copied without the reference cache: the probe said "rebuild the profile", but the
    rebuild reused the gate (its folder is there) and stored nothing. The fix names the cache folder to copy, or the
    gate folder to remove before the rebuild."""
    gate = _gate(tmp_path)
    monkeypatch.setattr(gate_reference, "cached_reference", lambda key, root=None: None)
    with pytest.raises(UserError) as ei:
        probe.load_probe_set(gate, 2, cache_root=tmp_path / "ref")
    p = ei.value.problems[0]
    assert p.reason.endswith(f"is not in the reference cache {tmp_path / 'ref'} (a build output copied from another "
                             "machine or cache).")
    assert p.fix == (f"copy {'k' * 32}/ from the reference cache of the machine that built it into {tmp_path / 'ref'}, or "
                     f"run the gate again: remove {gate} (a rebuild reuses a gate whose folder is there), then `invoke "
                     f"build --profile P --out {tmp_path}`.")
