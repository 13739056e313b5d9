"""A stage that dies or freezes mid-generation: the pipeline is restarted, every sequence is
replayed from its token ids, and every request finishes as if nothing had happened.

Stage processes are found through a public accessor only: ``LLMEngine.stage_pids``. The
server's side (16 streams, SIGKILL and SIGSTOP) is in test_recovery_server.py.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

from pipeserve.entrypoints.llm import LLM
from pipeserve.sampling_params import SamplingParams
from tests.test_engine_behaviour import random_prompts, token_lists
from tests.test_scheduler import FakeEngine

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
def test_llm_pp3_survives_killing_the_middle_stage(tiny_checkpoints, capsys):
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
    with capsys.disabled():
        print(f"\nPP=3, stage 1 SIGKILLed: restarted in {recovery['recovery_seconds'][0]:.1f} s "
              f"(undisturbed run {undisturbed_s:.1f} s)")
