"""uvicorn, with a shutdown that ends the process normally.

uvicorn re-raises a caught SIGINT/SIGTERM once its graceful shutdown is done;
with the default handler back in place that kills the process on the spot,
before the caller's clean-up (stopping the engine's stage processes) runs.
Here the signal only starts the graceful shutdown, and ``serve`` returns.

In-flight requests get ``shutdown_timeout`` seconds; then ``on_timeout`` (the
engine's shutdown, which aborts what is left) runs, so their handlers answer
503 / end their streams themselves, and uvicorn's own cancellation, a little
later, is only the last resort.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI

_HANDLED = (signal.SIGINT, signal.SIGTERM)
# Seconds uvicorn waits, after ``on_timeout``, for the handlers to answer before cancelling them.
_CANCEL_GRACE_S = 5.0


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, shutdown_timeout: float, on_timeout: Callable[[], None]) -> None:
        super().__init__(config)
        self._timer = threading.Timer(shutdown_timeout, on_timeout)
        self._timer.daemon = True

    def handle_exit(self, sig: int, frame) -> None:
        if not self._timer.is_alive() and not self._timer.finished.is_set():
            self._timer.start()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in _HANDLED}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def serve(app: FastAPI, *, host: str, port: int, log_level: str, shutdown_timeout: float,
          on_timeout: Callable[[], None]) -> None:
    """Serve until SIGINT/SIGTERM; in-flight requests get ``shutdown_timeout`` s, then
    ``on_timeout`` aborts them (and, ``_CANCEL_GRACE_S`` later, uvicorn cancels what still runs)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout + _CANCEL_GRACE_S, access_log=False)
    server = _Server(config, shutdown_timeout, on_timeout)
    try:
        server.run()
    finally:
        server._timer.cancel()
