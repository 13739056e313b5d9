"""The real server as a subprocess (``pipeserve serve``) on a tiny random checkpoint, driven by
the official ``openai`` client, raw HTTP and raw sockets.

One server per pipeline size for the whole module (start-up is the expensive part).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeserve.sampling_params import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.procs import descendants

ROOT = Path(__file__).resolve().parent.parent
KEY = "test-key"
NAME = "tiny"
MAX_MODEL_LEN = 256
# The pipeline sizes the server runs at. PP=2 is the acceptance target (stage processes + gloo).
PP_SIZES = [2]
ENGINE_ARGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", str(MAX_MODEL_LEN),
               "--threads-per-stage", "1", "--seed", "0"]
PROMPTS = ["the quick brown fox", "hello world", "a stage holds its layers", "tokens flow"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_checkpoint("llama_tied_gqa", tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def offline(model_dir):
    """The offline API on the same checkpoint: the reference for greedy results."""
    from pipeserve.entrypoints.llm import LLM
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN,
              threads_per_stage=1)
    yield llm
    llm.shutdown()


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path, pp: int) -> None:
        self.proc, self.url, self.log, self.pp = proc, url, log, pp

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, **kw)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    def post(self, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if isinstance(body, (bytes, str)):
            return httpx.post(self.url + path, content=body, headers={**headers, "Content-Type":
                                                                       "application/json"}, timeout=60)
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60, **kw)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> set[int]:
    """Every live process below ``pid``: its stage zygote and the stages forked from it."""
    return descendants(pid)


def _start_server(model_dir: Path, pp: int, log: Path, *extra: str, new_session: bool = False) -> Server:
    """``new_session``: the server leads its own process group (a test may signal the group,
    as a terminal's Ctrl-C does)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "pipeserve.entrypoints.cli", "serve", "--model", str(model_dir),
           "-pp", str(pp), "--port", str(port), "--api-key", KEY, "--served-model-name", NAME,
           "--max-request-bytes", "65536", "--max-queue", "200", "--shutdown-timeout", "5", *ENGINE_ARGS, *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=new_session)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return Server(proc, url, log, pp)
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"the server was not healthy within 120 s:\n{log.read_text()}")
        time.sleep(0.2)


def _stream_finishes_across(server: Server, fault, max_tokens: int = 40) -> None:
    """A stream runs, ``fault()`` (a signal) lands mid-way; the stream still ends normally and
    the server then exits 0."""
    body = {"model": NAME, "prompt": "hello", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # the request is running
        fault()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]", rest[-3:]
    assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(30) == 0, server.log.read_text()[-3000:]


def _stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait(10)


@pytest.fixture(scope="module", params=PP_SIZES, ids=lambda p: f"pp{p}")
def server(request, model_dir, tmp_path_factory):
    server = _start_server(model_dir, request.param, tmp_path_factory.mktemp("server") / "server.log")
    yield server
    _stop(server)


# -- the openai client ---------------------------------------------------------
def test_greedy_equals_offline_llm(server, offline):
    client = server.client()
    ref = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    got = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in got.choices] == [r.outputs[0].text for r in ref]
    assert got.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in ref)
    assert got.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)

    messages = [{"role": "user", "content": "hello pipeline"}]
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10))[0]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == ref.outputs[0].text
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(ref.prompt_token_ids)

    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [ref.outputs[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_n2_seed_logprobs_and_stop(server):
    client = server.client()
    kw = dict(model=NAME, messages=[{"role": "user", "content": "the lazy dog"}], max_tokens=8, n=2,
              temperature=1.0, seed=1234, logprobs=True, top_logprobs=2)
    first = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    assert len(first.choices) == 2
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    for choice in first.choices:
        content = choice.logprobs.content
        assert content and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in first.choices)

    completion = client.completions.create(model=NAME, prompt="hello world", max_tokens=12, temperature=0,
                                           logprobs=2)
    lp = completion.choices[0].logprobs
    assert "".join(lp.tokens) == completion.choices[0].text and len(lp.top_logprobs[0]) >= 2
    text = completion.choices[0].text
    # Stop at the first character that is new in the text, so the cut keeps a non-empty prefix.
    first_new = [i for i in range(1, len(text)) if text[i] not in text[:i] and text[i].isprintable()
                 and text[i] != "\ufffd"]
    if not first_new:
        pytest.fail(f"the greedy text {text!r} gives no usable stop string")
    stop = text[first_new[0]]
    cut = client.completions.create(model=NAME, prompt="hello world", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:first_new[0]] and cut.choices[0].finish_reason == "stop"


def test_64_concurrent_streams(server):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(64)]

    async def one_stream(client, prompt):
        stream = await client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        parts, usage = [], None
        async for chunk in stream:
            parts.extend(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return "".join(parts), usage

    async def main():
        client = server.async_client()
        try:
            return await asyncio.gather(*(one_stream(client, p) for p in prompts))
        finally:
            await client.close()
    streamed = asyncio.run(main())
    whole = server.client().completions.create(model=NAME, prompt=prompts, max_tokens=10, temperature=0)
    for (text, usage), choice, prompt in zip(streamed, whole.choices, prompts):
        assert text == choice.text, prompt
        assert usage is not None and usage.completion_tokens >= 1
    assert sum(u.completion_tokens for _, u in streamed) == whole.usage.completion_tokens
    assert sum(u.prompt_tokens for _, u in streamed) == whole.usage.prompt_tokens


# -- errors ------------------------------------------------------------------------
def _check_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_errors_leave_the_server_working(server):
    ok = {"model": NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0}
    before = server.post("/v1/completions", ok).json()["choices"][0]["text"]
    _check_error(server.post("/v1/completions", b"{oops"), 400)
    assert _check_error(server.post("/v1/completions", {**ok, "top_p": 2}), 400)["param"] == "top_p"
    assert _check_error(server.post("/v1/completions", {**ok, "suffix": "x"}), 400)["param"] == "suffix"
    long_ids = [5] * (MAX_MODEL_LEN + 10)
    err = _check_error(server.post("/v1/completions", {**ok, "prompt": long_ids}), 400)
    assert str(MAX_MODEL_LEN) in err["message"] and str(MAX_MODEL_LEN + 10) in err["message"]
    err = _check_error(server.post("/v1/completions", {**ok, "prompt": [5] * 250, "max_tokens": 10}), 400)
    assert str(MAX_MODEL_LEN) in err["message"] and "260" in err["message"]
    err = _check_error(server.post("/v1/completions", {**ok, "prompt": [10_000]}), 400)
    assert "10000" in err["message"]  # a token id out of the vocabulary, refused by the engine
    _check_error(server.post("/v1/completions", ok, key=None), 401)
    _check_error(server.post("/v1/completions", ok, key="wrong"), 401)
    assert _check_error(server.post("/v1/completions", {**ok, "model": "nope"}), 404)["code"] == "model_not_found"
    _check_error(server.post("/v1/nothing", ok), 404)
    _check_error(server.post("/v1/completions", {**ok, "prompt": "x" * 70_000}), 413)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                                temperature=-1)
    assert server.post("/v1/completions", ok).json()["choices"][0]["text"] == before
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_tokenize_matches_what_the_model_is_fed(server):
    """``/tokenize`` gives the ids (and count) that the completion and chat routes feed the model,
    through the real tokenizer and chat template; ``/detokenize`` turns them back into text."""
    def tokenize(body):
        r = server.post("/tokenize", {"model": NAME, **body})
        assert r.status_code == 200, r.text
        return r.json()

    text = "the quick brown fox"
    plain = tokenize({"prompt": text})
    usage = server.post("/v1/completions", {"model": NAME, "prompt": text, "max_tokens": 1}).json()["usage"]
    assert plain["count"] == len(plain["tokens"]) == usage["prompt_tokens"]
    assert plain["max_model_len"] == MAX_MODEL_LEN
    done = server.post("/v1/completions", {"model": NAME, "prompt": plain["tokens"], "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == plain["count"]
    bare = tokenize({"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert len(bare["token_strs"]) == bare["count"] > 0
    assert server.post("/detokenize", {"tokens": bare["tokens"]}).json() == {"prompt": text}
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    chat = tokenize({"messages": messages})
    usage = server.post("/v1/chat/completions", {"model": NAME, "messages": messages, "max_tokens": 1}).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]
    rendered = server.post("/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert "<|im_start|>user\nhello world<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")
    assert tokenize({"messages": messages, "add_generation_prompt": False})["count"] < chat["count"]
    _check_error(server.post("/tokenize", {"prompt": text}, key=None), 401)
    assert _check_error(server.post("/detokenize", {"tokens": [10_000]}), 400)["param"] == "tokens"


# -- disconnects and metrics ---------------------------------------------------------
def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_killed_client_is_aborted_and_frees_kv(server):
    aborted = ("pipeserve_request_success_total", (("finished_reason", "abort"),))
    before = server.metrics().get(aborted, 0.0)
    body = json.dumps({"model": NAME, "prompt": "hello world", "max_tokens": 200, "stream": True,
                       "ignore_eos": True}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    received = b""
    while received.count(b"data: ") < 3:  # a few tokens streamed: the request is running
        received += sock.recv(4096)
    sock.close()
    killed = time.time()
    assert _wait_for(lambda: server.metrics().get(aborted, 0.0) == before + 1, 2.0), \
        "the request was not aborted within 2 s of the client going away"
    assert time.time() - killed < 2.5

    def idle():
        m = server.metrics()
        return (m[("pipeserve_kv_cache_usage_ratio", ())] == 0.0 and m[("pipeserve_num_requests_running", ())] == 0
                and m[("pipeserve_num_requests_in_server", ())] == 0)
    assert _wait_for(idle, 5.0), server.metrics()


def test_metrics_parse_and_move(server):
    before = server.metrics()
    server.client().completions.create(model=NAME, prompt="hello world", max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    server.post("/v1/completions", {"model": NAME, "prompt": "x", "top_p": 5})
    after = server.metrics()

    def delta(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)
    assert delta("pipeserve_request_success_total", (("finished_reason", "length"),)) == 1
    assert delta("pipeserve_generation_tokens_total") == 5
    assert delta("pipeserve_prompt_tokens_total") >= 2
    assert delta("pipeserve_time_to_first_token_seconds_count") == 1
    assert delta("pipeserve_time_per_output_token_seconds_count") == 1
    # One observation per output after the first; at PP = 2 a decode ahead's result can come
    # back with the one before it (one output, two tokens), as under load.
    assert 1 <= delta("pipeserve_inter_token_latency_seconds_count") <= 4
    assert delta("pipeserve_e2e_request_latency_seconds_count") == 1
    assert delta("pipeserve_http_errors_total", (("status", "400"),)) == 1
    assert delta("pipeserve_prefix_cache_queries_total") >= 2
    assert 0.0 <= after[("pipeserve_prefix_cache_hit_rate", ())] <= 1.0
    assert after[("pipeserve_healthy", ())] == 1.0
    if server.pp > 1:  # per-stage timeline figures exist only with stage processes
        for stage in range(server.pp):
            assert 0.0 < after[("pipeserve_stage_busy_ratio", (("stage", str(stage)),))] <= 1.0
            assert 0.0 <= after[("pipeserve_stage_bubble_ratio", (("stage", str(stage)),))] <= 1.0


# -- last: the shutdown ------------------------------------------------------------
def test_sigterm_finishes_cleanly(server):
    """Runs last in this module: SIGTERM lets the in-flight stream finish, then stops the server,
    its engine and every stage process, and the process exits 0."""
    children = _children(server.proc.pid)
    _stream_finishes_across(server, lambda: server.proc.send_signal(signal.SIGTERM))
    assert _wait_for(lambda: not any(Path(f"/proc/{c}").exists() for c in children), 10.0), children


def test_dead_stage_fails_requests_and_health(model_dir, tmp_path):
    """--max-stage-restarts 0, a stage killed mid-stream: the stream ends with an error event,
    /health and new requests answer 503, /metrics says unhealthy, and SIGTERM still exits
    cleanly. Its own server."""
    server = _start_server(model_dir, 2, tmp_path / "server.log", "--stage-timeout", "10",
                           "--max-stage-restarts", "0")
    try:
        stages = [int(pid) for (name, labels), pid in sorted(server.metrics().items())
                  if name == "pipeserve_stage_pid"]
        assert len(stages) == 2 and all(pid in _children(server.proc.pid) for pid in stages), stages
        body = {"model": NAME, "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(stages[-1], signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2], rest[-2:]
        _check_error(httpx.get(f"{server.url}/health", timeout=10), 503)
        _check_error(server.post("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2}), 503)
        assert server.metrics()[("pipeserve_healthy", ())] == 0.0
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0, server.log.read_text()[-3000:]
        assert _wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in stages), 10.0)
    finally:
        _stop(server)
