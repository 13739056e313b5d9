"""A stage's compute threads, lowered while other work holds its cores.

A stage runs each step on ``threads_per_stage`` OpenMP threads that meet at barriers (about
ten a layer in the fused decode). OpenMP's threads spin while they wait, which is what makes a
dedicated box fast (one request on the built-in GGUF, two threads: TPOT 4.5 ms spinning, 15 ms
with ``OMP_WAIT_POLICY=PASSIVE``), and what breaks on a shared one: when another busy process
takes one of the cores, every barrier waits for a descheduled thread while its partner spins
out its time slice (TPOT 24-26 ms beside one busy loop, 550 ms beside a benchmark of the
kernels; benchmarks/README.md). One thread on the core that is left has no barriers to wait at.

So every ``interval_s`` (checked at step boundaries, so an idle stage costs nothing) the
governor asks how many cores this process could have had: its own CPU time plus the idle time
of the CPUs it may run on, per second of wall time. While that rounds below the current
thread count it lowers the threads (at once: a collapse costs most); when it rounds above, it
raises them after ``raise_after`` such intervals in a row (one sample of idle time between two
bursts of another job is not a free core). A stage configured with one thread is left alone,
and so is every stage with ``--no-adaptive-threads``.

Changing the count changes how the work is split over threads, not what is computed per
output row, but attention merges its partial softmaxes in an order that depends on the split
(pipeserve/kernels/decode_stage.c): greedy outputs on a loaded machine can differ in the last
bits from those on an idle one. Hence the switch for runs that must reproduce bit for bit.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def idle_seconds(cpus: list[int], path: str = "/proc/stat") -> float | None:
    """Idle + iowait seconds of ``cpus`` since boot (Linux ``/proc/stat``), or None where unreadable."""
    wanted = {f"cpu{c}" for c in cpus}
    try:
        with open(path) as f:
            ticks = sum(int(fields[4]) + int(fields[5]) for fields in (line.split() for line in f)
                        if fields and fields[0] in wanted and len(fields) > 5)
    except (OSError, ValueError):
        return None
    return ticks / _TICKS


class ThreadGovernor:
    """``tick()`` at each step; it calls ``set_threads(n)`` when the cores this process could
    have had over the last interval differ from its thread count (the module docstring says how)."""

    def __init__(self, threads: int, *, interval_s: float = 0.5, raise_after: int = 2,
                 cpus: list[int] | None = None, clock: Callable[[], float] = time.monotonic,
                 cpu_time: Callable[[], float] = time.process_time,
                 idle: Callable[[], float | None] | None = None,
                 set_threads: Callable[[int], None] = torch.set_num_threads) -> None:
        if threads < 1 or interval_s <= 0 or raise_after < 1:
            raise ValueError(f"need threads >= 1, interval_s > 0, raise_after >= 1; got {threads}, "
                             f"{interval_s}, {raise_after}")
        self.max_threads = self.threads = threads
        self.interval_s, self.raise_after = interval_s, raise_after
        self.cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
        self._clock, self._cpu_time, self._set = clock, cpu_time, set_threads
        self._idle = idle or (lambda: idle_seconds(self.cpus))
        self._ups = 0
        self.changes = 0
        self._mark()

    def _mark(self) -> None:
        self._t0, self._cpu0, self._idle0 = self._clock(), self._cpu_time(), self._idle()

    def available(self) -> float | None:
        """Cores this process could have had since the last interval (None: no idle figures)."""
        wall = self._clock() - self._t0
        idle = self._idle()
        if idle is None or self._idle0 is None or wall <= 0:
            return None
        own = (self._cpu_time() - self._cpu0) / wall
        return min(float(len(self.cpus)), own + max(0.0, idle - self._idle0) / wall)

    def tick(self) -> None:
        wall = self._clock() - self._t0
        if wall < self.interval_s:
            return
        cores = self.available()
        self._mark()
        if cores is None:
            return
        want = max(1, min(self.max_threads, int(cores + 0.5)))
        if want > self.threads:
            self._ups += 1
            if self._ups < self.raise_after:
                return
        self._ups = 0
        if want != self.threads:
            logger.info("stage threads %d -> %d: %.2f of %d cores free for this process over the last %.1f s "
                        "(--no-adaptive-threads keeps %d)", self.threads, want, cores, len(self.cpus),
                        wall, self.max_threads)
            self.threads = want
            self.changes += 1
            self._set(want)


_governor: ThreadGovernor | None = None


def start(threads: int, adaptive: bool) -> None:
    """Set this process's compute threads; with ``adaptive`` and more than one, govern them."""
    global _governor
    torch.set_num_threads(threads)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    _governor = ThreadGovernor(threads, cpus=cpus) if adaptive and threads > 1 and idle_seconds(cpus) is not None else None


def tick() -> None:
    """At each step of a stage (ModelRunner.execute): the governor's check, if one runs."""
    if _governor is not None:
        _governor.tick()
