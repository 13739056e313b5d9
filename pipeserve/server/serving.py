"""What both endpoints share: the server state, admission, request submission, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pipeserve.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from pipeserve.outputs import RequestOutput
from pipeserve.sampling_params import SamplingParams
from pipeserve.server.errors import APIError
from pipeserve.server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE
from pipeserve.server.metrics import ServerMetrics
from pipeserve.server.streaming import EventStreamResponse

T = TypeVar("T")


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any
    model_name: str
    model_path: str
    max_model_len: int
    metrics: ServerMetrics
    max_queue: int | None = DEFAULT_MAX_QUEUE
    max_n: int = 128
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    created: int = field(default_factory=lambda: int(time.time()))
    admitted: int = 0     # sequences (prompts x n) being handled; event-loop thread only
    reasoning: Any = None  # server/reasoning.py's ReasoningParser (--reasoning-parser), or None
    aliases: tuple[str, ...] = ()   # more names clients may send (--served-model-name's others)

    @property
    def model_names(self) -> tuple[str, ...]:
        """The name responses carry first, then its aliases."""
        return (self.model_name, *self.aliases)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            served = ", ".join(f"`{n}`" for n in self.model_names)
            raise APIError(404, f"The model `{name}` does not exist; this server serves {served}.",
                           param="model", code="model_not_found")

    def check_healthy(self, admitting: bool = True) -> None:
        """503 unless the engine serves. While the pipeline restarts after a stage
        failure, ``/health`` (``admitting=False``) answers 503 but new requests are
        admitted: they wait, as the running ones do, and are served after."""
        if admitting and self.engine.recovering:
            return
        if not self.engine.healthy:
            if self.engine.recovering:
                raise APIError(503, "the pipeline is restarting after a stage failure; requests are kept "
                                    "and continue when it is back")
            raise APIError(503, f"the engine is unhealthy: {self.engine.error or 'a stage died'}")

    def decode_token(self, token_id: int) -> str:
        # Logprobs show special tokens (an end-of-turn token) by name, as OpenAI and vLLM do.
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


class Admission:
    """Counts sequences (prompts x n) in the server against ``--max-queue``; 429 when full.

    Checked and counted on the event loop, so concurrent requests cannot
    overshoot the limit between the check and the count.
    """

    def __init__(self, state: ServerState, count: int) -> None:
        if state.max_queue is not None and state.admitted + count > state.max_queue:
            raise APIError(429, f"the server queue is full ({state.admitted} of {state.max_queue} sequences "
                           f"in progress, this request adds {count}); retry later", code="queue_full")
        self.state = state
        self.count = count
        state.admitted += count

    def release(self) -> None:
        self.state.admitted -= self.count
        self.count = 0


def check_n(state: ServerState, params: Sequence[SamplingParams]) -> None:
    """Bound the sequences one request may start: ``n`` is at most ``--max-n``."""
    for p in params:
        if p.n > state.max_n:
            raise APIError(400, f"n={p.n} is over this server's limit of {state.max_n} sequences per "
                           "request (--max-n)", param="n")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON; 413 beyond ``limit`` bytes (checked while reading), 400 if not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes, over the limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None


async def open_streams(state: ServerState, request_id: str, prompts: Sequence[tuple[str | None, list[int]]],
                       params: Sequence[SamplingParams], *, priority: int,
                       user: str | None) -> list[RequestStream]:
    """Submit one engine request per prompt; any refusal closes the others and becomes an HTTP error."""
    arrival = time.time()
    streams: list[RequestStream] = []
    try:
        for i, ((text, ids), p) in enumerate(zip(prompts, params)):
            prompt = {"prompt": text, "prompt_token_ids": ids}
            streams.append(await state.engine.add_request(f"{request_id}-{i}", prompt, p, priority=priority,
                                                          user=user, arrival_time=arrival))
    except Exception as exc:
        close_all(streams)
        raise _as_api_error(exc) from None
    except BaseException:  # cancelled: the client went away while we were submitting
        close_all(streams)
        raise
    return streams


def _as_api_error(exc: Exception) -> Exception:
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), param="prompt")
    if isinstance(exc, (EngineDeadError, RuntimeError)):
        return APIError(503, str(exc))
    return exc


def close_all(streams: Sequence[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def final_outputs(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    async def last(stream: RequestStream) -> RequestOutput:
        out = None
        async for out in stream:
            pass
        return out
    try:
        return list(await asyncio.gather(*(last(s) for s in streams)))
    finally:
        close_all(streams)


class ClientDisconnected(Exception):
    """The client went away before its (non-streaming) answer was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # the request is dropped: its streams close and abort in the engine
    if task in done:
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def raise_for_failure(outputs: Sequence[RequestOutput]) -> None:
    """A request the engine failed (a dead stage) becomes a 503 / 500 for a non-streaming client."""
    for out in outputs:
        if out.error:
            raise APIError(503, f"the request failed: {out.error}")
        if any(c.finish_reason == "abort" for c in out.outputs):
            raise APIError(503, "the request was aborted: the server is shutting down")


async def respond(state: ServerState, raw: Request, body: Any, request_id: str,
                  prompts: Sequence[tuple[str | None, list[int]]], params: Sequence[SamplingParams],
                  events: Callable[[list[RequestStream], Admission], AsyncIterator[str]],
                  render: Callable[[list[RequestOutput]], dict]) -> Response:
    """Admit and run the prompts, then answer as Server-Sent Events (``events``)
    or as one JSON body (``render``). The admission is released however the
    request ends: done, failed, or the client gone."""
    check_n(state, params)
    admission = Admission(state, sum(p.n for p in params))
    try:
        streams = await open_streams(state, request_id, prompts, params, priority=body.priority,
                                     user=body.user)
    except BaseException:
        admission.release()
        raise
    if body.stream:
        return EventStreamResponse(events(streams, admission),
                                   on_close=lambda: (close_all(streams), admission.release()))
    try:
        outputs = await unless_disconnected(raw, final_outputs(streams))
    finally:
        admission.release()
    raise_for_failure(outputs)
    return JSONResponse(render(outputs))
