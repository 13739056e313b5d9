"""``POST /v1/completions``: plain-text (or token-id) prompts, streamed or whole."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import Response

from pipeserve.engine.async_engine import RequestStream
from pipeserve.outputs import CompletionOutput, RequestOutput
from pipeserve.server.errors import error_body
from pipeserve.server.logprobs import completion_logprobs
from pipeserve.server.protocol import CompletionRequest, resolve_max_tokens
from pipeserve.server.serving import Admission, ServerState, close_all, new_request_id, respond
from pipeserve.server.streaming import DONE, DeltaTracker, merge_streams, sse, usage

logger = logging.getLogger(__name__)


async def create_completion(state: ServerState, body: CompletionRequest, raw: Request) -> Response:
    state.check_model(body.model)
    state.check_healthy()
    prompts = [_encode(state, p, body) for p in body.prompts()]
    structured = body.structured()
    params = [body.sampling_params(resolve_max_tokens(body.max_tokens, len(ids), state.max_model_len),
                                   body.logprobs, structured) for _, ids in prompts]
    request_id = new_request_id("cmpl")
    view = _View(state, body, request_id, prompts)
    return await respond(state, raw, body, request_id, prompts, params,
                         lambda streams, admission: _stream(view, streams, admission), view.response)


def _encode(state: ServerState, prompt: str | list[int], body: CompletionRequest) -> tuple[str | None, list[int]]:
    """(the prompt's text, or None where only ids stand for it; its ids), truncated as asked."""
    text, ids = (prompt, state.tokenizer.encode(prompt)) if isinstance(prompt, str) else (None, prompt)
    kept = body.truncate(ids, state.max_model_len)
    return (text if len(kept) == len(ids) else None), kept


class _View:
    """Shapes engine outputs into completion objects for one HTTP request."""

    def __init__(self, state: ServerState, body: CompletionRequest, request_id: str,
                 prompts: Sequence[tuple[str | None, list[int]]]) -> None:
        self.state = state
        self.body = body
        self.id = request_id
        self.created = int(time.time())
        self.prompts = prompts

    def echo_text(self, prompt_index: int) -> str:
        text, ids = self.prompts[prompt_index]
        if not self.body.echo:
            return ""
        return text if text is not None else self.state.tokenizer.decode(ids)

    def choice_index(self, prompt_index: int, completion: CompletionOutput) -> int:
        return prompt_index * self.body.n + completion.index

    def response(self, outputs: Sequence[RequestOutput]) -> dict:
        choices = []
        for p, out in enumerate(outputs):
            echo = self.echo_text(p)
            for c in out.outputs:
                logprobs = completion_logprobs(c, 0, len(c.token_ids), self.state.decode_token, len(echo))
                choices.append({"index": self.choice_index(p, c), "text": echo + c.text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.state.model_name, "choices": choices, "usage": usage(outputs)}

    def chunk(self, choices: list[dict], usage_value: dict | None = None) -> str:
        payload = {"id": self.id, "object": "text_completion", "created": self.created,
                   "model": self.state.model_name, "choices": choices}
        if self.body.include_usage:
            payload["usage"] = usage_value
        return sse(payload)

    def usage_chunk(self, outputs: Sequence[RequestOutput]) -> str:
        return sse({"id": self.id, "object": "text_completion", "created": self.created,
                    "model": self.state.model_name, "choices": [], "usage": usage(outputs)})


async def _stream(view: _View, streams: list[RequestStream], admission: Admission) -> AsyncIterator[str]:
    tracker = DeltaTracker()
    latest: dict[int, RequestOutput] = {}
    offsets: dict[int, int] = {}
    try:
        for p in range(len(streams)):
            if view.body.echo:
                yield view.chunk([{"index": view.choice_index(p, c), "text": view.echo_text(p),
                                   "logprobs": None, "finish_reason": None}
                                  for c in _placeholders(view.body.n)])
        async for p, out in merge_streams(streams):
            latest[p] = out
            if out.error:
                yield sse(error_body(503, f"the request failed: {out.error}"))
                break
            choices = []
            for c in out.outputs:
                key = view.choice_index(p, c)
                delta = tracker.delta(key, c)
                if delta is None:
                    continue
                offset = offsets.get(key, len(view.echo_text(p)))
                logprobs = completion_logprobs(c, delta.start, delta.end, view.state.decode_token, offset)
                offsets[key] = offset + sum(len(t) for t in (logprobs or {}).get("tokens", []))
                choices.append({"index": key, "text": delta.text, "logprobs": logprobs,
                                "finish_reason": delta.finish_reason})
            if choices:   # continuous usage: this prompt's so far (its choices' chunk), as vLLM
                yield view.chunk(choices, usage([out]) if view.body.continuous_usage else None)
        else:
            if view.body.include_usage:
                yield view.usage_chunk([latest[p] for p in sorted(latest)])
    except Exception as exc:  # engine failure mid-stream: tell the client, then end the stream
        logger.warning("completion stream %s failed: %s", view.id, exc)
        yield sse(error_body(503, str(exc)))
    finally:
        close_all(streams)
        admission.release()
    yield DONE


def _placeholders(n: int) -> list[CompletionOutput]:
    return [CompletionOutput(index=i, text="", token_ids=[]) for i in range(n)]
