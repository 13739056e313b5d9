"""What the engine remembers of pipeline restarts: how many, when, how long, and whether one is
under way.

Written by the engine thread, read from any thread (``/health``, ``/metrics``).

The restart budget (``--max-stage-restarts`` within ``--stage-restart-window`` seconds) counts
the attempts begun inside the window, as a supervisor's start limit does (systemd's
``StartLimitBurst`` in ``StartLimitIntervalSec``): failures in quick succession (a stage that
dies again as soon as it is replaced) end the requests, while a server that loses a stage now
and then over weeks keeps recovering.
"""

from __future__ import annotations

import threading
import time


class RecoveryLog:
    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock                 # seconds, for the restart window
        self.restarts = 0                  # attempts, successful or not
        self.begun: list[float] = []       # clock() at each attempt
        self.failures = 0                  # attempts whose new stages failed as well
        self.durations: list[float] = []   # seconds from failure to serving again, per success
        self.last_error: str | None = None
        self.last_recovered_at: float | None = None
        self._recovering = threading.Event()

    @property
    def recovering(self) -> bool:
        return self._recovering.is_set()

    def begin(self, error: str) -> None:
        self.restarts += 1
        self.begun.append(self.clock())
        self.last_error = error
        self._recovering.set()

    def recent(self, window: float) -> int:
        """Attempts begun in the last ``window`` seconds (0: all of them)."""
        if window <= 0:
            return self.restarts
        since = self.clock() - window
        return sum(1 for t in self.begun if t > since)

    def end(self, seconds: float, ok: bool) -> None:
        if ok:
            self.durations.append(seconds)
            self.last_recovered_at = time.time()
        else:
            self.failures += 1
        self._recovering.clear()

    def stats(self) -> dict:
        return {"stage_restarts": self.restarts, "failed_restarts": self.failures,
                "recovery_seconds": list(self.durations), "recovering": self.recovering,
                "last_error": self.last_error}
