"""A stage that dies or freezes mid-generation: the pipeline is restarted, every sequence is
replayed from its token ids, and every request finishes as if nothing had happened.

Stage processes are found through public accessors only: ``LLMEngine.stage_pids`` offline and
the ``pipeserve_stage_pid`` gauge of a server's /metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time

import httpx
import pytest

from pipeserve.entrypoints.llm import LLM
from pipeserve.sampling_params import SamplingParams
from tests.test_engine_behaviour import random_prompts, token_lists
from tests.test_scheduler import FakeEngine
from tests.test_server_e2e import KEY, NAME, _start_server, _stop

NEW_TOKENS = 64
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


# -- the scheduler's side: what is dropped, what is replayed ------------------------
def _lose_all_kv(eng: FakeEngine) -> int:
    """What the engine does when a stage dies: the micro-batches in flight are lost, the
    stages come back with empty caches (the fake's KV signatures are wiped), replay."""
    while eng.inflight:
        eng.sched.on_step_failed(eng.inflight.popleft())
    replayed = eng.sched.replay_all()
    eng.dev = [[None] * len(b) for b in eng.dev]
    eng.host = [[None] * len(b) for b in eng.host]
    eng.sched.block_manager.check_integrity()
    return replayed


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_replay_after_lost_kv_never_reads_a_lost_block(seed, mode):
    """Random load with the prefix cache, swaps and n > 1; the KV is lost twice in the middle.
    The fake stages assert that every position a step reads holds the KV of exactly its
    tokens, so a prefix-cache hit on a lost block or a sequence resumed at its old position
    would fail; every request still finishes with all its tokens."""
    eng = FakeEngine(num_blocks=10, num_host_blocks=6, max_inflight=2, seed=seed, preemption_mode=mode,
                     enable_prefix_caching=True, max_num_batched_tokens=12, max_num_seqs=4)
    rng = random.Random(seed)
    replayed, losses = 0, 0
    for step in range(300):
        if rng.random() < 0.3 or step < 4:
            eng.add_random()
        if step >= 40 * (losses + 1) and losses < 2 and eng.sched.num_running:
            replayed += _lose_all_kv(eng)
            losses += 1
            assert eng.sched.block_manager.stats()["num_cached_blocks"] == 0
            assert eng.sched.num_running == eng.sched.num_swapped == 0
        eng.pump()
    eng.drain()
    eng.assert_clean()
    assert losses == 2 and replayed > 0


def test_replay_refuses_while_steps_are_in_flight():
    eng = FakeEngine(num_blocks=8)
    eng.add([1, 2, 3, 4, 5], max_tokens=3)
    eng.submit()
    with pytest.raises(RuntimeError, match="in flight"):
        eng.sched.replay_all()


# -- offline: LLM.generate at PP = 3, the middle stage killed -------------------------
def test_llm_pp3_survives_killing_the_middle_stage(tiny_checkpoints):
    path = str(tiny_checkpoints("llama_tied_gqa"))
    prompts = [{"prompt_token_ids": p} for p in random_prompts(8, seed=5)]
    llm = LLM(model=path, dtype="float32", kv_cache_memory="16MiB", pipeline_parallel_size=3,
              threads_per_stage=1, stage_timeout=10, max_stage_restarts=2)
    try:
        start = time.monotonic()
        reference = token_lists(llm.generate(prompts, GREEDY, use_tqdm=False))
        undisturbed_s = time.monotonic() - start
        victim = llm.engine.stage_pids[1]
        killer = threading.Timer(undisturbed_s * 0.4, os.kill, (victim, signal.SIGKILL))
        killer.start()
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        killer.join()
        recovery = llm.stats()["recovery"]
        new_pids = llm.engine.stage_pids
    finally:
        llm.shutdown()
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * len(prompts)
    assert not any(o.error for o in outs)
    assert token_lists(outs) == reference
    assert recovery["stage_restarts"] == 1 and len(recovery["recovery_seconds"]) == 1, recovery
    assert "stage 1" in recovery["last_error"], recovery
    assert victim not in new_pids.values() and len(new_pids) == 3
    with pytest.raises(ProcessLookupError):
        os.kill(victim, 0)


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
    """Polls /health from the moment the fault is injected: when it turned 503 and back to 200."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.start_t = url, time.monotonic()
        self.down_at: float | None = None
        self.up_at: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() and self.up_at is None:
            try:
                code = httpx.get(f"{self.url}/health", timeout=5).status_code
            except httpx.HTTPError:
                code = None
            now = time.monotonic() - self.start_t
            if code == 503 and self.down_at is None:
                self.down_at = now
            elif code == 200 and self.down_at is not None:
                self.up_at = now
            time.sleep(0.05)


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
    watch = HealthWatch(server.url)

    def inject(chunks: int) -> None:
        if chunks == STREAMS * 8 and not watch.is_alive():      # every stream is mid-generation
            os.kill(victim, getattr(signal, fault))
            watch.start_t = time.monotonic()
            watch.start()

    try:
        got = asyncio.run(_stream_all(server, inject))
        assert watch.is_alive() or watch.up_at is not None, "the fault was never injected"
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
    with capsys.disabled():
        print(f"\n{fault}: /health 503 after {watch.down_at:.1f} s, 200 again {watch.up_at:.1f} s after the "
              f"fault (stage timeout 3 s); restart took "
              f"{_metric(after, 'pipeserve_stage_recovery_seconds_sum') - (_metric(before, 'pipeserve_stage_recovery_seconds_sum') or 0):.1f} s")
