"""``pipeserve serve -pp 2`` with 16 concurrent streaming requests (greedy, ignore_eos, 64 tokens):
stage 1 is SIGKILLed, or SIGSTOPped past ``--stage-timeout``, mid-generation. Every stream pauses,
then finishes with finish_reason "length" and the same text as an undisturbed run; /health
answers 503 during the restart and 200 again within 30 s. Stage processes are found through the
``pipeserve_stage_pid`` gauge of /metrics. The measured recovery times are printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.test_server_e2e import KEY, NAME, _start_server, _stop

NEW_TOKENS = 64
# -- the server: 16 streams, a stage killed or frozen -----------------------------------
STREAMS = 16
STREAM_PROMPTS = [f"request {i}: the stages pass activations along" for i in range(STREAMS)]


def _metric(text: str, name: str, labels: str = "") -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def _metrics(server) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=30).text


async def _stream_all(server, on_progress=None) -> list[tuple[str, str | None]]:
    """16 concurrent streaming completions; (text, finish_reason) each. ``on_progress(chunks)``
    runs on the event loop after every chunk received (any stream)."""
    received = [0]

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[str, str | None]:
        body = {"model": NAME, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text, reason = "", None
        async with client.stream("POST", f"{server.url}/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                choice = event["choices"][0]
                text += choice["text"]
                reason = choice.get("finish_reason") or reason
                received[0] += 1
                if on_progress is not None:
                    on_progress(received[0])
        return text, reason

    async with httpx.AsyncClient(timeout=180) as client:
        return list(await asyncio.gather(*(one(client, p) for p in STREAM_PROMPTS)))


class HealthWatch(threading.Thread):
    """Polls /health (one kept-alive connection, every 10 ms) from the moment it is armed (at
    once, or by ``arm()`` when the fault is injected): when it turned 503 and back to 200. A
    restart takes a few tenths of a second, so the watch runs before the fault and the pause
    it must see is not lost to a new connection's set-up."""

    def __init__(self, url: str, armed: bool = True) -> None:
        super().__init__(daemon=True)
        self.url, self.start_t = url, time.monotonic()
        self.down_at: float | None = None
        self.up_at: float | None = None
        self.stop = threading.Event()
        self.armed = threading.Event()
        if armed:
            self.armed.set()

    def arm(self) -> None:
        self.start_t = time.monotonic()
        self.armed.set()

    def run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self.stop.is_set() and self.up_at is None:
                try:
                    code = client.get(f"{self.url}/health").status_code
                except httpx.HTTPError:
                    code = None
                if self.armed.is_set():
                    now = time.monotonic() - self.start_t
                    if code == 503 and self.down_at is None:
                        self.down_at = now
                    elif code == 200 and self.down_at is not None:
                        self.up_at = now
                time.sleep(0.01)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.checkpoints import build_checkpoint
    model = build_checkpoint("llama_tied_gqa", tmp_path_factory.mktemp("tiny_llama"))
    server = _start_server(model, 2, tmp_path_factory.mktemp("server") / "server.log",
                           "--stage-timeout", "3", "--max-stage-restarts", "4")
    yield server
    _stop(server)


@pytest.fixture(scope="module")
def undisturbed(server):
    return asyncio.run(_stream_all(server))


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_server_streams_survive_a_failed_stage(server, undisturbed, fault, capsys):
    before = _metrics(server)
    victim = int(_metric(before, "pipeserve_stage_pid", 'stage="1"'))
    restarts = _metric(before, "pipeserve_stage_restarts_total") or 0.0
    watch = HealthWatch(server.url, armed=False)
    watch.start()

    def inject(chunks: int) -> None:
        if chunks == STREAMS * 8 and not watch.armed.is_set():      # every stream is mid-generation
            watch.arm()
            os.kill(victim, getattr(signal, fault))

    try:
        got = asyncio.run(_stream_all(server, inject))
        assert watch.armed.is_set(), "the fault was never injected"
        watch.join(30)
    finally:
        watch.stop.set()
        if fault == "SIGSTOP":
            try:
                os.kill(victim, signal.SIGCONT)   # only matters if it was not replaced
            except ProcessLookupError:
                pass
    assert [r for _, r in got] == ["length"] * STREAMS
    assert got == undisturbed
    assert watch.down_at is not None and watch.up_at is not None and watch.up_at < 30, \
        (watch.down_at, watch.up_at, server.log.read_text()[-3000:])
    after = _metrics(server)
    assert _metric(after, "pipeserve_stage_restarts_total") == restarts + 1
    assert _metric(after, "pipeserve_stage_recovery_seconds_count") == restarts + 1
    new_pid = int(_metric(after, "pipeserve_stage_pid", 'stage="1"'))
    assert new_pid != victim
    with pytest.raises(ProcessLookupError):
        os.kill(victim, 0)
    took = _metric(after, "pipeserve_stage_recovery_seconds_sum") - \
        (_metric(before, "pipeserve_stage_recovery_seconds_sum") or 0.0)
    with capsys.disabled():
        print(f"\n{fault}: /health 503 after {watch.down_at:.1f} s, 200 again {watch.up_at:.1f} s after the "
              f"fault (stage timeout 3 s); the restart itself took {took:.1f} s")


def test_server_replaces_a_stage_that_dies_while_idle(server):
    """No request running: the dead stage is replaced at once (not at the next request) and
    /health comes back on its own; a request sent while /health says 503 is admitted, waits
    for the restart and is served."""
    before = _metrics(server)
    victim = int(_metric(before, "pipeserve_stage_pid", 'stage="0"'))
    restarts = _metric(before, "pipeserve_stage_restarts_total") or 0.0
    watch = HealthWatch(server.url)
    os.kill(victim, signal.SIGKILL)
    watch.start()
    deadline = time.monotonic() + 10
    while watch.down_at is None and time.monotonic() < deadline:
        time.sleep(0.02)
    sent_at = time.monotonic() - watch.start_t
    body = {"model": NAME, "prompt": "during the restart", "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"})
    watch.join(60)
    watch.stop.set()
    assert watch.down_at is not None and watch.up_at is not None, server.log.read_text()[-3000:]
    assert sent_at < watch.up_at, (sent_at, watch.up_at)     # sent while the pipeline restarted
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length", \
        response.text
    after = _metrics(server)
    assert _metric(after, "pipeserve_stage_restarts_total") == restarts + 1
    assert int(_metric(after, "pipeserve_stage_pid", 'stage="0"')) != victim
