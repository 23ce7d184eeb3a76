"""gate/engine_gate.py on a stand-in ``tensorrt_llm`` (issue 26: its fast tests scored 0/10; the engine gate runs only
where TensorRT-LLM and a GPU are). The stand-in records what the gate asks of TensorRT-LLM's runtime
(``tensorrt_llm.runtime.ModelRunnerCpp.from_dir`` / ``.generate``, ``tensorrt_llm._utils.mpi_rank`` / ``mpi_barrier``):
greedy decoding is top_k 1, top_p 0, temperature 1, one beam, the stop token as end and pad id, and a generated
sequence is cut after its first stop token. Test doubles only: the product never runs an engine it did not build."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from precision_pipeline.core.errors import StrictSkip, UserError
from precision_pipeline.gate import engine_gate as EG
from precision_pipeline.gate.options import GateOptions
from precision_pipeline.spec.profile import GateThresholds


class FakeRunner:
    made: list = []
    gather_context_logits = True

    def __init__(self):
        self.calls = []

    @classmethod
    def from_dir(cls, **kw):
        r = cls()
        cls.made.append((kw, r))
        return r

    def generate(self, batch, **kw):
        self.calls.append(([b.tolist() for b in batch], kw))
        stop = kw["end_id"]
        out = [[p.tolist() + [5, stop, 7, 9][:kw["max_new_tokens"]] + [stop] * 2] for p in batch]
        n = max(len(o[0]) for o in out)
        out = [[o[0] + [stop] * (n - len(o[0]))] for o in out]
        lens = [[len(p) + min(3, kw["max_new_tokens"])] for p in batch]
        return {"output_ids": torch.tensor(out), "sequence_lengths": torch.tensor(lens),
                "context_logits": [torch.arange(len(batch[0]) * 4 + 8, dtype=torch.float32).reshape(-1, 4)]}


@pytest.fixture
def trtllm(monkeypatch):
    """A stand-in tensorrt_llm package (runtime.ModelRunnerCpp, _utils.mpi_rank / mpi_barrier) and a visible CUDA."""
    FakeRunner.made = []
    pkg = types.ModuleType("tensorrt_llm")
    pkg.__spec__ = importlib.machinery.ModuleSpec("tensorrt_llm", None)
    rt = types.ModuleType("tensorrt_llm.runtime")
    rt.ModelRunnerCpp = FakeRunner
    utils = types.ModuleType("tensorrt_llm._utils")
    state = {"rank": 0, "barriers": 0}
    utils.mpi_rank = lambda: state["rank"]
    utils.mpi_barrier = lambda: state.__setitem__("barriers", state["barriers"] + 1)
    pkg.runtime, pkg._utils = rt, utils
    for name, mod in (("tensorrt_llm", pkg), ("tensorrt_llm.runtime", rt), ("tensorrt_llm._utils", utils)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return state


@pytest.mark.parametrize("cfg, want", [({"build_config": {"gather_context_logits": False, "gather_all_token_logits": True}}, False),
                                       ({"build_config": {"gather_all_token_logits": 1}}, True),
                                       ({"build_config": {"gather_context_logits": 1}}, True),
                                       ({"build_config": None}, None), ({}, None)])
def test_gathers_context_logits(cfg, want):
    assert EG._gathers_context_logits(cfg) is want


def test_engine_available(monkeypatch, trtllm):
    assert EG.engine_available() == (True, "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EG.engine_available() == (False, f"{EG.SKIP_REASON} (no CUDA device visible)")
    monkeypatch.delitem(sys.modules, "tensorrt_llm")
    monkeypatch.setattr(EG.importlib.util, "find_spec", lambda name: None)
    assert EG.engine_available() == (False, "skipped: needs tensorrt_llm and a GPU (tensorrt_llm is not installed)")


def test_greedy_asks_the_runner_for_greedy_decoding(trtllm, tmp_path):
    cand = EG.EngineCandidate(tmp_path, max_new_tokens=32, rank=0)
    ((kw, runner),) = FakeRunner.made
    assert kw == {"engine_dir": str(tmp_path), "rank": 0, "max_output_len": 32}
    assert cand.name == f"engine {tmp_path.name}"
    got = cand.greedy_batch([[11, 12], [13]], 4, stop_id=2)
    # generated 5, 2, 7 (sequence length: prompt + 3): cut after the first stop token
    assert got == [[5, 2], [5, 2]]
    (batch, gk), = runner.calls
    assert batch == [[11, 12], [13]]
    assert gk == {"max_new_tokens": 4, "end_id": 2, "pad_id": 2, "top_k": 1, "top_p": 0.0, "temperature": 1.0,
                  "num_beams": 1, "output_sequence_lengths": True, "return_dict": True}
    assert cand.greedy([11, 12], 1, stop_id=2) == [5]  # one new token: no stop token in it
    EG.EngineCandidate(tmp_path, max_new_tokens=0)
    assert FakeRunner.made[-1][0]["max_output_len"] == 1


def test_logits_asks_one_token_and_keeps_the_prompt_rows(trtllm, tmp_path):
    cand = EG.EngineCandidate(tmp_path)
    cl = cand.logits([1, 2, 3])
    assert cl.shape == (3, 4) and cl[2].tolist() == [8.0, 9.0, 10.0, 11.0]
    (_, gk), = FakeRunner.made[0][1].calls
    assert gk == {"max_new_tokens": 1, "end_id": 0, "pad_id": 0, "top_k": 1, "top_p": 0.0, "temperature": 1.0,
                  "num_beams": 1, "output_sequence_lengths": True, "return_dict": True}
    assert FakeRunner.made[0][0]["max_output_len"] == 64  # the default greedy budget


@pytest.mark.parametrize("shape", [(1, 5, 4), (5, 4)])
def test_logits_of_a_batched_or_flat_tensor(trtllm, tmp_path, monkeypatch, shape):
    """ModelRunnerCpp returns context logits as a list per request or one tensor ``[batch, T, V]`` (or ``[T, V]``)."""
    full = torch.arange(20, dtype=torch.float32).reshape(shape)
    monkeypatch.setattr(FakeRunner, "generate", lambda self, batch, **kw: {"context_logits": full})
    cl = EG.EngineCandidate(tmp_path).logits([1, 2, 3])
    assert cl.tolist() == torch.arange(12, dtype=torch.float32).reshape(3, 4).tolist()
    monkeypatch.setattr(FakeRunner, "generate", lambda self, batch, **kw: {"context_logits": full[..., :2, :]})
    with pytest.raises(RuntimeError, match="engine returned 2 context-logit rows for 3 tokens"):
        EG.EngineCandidate(tmp_path).logits([1, 2, 3])


def test_a_runner_without_context_logits_is_refused(trtllm, tmp_path, monkeypatch):
    monkeypatch.setattr(FakeRunner, "gather_context_logits", False)
    with pytest.raises(UserError, match="without --gather_context_logits"):
        EG.EngineCandidate(tmp_path)


def _engine(tmp_path, **bc) -> Path:
    d = tmp_path / "engine"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"build_config": {"gather_context_logits": True, **bc}}))
    return d


def test_skipped_without_tensorrt_llm_unless_strict(tmp_path, monkeypatch):
    monkeypatch.setattr(EG, "engine_available", lambda: (False, "skipped: needs tensorrt_llm and a GPU (x)"))
    res = EG.run_engine_gate(tmp_path / "e", tmp_path / "m", GateThresholds(), tmp_path / "out")
    assert isinstance(res, EG.EngineGateSkipped) and res.status == "skipped"
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert {k: m[k] for k in ("status", "reason", "passed", "engine_dir")} == {
        "status": "skipped", "reason": "skipped: needs tensorrt_llm and a GPU (x)", "passed": None,
        "engine_dir": str(tmp_path / "e")}
    with pytest.raises(StrictSkip):
        EG.run_engine_gate(tmp_path / "e", tmp_path / "m", GateThresholds(), tmp_path / "out2", strict=True)
    assert not (tmp_path / "out2").exists()


def test_rank_0_scores_with_the_engine_limits(trtllm, tmp_path, monkeypatch):
    from precision_pipeline.gate import checkpoint_gate

    seen = []
    monkeypatch.setattr(checkpoint_gate, "run_gate", lambda cand, ref, thr, out, options, runtime, extra: seen.append(
        (cand, ref, out, options, extra)) or "result")
    eng = _engine(tmp_path, max_input_len=256, max_batch_size=8)
    assert EG.run_engine_gate(eng, tmp_path / "m", GateThresholds(), tmp_path / "out") == "result"
    ((cand, ref, out, options, extra),) = seen
    assert (options.heldout_window, options.greedy_batch) == (256, 8)  # lowered to the engine's limits
    assert extra == {"engine_dir": str(eng), "engine_build_config": {"gather_context_logits": True, "max_input_len": 256,
                                                                     "max_batch_size": 8}, "gate_kind": "engine"}
    assert trtllm["barriers"] == 1  # every rank meets after scoring
    EG.run_engine_gate(eng, tmp_path / "m", GateThresholds(), tmp_path / "out",
                       GateOptions(heldout_window=100, greedy_batch=4))
    assert (seen[-1][3].heldout_window, seen[-1][3].greedy_batch) == (100, 4)  # already under them


def test_other_ranks_host_their_shards(trtllm, tmp_path, monkeypatch):
    from precision_pipeline.gate import checkpoint_gate

    monkeypatch.setattr(checkpoint_gate, "run_gate", lambda *a, **k: pytest.fail("only rank 0 scores"))
    trtllm["rank"] = 1
    res = EG.run_engine_gate(_engine(tmp_path), tmp_path / "m", GateThresholds(), tmp_path / "out")
    assert (res.status, res.reason, trtllm["barriers"]) == ("worker", "rank 1: scoring happens on rank 0", 1)


def test_without_mpi_helpers_the_process_is_rank_0(trtllm, tmp_path, monkeypatch):
    from precision_pipeline.gate import checkpoint_gate

    monkeypatch.setattr(checkpoint_gate, "run_gate", lambda *a, **k: "scored")
    monkeypatch.setitem(sys.modules, "tensorrt_llm._utils", types.ModuleType("tensorrt_llm._utils"))  # no mpi_rank
    assert EG.run_engine_gate(_engine(tmp_path), tmp_path / "m", GateThresholds(), tmp_path / "out") == "scored"


def test_an_engine_built_without_context_logits_is_refused(trtllm, tmp_path):
    d = tmp_path / "engine"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"build_config": {"gather_context_logits": False}}))
    with pytest.raises(UserError, match="built without gather_context_logits"):
        EG.run_engine_gate(d, tmp_path / "m", GateThresholds(), tmp_path / "out")


@pytest.mark.parametrize("missing", ["--engine-dir", "--profile", "--out-dir"])
def test_main_requires_its_arguments(tmp_path, missing, capsys):
    argv = {"--engine-dir": str(tmp_path), "--profile": "fp8-h100", "--out-dir": str(tmp_path / "o")}
    argv.pop(missing)
    with pytest.raises(SystemExit) as e:
        EG.main([x for kv in argv.items() for x in kv])
    assert e.value.code == 2 and f"the following arguments are required: {missing}" in capsys.readouterr().err


@pytest.mark.parametrize("passed, code", [(True, 0), (False, 3), (None, 0)])
def test_main_exit_codes(monkeypatch, tmp_path, capsys, passed, code):
    class Res:
        report_md = tmp_path / "report.md"

    Res.passed = passed
    res = EG.EngineGateSkipped("skipped: x") if passed is None else Res()
    monkeypatch.setattr(EG, "run_engine_gate", lambda *a, **k: res)
    assert EG.main(["--engine-dir", str(tmp_path), "--profile", "fp8-h100", "--out-dir", str(tmp_path / "o")]) == code
    out = capsys.readouterr().out
    assert out == ("skipped: x\n" if passed is None else
                   f"engine gate {'passed' if passed else 'FAILED'}; see {tmp_path / 'report.md'}\n")
