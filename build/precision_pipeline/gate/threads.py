"""How many torch CPU threads the gate (and the sensitivity analysis) use on a machine that may be shared:
the cores other processes leave free (``thread_choice``), applied around a block by ``torch_threads``."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

THREAD_SAMPLE_S = 0.5
"""Seconds ``thread_choice`` watches /proc/stat to see how busy the other processes keep the cores."""


def _proc_jiffies() -> Optional[tuple[float, float]]:
    """(busy jiffies of all CPUs, this process's own user+system jiffies, threads included), or None."""
    try:
        with open("/proc/stat") as f:
            cpu = [float(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = cpu[3] + (cpu[4] if len(cpu) > 4 else 0.0)  # idle + iowait
    busy = sum(cpu[:8]) - idle  # user nice system idle iowait irq softirq steal (guest is inside user)
    return busy, float(own[11]) + float(own[12])  # utime, stime (fields 14, 15)


@dataclass(frozen=True)
class ThreadChoice:
    """How many torch threads the gate uses and why (``reason`` is printed in the build log)."""

    threads: int
    cores: int
    others_busy: Optional[float]   # cores kept busy by other processes while sampled (None: not measurable)
    load1: Optional[float]         # 1-minute load average (all processes, ours included)
    reason: str


def thread_choice(sample_s: float = THREAD_SAMPLE_S, cores: Optional[int] = None) -> ThreadChoice:
    """Torch threads for CPU inference on a machine that may be shared: the cores that *other*
    processes leave free, ``round(cores - others_busy + 0.5)``, at least 1, at most ``cores``.

    ``others_busy``: from /proc/stat over ``sample_s`` seconds, all CPUs' busy time minus this
    process's own CPU time (so a build that just calibrated on every core does not count itself
    as load, which the load average would). Where /proc is unreadable: the 1-minute load average
    minus this process's own average CPU use since it started. More threads than free cores makes
    PyTorch CPU inference several times *slower* (2 cores with 3 other jobs: a 256-token forward
    2.4 s with 1 thread, 4.6-17 s with 2), so the gate does not oversubscribe.
    """
    n = cores or os.cpu_count() or 1
    try:
        load1: Optional[float] = os.getloadavg()[0]
    except (OSError, AttributeError):  # pragma: no cover - not on Linux
        load1 = None
    others: Optional[float] = None
    how = ""
    a = _proc_jiffies()
    if a is not None and sample_s > 0:
        t0 = time.monotonic()
        time.sleep(sample_s)
        b = _proc_jiffies()
        dt = time.monotonic() - t0
        if b is not None and dt > 0:
            hz = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
            others = max(0.0, ((b[0] - a[0]) - (b[1] - a[1])) / hz / dt)
            how = f"other processes kept {others:.1f} of {n} cores busy over {dt:.1f} s (/proc/stat minus this process)"
    if others is None and load1 is not None:
        import resource

        ru = resource.getrusage(resource.RUSAGE_SELF)
        own_rate = 0.0
        try:
            age = time.time() - _process_start_time()
            own_rate = (ru.ru_utime + ru.ru_stime) / age if age > 0 else 0.0
        except (OSError, ValueError):
            pass
        others = max(0.0, load1 - own_rate)
        how = f"load average {load1:.2f} minus this process's own {own_rate:.2f}"
    busy = others or 0.0
    threads = max(1, min(n, int(round(n - busy + 0.5))))
    if others is None:
        how = "load unknown"
    load_s = f"; load average {load1:.2f}" if load1 is not None else ""
    return ThreadChoice(threads, n, others, load1, f"{threads} torch thread{'s' if threads != 1 else ''}: {how}{load_s}")


def _process_start_time() -> float:
    """This process's start (epoch seconds), from /proc/self/stat and /proc/stat btime."""
    with open("/proc/self/stat") as f:
        start_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        btime = next(float(ln.split()[1]) for ln in f if ln.startswith("btime"))
    return btime + start_ticks / float(os.sysconf("SC_CLK_TCK"))


def auto_threads() -> int:
    """Torch threads for the gate: ``thread_choice().threads`` (the cores other processes leave free)."""
    return thread_choice().threads


@contextlib.contextmanager
def torch_threads(n: Optional[int]) -> Iterator[None]:
    """Run the block with ``n`` torch CPU threads (None: ``auto_threads()``); the old count is restored after.

    Shared by the gate and the sensitivity analysis (both are CPU inference on a shared machine).
    """
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, n or auto_threads()))
    try:
        yield
    finally:
        torch.set_num_threads(old)


__all__ = ["THREAD_SAMPLE_S", "ThreadChoice", "thread_choice", "auto_threads", "torch_threads"]
