"""core/progress.py: the plain-line mode a CI log sees (fake clock, no sleeping, no timing asserts)."""

from __future__ import annotations

import io

from precision_pipeline.core.progress import StageProgress, choose_mode, fmt_duration


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def lines_progress(every: float = 10.0):
    clock, out = FakeClock(), []
    prog = StageProgress("gate", mode="lines", every=every, clock=clock, write=out.append, heartbeat=False)
    return prog, clock, out


def test_fmt_duration():
    assert [fmt_duration(x) for x in (0, 42.4, 75.3, 3725, -1, float("nan"))] == ["0s", "42s", "1m15s", "1h02m", "-", "-"]


def test_lines_mode_start_heartbeat_eta_and_end():
    prog, clock, out = lines_progress()
    with prog:
        ph = prog.phase("candidate greedy", total=65, unit="prompts")
        assert out == ["[gate] candidate greedy: 0/65 prompts, - prompts/s, ETA - (0s)"]
        clock.t += 9.9
        assert prog.tick() is None          # not due yet
        clock.t += 0.1                      # 10 s since the last line, nothing done: still a line
        assert prog.tick() == "[gate] candidate greedy: 0/65 prompts, - prompts/s, ETA - (10s)"
        clock.t += 10
        ph.advance(13)                      # 13 in 20 s: 0.65/s, 52 left -> 80 s
        assert out[-1] == "[gate] candidate greedy: 13/65 prompts, 0.65 prompts/s, ETA 1m20s (20s)"
        clock.t += 3
        ph.advance(1)                       # advancing does not print more often than every 10 s
        assert len(out) == 3
        clock.t += 17
        ph.finish()
        assert out[-1] == "[gate] candidate greedy: 14/65 prompts done in 40s, 0.35 prompts/s"
        assert prog.tick() is None          # no phase running: no heartbeat
    assert len(out) == 4


def test_no_gap_longer_than_every_while_a_phase_runs():
    """Simulated 10 minutes of a phase that advances once a minute: the line gaps stay <= 15 s
    when ``tick`` runs once a second (what the heartbeat thread does)."""
    prog, clock, out = lines_progress()
    stamps: list[float] = []
    prog._write = lambda text: (out.append(text), stamps.append(clock.t))
    with prog:
        ph = prog.phase("reference FP32", total=10, unit="prompts")
        for sec in range(1, 601):
            clock.t += 1
            if sec % 60 == 0:
                ph.advance()
            prog.tick()
        ph.finish()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert len(stamps) >= 60 and max(gaps) <= 10.0
    assert out[-1].startswith("[gate] reference FP32: 10/10 prompts done in 10m00s")


def test_eta_hidden_when_count_exceeds_total_and_say():
    prog, clock, out = lines_progress()
    with prog:
        ph = prog.phase("per-layer search", total=2, unit="steps")
        clock.t += 10
        ph.advance(3)
        assert out[-1] == "[gate] per-layer search: 3/2 steps, 0.3 steps/s, ETA - (10s)"
        prog.say("2 torch threads: idle machine")
        assert out[-1] == "[gate] 2 torch threads: idle machine"


def test_new_phase_ends_the_previous_one():
    prog, clock, out = lines_progress()
    with prog:
        prog.phase("a", total=1).advance()
        prog.phase("b", total=2)
    assert out == ["[gate] a: 0/1, -/s, ETA - (0s)", "[gate] a: 1/1 done in 0s, 0/s", "[gate] b: 0/2, -/s, ETA - (0s)",
                   "[gate] b: 0/2 done in 0s, -/s"]


def test_off_mode_prints_nothing_and_mode_choice():
    out: list[str] = []
    with StageProgress("gate", enabled=False, write=out.append) as prog:
        prog.phase("x", total=3).advance(3)
        prog.say("hello")
    assert out == []

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert choose_mode(False) == "off"
    assert choose_mode(True, Tty(), Tty()) == "bars"
    assert choose_mode(True, io.StringIO(), Tty()) == "lines"   # ./run.sh build ... | cat
    assert choose_mode(True, Tty(), io.StringIO()) == "lines"


def test_heartbeat_thread_prints_without_advance():
    """The real thread, with a fake clock moved by the test: a line appears without any advance."""
    import threading

    clock, out = FakeClock(), []
    got = threading.Event()

    def write(text: str) -> None:
        out.append(text)
        if len(out) >= 2:
            got.set()

    with StageProgress("gate", mode="lines", every=0.2, clock=clock, write=write) as prog:
        prog.phase("long forward", total=1, unit="prompts")
        clock.t += 5
        assert got.wait(timeout=30)
    assert out[1] == "[gate] long forward: 0/1 prompts, - prompts/s, ETA - (5s)"
