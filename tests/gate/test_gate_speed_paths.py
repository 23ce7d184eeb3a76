"""The gate's fast paths give what the plain paths give, its thread choice does not count its own
process, and its phases report often enough for a CI log (no speed assertions)."""

from __future__ import annotations

import time

import pytest
import torch

from precision_pipeline.core import progress as progress_mod
from precision_pipeline.gate import candidates as gc
from precision_pipeline.gate import checkpoint_gate as cg
from precision_pipeline.gate import threads as gthreads
from precision_pipeline.gate.golden import encode_golden, end_of_turn_id, load_golden
from precision_pipeline.gate.options import GateOptions, GateRuntime
from precision_pipeline.spec.profile import GateThresholds


@pytest.fixture(scope="module")
def tiny(smollm_2layers):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm_2layers))
    enc = encode_golden(tok, load_golden(None, per_category=1))
    return gc.load_hf_model(smollm_2layers, torch.float32), enc, end_of_turn_id(tok)


def test_forward_with_prefix_is_the_plain_forward_and_its_prefill(tiny):
    model, enc, _ = tiny
    e = max(enc, key=lambda x: len(x.input_ids))
    pp = gc.forward_with_prefix(model, e, hidden=True)
    plain = gc.HFCandidate(model).logits(e.input_ids)
    assert torch.equal(pp.logits, plain)
    assert pp.hidden.shape == (len(e.input_ids), model.config.hidden_size)
    plen = len(e.generation_prompt)
    assert len(pp.prefix_kv) == model.config.num_hidden_layers
    assert pp.prefix_kv[0][0].shape[2] == plen and pp.prefix_kv[-1][1].shape[2] == plen
    assert pp.first_token == int(plain[plen - 1].argmax())
    # the kept keys are those of a prefill of the prompt alone (causal attention), up to rounding
    with torch.inference_mode():
        pre = model(input_ids=torch.tensor([e.generation_prompt]), use_cache=True).past_key_values
    assert torch.allclose(pp.prefix_kv[1][0], pre[1][0], atol=1e-4)


def test_decode_greedy_matches_generate(tiny):
    """FP32, batches of prompts of different lengths: the same tokens as HF generate (left-padded
    batch), including stopping at end-of-turn."""
    model, enc, stop = tiny
    cand = gc.HFCandidate(model)
    for idx in gc.batches_by_length(enc, 4):
        passes = [gc.forward_with_prefix(model, enc[i]) for i in idx]
        new = gc.decode_greedy(model, passes, 12, stop)
        old = cand.greedy_batch([enc[i].generation_prompt for i in idx], 12, stop)
        assert new == old
        assert all(1 <= len(g) <= 12 for g in new)
    assert gc.decode_greedy(model, passes, 0, stop) == [[] for _ in passes]


def _prompts(lengths):
    from precision_pipeline.gate.golden import EncodedPrompt
    return [EncodedPrompt(id=f"p{i}", category="c", prompt="", answer="", input_ids=list(range(n + 2)), user_start=1,
                          answer_start=n, answer_end=n + 2) for i, n in enumerate(lengths)]


def test_batches_are_balanced_and_sorted_by_length():
    """65 prompts at batch 48: 33 + 32 (not 48 + 17), each batch sorted by length; every prompt once."""
    enc = _prompts([(i * 37) % 101 + 5 for i in range(65)])
    groups = gc.batches_by_length(enc, 48)
    assert [len(g) for g in groups] == [33, 32]
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(65))
    lens = [len(enc[i].generation_prompt) for i in flat]
    assert lens == sorted(lens)
    assert [len(g) for g in gc.batches_by_length(enc, 8)] == [8, 8] + [7] * 7
    assert [len(g) for g in gc.batches_by_length(enc, 65)] == [65]
    assert [len(g) for g in gc.batches_by_length(enc, 1)] == [1] * 65
    assert gc.batches_by_length([], 48) == []


def test_others_busy_excludes_our_own_cpu(monkeypatch):
    """Both cores busy during the sample, all of it this process: 2 threads, not 1."""
    seq = iter([(1000.0, 500.0), (1100.0, 599.0)])     # 100 busy jiffies, 99 of them ours
    monkeypatch.setattr(gthreads, "_proc_jiffies", lambda: next(seq))
    monkeypatch.setattr(gthreads.os, "sysconf", lambda name: 100)
    ch = gthreads.thread_choice(sample_s=0.5, cores=2)
    assert ch.threads == 2 and ch.others_busy < 0.05
    assert ch.reason.startswith("2 torch threads: other processes kept 0.0 of 2 cores busy")
    # others really busy (1.5 cores of the 2 over the sample): back off to 1
    seq = iter([(1000.0, 500.0), (1075.0, 500.0)])      # 75 jiffies at 100/s over ~0.5 s
    ch = gthreads.thread_choice(sample_s=0.5, cores=2)
    assert ch.threads == 1 and ch.others_busy == pytest.approx(1.5, rel=0.1)


def test_proc_stat_fields_by_hand(monkeypatch):
    """/proc/stat's cpu line (user nice system idle iowait irq softirq steal ...), /proc/self/stat's utime/stime
    (fields 14, 15) and starttime (22), and btime: read from stand-in files worked out by hand."""
    import io

    files = {"/proc/stat": "cpu  100 0 50 1000 20 0 5 0 0 0\ncpu0 1 2 3 4\nbtime 1700000000\n",
             "/proc/self/stat": "4242 (py (x) thon) S " + " ".join(str(i) for i in range(4, 53)) + "\n"}
    monkeypatch.setattr(gthreads, "open", lambda path: io.StringIO(files[path]), raising=False)
    monkeypatch.setattr(gthreads.os, "sysconf", lambda name: 100)
    # busy = 100 + 0 + 50 + 1000 + 20 + 0 + 5 + 0 - (idle 1000 + iowait 20) = 155; own = utime 14 + stime 15
    assert gthreads._proc_jiffies() == (155.0, 29.0)
    assert gthreads._process_start_time() == 1700000000 + 22 / 100


def test_a_second_unreadable_proc_sample_falls_back_to_the_load_average(monkeypatch):
    seq = iter([(1000.0, 500.0), None])
    monkeypatch.setattr(gthreads, "_proc_jiffies", lambda: next(seq))
    monkeypatch.setattr(gthreads.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    monkeypatch.setattr(gthreads, "_process_start_time", lambda: time.time() - 100.0)
    ch = gthreads.thread_choice(sample_s=0.01, cores=2)
    assert ch.threads == 2 and "load average 0.50 minus this process's own" in ch.reason


def test_thread_choice_without_proc_subtracts_own_average(monkeypatch):
    monkeypatch.setattr(gthreads, "_proc_jiffies", lambda: None)
    monkeypatch.setattr(gthreads.os, "getloadavg", lambda: (2.0, 2.0, 2.0))
    monkeypatch.setattr(gthreads, "_process_start_time", lambda: time.time() - 100.0)

    class RU:
        ru_utime, ru_stime = 150.0, 40.0   # 1.9 cores on average for 100 s: the load is ours

    import resource

    monkeypatch.setattr(resource, "getrusage", lambda who: RU)
    ch = gthreads.thread_choice(sample_s=0.5, cores=2)
    assert ch.threads == 2 and ch.others_busy == pytest.approx(0.1, abs=0.01)
    assert "load average 2.00 minus this process's own 1.90" in ch.reason


def test_gate_phases_print_lines_often_enough(tiny, smollm_2layers, tmp_path, monkeypatch):
    """A CI-style gate run (stdout not a terminal) on --golden-limit 1: every phase prints its start
    and end, the thread choice is said, no two lines are more than 15 s apart, and a heartbeat line
    appears within a phase when the interval is short."""
    model, enc, _ = tiny
    stamps: list[tuple[float, str]] = []

    class Log:
        def write(self, text: str) -> None:
            for ln in text.splitlines():
                if ln.strip():
                    stamps.append((time.monotonic(), ln))

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return False

    monkeypatch.setattr(progress_mod.sys, "stdout", Log())
    monkeypatch.setattr(progress_mod, "DEFAULT_EVERY_S", 0.2)
    opts = GateOptions(prompts_per_category=1, heldout_tokens=256, heldout_window=128, greedy_new_tokens=6,
                       bootstrap_resamples=50)
    res = cg.run_gate(model, smollm_2layers, GateThresholds(), tmp_path / "gate", opts,
                      GateRuntime(reference_cache=tmp_path / "ref", write_report=False))
    lines = [ln for _, ln in stamps]
    assert res.metrics["reference_cache"]["hit"] is False  # computed and written to the cache ...
    assert res.metrics["metrics"]["kl_mean"]["value"] == pytest.approx(0.0, abs=1e-7)
    assert res.metrics["metrics"]["greedy_same"]["value"] == 1.0
    assert lines[0].startswith("[gate] ") and "torch thread" in lines[0]
    assert lines[1] == f"[gate] candidate LlamaForCausalLM against the FP32 reference {smollm_2layers}"
    phases = ["reference FP32 + BF16 floor, teacher-forced + greedy (6 tokens)", "reference FP32 + BF16 floor, held-out",
              "candidate, teacher-forced + greedy (6 tokens)", "candidate, held-out"]
    for ph in phases:
        assert any(ln.startswith(f"[gate] {ph}") and ": 0/" in ln for ln in lines), ph
        assert any(ln.startswith(f"[gate] {ph}") and " done in " in ln for ln in lines), ph
    ref_lines = [ln for ln in lines if ln.startswith("[gate] reference FP32 + BF16 floor, teacher-forced")]
    assert len(ref_lines) >= 3 and "ETA" in ref_lines[1] and " tokens, " in ref_lines[1]  # start, heartbeat(s), end
    # units: every prompt's tokens + 5 decode steps per prompt, for the FP32 reference and the BF16 floor
    total = 2 * (sum(len(e.input_ids) for e in enc) + 5 * len(enc))
    assert gc.greedy_units(enc, 6) * 2 == total
    assert f": {total}/{total} tokens done in " in ref_lines[-1]
    # the count moves within the phase (per prompt and per decode step), not only at its end
    counts = [int(ln.split(": ")[1].split("/")[0]) for ln in ref_lines]
    assert any(0 < c < total for c in counts), counts
    gaps = [b - a for (a, _), (b, _) in zip(stamps, stamps[1:])]
    assert max(gaps) <= 15.0
    # second run: the reference comes from the cache and says so
    stamps.clear()
    again = cg.run_gate(model, smollm_2layers, GateThresholds(), tmp_path / "gate2", opts,
                        GateRuntime(reference_cache=tmp_path / "ref", write_report=False, threads=1))
    lines = [ln for _, ln in stamps]
    assert again.metrics["reference_cache"] == {**res.metrics["reference_cache"], "hit": True}  # ... then read
    assert again.metrics["metrics"] == res.metrics["metrics"]  # the same numbers from the cached reference
    assert lines[0] == "[gate] 1 torch threads (set by the caller)"
    assert any(ln.startswith("[gate] reference FP32 + BF16 floor from the cache") for ln in lines)
    assert not any(ln.startswith("[gate] reference FP32 + BF16 floor, teacher-forced") for ln in lines)


def test_a_four_field_cpu_line_has_no_iowait(monkeypatch):
    """An old kernel's /proc/stat cpu line (user nice system idle only): idle alone, no iowait."""
    import io

    files = {"/proc/stat": "cpu  100 0 50 1000\n",
             "/proc/self/stat": "4242 (x) S " + " ".join(str(i) for i in range(4, 53)) + "\n"}
    monkeypatch.setattr(gthreads, "open", lambda path: io.StringIO(files[path]), raising=False)
    assert gthreads._proc_jiffies() == (150.0, 29.0)


def test_no_sampling_time_uses_the_load_average(monkeypatch):
    calls = []
    monkeypatch.setattr(gthreads, "_proc_jiffies", lambda: calls.append(1) or (1000.0, 0.0))
    monkeypatch.setattr(gthreads.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    monkeypatch.setattr(gthreads, "_process_start_time", lambda: time.time() - 100.0)
    ch = gthreads.thread_choice(sample_s=0, cores=2)
    assert "load average 0.50" in ch.reason and "/proc/stat" not in ch.reason and len(calls) <= 1
