"""The HTTP layer and the async engine against a small fake engine: fast, no model, no torch.

The fake keeps ``LLMEngine``'s contract (cumulative outputs, ValueError on add,
abort returns a finished output) so the server's own logic is what is tested:
shapes of responses and SSE streams, error statuses, admission, auth, aborts.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from pipeserve.engine.async_engine import AsyncEngine
from pipeserve.engine.input_processor import RequestRejected
from pipeserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pipeserve.sampling_params import SamplingParams
from pipeserve.server.app import build_app
from pipeserve.server.metrics import ServerMetrics
from pipeserve.server.serving import ServerState

MAX_MODEL_LEN = 64
MODEL = "fake-model"


class FakeTokenizer:
    eos_token_ids = (0,)
    chat_template = None
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:   # no special tokens
        return [ord(c) % 256 for c in text]

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        text += "".join(f"[{k}={v}]" for k, v in (chat_template_kwargs or {}).items())
        text += "+" * continue_final_message            # marks the open turn
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""), add_special_tokens=False)


class _Req:
    def __init__(self, request_id: str, ids: list[int], params: SamplingParams, arrival: float) -> None:
        self.id, self.ids, self.params, self.arrival = request_id, ids, params, arrival
        self.tokens: list[list[int]] = [[] for _ in range(params.n)]
        self.reasons: list[str | None] = [None] * params.n


class FakeEngine:
    """One token per sequence per step: letters that depend on the prompt length, index and step."""

    def __init__(self, step_s: float = 0.002) -> None:
        self.tokenizer = FakeTokenizer()
        self.healthy = True
        self.step_s = step_s
        self.reqs: dict[str, _Req] = {}
        self.aborted: list[str] = []
        self.threads: set[str] = set()
        self.shut_down = False

    def add_request(self, request_id, prompt, params, *, priority=0, user=None, arrival_time=None) -> None:
        self.threads.add(threading.current_thread().name)
        ids = prompt["prompt_token_ids"]
        if len(ids) >= MAX_MODEL_LEN:
            raise RequestRejected(f"this model's maximum context length is {MAX_MODEL_LEN} tokens, "
                                  f"but the prompt has {len(ids)} tokens")
        self.reqs[request_id] = _Req(request_id, ids, params, arrival_time or time.time())

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.reqs.pop(request_id, None)
        if req is None:
            return None
        self.aborted.append(request_id)
        req.reasons = [r or "abort" for r in req.reasons]
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[RequestOutput]:
        self.threads.add(threading.current_thread().name)
        time.sleep(self.step_s)
        outs = []
        for req in list(self.reqs.values()):
            for i, toks in enumerate(req.tokens):
                if req.reasons[i] is None:
                    token, req.reasons[i] = self.next_token(req, i, len(toks))
                    toks.append(token)
            out = self._output(req)
            if out.finished:
                del self.reqs[req.id]
            outs.append(out)
        return outs

    def next_token(self, req: _Req, index: int, made: int) -> tuple[int, str | None]:
        """Sequence ``index``'s next token after ``made`` of them, and its finish reason if it ends."""
        token = ord("a") + (len(req.ids) + index + made) % 26
        return token, ("length" if made + 1 >= req.params.max_tokens else None)

    def _output(self, req: _Req) -> RequestOutput:
        outputs = [CompletionOutput(index=i, text=self.tokenizer.decode(t), token_ids=list(t),
                                    logprobs=self._logprobs(req, t), finish_reason=req.reasons[i])
                   for i, t in enumerate(req.tokens)]
        return RequestOutput(req.id, None, req.ids, outputs, finished=all(req.reasons),
                             metrics=RequestMetrics(arrival_time=req.arrival))

    def _logprobs(self, req: _Req, toks: list[int]):
        if req.params.logprobs is None:
            return None
        return [{t: Logprob(-0.25, 1, chr(t)), 0: Logprob(-3.0, 2, "<0>")} for t in toks]

    def stats(self) -> dict:
        running = sum(1 for _ in self.reqs)
        return {"scheduler": {"num_running": running, "num_waiting": 0, "num_swapped": 0,
                              "kv_usage": running / 100, "num_preemptions": 0,
                              "prefix_cache_query_tokens": 10, "prefix_cache_hit_tokens": 4},
                "pipeline": {"stages": [{"stage": 0, "busy_fraction": 0.7, "bubble_ratio": 0.2},
                                        {"stage": 1, "busy_fraction": 0.6, "bubble_ratio": 0.3}]}}

    def shutdown(self) -> None:
        self.shut_down = True


def _expected_text(prompt_len: int, index: int, count: int) -> str:
    return "".join(chr(ord("a") + (prompt_len + index + k) % 26) for k in range(count))


def make_client(engine: FakeEngine, **state_kwargs) -> TestClient:
    metrics = ServerMetrics(MODEL)
    state = ServerState(engine=AsyncEngine(engine, observer=metrics.observe), tokenizer=engine.tokenizer,
                        model_name=MODEL, model_path="/fake", max_model_len=MAX_MODEL_LEN, metrics=metrics,
                        **{k: v for k, v in state_kwargs.items() if k not in ("api_key", "allowed_origins")})
    return TestClient(build_app(state, api_key=state_kwargs.get("api_key"),
                                allowed_origins=state_kwargs.get("allowed_origins")))


@pytest.fixture(scope="module")
def engine():
    return FakeEngine()


@pytest.fixture(scope="module")
def client(engine):
    with make_client(engine) as c:
        yield c


def _events(response) -> list:
    """The JSON payloads of an SSE body; the last event must be [DONE]."""
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


# -- completions ---------------------------------------------------------------
def test_completion_whole(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 5, "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert [c["text"] for c in body["choices"]] == [_expected_text(5, 0, 5), _expected_text(5, 1, 5)]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15}


def test_completion_prompt_list_and_token_ids(client):
    r = client.post("/v1/completions", json={"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 3, "n": 2})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][2]["text"] == _expected_text(2, 0, 3)
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 12


def test_completion_echo_and_logprobs(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "echo": True})
    assert r.json()["choices"][0]["text"] == "hi" + _expected_text(2, 0, 3)
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == list(_expected_text(2, 0, 3))
    assert lp["token_logprobs"] == [-0.25] * 3 and lp["text_offset"] == [0, 1, 2]
    assert lp["top_logprobs"][0] == {"c": -0.25, "<0>": -3.0}


def test_completion_stream_joins_to_whole(client):
    payload = {"prompt": ["abc", "de"], "max_tokens": 6, "n": 2, "stream": True,
               "stream_options": {"include_usage": True}}
    events = _events(client.post("/v1/completions", json=payload))
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for e in events[:-1]:
        assert e["object"] == "text_completion" and e["usage"] is None
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
    assert texts == {0: _expected_text(3, 0, 6), 1: _expected_text(3, 1, 6),
                     2: _expected_text(2, 0, 6), 3: _expected_text(2, 1, 6)}
    assert finish == {i: "length" for i in range(4)}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 24


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": ["abc", "de"], "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hey"}]}),
])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, path, body):
    """Each chunk with text carries its prompt's usage so far (the fake's tokens are characters)."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = _events(client.post(path, json={**body, "max_tokens": 6, "stream": True, "stream_options": options}))
    n = body.get("n", 1)
    sent: dict[int, int] = {}                      # prompt -> characters sent so far
    checked = 0
    for e in events[:-1]:
        texts = [(c["index"], c.get("text") or (c.get("delta") or {}).get("content") or "") for c in e["choices"]]
        if not any(t for _, t in texts):
            continue
        prompt = texts[0][0] // n
        sent[prompt] = sent.get(prompt, 0) + sum(len(t) for _, t in texts)
        assert e["usage"]["completion_tokens"] == sent[prompt], e
        checked += 1
    assert checked and sum(sent.values()) == events[-1]["usage"]["completion_tokens"]
    plain = _events(client.post(path, json={**body, "max_tokens": 6, "stream": True,
                                            "stream_options": {"include_usage": True}}))
    assert all(e["usage"] is None for e in plain[:-1])          # without it: only the last chunk's


# -- chat ---------------------------------------------------------------------
def test_chat_whole(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hey"}]}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 4,
                                                  "logprobs": True, "top_logprobs": 1})
    body = r.json()
    prompt_len = len("<user>hey<assistant>")
    choice = body["choices"][0]
    assert body["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": _expected_text(prompt_len, 0, 4)}
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == list(choice["message"]["content"])
    assert all(len(c["top_logprobs"]) == 1 and c["bytes"] == list(c["token"].encode()) for c in content)
    assert body["usage"]["prompt_tokens"] == prompt_len


def test_chat_stream_shape(client):
    payload = {"messages": [{"role": "user", "content": "yo"}], "max_tokens": 5, "n": 2, "stream": True,
               "stream_options": {"include_usage": True}}
    events = _events(client.post("/v1/chat/completions", json=payload))
    first = events[0]
    assert first["object"] == "chat.completion.chunk"
    assert [c["delta"] for c in first["choices"]] == [{"role": "assistant", "content": ""}] * 2
    text: dict[int, str] = {0: "", 1: ""}
    finishes = []
    for e in events[1:-1]:
        for c in e["choices"]:
            if c["finish_reason"]:
                assert c["delta"] == {}
                finishes.append((c["index"], c["finish_reason"]))
            else:
                text[c["index"]] += c["delta"]["content"]
    prompt_len = len("<user>yo<assistant>")
    assert text == {0: _expected_text(prompt_len, 0, 5), 1: _expected_text(prompt_len, 1, 5)}
    assert sorted(finishes) == [(0, "length"), (1, "length")]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 10


# -- errors ---------------------------------------------------------------------
def _error(r, status: int, param: str | None = "__any__") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "__any__":
        assert err["param"] == param
    return err


@pytest.mark.parametrize("payload,param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "logit_bias": {"one": 5}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"1": 500}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"-3": 1}}, "logit_bias"),
])
def test_completion_bad_parameters(client, payload, param):
    _error(client.post("/v1/completions", json=payload), 400, param)


@pytest.mark.parametrize("payload,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
])
def test_chat_bad_parameters(client, payload, param):
    _error(client.post("/v1/chat/completions", json=payload), 400, param)


def test_invalid_json_unknown_model_and_route(client):
    err = _error(client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                 400)
    assert "JSON" in err["message"]
    err = _error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model")
    assert err["code"] == "model_not_found"
    _error(client.get("/v1/nothing"), 404)


def test_context_length_names_both_numbers(client):
    err = _error(client.post("/v1/completions", json={"prompt": "x" * 80, "max_tokens": 1}), 400)
    assert "64" in err["message"] and "80" in err["message"]
    err = _error(client.post("/v1/completions", json={"prompt": "x" * 60, "max_tokens": 10}), 400, "max_tokens")
    assert "64" in err["message"] and "70" in err["message"]
    # Rejected by the engine itself (token ids skip the server's length check path for max_tokens).
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 70}]})
    assert "64" in _error(r, 400)["message"]


def test_server_still_answers_after_errors(client):
    client.post("/v1/completions", content=b"]]")
    client.post("/v1/completions", json={"prompt": "x", "top_p": 7})
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == _expected_text(5, 0, 2)


def test_body_too_large():
    with make_client(FakeEngine(), max_body_bytes=100) as c:
        err = _error(c.post("/v1/completions", json={"prompt": "x" * 200}), 413)
        assert "100" in err["message"]
        assert c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1}).status_code == 200


def test_api_key():
    with make_client(FakeEngine(), api_key="s3cret") as c:
        _error(c.post("/v1/completions", json={"prompt": "x"}), 401)
        _error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        r = c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
        assert c.get("/health").status_code == 200  # probes need no key


def test_truncate_prompt_tokens_keeps_the_prompts_end(client):
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1, "echo": True,
                                             "truncate_prompt_tokens": 3}).json()
    assert r["usage"]["prompt_tokens"] == 3 and r["choices"][0]["text"].startswith("llo")
    whole = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1, "echo": True,
                                                 "truncate_prompt_tokens": 9}).json()
    assert whole["usage"]["prompt_tokens"] == 5 and whole["choices"][0]["text"].startswith("hello")
    fits = client.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert fits.status_code == 200 and fits.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi there"}],
                                                     "max_tokens": 1, "truncate_prompt_tokens": 4}).json()
    assert chat["usage"]["prompt_tokens"] == 4
    for bad in (0, -2):
        _error(client.post("/v1/completions", json={"prompt": "x", "truncate_prompt_tokens": bad}), 400,
               "truncate_prompt_tokens")


@pytest.mark.parametrize("field, value", [("prompt_logprobs", 1), ("prompt_logprobs", 0), ("allowed_token_ids", [104]),
                                          ("bad_words", ["x"]), ("use_beam_search", True),
                                          ("logits_processors", ["my.processor"])])
def test_vllm_fields_pipeserve_cannot_honour_are_refused(client, field, value):
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        _error(client.post(path, json={**body, "max_tokens": 1, field: value}), 400, field)
        off = {"prompt_logprobs": None, "allowed_token_ids": [], "bad_words": [], "use_beam_search": False,
               "logits_processors": None}[field]
        assert client.post(path, json={**body, "max_tokens": 1, field: off}).status_code == 200


# -- /tokenize and /detokenize (vLLM's) ---------------------------------------------------
def test_tokenize_counts_what_the_completion_routes_feed_the_model(client):
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "hello"})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 5, "max_model_len": MAX_MODEL_LEN, "tokens": [*map(ord, "hello")],
                        "token_strs": None}
    usage = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == 5
    r = client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False, "return_token_strs": True})
    assert r.json()["tokens"] == [104, 105] and r.json()["token_strs"] == ["h", "i"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = client.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == [ord(c) for c in "<system>be brief<user>hi<assistant>"]
    usage = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == chat["count"]
    bare = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == [ord(c) for c in "<system>be brief<user>hi"]
    kwargs = client.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"x": 1}}).json()
    assert kwargs["tokens"] == [ord(c) for c in "<system>be brief<user>hi[x=1]<assistant>"]


def test_chat_rendering_options_reach_the_template_or_are_refused(client):
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "He"}]
    body = {"messages": prefill, "max_tokens": 1, "add_generation_prompt": False, "continue_final_message": True}
    assert client.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"] == len("<user>hi<assistant>He+")
    body = {"messages": prefill[:1], "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}}
    usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    assert usage["prompt_tokens"] == len("<user>hi[enable_thinking=False]<assistant>")
    bad = [({"messages": prefill, "continue_final_message": True}, "continue_final_message"),
           ({"messages": prefill[:1], "continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message"),
           ({"messages": prefill, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
           ({"messages": prefill, "chat_template_kwargs": "x"}, "chat_template_kwargs"),
           ({"messages": prefill, "continue_final_message": "yes"}, "continue_final_message")]
    for payload, param in bad:
        _error(client.post("/v1/chat/completions", json={**payload, "max_tokens": 1}), 400, param)
        _error(client.post("/tokenize", json=payload), 400, param)


def test_detokenize_and_the_tokenizer_routes_errors(client):
    assert client.post("/detokenize", json={"model": MODEL, "tokens": [104, 105]}).json() == {"prompt": "hi"}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    assert _error(client.post("/detokenize", json={"tokens": [256]}), 400)["param"] == "tokens"
    assert _error(client.post("/detokenize", json={"tokens": [-1]}), 400)["param"] == "tokens"
    assert _error(client.post("/detokenize", json={"tokens": ["a"]}), 400)["param"] == "tokens.0"
    assert _error(client.post("/tokenize", json={}), 400)["param"] == "prompt"
    assert _error(client.post("/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]}),
                  400)["param"] == "prompt"
    assert _error(client.post("/tokenize", json={"messages": [{"role": "robot", "content": "x"}]}),
                  400)["param"] == "messages.0.role"
    assert _error(client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}],
                                                 "add_special_tokens": True}), 400)["param"] == "add_special_tokens"
    assert _error(client.post("/tokenize", json={"model": "other", "prompt": "x"}), 404)["code"] == "model_not_found"
    assert _error(client.post("/tokenize", content=b"{nope", headers={"content-type": "application/json"}), 400)
    with make_client(FakeEngine(), api_key="s3cret") as c:
        _error(c.post("/tokenize", json={"prompt": "x"}), 401)
        _error(c.post("/detokenize", json={"tokens": [104]}), 401)
        ok = c.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["count"] == 1


def test_cors_only_for_the_allowed_origins():
    page = {"Origin": "https://chat.example.com"}
    preflight = {**page, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with make_client(FakeEngine()) as c:               # default: no CORS headers for any page
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=page)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    with make_client(FakeEngine(), api_key="s3cret", allowed_origins=["https://chat.example.com"]) as c:
        r = c.options("/v1/chat/completions", headers=preflight)      # preflight: no key needed
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://chat.example.com"
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                   headers={**page, "Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://chat.example.com"
        _error(c.post("/v1/completions", json={"prompt": "x"}, headers=page), 401)   # the key still counts
        other = c.options("/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
    with make_client(FakeEngine(), allowed_origins=["*"]) as c:
        r = c.get("/v1/models", headers={"Origin": "http://localhost:3000"})
        assert r.headers["access-control-allow-origin"] == "*"


def test_allowed_origins_flag_refuses_what_is_no_origin():
    import argparse
    from pipeserve.server.cli import _origins
    assert _origins("https://a.example, http://localhost:3000") == ["https://a.example", "http://localhost:3000"]
    assert _origins("*") == ["*"]
    for bad in ("a.example", "https://a.example/chat", "ftp://a.example"):
        with pytest.raises(argparse.ArgumentTypeError, match="no origin"):
            _origins(bad)


@contextlib.contextmanager
def live_server(engine: FakeEngine, **state_kwargs):
    """The app on a real uvicorn in a thread: TestClient does not model client disconnects."""
    client = make_client(engine, **state_kwargs)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(client.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", client.app.state.server
    finally:
        server.should_exit = True
        thread.join(10)


def test_queue_full_then_free():
    engine = FakeEngine(step_s=0.02)
    with live_server(engine, max_queue=1) as (url, state), httpx.Client(base_url=url) as c:
        payload = {"prompt": "abc", "max_tokens": 60, "stream": True}
        with c.stream("POST", "/v1/completions", json=payload) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # held: a dropped iterator closes the response
            next(lines)  # admitted and producing
            err = _error(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}), 429)
            assert err["type"] == "rate_limit_error"
        deadline = time.time() + 5
        while state.admitted and time.time() < deadline:  # the closed stream releases its slot
            time.sleep(0.01)
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    assert engine.shut_down  # the app's shutdown stopped the engine


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts(stream):
    engine = FakeEngine(step_s=0.02)
    with live_server(engine) as (url, state):
        body = json.dumps({"prompt": "abc", "max_tokens": 60, "stream": stream}).encode()
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            deadline = time.time() + 5
            while not engine.reqs and time.time() < deadline:
                time.sleep(0.01)
            if stream:
                sock.recv(100)  # the stream has started
        killed = time.time()
        while not engine.aborted and time.time() < killed + 2:
            time.sleep(0.01)
        assert len(engine.aborted) == 1 and not engine.reqs
        assert state.admitted == 0


def test_health_503_when_engine_unhealthy():
    engine = FakeEngine()
    with make_client(engine) as c:
        assert c.get("/health").status_code == 200
        engine.healthy = False
        _error(c.get("/health"), 503)
        _error(c.post("/v1/completions", json={"prompt": "x"}), 503)
        engine.healthy = True
        assert c.get("/health").status_code == 200


def test_version_and_models(client):
    assert client.get("/version").json()["version"]
    model = client.get("/v1/models").json()["data"][0]
    assert model["id"] == MODEL and model["max_model_len"] == MAX_MODEL_LEN


def test_served_model_name_aliases():
    with make_client(FakeEngine(), aliases=("alias-b", "alias-c")) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [MODEL, "alias-b", "alias-c"]
        r = c.post("/v1/completions", json={"model": "alias-c", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == MODEL        # responses carry the first name
        chat = c.post("/v1/chat/completions", json={"model": "alias-b", "messages": [{"role": "user", "content": "x"}],
                                                    "max_tokens": 1})
        assert chat.status_code == 200 and chat.json()["model"] == MODEL
        err = _error(c.post("/v1/completions", json={"model": "other", "prompt": "x"}), 404)
        assert "alias-b" in err["message"] and err["code"] == "model_not_found"
    from pipeserve.server.cli import register
    import argparse
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--served-model-name", "a", "b"])
    assert args.served_model_name == ["a", "b"]


# -- metrics ------------------------------------------------------------------
def _samples(client) -> dict[tuple[str, tuple], float]:
    text = client.get("/metrics").text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_move(client):
    before = _samples(client)
    client.post("/v1/completions", json={"prompt": "four", "max_tokens": 3})
    client.post("/v1/completions", json={"prompt": "x", "top_p": 9})
    after = _samples(client)

    def delta(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)
    assert delta("pipeserve_request_success_total", (("finished_reason", "length"),)) == 1
    assert delta("pipeserve_prompt_tokens_total") == 4
    assert delta("pipeserve_generation_tokens_total") == 3
    assert delta("pipeserve_time_to_first_token_seconds_count") == 1
    assert delta("pipeserve_e2e_request_latency_seconds_count") == 1
    assert delta("pipeserve_inter_token_latency_seconds_count") == 2
    assert delta("pipeserve_http_errors_total", (("status", "400"),)) == 1
    assert after[("pipeserve_stage_bubble_ratio", (("stage", "1"),))] == 0.3
    assert after[("pipeserve_stage_busy_ratio", (("stage", "0"),))] == 0.7
    assert after[("pipeserve_prefix_cache_hit_rate", ())] == 0.4
