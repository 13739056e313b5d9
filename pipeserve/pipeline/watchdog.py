"""Liveness of one generation of stages: process exits and silence.

The watchdog thread reports the first failure it sees through ``on_failure``
and stops: a local stage process that exited, or, once no result has come for
``stage_timeout`` seconds while work is in flight, what a ping of every stage
finds (stages answer on their reader thread, busy or not: ``StageWorker._answer_ping``):

- a stage that does not answer (frozen process, dead or unreachable host): a failure
  naming it;
- a stage at work (a step computing and using the CPU, or a transfer on the wire): no
  failure, however long the step takes (a 70B prompt chunk on an old CPU may run for
  minutes); a warning, and the next look ``stage_timeout`` later;
- a step that has computed for ``stage_timeout`` seconds without using the CPU (a deadlock):
  a failure naming the stage;
- every stage answering and none at work, twice ``CONFIRM_S`` apart, with steps in flight: a
  failure (a step lost between them).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

POLL_S = 0.05
CONFIRM_S = 0.5             # between the two pings that must both find no stage at work
FROZEN_CPU_SHARE = 0.05     # a step that used less CPU than this share of its time is frozen


class Watchdog:
    def __init__(self, num_stages: int, procs: dict[int, Any], stage_timeout: float,
                 stalled_for: Callable[[], tuple[int, float]],
                 ping: Callable[[list[int], float], dict], on_failure: Callable[[str], None]) -> None:
        """``stalled_for()`` -> (steps in flight, seconds since the last result or first submit);
        ``ping(stages, timeout)`` -> {stage: answer with ``.pong`` (``comm.messages.Pong``)}."""
        self.num_stages = num_stages
        self.procs = procs
        self.stage_timeout = stage_timeout
        self._stalled_for = stalled_for
        self._ping = ping
        self._on_failure = on_failure
        self._stop = threading.Event()
        self._at_work_seen = -float("inf")    # monotonic time of the last look that found stages at work
        self.thread = threading.Thread(target=self._loop, name="pp-watchdog", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            message = dead_stage_message(self.procs)
            if message is None:
                inflight, quiet = self._stalled_for()
                since_look = time.monotonic() - self._at_work_seen
                if inflight and quiet > self.stage_timeout and since_look > self.stage_timeout:
                    message = self._look(inflight, quiet)
            if message is not None and not self._stop.is_set():
                self._on_failure(message)
                return

    def _look(self, inflight: int, quiet: float) -> str | None:
        """Ping every stage: the failure to report, or None (stages at work: look again later)."""
        stages = list(range(self.num_stages))
        grace = min(2.0, self.stage_timeout)
        for attempt in range(2):
            answers = self._ping(stages, grace)
            silent = [s for s in stages if s not in answers]
            prefix = (f"pipeline stalled: no result for {quiet:.0f} s (--stage-timeout "
                      f"{self.stage_timeout:g}) with {inflight} step(s) in flight")
            if silent:
                return f"{prefix}; stage(s) {silent} did not answer"
            pongs = {s: a.pong for s, a in answers.items()}
            frozen = [s for s, p in pongs.items()
                      if p.computing_s >= self.stage_timeout and p.computing_cpu_s < FROZEN_CPU_SHARE * p.computing_s]
            if frozen:
                p = pongs[frozen[0]]
                return (f"{prefix}; stage(s) {frozen} frozen: a step has run {p.computing_s:.0f} s there "
                        f"using {p.computing_cpu_s:.2f} s of CPU")
            at_work = {s: p for s, p in pongs.items() if p.computing_s > 0 or p.sending_s > 0}
            if at_work:
                self._at_work_seen = time.monotonic()
                logger.warning("no result for %.0f s with %d step(s) in flight; %s: waiting for it "
                               "(--stage-timeout %g counts silence, not slow steps)", quiet, inflight,
                               _at_work_text(at_work), self.stage_timeout)
                return None
            if attempt == 0 and self._stop.wait(CONFIRM_S):
                return None
            inflight, quiet = self._stalled_for()
            if not inflight or quiet <= self.stage_timeout:
                return None               # a result came meanwhile
        return f"{prefix}; every stage answers pings and none is working on a step (a step was lost)"


def _at_work_text(at_work: dict) -> str:
    parts = []
    for stage, p in sorted(at_work.items()):
        if p.computing_s > 0:
            parts.append(f"stage {stage} has computed a step for {p.computing_s:.0f} s "
                         f"({p.computing_cpu_s:.0f} s of CPU)")
        else:
            parts.append(f"stage {stage} has been sending for {p.sending_s:.0f} s")
    return "; ".join(parts)


def dead_stage_message(procs: dict[int, Any], grace_s: float = 0.0) -> str | None:
    """Which local stage process died, waiting up to ``grace_s`` for its exit to show."""
    deadline = time.monotonic() + grace_s
    while True:
        for stage, proc in procs.items():
            if not proc.is_alive():
                return (f"pipeline stage {stage} (pid {proc.pid}) died with exit code {proc.exitcode}"
                        f"{signal_note(proc.exitcode)}")
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)


def signal_note(code: int | None) -> str:
    if code is not None and code < 0:
        return f" (killed by {signal.Signals(-code).name})"
    from pipeserve.pipeline.tensor_group import EXIT_TP_RANK_DIED
    if code == EXIT_TP_RANK_DIED:
        return " (one of its tensor-parallel ranks died; its log above says which)"
    return ""
