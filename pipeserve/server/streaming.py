"""Server-Sent Events, per-choice deltas of cumulative outputs, and merged request streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pipeserve.engine.async_engine import RequestStream
from pipeserve.outputs import CompletionOutput, RequestOutput

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    """One SSE event carrying a JSON object, as OpenAI clients parse it."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStreamResponse(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends.

    The body generator's own ``finally`` does not run if the client leaves
    before the first chunk is pulled (the generator never started); this does.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


@dataclass
class Delta:
    text: str
    start: int          # index of the first new token
    end: int            # one past the last new token
    finish_reason: str | None


class DeltaTracker:
    """Turns the engine's cumulative outputs into what is new since the last call, per choice."""

    def __init__(self) -> None:
        self._text_len: dict[int, int] = {}
        self._tokens: dict[int, int] = {}
        self._finished: set[int] = set()

    def delta(self, key: int, out: CompletionOutput) -> Delta | None:
        """``None`` when nothing changed for this choice (or it already finished)."""
        if key in self._finished:
            return None
        text_len, tokens = self._text_len.get(key, 0), self._tokens.get(key, 0)
        # Text only grows: the detokenizer holds back what a stop string may still cut.
        text = out.text[text_len:] if len(out.text) > text_len else ""
        end = len(out.token_ids)
        if not text and end == tokens and out.finish_reason is None:
            return None
        self._text_len[key] = max(text_len, len(out.text))
        self._tokens[key] = end
        if out.finish_reason is not None:
            self._finished.add(key)
        return Delta(text, tokens, end, out.finish_reason)


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as ``(stream index, output)`` in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    merged: asyncio.Queue = asyncio.Queue()
    pumps = [asyncio.create_task(_pump(i, s, merged)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(streams)):
            while True:
                item = await merged.get()
                if item is None:
                    break  # one stream ended
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for pump in pumps:
            pump.cancel()


async def _pump(index: int, stream: RequestStream, merged: asyncio.Queue) -> None:
    try:
        async for out in stream:
            merged.put_nowait((index, out))
    except Exception as exc:  # handed to the consumer, which raises it
        merged.put_nowait(exc)
    merged.put_nowait(None)


def usage(outputs: Sequence[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
