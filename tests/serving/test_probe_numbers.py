"""The probe's numeric path without a server (fast): a stand-in HTTP client returns chosen context
logits, so KL P99 / mean, top-1, the checks at their thresholds, the intervals, the request the
probe sends and its refusals are pinned to exact values (the live probe: test_rollout.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from precision_pipeline.gate import metrics as gm
from precision_pipeline.serving import probe
from precision_pipeline.spec.profile import GateThresholds

V = 5  # vocabulary


class _Result:
    def __init__(self, arr):
        self.arr = arr

    def as_numpy(self, name):
        assert name == "context_logits"
        return self.arr


class Client:
    """Answers engine_context_logits: ``logits[prompt_id]`` ([T, V]) as context_logits [1, T + extra, V]."""

    def __init__(self, logits_by_len, extra=0, shape=None, fail=None):
        self.logits, self.extra, self.shape, self.fail = logits_by_len, extra, shape, fail
        self.calls, self.closed = [], 0

    def infer(self, unit, inputs, outputs=None):
        ins = {i.name(): (i.datatype(), i.shape()) for i in inputs}
        self.calls.append((unit, ins, [o.name() for o in outputs]))
        if self.fail:
            raise self.fail
        t = ins["input_ids"][1][1]
        lg = self.logits[t]
        if self.shape is not None:
            return _Result(None if self.shape == "none" else np.zeros(self.shape, np.float32))
        pad = np.full((self.extra, V), 7.0, np.float32)
        return _Result(np.concatenate([lg, pad])[None])

    def close(self):
        self.closed += 1


class Server:
    def __init__(self, client):
        self.client = client

    def http_client(self):
        return self.client


def _prompt(pid, n_ids, answer, ref, kl=(0.0,), top1=(1,)):
    return probe.ProbePrompt(pid, "cat", list(range(1, n_ids + 1)), answer, torch.tensor(ref, dtype=torch.float32),
                             np.array(kl), np.array(top1))


REF_A = [[4.0, 0.0, 0.0, 0.0, 0.0], [0.0, 4.0, 0.0, 0.0, 0.0]]
REF_B = [[0.0, 0.0, 4.0, 0.0, 0.0]]


def _set(thr=GateThresholds(kl_p99_max=0.5, top1_min=0.5)):
    a = _prompt("a", 4, slice(1, 3), REF_A, kl=(0.1, 0.3), top1=(1, 0))
    b = _prompt("b", 3, slice(2, 3), REF_B, kl=(0.2,), top1=(1,))
    return probe.ProbeSet([a, b], thr, end_id=2, gate_dir=None, reference_key="k")


def _engine(same=True):
    """Engine logits for prompt a (4 tokens) and b (3 tokens): the reference at the answer rows, or,
    with same=False, prompt a's second answer row pointing at another token."""
    a = np.zeros((4, V), np.float32)
    a[1:3] = REF_A
    if not same:
        a[2] = [0.0, 0.0, 0.0, 4.0, 0.0]
    b = np.zeros((3, V), np.float32)
    b[2] = REF_B[0]
    return {4: a, 3: b}


def test_identical_logits_score_zero_and_pass():
    ps = _set()
    c = Client(_engine(), extra=1)  # one generated position after the prompt is ignored
    r = probe.run_probe(Server(c), "tensorrt_llm_u", ps, bootstrap=20)
    assert (r.unit, r.tokens, r.prompts) == ("tensorrt_llm_u", 3, 2)
    assert r.kl_p99 == pytest.approx(0.0, abs=1e-6) and r.kl_mean == pytest.approx(0.0, abs=1e-6) and r.top1 == 1.0
    assert r.passed and r.failures == []
    assert r.checks["kl_p99"]["op"] == "<=" and r.checks["top1"]["op"] == ">=" and r.checks["top1"]["threshold"] == 0.5
    assert [p["id"] for p in r.per_prompt] == ["a", "b"] and [p["tokens"] for p in r.per_prompt] == [2, 1]
    # the gate's own numbers on these prompts, from per_token.npz
    assert r.gate_same_prompts == {"kl_p99": pytest.approx(np.percentile([0.1, 0.3, 0.2], 99)),
                                   "kl_mean": pytest.approx(0.2), "top1": pytest.approx(2 / 3), "tokens": 3}
    assert c.closed == 1 and len(c.calls) == 2


def test_the_request_the_probe_sends():
    c = Client(_engine())
    probe.run_probe(Server(c), "tensorrt_llm_u", _set(), bootstrap=5)
    unit, ins, outs = c.calls[0]
    assert unit == "tensorrt_llm_u" and outs == ["context_logits"]
    assert ins == {"input_ids": ("INT32", [1, 4]), "input_lengths": ("INT32", [1, 1]), "request_output_len": ("INT32", [1, 1]),
                   "end_id": ("INT32", [1, 1]), "pad_id": ("INT32", [1, 1]), "return_context_logits": ("BOOL", [1, 1])}


def test_a_wrong_token_counts_exactly():
    """Prompt a's second answer token: the engine puts all its mass elsewhere. Exact numbers from
    the gate's own token_metrics on the same rows."""
    ps = _set()
    r = probe.run_probe(Server(Client(_engine(same=False))), "u", ps, bootstrap=50)
    m = gm.token_metrics(torch.tensor([REF_A[1]]), torch.tensor([[0.0, 0.0, 0.0, 4.0, 0.0]]))
    bad = float(m.kl[0])
    assert bad > 1.0
    kl = np.array([0.0, bad, 0.0])
    assert r.kl_mean == pytest.approx(bad / 3, rel=1e-5)
    assert r.kl_p99 == pytest.approx(float(np.percentile(kl, 99)), rel=1e-5)
    assert r.top1 == pytest.approx(2 / 3)
    assert not r.passed and r.failures == ["kl_p99"]  # top1 2/3 >= 0.5 still passes
    assert r.checks["kl_p99"] == {"value": r.kl_p99, "threshold": 0.5, "op": "<=", "passed": False}
    assert r.per_prompt[0] == {"id": "a", "tokens": 2, "kl_mean": pytest.approx(bad / 2, rel=1e-5), "top1": 0.5}
    lo, hi = r.ci95["kl_p99"]
    assert 0.0 <= lo <= r.kl_p99 <= hi and set(r.ci95) == {"kl_p99", "kl_mean", "top1"}
    # the intervals are the gate's own bootstrap over prompts (same statistic, resamples and seed)
    groups = [np.array([0.0, bad], np.float32), np.array([0.0], np.float32)]
    assert r.ci95["kl_p99"] == pytest.approx(list(gm.bootstrap_ci(groups, lambda x: float(np.percentile(x, 99)), 50, 0)), abs=1e-6)
    assert r.ci95["kl_mean"] == pytest.approx(list(gm.bootstrap_ci(groups, np.mean, 50, 0)), abs=1e-6)
    s = r.summary()
    assert s["passed"] is False and s["tokens"] == 3 and s["unit"] == "u" and s["ms"] >= 0
    r.ms = 12.3456
    assert r.summary()["ms"] == 12.3  # rounded to 0.1 ms


def test_checks_at_their_thresholds():
    """kl_p99 <= max and top1 >= min pass AT the threshold; None is not checked."""
    ps = _set(GateThresholds(kl_p99_max=0.0, top1_min=1.0))
    r = probe.run_probe(Server(Client(_engine())), "u", ps, bootstrap=5)
    assert r.checks["kl_p99"]["passed"] is True and r.checks["top1"]["passed"] is True and r.passed
    r = probe.run_probe(Server(Client(_engine(same=False))), "u", _set(GateThresholds(top1_min=0.7)), bootstrap=5)
    assert r.checks["kl_p99"]["passed"] is None and r.checks["top1"]["passed"] is False and r.failures == ["top1"]
    r = probe.run_probe(Server(Client(_engine(same=False))), "u", _set(GateThresholds()), bootstrap=5)
    assert r.passed and r.failures == []


@pytest.mark.parametrize("shape, says", [
    ("none", "context_logits None"),
    ((4, V), r"context_logits \(4, 5\)"),      # no batch dimension
    ((2, 4, V), r"context_logits \(2, 4, 5\)"),  # two sequences
    ((1, 3, V), r"context_logits \(1, 3, 5\), expected \[1, 4, vocab\]"),  # fewer positions than the prompt
])
def test_wrong_logits_shape_is_a_runtime_error(shape, says):
    c = Client(_engine(), shape=shape)
    with pytest.raises(RuntimeError, match=says):
        probe.run_probe(Server(c), "u", _set(), bootstrap=5)
    assert c.closed == 1


def test_server_error_is_a_runtime_error_naming_the_unit():
    c = Client(_engine(), fail=ConnectionError("refused"))
    with pytest.raises(RuntimeError, match="probe of u: ConnectionError: refused"):
        probe.run_probe(Server(c), "u", _set(), bootstrap=5)
    assert c.closed == 1


def test_engine_context_logits_with_its_own_client():
    c = Client(_engine(), extra=2)
    out = probe.engine_context_logits(Server(c), "u", [1, 2, 3], end_id=2)
    assert out.dtype == torch.float32 and tuple(out.shape) == (3, V) and c.closed == 1


def test_spread_takes_one_prompt_per_category_in_turn():
    cats = ["x", "x", "x", "y", "z", "z"]
    assert probe._spread(6, cats, 1) == [0]
    assert probe._spread(6, cats, 3) == [0, 3, 4]
    assert probe._spread(6, cats, 4) == [0, 1, 3, 4]
    assert probe._spread(6, cats, 5) == [0, 1, 3, 4, 5]
    assert probe._spread(6, cats, 10) == [0, 1, 2, 3, 4, 5]
    assert probe.DEFAULT_PROMPTS == 4 and probe.DEFAULT_BOOTSTRAP == 200


def test_probe_and_record_and_the_exporter(tmp_path):
    from prometheus_client import generate_latest

    ex = probe.ProbeExporter()
    rec = probe.probe_and_record(Server(Client(_engine(same=False))), "u", _set(), profile="fp8-h100", exporter=ex)
    assert rec["unit"] == "u" and rec["profile"] == "fp8-h100" and rec["probe"]["passed"] is False
    err = probe.probe_and_record(Server(Client(_engine(), fail=OSError("down"))), "u", _set(), profile="fp8-h100",
                                 exporter=ex)
    assert err["probe"]["passed"] is False and "OSError: down" in err["probe"]["error"]
    text = generate_latest(ex.registry).decode()
    lab = 'engine_unit="u",profile="fp8-h100",route=""'
    assert f'precision_pipeline_probe_passed{{{lab}}} 0.0' in text
    assert f'precision_pipeline_probe_kl_p99_threshold{{{lab}}} 0.5' in text
    assert f'precision_pipeline_probe_top1_threshold{{{lab}}} 0.5' in text
    assert f'precision_pipeline_probe_tokens{{{lab}}} 3.0' in text
    assert f'precision_pipeline_probe_top1{{{lab}}} 0.666666' in text
    assert 'precision_pipeline_probe_runs_total{engine_unit="u",profile="fp8-h100",result="fail",route=""} 1.0' in text
    assert 'precision_pipeline_probe_runs_total{engine_unit="u",profile="fp8-h100",result="error",route=""} 1.0' in text
    assert f'{probe.PROBE_LAST_RUN}{{{lab}}}' in text


def test_a_metrics_port_in_use_is_a_user_error_naming_the_flag():
    """Hostile round s11: `probe --every 1 --metrics-port <a port in use>` ended in an OSError traceback (exit 1)."""
    import socket

    from precision_pipeline.core.errors import EXIT_INVALID, UserError

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(UserError) as e:
            probe.ProbeExporter(port, addr="127.0.0.1")
    assert e.value.exit_code == EXIT_INVALID
    assert str(e.value).startswith("--metrics-port") and f"127.0.0.1:{port}" in str(e.value) and "in use" in str(e.value)
