"""What the engine remembers of pipeline restarts: how many, how long, and whether one is under way.

Written by the engine thread, read from any thread (``/health``, ``/metrics``).
"""

from __future__ import annotations

import threading
import time


class RecoveryLog:
    def __init__(self) -> None:
        self.restarts = 0                  # attempts, successful or not
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
        self.last_error = error
        self._recovering.set()

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
