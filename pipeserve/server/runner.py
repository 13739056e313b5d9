"""uvicorn, with a shutdown that ends the process normally.

uvicorn re-raises a caught SIGINT/SIGTERM once its graceful shutdown is done;
with the default handler back in place that kills the process on the spot,
before the caller's clean-up (stopping the engine's stage processes) runs.
Here the signal only starts the graceful shutdown, and ``serve`` returns.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

_HANDLED = (signal.SIGINT, signal.SIGTERM)


class _Server(uvicorn.Server):
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


def serve(app: FastAPI, *, host: str, port: int, log_level: str, shutdown_timeout: float) -> None:
    """Serve until SIGINT/SIGTERM; in-flight requests get ``shutdown_timeout`` s, then are cancelled."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout, access_log=False)
    _Server(config).run()
