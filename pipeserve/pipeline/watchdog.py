"""Liveness of one generation of stages: process exits and the per-result deadline.

The watchdog thread reports the first failure it sees through ``on_failure``
and stops: a local stage process that exited, or no result for
``stage_timeout`` seconds while work is in flight (then it pings every stage to
name the silent ones, so the message says which process is frozen).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

POLL_S = 0.05


class Watchdog:
    def __init__(self, num_stages: int, procs: dict[int, Any], stage_timeout: float,
                 stalled_for: Callable[[], tuple[int, float]],
                 ping: Callable[[list[int], float], dict], on_failure: Callable[[str], None]) -> None:
        """``stalled_for()`` -> (steps in flight, seconds since the last result or first submit)."""
        self.num_stages = num_stages
        self.procs = procs
        self.stage_timeout = stage_timeout
        self._stalled_for = stalled_for
        self._ping = ping
        self._on_failure = on_failure
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="pp-watchdog", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            message = dead_stage_message(self.procs)
            if message is None:
                inflight, quiet = self._stalled_for()
                if inflight and quiet > self.stage_timeout:
                    message = self._silence_message(inflight)
            if message is not None and not self._stop.is_set():
                self._on_failure(message)
                return

    def _silence_message(self, inflight: int) -> str:
        """Which stages are silent: ping everyone, name those that do not answer."""
        stages = list(range(self.num_stages))
        answered = self._ping(stages, min(2.0, self.stage_timeout))
        silent = [s for s in stages if s not in answered]
        who = f"stage(s) {silent} did not answer" if silent else "all stages answer pings but no result came"
        return (f"pipeline stalled: no result for {self.stage_timeout:g} s (--stage-timeout) with "
                f"{inflight} step(s) in flight; {who}")


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
