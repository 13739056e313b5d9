"""Pure pieces of the server: request parsing, context checks, SSE deltas, error bodies, metrics rows."""

from __future__ import annotations

import json

import pytest

from pipeserve.outputs import CompletionOutput, Logprob
from pipeserve.server.errors import APIError, error_body
from pipeserve.server.logprobs import chat_logprobs, completion_logprobs
from pipeserve.server.metrics import stage_rows
from pipeserve.server.protocol import (ChatCompletionRequest, CompletionRequest, normalize_prompts,
                                       parse_request, resolve_max_tokens)
from pipeserve.server.streaming import DONE, DeltaTracker, sse


@pytest.mark.parametrize("prompt,expected", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2], [[1, 2]]),
    ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_normalize_prompts(prompt, expected):
    assert normalize_prompts(prompt) == expected


@pytest.mark.parametrize("prompt", [None, [], [[]], ["a", 1], [True, 2], {"x": 1}, 5])
def test_normalize_prompts_refuses(prompt):
    with pytest.raises(APIError) as info:
        normalize_prompts(prompt)
    assert info.value.status == 400 and info.value.param == "prompt"


def test_resolve_max_tokens():
    assert resolve_max_tokens(None, 10, 64) == 54
    assert resolve_max_tokens(54, 10, 64) == 54
    with pytest.raises(APIError, match="64 tokens.*65 tokens.*10 in the prompt, 55 in the completion"):
        resolve_max_tokens(55, 10, 64)
    with pytest.raises(APIError, match="64 tokens, but the prompt has 64"):
        resolve_max_tokens(None, 64, 64, prompt_field="messages")


def test_sampling_params_mapping_and_errors():
    req = parse_request(CompletionRequest, {"prompt": "x", "temperature": 0, "top_k": -1, "stop": "\n",
                                            "seed": 3, "min_tokens": 2, "ignore_eos": True, "priority": 5})
    p = req.sampling_params(8, req.logprobs)
    assert (p.temperature, p.top_k, p.stop, p.seed, p.max_tokens, p.min_tokens, p.ignore_eos) == \
        (0, 0, ["\n"], 3, 8, 2, True)
    bad = parse_request(CompletionRequest, {"prompt": "x", "repetition_penalty": 0})
    with pytest.raises(APIError) as info:
        bad.sampling_params(8, None)
    assert info.value.param == "repetition_penalty"


def test_chat_request_fields():
    req = parse_request(ChatCompletionRequest, {
        "messages": [{"role": "user", "content": "a"}], "max_tokens": 5, "max_completion_tokens": 7,
        "logprobs": True, "top_logprobs": 3, "stream": True, "stream_options": {"include_usage": True},
        "some_future_field": 1})
    assert req.requested_max_tokens == 7 and req.num_logprobs == 3 and req.include_usage
    with pytest.raises(APIError, match="stream_options"):
        parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "a"}],
                                              "stream_options": {"include_usage": True}})
    with pytest.raises(APIError, match="image"):
        parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}).template_messages()


def test_error_body_shape():
    assert error_body(429, "full") == {"error": {"message": "full", "type": "rate_limit_error", "param": None,
                                                 "code": "too_many_requests"}}
    assert APIError(400, "m", param="n").body()["error"]["param"] == "n"


def test_sse_framing():
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert DONE == "data: [DONE]\n\n"


def test_delta_tracker_sends_each_piece_once():
    tracker = DeltaTracker()
    out = CompletionOutput(index=0, text="He", token_ids=[1])
    assert tracker.delta(0, out).text == "He"
    assert tracker.delta(0, out) is None  # nothing new
    out = CompletionOutput(index=0, text="He", token_ids=[1, 2])  # a token whose text is held back
    d = tracker.delta(0, out)
    assert (d.text, d.start, d.end) == ("", 1, 2)
    d = tracker.delta(0, CompletionOutput(index=0, text="Hello", token_ids=[1, 2, 3], finish_reason="stop"))
    assert (d.text, d.start, d.end, d.finish_reason) == ("llo", 2, 3, "stop")
    assert tracker.delta(0, CompletionOutput(index=0, text="Hello!", token_ids=[1, 2, 3, 4])) is None


def test_logprob_shapes_and_floor():
    out = CompletionOutput(index=0, text="ab", token_ids=[1, 2], logprobs=[
        {1: Logprob(-0.1, 1, "a"), 9: Logprob(-2.0, 2, "z")},
        {2: Logprob(float("-inf"), 3, None), 9: Logprob(-0.5, 1, "z")}])
    comp = completion_logprobs(out, 0, 2, lambda t: "b", text_offset=3)
    assert comp == {"tokens": ["a", "b"], "token_logprobs": [-0.1, -9999.0],
                    "top_logprobs": [{"a": -0.1, "z": -2.0}, {"z": -0.5, "b": -9999.0}], "text_offset": [3, 4]}
    json.dumps(comp, allow_nan=False)  # valid JSON: no infinities
    chat = chat_logprobs(out, 1, 2, lambda t: "b", top_n=1)
    assert chat == {"content": [{"token": "b", "logprob": -9999.0, "bytes": [98],
                                 "top_logprobs": [{"token": "z", "logprob": -0.5, "bytes": [122]}]}]}
    assert completion_logprobs(CompletionOutput(0, "", []), 0, 0, str, 0) is None


def test_stage_rows_shapes():
    assert stage_rows({}) == []  # PP=1: no pipeline timeline
    stages = [{"stage": 0, "busy_fraction": 0.5, "bubble_ratio": 0.1, "compute_s": 1.0},
              {"stage": 1, "busy_fraction": 1, "bubble_ratio": None}]
    assert stage_rows({"stages": stages}) == [(0, 0.5, 0.1), (1, 1.0, None)]


def test_event_stream_response_closes_even_if_never_started():
    """A client gone before the first chunk: the body generator never runs, on_close still does."""
    import asyncio

    from pipeserve.server.streaming import EventStreamResponse
    started, closed = [], []

    async def body():
        started.append(1)
        yield "data: x\n\n"

    async def send(message):
        raise OSError("client gone")

    async def receive():
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    response = EventStreamResponse(body(), on_close=lambda: closed.append(1))
    with pytest.raises(Exception):
        asyncio.run(response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send))
    assert closed == [1] and started == []
