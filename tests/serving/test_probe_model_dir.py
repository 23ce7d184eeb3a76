"""The probe's reference model folder: taken from the gate's metrics.json unless --model /
PRECISION_PROBE_MODEL_DIR names it (a pod, another machine); a missing one is a UserError."""

from __future__ import annotations

import json

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.gate import checkpoint_gate as cg
from precision_pipeline.serving import probe


def test_missing_reference_model_is_refused_with_the_fix(tmp_path, monkeypatch):
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "per_token.npz").write_bytes(b"")
    (gate / "metrics.json").write_text(json.dumps({"reference_cache": {"key": "k" * 64},
                                                   "reference_model_dir": str(tmp_path / "gone" / "SmolLM2-135M-Instruct"),
                                                   "prompts": [], "thresholds": {}}))
    monkeypatch.setattr(cg, "cached_reference", lambda key, root=None: object())  # the stored reference is there
    monkeypatch.delenv("PRECISION_PROBE_MODEL_DIR", raising=False)
    with pytest.raises(UserError, match="SmolLM2-135M-Instruct, on this machine") as e:
        probe.load_probe_set(gate, 2)
    assert e.value.problems[0].field == "--model"
    monkeypatch.setenv("PRECISION_PROBE_MODEL_DIR", str(tmp_path / "also-gone"))
    with pytest.raises(UserError, match="also-gone"):
        probe.load_probe_set(gate, 2)
