"""The KV block manager alone: refcounts, prefix cache, LRU eviction, swap, fork."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeserve.kv_cache.block_manager import BlockManager, KVCacheIntegrityError
from pipeserve.sampling_params import SamplingParams
from pipeserve.sequence import Sequence

BS = 4


def make_seq(tokens: list[int], request_id: str = "r", index: int = 0) -> Sequence:
    return Sequence(request_id, index, tokens, SamplingParams(max_tokens=8))


def run_prefill(bm: BlockManager, seq: Sequence, budget: int = 10_000) -> None:
    """Admit ``seq`` and 'compute' its whole prompt as the scheduler would."""
    n = bm.admit(seq, budget)
    assert n > 0
    seq.num_computed_tokens += n
    bm.register_computed(seq)


def test_admit_allocate_free_counts() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(list(range(10)))
    assert bm.admit(seq, 6) == 6            # chunk of 6 -> 2 blocks
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    seq.num_computed_tokens = 6
    assert bm.allocate_slots(seq, 4)          # 10 tokens -> 3 blocks
    assert len(seq.block_table) == 3
    assert bm.usage == pytest.approx(3 / 8)
    assert not bm.allocate_slots(seq, 4 + 6 * BS)   # all-or-nothing: nothing taken
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.check_integrity()
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8
    bm.check_integrity()


def test_prefix_hit_shares_blocks_and_counts() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(list(range(10)), "a")
    run_prefill(bm, a)
    b = make_seq(list(range(10)) + [99], "b")
    n = bm.admit(b, 100)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8 and n == 3
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.refcount(x) for x in a.block_table[:2]] == [2, 2]
    assert bm.refcount(a.block_table[2]) == 1 and b.block_table[2] != a.block_table[2]
    stats = bm.stats()
    assert stats["prefix_cache_hit_blocks"] == 2 and stats["prefix_cache_hit_tokens"] == 8
    assert stats["prefix_cache_query_blocks"] == 2 + 2 and stats["prefix_cache_query_tokens"] == 10 + 11
    bm.check_integrity()


def test_prefix_hit_leaves_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    run_prefill(bm, make_seq(list(range(8)), "a"))
    b = make_seq(list(range(8)), "b")
    # Both blocks are cached, but only block 0 is shared: the last token needs logits.
    assert bm.admit(b, 100) == 4 and b.num_computed_tokens == 4


def test_block_not_shared_before_its_kv_exists() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(list(range(9)), "a")
    assert bm.admit(a, 100) == 9              # scheduled, step not done: nothing registered
    b = make_seq(list(range(9)), "b")
    assert bm.admit(b, 100) == 9 and b.num_computed_tokens == 0
    a.num_computed_tokens = 9
    bm.register_computed(a)
    c = make_seq(list(range(9)), "c")
    assert bm.admit(c, 100) == 1 and c.block_table[:2] == a.block_table[:2]


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    run_prefill(bm, make_seq(list(range(12)), "a"))
    b = make_seq(list(range(12)), "b")
    assert bm.admit(b, 100) == 12
    assert bm.stats()["prefix_cache_hit_blocks"] == 0 and bm.stats()["num_cached_blocks"] == 0


def test_lru_eviction_of_unreferenced_cached_blocks() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = make_seq([1] * 9, "a")                # 2 full blocks registered, the tail block not
    b = make_seq([2] * 9, "b")
    run_prefill(bm, a)
    run_prefill(bm, b)
    a_table, b_table = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    # Cached content survives release: 4 cached blocks, all 6 allocatable.
    assert bm.stats()["num_cached_blocks"] == 4 and bm.num_free_blocks == 6
    # 4 blocks needed: the 2 uncached tails first, then a's (released before b's).
    c = make_seq([3] * 16, "c")
    assert bm.admit(c, 100) == 16
    assert sorted(c.block_table) == sorted([a_table[2], b_table[2], a_table[0], a_table[1]])
    assert all(bm.is_cached(x) for x in b_table[:2])
    assert bm.stats()["prefix_cache_evictions"] == 2
    # b's prefix is still served from the cache.
    bm.free(c)
    d = make_seq([2] * 9, "d")
    assert bm.admit(d, 100) == 1 and d.block_table[:2] == b_table[:2]
    bm.check_integrity()


def test_touching_a_cached_block_protects_it_from_eviction() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq([1] * 5, "a")
    b = make_seq([2] * 5, "b")
    run_prefill(bm, a)
    run_prefill(bm, b)
    a0, b0 = a.block_table[0], b.block_table[0]
    bm.free(a)
    bm.free(b)                                # LRU order now: a0, b0
    again = make_seq([1] * 5, "a2")           # hits a0, then releases it: LRU order b0, a0
    assert bm.admit(again, 100) == 1 and again.block_table[0] == a0
    bm.free(again)
    filler = make_seq([7] * 12, "f")          # 3 blocks: the 2 free ones + the LRU cached one
    assert bm.admit(filler, 100) == 12
    assert bm.is_cached(a0) and not bm.is_cached(b0)
    assert bm.stats()["prefix_cache_evictions"] == 1


def test_a_released_sequence_is_evicted_tail_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq([1] * 13, "a")               # 3 full registered blocks + 1 tail
    run_prefill(bm, a)
    table = list(a.block_table)
    bm.free(a)
    other = make_seq([9] * 8, "o")            # the free tail block + 1 eviction
    assert bm.admit(other, 100) == 8
    assert not bm.is_cached(table[2]) and bm.is_cached(table[0]) and bm.is_cached(table[1])
    again = make_seq([1] * 13, "a2")          # the leading blocks still hit
    bm.free(other)
    assert bm.admit(again, 100) == 5 and again.block_table[:2] == table[:2]


def test_swap_out_and_in_roundtrip_reuses_cached_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, num_host_blocks=3)
    seq = make_seq(list(range(10)))
    run_prefill(bm, seq)
    old = list(seq.block_table)
    assert bm.can_swap_out(seq)
    out = bm.swap_out(seq)
    assert [d for d, _ in out] == old and seq.block_table == [] and bm.host.num_free == 0
    bm.check_integrity()
    assert bm.can_swap_in(seq, 1)
    back = bm.swap_in(seq)
    # The two full blocks are still cached on the device: shared, not copied.
    assert seq.block_table[:2] == old[:2] and len(back) == 1 and back[0][1] == seq.block_table[2]
    assert bm.host.num_free == 3
    bm.check_integrity()


def test_swap_needs_host_room() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, num_host_blocks=2)
    seq = make_seq(list(range(10)))
    run_prefill(bm, seq)
    assert not bm.can_swap_out(seq)
    with pytest.raises(RuntimeError, match="host pool"):
        bm.swap_out(seq)


def test_fork_shares_full_prompt_blocks_and_recomputes_tail() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    parent = make_seq(list(range(10)), "r", 0)
    run_prefill(bm, parent)
    child = make_seq(list(range(10)), "r", 1)
    assert bm.admit(child, 100, share_from=parent) == 2
    assert child.block_table[:2] == parent.block_table[:2] and child.block_table[2] != parent.block_table[2]
    assert bm.refcount(parent.block_table[0]) == 2
    # A prompt that is a whole number of blocks keeps its last block to itself.
    p2 = make_seq(list(range(8)), "s", 0)
    run_prefill(bm, p2)
    c2 = make_seq(list(range(8)), "s", 1)
    assert bm.admit(c2, 100, share_from=p2) == 4 and c2.block_table[0] == p2.block_table[0]
    bm.check_integrity()


def test_integrity_check_detects_corruption() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = make_seq(list(range(6)))
    bm.admit(seq, 100)
    bm._ref[seq.block_table[0]] += 1
    with pytest.raises(KVCacheIntegrityError, match="refcount"):
        bm.check_integrity()


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=BS)
    assert BlockManager(num_blocks=3, block_size=BS).can_ever_fit(12)
    assert not BlockManager(num_blocks=3, block_size=BS).can_ever_fit(13)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), caching=st.booleans(), host=st.integers(0, 12))
def test_random_operations_keep_integrity(seed: int, caching: bool, host: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=12, block_size=BS, num_host_blocks=host, enable_prefix_caching=caching)
    live: list[Sequence] = []
    swapped: list[Sequence] = []
    for step in range(150):
        op = rng.random()
        if op < 0.25:
            seq = make_seq([rng.randrange(3) for _ in range(rng.randrange(1, 14))], f"q{step}")
            parent = rng.choice(live) if live and rng.random() < 0.3 else None
            if parent is not None and parent.num_computed_tokens >= parent.num_prompt_tokens:
                seq = make_seq(parent.prompt_token_ids, parent.request_id, 1)
            else:
                parent = None
            if bm.admit(seq, rng.randrange(1, 20), share_from=parent):
                live.append(seq)
        elif op < 0.55 and live:
            seq = rng.choice(live)                # the step that filled its slots is done
            seq.num_computed_tokens = min(seq.num_tokens, len(seq.block_table) * BS)
            bm.register_computed(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(rng.randrange(3))
            bm.allocate_slots(seq, min(seq.num_uncomputed_tokens, rng.randrange(1, 9)))
        elif op < 0.7 and live:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        elif op < 0.85 and live:
            seq = rng.choice(live)
            if bm.can_swap_out(seq):
                bm.swap_out(seq)
                live.remove(seq)
                swapped.append(seq)
        elif swapped:
            seq = rng.choice(swapped)
            if bm.can_swap_in(seq):
                bm.swap_in(seq)
                swapped.remove(seq)
                live.append(seq)
        bm.check_integrity()
    for seq in live + swapped:
        bm.free(seq)
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks and bm.host.num_free == host
