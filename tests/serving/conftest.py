"""Fixtures shared by the serving tests that start a real server."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def gate_dir(tmp_path_factory, fp8_checkpoint, default_model_dir):
    """A small gate run of the FP8 + FP8-KV test checkpoint (one prompt per category; no held-out text, greedy
    tokens or noise floor; fp8-h100's bar for the default model without the two it does not measure): the
    probe's prompts and reference for test_rollout.py and test_observability.py. Once per session: both
    modules read it, neither writes to it; under pytest-xdist once per run (``once_per_run``), not per worker."""
    from precision_pipeline.gate.checkpoint_gate import gate_checkpoint
    from precision_pipeline.gate.options import GateOptions, GateRuntime
    from precision_pipeline.spec.profile import load_profile
    from tests.conftest import once_per_run

    def make(folder):
        thr = load_profile("fp8-h100").gate.for_model_dir(default_model_dir).thresholds().model_copy(
            update={"ppl_delta_pct_max": None, "greedy_same_min": None})  # not measured in this small run
        opts = GateOptions(prompts_per_category=1, heldout_tokens=0, greedy_new_tokens=0, noise_floor=False,
                           bootstrap_resamples=50)
        res = gate_checkpoint(fp8_checkpoint, default_model_dir, thr, folder / "gate", opts,
                              GateRuntime(progress=False, write_report=False))
        assert res.passed, res.failures

    return once_per_run(tmp_path_factory, "rollout-gate", make) / "gate"
