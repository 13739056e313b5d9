"""One long prompt alone at PP > 1: its chunks flow through the pipeline together
(``pipeline_prompt_chunks``), and the float32 greedy tokens are still those of PP = 1 and of
transformers, for every schedule and with TP inside a stage; a stage killed while chunks
are in flight is recovered."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

from pipeserve import LLM
from tests.test_engine_behaviour import greedy, hf_greedy_batch, token_lists

# 400 prompt tokens at 64 a step: 32 a micro-batch at PP = 2 (13 chunks), 21 at PP = 3 (20).
PROMPT = [random.Random(21).randrange(3, 300) for _ in range(400)]
BATCHED = 64


def run_long(path: str, **kwargs) -> tuple[list[int], dict]:
    with LLM(model=path, dtype="float32", kv_cache_memory="16MiB", threads_per_stage=1,
             max_num_batched_tokens=BATCHED, **kwargs) as llm:
        tokens = token_lists(llm.generate([{"prompt_token_ids": PROMPT}], greedy(), use_tqdm=False))[0]
        return tokens, llm.stats()["scheduler"]


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    path = tiny_checkpoints("llama_tied_gqa")
    single, stats = run_long(str(path))
    assert stats["num_pipelined_chunks"] == 0          # PP = 1: one micro-batch at a time
    assert single == hf_greedy_batch(path, [PROMPT])[0]
    return str(path), single


# Every schedule once, P = 3 once (each case is an engine start).
CASES = [(2, "async", {}), (3, "async", {}), (2, "gpipe", {"pp_micro_batches": 2}),
         (2, "interleaved", {"pp_virtual_stages": 2}), (2, "async", {"tensor_parallel_size": 2})]


@pytest.mark.parametrize("pp,schedule,extra", CASES, ids=["pp2-async", "pp3-async", "pp2-gpipe",
                                                           "pp2-interleaved", "pp2-async-tp2"])
def test_long_prompt_chunks_overlap_and_tokens_match(llama, pp, schedule, extra):
    path, single = llama
    tokens, stats = run_long(path, pipeline_parallel_size=pp, pp_schedule=schedule, **extra)
    assert tokens == single
    # Most chunks went in behind an earlier chunk of the same prompt still in flight.
    num_chunks = -(-len(PROMPT) // (BATCHED // pp))
    assert stats["num_pipelined_chunks"] >= num_chunks // 2, stats


def test_switched_off_chunks_go_one_at_a_time(llama):
    path, single = llama
    tokens, stats = run_long(path, pipeline_parallel_size=2, pipeline_prompt_chunks=False)
    assert tokens == single and stats["num_pipelined_chunks"] == 0


def test_stage_killed_with_chunks_in_flight_recovers(llama):
    """Stage 1 of 3 is stopped, so nothing it receives can finish; once two chunks of the prompt
    are in flight it is killed. The pipeline is restarted, the prompt replayed, and the tokens
    are the undisturbed run's."""
    path, single = llama
    llm = LLM(model=path, dtype="float32", kv_cache_memory="16MiB", threads_per_stage=1,
              max_num_batched_tokens=BATCHED, pipeline_parallel_size=3, stage_timeout=10,
              max_stage_restarts=2)
    seen: list[int] = []

    def kill_with_chunks_in_flight(pid: int) -> None:
        deadline = time.monotonic() + 60
        while llm.engine.scheduler.num_inflight_items < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        seen.append(llm.engine.scheduler.num_inflight_items)
        os.kill(pid, signal.SIGKILL)

    try:
        victim = llm.engine.stage_pids[1]
        os.kill(victim, signal.SIGSTOP)
        killer = threading.Thread(target=kill_with_chunks_in_flight, args=(victim,), daemon=True)
        killer.start()
        out = llm.generate([{"prompt_token_ids": PROMPT}], greedy(), use_tqdm=False)[0]
        killer.join()
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert seen and seen[0] >= 2, seen
    assert out.outputs[0].finish_reason == "length" and not out.error
    assert out.outputs[0].token_ids == single
    assert stats["recovery"]["stage_restarts"] == 1, stats["recovery"]
    assert stats["scheduler"]["num_replayed"] == 1
    assert stats["scheduler"]["num_pipelined_chunks"] > 0
