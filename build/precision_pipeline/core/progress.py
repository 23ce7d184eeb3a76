"""One progress helper for every long stage: rich bars in a terminal, plain lines in a log.

``StageProgress(stage)`` is a context manager; ``phase(name, total, unit)`` starts a phase and
returns a ``Phase`` whose ``advance(n)`` counts work done. Two modes:

* ``bars``: rich progress bars on stderr (transient), as before. Chosen when both stdout and
  stderr are terminals (an interactive run).
* ``lines``: one plain line per event on stdout (flushed), for CI logs and ``... | cat``. A line
  is printed when a phase starts and ends, and at least every ``every`` seconds while a phase
  runs (default 10 s, so a log never goes 15 s without a line), by a heartbeat thread even when
  the work itself does not advance (one long forward pass). Format::

      [gate] reference FP32 + BF16 floor: 12/65 prompts, 0.42 prompts/s, ETA 2m05s (28s)

  ``ETA`` is ``(total - done) / rate`` from the phase's own elapsed time; ``-`` before the first
  unit is done.
* ``off``: nothing (``enabled=False``).

``say(text)`` prints one line of our own in either mode (``[stage] text``), never in ``off``.

Torch-free and rich-free at import (rich is imported only for bars). ``clock`` and ``write`` can be
injected (tests use a fake clock and call ``tick()`` instead of the heartbeat thread).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Optional, TextIO

DEFAULT_EVERY_S = 10.0
"""Seconds between two progress lines in ``lines`` mode (the promise is: never 15 s without one)."""


def fmt_duration(seconds: float) -> str:
    """``75.3`` -> ``1m15s``; ``3725`` -> ``1h02m``; under a minute ``42s``; negative or NaN -> ``-``."""
    if seconds != seconds or seconds < 0:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def choose_mode(enabled: bool = True, stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None) -> str:
    """``off`` when not enabled, ``bars`` when stdout and stderr are both terminals, else ``lines``."""
    if not enabled:
        return "off"
    out, err = stdout or sys.stdout, stderr or sys.stderr

    def tty(s: Any) -> bool:
        try:
            return bool(s.isatty())
        except (AttributeError, ValueError):
            return False

    return "bars" if tty(out) and tty(err) else "lines"


class Phase:
    """One phase of a stage: ``done`` of ``total`` units since ``started`` (clock seconds)."""

    def __init__(self, owner: "StageProgress", name: str, total: Optional[int], unit: str, task: Any = None):
        self.owner, self.name, self.total, self.unit = owner, name, total, unit
        self.done = 0
        self.started = owner.clock()
        self.ended: Optional[float] = None
        self._task = task

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more units done (prints a line in ``lines`` mode when one is due)."""
        with self.owner.lock:
            self.done += n
        if self._task is not None and self.owner.bar is not None:
            self.owner.bar.advance(self._task, n)
        self.owner.tick()

    def line(self, now: Optional[float] = None, final: bool = False) -> str:
        """The plain progress line of this phase at clock time ``now``."""
        now = self.owner.clock() if now is None else now
        elapsed = max(0.0, (self.ended if self.ended is not None else now) - self.started)
        unit = f" {self.unit}" if self.unit else ""
        if self.total is None and not self.done:  # a phase without a count: only how long it has run
            if final:
                return f"[{self.owner.stage}] {self.name}: done in {fmt_duration(elapsed)}"
            return f"[{self.owner.stage}] {self.name}: running ({fmt_duration(elapsed)})"
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        rate = self.done / elapsed if elapsed > 0 else 0.0
        rate_s = f"{rate:.3g}{unit}/s" if self.done else f"-{unit}/s"
        if final:
            return f"[{self.owner.stage}] {self.name}: {count}{unit} done in {fmt_duration(elapsed)}, {rate_s}"
        eta = "-"
        if self.total is not None and 0 < self.done <= self.total and rate > 0:
            eta = fmt_duration((self.total - self.done) / rate)
        return f"[{self.owner.stage}] {self.name}: {count}{unit}, {rate_s}, ETA {eta} ({fmt_duration(elapsed)})"

    def finish(self) -> None:
        """End the phase (its final line in ``lines`` mode); later calls do nothing."""
        if self.ended is not None:
            return
        with self.owner.lock:
            self.ended = self.owner.clock()
            if self.owner.current is self:
                self.owner.current = None
        self.owner.emit(self.line(self.ended, final=True))

    def __enter__(self) -> "Phase":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finish()


class StageProgress:
    """Progress of one stage (``[stage]`` prefix). Use as ``with StageProgress("gate") as p:``.

    ``enabled=False`` prints nothing; ``mode`` forces ``bars``/``lines``/``off`` (default:
    ``choose_mode``). ``every``: seconds between lines in ``lines`` mode (None: ``DEFAULT_EVERY_S``,
    read at call time). ``write``: where lines go
    (default: stdout, flushed). ``heartbeat=False`` leaves the periodic lines to ``tick()`` calls.
    """

    def __init__(self, stage: str, *, enabled: bool = True, mode: Optional[str] = None, every: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic, write: Optional[Callable[[str], None]] = None,
                 heartbeat: bool = True):
        self.stage = stage
        self.mode = mode or choose_mode(enabled)
        self.every = float(DEFAULT_EVERY_S if every is None else every)
        self.clock = clock
        self._write = write
        self.lock = threading.RLock()
        self.current: Optional[Phase] = None
        self.last_line = clock()
        self.bar: Any = None
        self._heartbeat = heartbeat and self.mode == "lines"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- output
    def emit(self, text: str) -> None:
        """Write one line now (``lines`` and ``bars`` modes; bars print it above the bars)."""
        if self.mode == "off":
            return
        with self.lock:
            self.last_line = self.clock()
            if self._write is not None:
                self._write(text)
            elif self.bar is not None:
                self.bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
            else:
                sys.stdout.write(text + "\n")
                sys.stdout.flush()

    def say(self, text: str) -> None:
        """One line of our own: ``[stage] text``."""
        self.emit(f"[{self.stage}] {text}")

    def tick(self) -> Optional[str]:
        """In ``lines`` mode: print the current phase's line if ``every`` seconds passed since the
        last line; returns the line printed (None if none was due)."""
        if self.mode != "lines":
            return None
        with self.lock:
            now = self.clock()
            ph = self.current
            if ph is None or now - self.last_line < self.every:
                return None
            text = ph.line(now)
            self.emit(text)
            return text

    # -- phases
    def phase(self, name: str, total: Optional[int] = None, unit: str = "") -> Phase:
        """Start a phase (ends the previous one); returns it (also a context manager)."""
        if self.current is not None:
            self.current.finish()
        task = None
        if self.mode == "bars" and self.bar is not None:
            task = self.bar.add_task(name, total=total)
        ph = Phase(self, name, total, unit, task)
        with self.lock:
            self.current = ph
        if self.mode == "lines":
            self.emit(ph.line(ph.started))
        return ph

    # -- lifetime
    def __enter__(self) -> "StageProgress":
        if self.mode == "bars":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn(f"[bold]{self.stage}[/] " + "{task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True),
                                transient=True)
            self.bar.__enter__()
        if self._heartbeat:
            self._thread = threading.Thread(target=self._beat, name=f"progress-{self.stage}", daemon=True)
            self._thread.start()
        return self

    def _beat(self) -> None:
        step = max(0.05, min(1.0, self.every / 4))
        while not self._stop.wait(step):
            self.tick()

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self.current is not None and exc[0] is None:
            self.current.finish()
        self.current = None
        if self.bar is not None:
            self.bar.__exit__(*exc)
            self.bar = None


__all__ = ["StageProgress", "Phase", "choose_mode", "fmt_duration", "DEFAULT_EVERY_S"]
