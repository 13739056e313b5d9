"""``POST /v1/chat/completions``: messages through the model's chat template, streamed or whole."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from pipeserve.engine.async_engine import RequestStream
from pipeserve.outputs import RequestOutput
from pipeserve.server.errors import APIError, error_body
from pipeserve.server.logprobs import chat_logprobs
from pipeserve.server.protocol import ChatCompletionRequest, resolve_max_tokens
from pipeserve.server.reasoning import ThinkSplitter
from pipeserve.server.serving import Admission, ServerState, close_all, new_request_id, respond
from pipeserve.server.streaming import DONE, DeltaTracker, sse, usage
from pipeserve.structured.chat_tools import ChatTools, ToolsError, ToolStream

logger = logging.getLogger(__name__)


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, raw: Request) -> Response:
    state.check_model(body.model)
    state.check_healthy()
    try:
        tools = ChatTools.of(body.tools, body.tool_choice, state.tokenizer.chat_template)
    except ToolsError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    ids = body.truncate(render_messages(state, body, tools), state.max_model_len)
    max_tokens = resolve_max_tokens(body.requested_max_tokens, len(ids), state.max_model_len,
                                    prompt_field="messages")
    structured = body.structured()
    if tools.forced and structured is not None:
        raise APIError(400, f"tool_choice {tools.mode!r} already constrains the output; drop the other "
                       "constraint (response_format / structured_outputs / guided_*)", param="tool_choice")
    params = body.sampling_params(max_tokens, body.num_logprobs, tools.structured() or structured)
    request_id = new_request_id("chatcmpl")
    # The prompt's end tells a reasoning parser whether the template left a think block open.
    tail = state.tokenizer.decode(ids[-8:], skip_special_tokens=False) if state.reasoning else ""
    view = _View(state, body, request_id, tools, tail)
    return await respond(state, raw, body, request_id, [(None, ids)], [params],
                         lambda streams, admission: _stream(view, streams[0], admission),
                         lambda outputs: view.response(outputs[0]))


def render_messages(state: ServerState, body: ChatCompletionRequest, tools: ChatTools) -> list[int]:
    """The chat's token ids through the model's template (also ``POST /tokenize``'s)."""
    try:
        extra = {"tools": tools.template_tools()} if tools.template_tools() else {}
        return list(state.tokenizer.apply_chat_template(
            tools.template_messages(body.template_messages()), add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, chat_template_kwargs=body.chat_template_kwargs,
            **extra))
    except APIError:
        raise
    except Exception as exc:  # the template refused the conversation (roles, order)
        raise APIError(400, f"the chat template could not render these messages: {exc}",
                       param="messages") from None


class _View:
    """Shapes engine outputs into chat completion objects for one HTTP request."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, request_id: str,
                 tools: ChatTools, prompt_tail: str = "") -> None:
        self.state = state
        self.body = body
        self.tools = tools
        self.id = request_id
        self.created = int(time.time())
        self.top_n = body.top_logprobs or 0
        self.prompt_tail = prompt_tail
        self._splitters: dict[int, ThinkSplitter] = {}

    def splitter(self, index: int) -> ThinkSplitter | None:
        """Choice ``index``'s reasoning splitter (None without ``--reasoning-parser``)."""
        if self.state.reasoning is None:
            return None
        if index not in self._splitters:
            self._splitters[index] = self.state.reasoning.splitter(self.prompt_tail)
        return self._splitters[index]

    def response(self, out: RequestOutput) -> dict:
        choices = []
        for c in out.outputs:
            splitter = self.splitter(c.index)
            reasoning, text = splitter.split(c.text) if splitter is not None else (None, c.text)
            message, has_calls = self.tools.message(text or "")
            if splitter is not None:
                if text is None and not has_calls:
                    message["content"] = None
                message["reasoning_content"] = reasoning
            choices.append({"index": c.index, "message": message,
                            "logprobs": chat_logprobs(c, 0, len(c.token_ids), self.state.decode_token,
                                                      self.top_n),
                            "finish_reason": _finish_reason(c.finish_reason, has_calls),
                            "stop_reason": c.stop_reason})
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.state.model_name, "choices": choices, "usage": usage([out])}

    def chunk(self, choices: list[dict], usage_value: dict | None = None) -> str:
        payload = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                   "model": self.state.model_name, "choices": choices}
        if self.body.include_usage:
            payload["usage"] = usage_value
        return sse(payload)


async def _stream(view: _View, stream: RequestStream, admission: Admission) -> AsyncIterator[str]:
    tracker = DeltaTracker()
    tool_stream = ToolStream(view.tools) if view.tools.active else None
    last: RequestOutput | None = None
    try:
        # OpenAI clients expect the role alone in each choice's first delta.
        yield view.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None} for i in range(view.body.n)])
        async for out in stream:
            last = out
            if out.error:
                yield sse(error_body(503, f"the request failed: {out.error}"))
                break
            content, finished = _delta_choices(view, tracker, out, tool_stream)
            for choices in (content, finished):  # a finish_reason comes in a chunk of its own
                if choices:
                    yield view.chunk(choices, usage([out]) if view.body.continuous_usage else None)
        else:
            if view.body.include_usage and last is not None:
                yield view.chunk([], usage([last]))
    except Exception as exc:  # engine failure mid-stream: tell the client, then end the stream
        logger.warning("chat stream %s failed: %s", view.id, exc)
        yield sse(error_body(503, str(exc)))
    finally:
        close_all([stream])
        admission.release()
    yield DONE


def _delta_choices(view: _View, tracker: DeltaTracker, out: RequestOutput,
                   tool_stream: ToolStream | None = None) -> tuple[list[dict], list[dict]]:
    """(content deltas, finish deltas) that ``out`` adds to what was already sent."""
    content, finished = [], []
    for c in out.outputs:
        delta = tracker.delta(c.index, c)
        if delta is None:
            continue
        text, reasoning = delta.text, ""
        splitter = view.splitter(c.index)
        if splitter is not None:
            reasoning, text = splitter.feed(delta.text, final=delta.finish_reason is not None)
            if reasoning:
                content.append({"index": c.index, "delta": {"reasoning_content": reasoning},
                                "logprobs": None, "finish_reason": None})
        if tool_stream is not None:
            deltas, has_calls = tool_stream.deltas(c.index, text, delta.finish_reason is not None)
            content += [{"index": c.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
            if delta.finish_reason is not None:
                finished.append({"index": c.index, "delta": {}, "logprobs": None,
                                 "finish_reason": _finish_reason(delta.finish_reason, has_calls)})
            continue
        logprobs = chat_logprobs(c, delta.start, delta.end, view.state.decode_token, view.top_n)
        if text or (logprobs and logprobs["content"] and not reasoning):
            content.append({"index": c.index, "delta": {"content": text}, "logprobs": logprobs,
                            "finish_reason": None})
        elif reasoning and logprobs and logprobs["content"]:
            content[-1]["logprobs"] = logprobs          # the tokens' logprobs ride on their reasoning
        if delta.finish_reason is not None:
            finished.append({"index": c.index, "delta": {}, "logprobs": None,
                             "finish_reason": delta.finish_reason})
    return content, finished


def _finish_reason(reason: str | None, has_tool_calls: bool) -> str | None:
    """OpenAI reports an answer that ends in tool calls as "tool_calls"."""
    return "tool_calls" if has_tool_calls and reason == "stop" else reason
