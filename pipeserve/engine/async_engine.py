"""The synchronous engine behind an asyncio front: one thread runs the engine loop.

``LLMEngine.step()`` blocks for a whole forward pass, so it cannot run on the
event loop that serves HTTP. The engine lives on its own thread and is touched
by that thread only: callers post commands (add, abort, stats) on a queue and
get answers through ``concurrent.futures.Future``; outputs flow back into one
``asyncio.Queue`` per request, a step's outputs in one ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pipeserve.outputs import RequestOutput
from pipeserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long the idle engine thread sleeps on its command queue before it looks
# at the stop flag again; bounds the shutdown latency of an idle server.
_IDLE_POLL_S = 0.2


class EngineLike(Protocol):
    """What the async front needs from ``LLMEngine`` (a fake stands in for it in tests)."""

    healthy: bool

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, *,
                    priority: int = 0, user: str | None = None,
                    arrival_time: float | None = None) -> None: ...

    def abort_request(self, request_id: str) -> RequestOutput | None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> dict: ...

    def shutdown(self) -> None: ...


OutputObserver = Callable[[RequestOutput, float], None]


class EngineDeadError(RuntimeError):
    """The engine loop failed or was shut down; no request can be served."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def push(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the caller's event loop is closed: nobody is listening any more


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    """On the event loop: a step's outputs into their streams' queues."""
    for outputs, out in items:
        outputs.put_nowait(out)


@dataclass
class _Add:
    request_id: str
    prompt: Any
    params: SamplingParams
    priority: int
    user: str | None
    arrival_time: float
    stream: _Stream
    done: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run ``fn(engine)`` on the engine thread (stats, probes)."""

    fn: Callable[[Any], Any]
    done: concurrent.futures.Future


class AsyncEngine:
    """Serve one engine to many asyncio callers.

    ``observer(output, now)`` sees every output on the engine thread (metrics);
    it must be cheap and thread-safe.
    """

    def __init__(self, engine: EngineLike, observer: OutputObserver | None = None) -> None:
        self.engine = engine
        self._observer = observer
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}      # engine thread only
        self._num_requests = 0                      # unfinished requests, read from any thread
        self._stopping = threading.Event()
        self._error: str | None = None
        self._thread = threading.Thread(target=self._loop, name="pipeserve-engine", daemon=True)
        self._thread.start()

    # -- the public, asyncio side -----------------------------------------
    @property
    def healthy(self) -> bool:
        return self._error is None and self._thread.is_alive() and bool(self.engine.healthy)

    @property
    def recovering(self) -> bool:
        """The engine is restarting failed stages; its requests wait and continue after."""
        return self._error is None and bool(getattr(self.engine, "recovering", False))

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def num_requests(self) -> int:
        """Requests admitted and not finished yet (running or waiting)."""
        return self._num_requests

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams, *,
                          priority: int = 0, user: str | None = None,
                          arrival_time: float | None = None) -> "RequestStream":
        """Queue a request and return its stream of cumulative outputs.

        Raises ``ValueError`` (from the engine) if the request is refused, so a
        server can answer 400 before it starts streaming. The caller must
        ``close()`` the stream (aborting the request if it is still running).
        """
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        done: concurrent.futures.Future = concurrent.futures.Future()
        arrival = time.time() if arrival_time is None else arrival_time
        self._post(_Add(request_id, prompt, params, priority, user, arrival, stream, done))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still land: undo it (commands run in order)
            raise
        return RequestStream(self, request_id, stream.queue)

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams, *,
                       priority: int = 0, user: str | None = None,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until it finishes; aborts it if left early."""
        stream = await self.add_request(request_id, prompt, params, priority=priority, user=user,
                                        arrival_time=arrival_time)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished). Safe from any thread."""
        if not self._stopping.is_set():
            self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._post(_Call(fn, done))
        return await asyncio.wrap_future(done)

    async def stats(self) -> dict:
        return await self.call(lambda engine: engine.stats())

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is left, stop the loop, then shut the engine (and its stages) down."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop within %.0f s", timeout)
        else:
            self._refuse_queued()  # a command posted while the thread was stopping
        self.engine.shutdown()

    def _post(self, command: _Add | _Call) -> None:
        if self._stopping.is_set():
            raise EngineDeadError("the server is shutting down")
        if self._error is not None:
            raise EngineDeadError(f"the engine failed: {self._error}")
        self._commands.put(command)

    # -- the engine thread -------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping.is_set():
            busy = self.engine.has_unfinished_requests() and self._error is None
            self._run_commands(block=not busy)
            # A stage that dies while the server is idle is replaced now, not at the next request.
            repair = self._error is None and bool(getattr(self.engine, "needs_recovery", False))
            if (busy or repair) and not self._stopping.is_set():
                self._step()
        self._drain_on_stop()

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run_one(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_one(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            self._abort(command.request_id)
        else:
            self._resolve(command.done, command.fn, self.engine)

    def _add(self, cmd: _Add) -> None:
        if self._error is not None:
            cmd.done.set_exception(EngineDeadError(f"the engine failed: {self._error}"))
            return
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, priority=cmd.priority,
                                    user=cmd.user, arrival_time=cmd.arrival_time)
        except Exception as exc:  # ValueError for the user; anything else travels back as well
            cmd.done.set_exception(exc)
            return
        self._streams[cmd.request_id] = cmd.stream
        self._num_requests = len(self._streams)
        cmd.done.set_result(None)

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is None:
            return  # finished before the abort arrived
        self._num_requests = len(self._streams)
        out = self.engine.abort_request(request_id)
        if out is not None:
            self._observe(out)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug or a dead stage: fail everyone, never hang them
            logger.exception("engine step failed")
            self._error = f"{type(exc).__name__}: {exc}"
            self._fail_all(EngineDeadError(f"the engine failed: {self._error}"))
            return
        # One hand-off per event loop a step, not one per request: each call_soon_threadsafe
        # writes to the loop's self-pipe (a system call and a wake-up; with 256 streams they
        # were ~6 % of the server process's samples). A stream's outputs keep their order.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._route(out)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass  # that event loop is closed: nobody is listening any more

    def _route(self, out: RequestOutput) -> _Stream | None:
        """The stream ``out`` goes to (dropped from the open ones when it finishes), or None."""
        self._observe(out)
        stream = self._streams.get(out.request_id)
        if stream is None:
            return None  # aborted by its caller while this step ran
        if out.finished:
            del self._streams[out.request_id]
            self._num_requests = len(self._streams)
        return stream

    def _observe(self, out: RequestOutput) -> None:
        if self._observer is None:
            return
        try:
            self._observer(out, time.time())
        except Exception:  # metrics must never take the engine down
            logger.exception("output observer failed")

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.push(exc)
        self._streams.clear()
        self._num_requests = 0

    def _drain_on_stop(self) -> None:
        """Abort every request still open and refuse queued commands."""
        for request_id in list(self._streams):
            stream = self._streams.pop(request_id)
            out = self.engine.abort_request(request_id)
            if out is not None:
                self._observe(out)
                stream.push(out)
        self._num_requests = 0
        self._refuse_queued()

    def _refuse_queued(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, (_Add, _Call)):
                command.done.set_exception(EngineDeadError("the server is shutting down"))

    @staticmethod
    def _resolve(done: concurrent.futures.Future, fn: Callable[[Any], Any], arg: Any) -> None:
        try:
            done.set_result(fn(arg))
        except Exception as exc:
            done.set_exception(exc)


class RequestStream:
    """The outputs of one request, as an async iterator; ``close()`` aborts it if unfinished."""

    def __init__(self, engine: AsyncEngine, request_id: str, outputs: asyncio.Queue) -> None:
        self.engine = engine
        self.request_id = request_id
        self._outputs = outputs
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)
