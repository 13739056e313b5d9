"""Each stage process of a host on its own CPUs (``--cpu-bind``).

One request through a pipeline runs its stages in turn, and a stage that wakes for its part
wherever the scheduler found room starts on a core whose caches hold the other stage's work:
on the two-core test machine stage 0 moved between the cores about once a token (``perf
stat``: 214 migrations a second), and one request decoded 12.5-13.8 ms a token at PP = 2
unbound against 12.0 bound (benchmarks/README.md, thirty-sixth session). vLLM's CPU backend
binds its workers' threads the same way (``VLLM_CPU_OMP_THREADS_BIND``).

``auto`` (default): the host's stages split the CPUs this process may use into equal, disjoint
runs in stage order, when each gets at least its ``--threads-per-stage`` (times
``--tensor-parallel-size``: a stage's ranks share its run); otherwise nothing is bound.
``none``: nothing is bound. Else one CPU list per stage of the host, ``|`` between stages
(``0-3|4-7``, ``0,2|1,3``). Every thread the stage has when it learns the setting (its main
thread, the reader thread of its link to the driver, which runs small steps itself) is bound
before its compute threads start, and the threads started later inherit the binding. One
stage on a host (and PP = 1, where the model runs in the driver) binds nothing.

The driver is not bound, except while one request is alone in the pipeline (``DriverCpus``):
then its stages run one after the other, and the driver's work for a token (the result, the
next steps; ~0.5-0.7 ms of CPU a token at PP = 2) ran on whichever core was free when the
result came, often the one where stage 0 had just started the next token. On the last stage's
CPUs it runs while that stage waits for the token to come round: one request at PP = 2 decoded
3-7 % faster a token (benchmarks/README.md, forty-eighth session). With more requests the
driver is unbound again: every stage is busy, and binding it would load one stage alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from pipeserve.config import parse_cpu_list

logger = logging.getLogger(__name__)

SLOT_ENV = "PIPESERVE_CPU_SLOT"   # "i/n": this process is the i-th of the n stages its launcher started


def stage_cpus(setting: str, slot: int, count: int, allowed: list[int], threads: int) -> list[int] | None:
    """The CPUs stage ``slot`` of the ``count`` on this host binds to, or None for no binding."""
    if setting == "none" or count <= 1:
        return None
    if setting == "auto":
        per = len(allowed) // count
        if per < max(1, threads):
            return None
        return sorted(allowed)[slot * per:(slot + 1) * per]
    parts = setting.split("|")
    if len(parts) != count:
        raise ValueError(f"--cpu-bind {setting!r} lists {len(parts)} CPU sets for the {count} stages on this host "
                         f"(one per stage, '|' between them)")
    cpus = parse_cpu_list(parts[slot])
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        raise ValueError(f"--cpu-bind gives stage slot {slot} CPUs {outside} that this process may not run on "
                         f"(allowed: {sorted(allowed)})")
    return cpus


def bind_stage(setting: str, threads: int) -> list[int] | None:
    """Bind every thread of this process (a stage, before its compute threads start) as
    ``setting`` says for the slot its launcher gave it; returns the CPUs, or None where unbound."""
    slot_text = os.environ.get(SLOT_ENV)
    if not slot_text or not hasattr(os, "sched_setaffinity"):
        return None
    slot, count = (int(x) for x in slot_text.split("/"))
    cpus = stage_cpus(setting, slot, count, sorted(os.sched_getaffinity(0)), threads)
    if cpus is not None:
        _bind_threads(cpus)   # every thread (0: this one, where /proc does not list them)
        logger.info("stage slot %d of %d on this host bound to CPUs %s (--cpu-bind %s)", slot, count,
                    _ranges(cpus), setting)
    return cpus


class DriverCpus:
    """``follow(alone)`` at each step the driver builds: while ``alone``, every thread of this
    process on the CPUs of the last stage (``last_stage_pid()``: its process on this host, or
    None) where that stage is bound to fewer CPUs than this process may use; otherwise back on
    those. Changes only when the state does (a few syscalls); a no-op where nothing is bound."""

    def __init__(self, last_stage_pid: Callable[[], int | None]) -> None:
        self._last_stage_pid = last_stage_pid
        self._home = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
        self.bound: frozenset[int] | None = None   # the CPUs the driver follows now, None: its own

    def follow(self, alone: bool) -> None:
        target = self._target() if alone else None
        if target == self.bound:
            return
        _bind_threads(target or self._home)
        self.bound = target

    def _target(self) -> frozenset[int] | None:
        pid = self._last_stage_pid() if self._home else None
        if pid is None:
            return None
        try:
            cpus = frozenset(os.sched_getaffinity(pid))
        except OSError:   # the stage has exited (a failure the executor handles)
            return None
        return cpus if cpus < self._home else None


def _bind_threads(cpus) -> None:
    for tid in _threads() or [0]:
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError):   # a thread that has ended meanwhile
            pass


def _threads() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return []


def _ranges(cpus: list[int]) -> str:
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)
