"""A prompt's chunks in flight together (``pipeline_prompt_chunks``): the scheduler alone,
driven by test_scheduler's fake engine, whose KV signatures catch a chunk that reads a
position no earlier step wrote, or a block shared or reused too early."""

from __future__ import annotations

import random

import pytest

from pipeserve.sequence import SequenceStatus
from tests.test_scheduler import BS, FakeEngine, run_random


def _chunks(*outs) -> list[tuple[int, int, bool]]:
    return [(i.start, i.num_new_tokens, i.sample) for out in outs for i in out.scheduled]


def _long_prompt_engine(**config) -> tuple[FakeEngine, object]:
    """One 20-token prompt, 8 tokens a micro-batch, 3 micro-batches in flight."""
    eng = FakeEngine(num_blocks=32, max_inflight=3, max_num_batched_tokens=8, **config)
    return eng, eng.add(list(range(20)), max_tokens=3).seqs[0]


def test_consecutive_chunks_of_one_prompt_are_in_flight_together() -> None:
    eng, seq = _long_prompt_engine()
    outs = [eng.submit() for _ in range(3)]
    assert _chunks(*outs) == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert seq.num_computed_tokens == 0
    assert eng.sched.num_inflight == 1 and eng.sched.num_inflight_items == 3
    # One table for the whole prompt, allocated once: 20 tokens in 5 blocks, none twice.
    bm = eng.sched.block_manager
    assert len(seq.block_table) == 5 == len(set(seq.block_table))
    assert bm.num_free_blocks == bm.num_blocks - 5
    bm.check_integrity()
    assert eng.submit().is_empty, "nothing to schedule until the sampled token is back"
    computed = []
    for _ in range(3):
        eng.complete_oldest()
        computed.append(seq.num_computed_tokens)
    assert computed == [8, 16, 20] and seq.num_output_tokens == 1
    assert eng.sched.stats()["num_pipelined_chunks"] == 2 == eng.pipelined
    assert _chunks(eng.submit()) == [(20, 1, True)]       # now the decode
    eng.drain()
    eng.assert_clean()


def test_no_decode_while_a_chunk_is_in_flight() -> None:
    eng, seq = _long_prompt_engine()
    short = eng.add([1, 2, 3], max_tokens=4).seqs[0]
    first = eng.submit()
    assert {i.seq.seq_id for i in first.scheduled} == {seq.seq_id}  # 8 tokens of budget: the prompt's chunk
    eng.submit()
    eng.submit()
    while eng.inflight:
        eng.complete_oldest()
    # Both prompts done: each now has a decode; in flight, neither may get a second item.
    out = eng.submit()
    assert sorted(_chunks(out)) == [(3, 1, True), (20, 1, True)]
    assert eng.submit().is_empty
    assert short.status == SequenceStatus.RUNNING
    eng.drain()
    eng.assert_clean()


def test_switched_off_one_item_per_sequence() -> None:
    eng, seq = _long_prompt_engine(pipeline_prompt_chunks=False)
    assert _chunks(eng.submit()) == [(0, 8, False)]
    assert eng.submit().is_empty
    eng.drain()
    eng.assert_clean()
    assert eng.pipelined == 0 and eng.sched.stats()["num_pipelined_chunks"] == 0


def test_abort_with_two_chunks_in_flight_frees_after_both_return() -> None:
    eng, seq = _long_prompt_engine()
    eng.submit()
    eng.submit()
    bm = eng.sched.block_manager
    table = list(seq.block_table)
    assert eng.sched.abort_request(seq.request_id) == [seq]
    assert seq.block_table == table                        # the stages may still write them
    eng.complete_oldest()
    assert seq.block_table == table and bm.num_free_blocks == bm.num_blocks - len(table)
    assert eng.sched.num_inflight_items == 1
    eng.complete_oldest()
    assert seq.block_table == [] and bm.num_free_blocks == bm.num_blocks
    assert not eng.sched.has_unfinished()
    eng.assert_clean()


def test_failed_chunks_in_flight_are_recomputed() -> None:
    eng, seq = _long_prompt_engine()
    for _ in range(3):
        eng.submit()
    eng.complete_oldest()                                  # chunk 1 computed
    while eng.inflight:                                    # a stage died: the others are lost
        eng.sched.on_step_failed(eng.inflight.popleft())
    assert seq.num_computed_tokens == 8 and eng.sched.num_inflight_items == 0
    assert eng.sched.replay_all() == 1                     # the stages' KV is gone
    eng.dev = [[None] * BS for _ in eng.dev]
    assert seq.status == SequenceStatus.WAITING and seq.num_computed_tokens == 0
    assert _chunks(eng.submit(), eng.submit()) == [(0, 8, False), (8, 8, False)]
    eng.drain()
    eng.assert_clean()
    assert seq.num_output_tokens == 3


def test_a_chunk_done_out_of_order_or_after_a_lost_one_is_refused() -> None:
    eng, seq = _long_prompt_engine()
    first, second = eng.submit(), eng.submit()
    with pytest.raises(RuntimeError, match="came back before"):
        eng.sched.on_step_done(second)
    eng.sched.on_step_failed(first)                        # lost alone: the next chunk is no good
    with pytest.raises(RuntimeError, match="computed before it"):
        eng.sched.on_step_done(second)


def test_prefix_cache_shares_only_computed_chunks() -> None:
    eng, seq = _long_prompt_engine()
    eng.submit()
    eng.complete_oldest()                                  # tokens 0..7 computed: 2 blocks cached
    eng.submit()                                           # tokens 8..15 in flight
    later = eng.add(list(range(20)) + [50, 51], max_tokens=2).seqs[0]
    out = eng.submit()
    assert _chunks(out) == [(16, 4, True), (8, 4, False)]
    assert later.num_cached_tokens == 8 and later.block_table[:2] == seq.block_table[:2]
    assert later.block_table[2] != seq.block_table[2]      # that one's KV is still being written
    eng.drain()
    eng.assert_clean()


def test_n_siblings_fork_once_the_prompt_is_computed() -> None:
    eng = FakeEngine(num_blocks=32, max_inflight=3, max_num_batched_tokens=8, enable_prefix_caching=False)
    group = eng.add(list(range(20)), max_tokens=3, n=3)
    first, *siblings = group.seqs
    outs = [eng.submit() for _ in range(3)]
    assert all(i.seq is first for out in outs for i in out.scheduled)
    eng.complete_oldest()
    eng.complete_oldest()
    assert eng.submit().is_empty                           # prompt not computed yet: they wait
    eng.complete_oldest()
    tails = {i.seq.seq_id: i for i in eng.submit(token_budget=16).scheduled}
    for sib in siblings:
        assert (tails[sib.seq_id].start, tails[sib.seq_id].num_new_tokens) == (16, 4)
        assert sib.block_table[:4] == first.block_table[:4]
    eng.drain()
    eng.assert_clean()
    assert all(s.num_output_tokens == 3 for s in group.seqs)


def test_pipelined_chunks_under_kv_pressure_never_double_allocate() -> None:
    """Long prompts pipelined beside decodes in a cache too small for all: preemptions happen,
    in-flight sequences are never their victims, and every block is read as written."""
    for mode in ("recompute", "swap"):
        eng = FakeEngine(num_blocks=12, num_host_blocks=8, max_inflight=3, preemption_mode=mode,
                         max_num_batched_tokens=12, seed=5)
        rng = random.Random(5)
        for _ in range(12):
            eng.add([rng.randrange(50) for _ in range(rng.randint(10, 24))], max_tokens=rng.randint(1, 20))
        eng.drain()
        eng.assert_clean()
        stats = eng.sched.stats()
        assert stats["num_preemptions"] > 0 and eng.pipelined > 0, (mode, stats)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_random_operations_pipeline_chunks(mode: str) -> None:
    """test_scheduler's random operations (aborts, preemption, prefix caching, n > 1) with 3 in
    flight: chunks do overlap, and switched off they do not."""
    on = run_random(seed=11, mode=mode, caching=True, inflight=3)
    assert on.pipelined > 0 and on.sched.stats()["num_pipelined_chunks"] == on.pipelined
    off = FakeEngine(num_blocks=10, max_inflight=3, pipeline_prompt_chunks=False, max_num_batched_tokens=6)
    for i in range(6):
        off.add([i] * 15, max_tokens=3)
    off.drain()
    off.assert_clean()
    assert off.pipelined == 0


def test_a_lone_prompt_is_cut_so_its_chunks_fill_the_pipeline() -> None:
    from types import SimpleNamespace

    from pipeserve.config import EngineConfig
    from pipeserve.scheduler.scheduler import lone_prompt_chunk, micro_batch_limits

    def limits(live: int, pp: int, **config) -> dict:
        sched = SimpleNamespace(config=EngineConfig(**config), num_running=live, num_waiting=0,
                                num_swapped=0, num_inflight=0)
        return micro_batch_limits(sched, [], pp, False, pp)

    assert limits(1, 2) == {"max_seqs": 1, "token_budget": 1024, "prefill_budget": 512}
    assert limits(2, 3)["prefill_budget"] == 256           # 682 // 3, raised to the minimum chunk
    assert "prefill_budget" not in limits(2, 2)             # a sequence for every micro-batch
    assert "prefill_budget" not in limits(1, 2, pipeline_prompt_chunks=False)
    assert "prefill_budget" not in limits(1, 2, enable_chunked_prefill=False)   # prompts run whole
    assert lone_prompt_chunk(100, 2) == 100                 # never above the micro-batch's budget


def test_a_recompute_is_pipelined_like_a_prompt() -> None:
    """After the KV is lost, a sequence recomputes prompt + generated tokens in chunks in
    flight together; the last one (a single token here) samples."""
    eng = FakeEngine(num_blocks=32, max_inflight=3, max_num_batched_tokens=8)
    seq = eng.add([1, 2, 3, 4, 5, 6], max_tokens=30).seqs[0]
    while seq.num_tokens < 17:
        eng.pump()
    while eng.inflight:
        eng.complete_oldest()
    assert eng.sched.replay_all() == 1
    eng.dev = [[None] * BS for _ in eng.dev]
    n = seq.num_tokens
    starts = list(range(0, n, 8))
    expected = [(s, min(8, n - s), s + 8 >= n) for s in starts]
    assert len(expected) == 3 and expected[-1][1] == n - 16
    assert _chunks(*[eng.submit() for _ in range(3)]) == expected
    eng.drain()
    eng.assert_clean()
    assert seq.num_output_tokens == 30
