"""The scheduler alone, driven by a fake engine whose 'KV cache' records which
token prefix each slot was computed for, so a wrong block (shared too early,
evicted while used, lost in a swap) is caught when a later step reads it."""

from __future__ import annotations

import itertools
import random
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeserve.config import EngineConfig
from pipeserve.sampling_params import SamplingParams
from pipeserve.scheduler.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from pipeserve.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 4
_ids = itertools.count()


class FakeEngine:
    """Drives a Scheduler the way the engine does, and checks every step."""

    def __init__(self, num_blocks: int, num_host_blocks: int = 0, max_inflight: int = 1,
                 seed: int = 0, **config) -> None:
        self.config = EngineConfig(block_size=BS, **config)
        self.requests: dict[str, SequenceGroup] = {}      # as the engine's table; never emptied here
        self.sched = Scheduler(self.config, num_blocks, num_host_blocks, self.requests)
        self.dev: list[list[int | None]] = [[None] * BS for _ in range(num_blocks)]
        self.host: list[list[int | None]] = [[None] * BS for _ in range(num_host_blocks)]
        self.inflight: deque[SchedulerOutput] = deque()
        self.max_inflight = max_inflight
        self.rng = random.Random(seed)
        self.groups: list[SequenceGroup] = []
        self.admission_order: list[str] = []
        self.served: dict[str, int] = {}
        self.swapped_in_blocks = 0
        self.steps = 0
        self.pipelined = 0          # items scheduled behind a chunk of their sequence in flight
        self._sigs: dict[int, list[int]] = {}

    # -- requests ------------------------------------------------------------
    def add(self, prompt: list[int], max_tokens: int, n: int = 1, priority: int = 0,
            user: str = "") -> SequenceGroup:
        rid = f"req{next(_ids)}"
        params = SamplingParams(n=n, max_tokens=max_tokens)
        now = float(len(self.groups))
        seqs = [Sequence(rid, i, prompt, params, now, priority, user) for i in range(n)]
        group = SequenceGroup(rid, None, prompt, params, seqs, now, priority, user)
        assert self.sched.can_ever_fit(len(prompt) + max_tokens)
        self.requests[rid] = group
        self.sched.add_request(group)
        self.groups.append(group)
        return group

    def add_random(self) -> None:
        prefix = [[5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4], []][self.rng.randrange(3)]
        prompt = prefix + [self.rng.randrange(4) for _ in range(self.rng.randrange(1, 9))]
        limit = self.sched.block_manager.num_blocks * BS - len(prompt)
        self.add(prompt, self.rng.randint(1, min(10, limit)), n=self.rng.choice([1, 1, 2, 3]),
                 priority=self.rng.randrange(3), user=self.rng.choice("ab"))

    # -- steps ---------------------------------------------------------------
    def submit(self, token_budget: int | None = None, max_seqs: int | None = None) -> SchedulerOutput:
        busy: dict[int, ScheduledSeq] = {}        # seq_id -> its latest item in flight
        for flying in self.inflight:
            busy.update((item.seq.seq_id, item) for item in flying.scheduled)
        out = self.sched.schedule(token_budget, max_seqs)
        self._check_output(out, busy, token_budget, max_seqs)
        self.swapped_in_blocks += len(out.swap_in)
        if not out.is_empty:
            self.inflight.append(out)
        return out

    def _check_output(self, out: SchedulerOutput, busy: dict[int, ScheduledSeq], token_budget: int | None,
                      max_seqs: int | None) -> None:
        ids = [item.seq.seq_id for item in out.scheduled]
        assert len(ids) == len(set(ids)), "a sequence twice in one micro-batch"
        if not self.config.pipeline_prompt_chunks:
            assert not set(ids) & set(busy), "a sequence in two micro-batches at once"
        assert not {s.seq_id for s in out.preempted} & set(busy), "an in-flight sequence was preempted"
        assert out.num_tokens <= (token_budget or self.config.max_num_batched_tokens)
        assert len(ids) <= (max_seqs or self.config.max_num_seqs)
        assert not (out.swap_in and out.swap_out), "swap in and out in one step"
        for item in out.scheduled:
            seq = item.seq
            assert seq.status == SequenceStatus.RUNNING and item.num_new_tokens >= 1
            last = busy.get(seq.seq_id)
            if last is None:
                assert item.start == seq.num_computed_tokens
            else:   # the prompt's next chunk, right after the one in flight, which does not sample
                assert not last.sample and item.start == last.start + last.num_new_tokens
                self.pipelined += 1
            assert len(seq.block_table) * BS >= item.start + item.num_new_tokens
            if seq.request_id not in self.admission_order:
                self.admission_order.append(seq.request_id)

    def complete_oldest(self) -> SchedulerOutput:
        out = self.inflight.popleft()
        self.steps += 1
        self._execute(out)
        self.sched.on_step_done(out)
        for item in out.scheduled:
            seq = item.seq
            if seq.is_finished:
                continue
            self.served[seq.user] = self.served.get(seq.user, 0) + item.num_new_tokens
            if item.sample:
                seq.append_token(self.rng.randrange(4))
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.sched.finish_seq(seq, "length")
        return out

    def _execute(self, out: SchedulerOutput) -> None:
        """What every stage does: swaps first, then attention reads and KV writes."""
        for dev, host in out.swap_out:
            self.host[host] = list(self.dev[dev])
        for host, dev in out.swap_in:
            self.dev[dev] = list(self.host[host])
        for item in out.scheduled:
            seq, table = item.seq, item.seq.block_table
            sigs = self._signatures(seq)
            for pos in range(item.start):
                assert self.dev[table[pos // BS]][pos % BS] == sigs[pos], f"stale KV read by {seq} at {pos}"
            for pos in range(item.start, item.start + item.num_new_tokens):
                block = table[pos // BS]
                assert self.sched.block_manager.refcount(block) == 1, "write into a shared block"
                self.dev[block][pos % BS] = sigs[pos]

    def _signatures(self, seq: Sequence) -> list[int]:
        """sigs[p] identifies the KV of position p: it depends on tokens 0..p."""
        sigs = self._sigs.setdefault(seq.seq_id, [])
        for pos in range(len(sigs), seq.num_tokens):
            sigs.append(hash((sigs[-1] if sigs else None, seq.token_ids[pos])))
        return sigs

    def pump(self, **schedule_args) -> bool:
        """Fill the pipeline, then complete one micro-batch. False when stuck."""
        while len(self.inflight) < self.max_inflight:
            if self.submit(**schedule_args).is_empty:
                break
        if not self.inflight:
            return False
        self.complete_oldest()
        return True

    def drain(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            assert self.pump(), f"deadlock: nothing schedulable, nothing in flight: {self.sched.stats()}"
        pytest.fail(f"not finished after {max_steps} steps: {self.sched.stats()}")

    def assert_clean(self) -> None:
        bm = self.sched.block_manager
        bm.check_integrity()
        assert all(g.is_finished for g in self.groups)
        assert bm.num_free_blocks == bm.num_blocks and bm.host.num_free == bm.host.num_blocks
        for group in self.groups:
            for seq in group.seqs:
                assert seq.block_table == []
                if seq.finish_reason == "length":
                    assert seq.num_output_tokens == seq.params.max_tokens


# -- random operations -----------------------------------------------------
def run_random(seed: int, mode: str, caching: bool, inflight: int, policy: str = "fcfs",
               ops: int = 1200) -> FakeEngine:
    eng = FakeEngine(num_blocks=10, num_host_blocks=6, max_inflight=inflight, seed=seed,
                     preemption_mode=mode, enable_prefix_caching=caching, scheduling_policy=policy,
                     max_num_batched_tokens=12, max_num_seqs=4)
    rng = random.Random(seed + 1)
    for _ in range(ops):
        r = rng.random()
        if r < 0.12:
            eng.add_random()
        elif r < 0.15 and eng.groups:
            eng.sched.abort_request(rng.choice(eng.groups).request_id)
        elif r < 0.6 and len(eng.inflight) < inflight:
            eng.submit(token_budget=rng.choice([None, None, 3, 7]))
        elif eng.inflight:
            eng.complete_oldest()
        eng.sched.block_manager.check_integrity()
    eng.drain()
    eng.assert_clean()
    return eng


@pytest.mark.parametrize("inflight", [1, 3])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_random_operations_finish_everything_without_leaks(mode: str, caching: bool, inflight: int) -> None:
    eng = run_random(seed=inflight * 7 + caching, mode=mode, caching=caching, inflight=inflight)
    stats = eng.sched.stats()
    assert stats["num_preemptions"] > 0, "the KV budget was meant to force preemptions"
    if mode == "swap":
        assert stats["num_preemptions_swap"] > 0
    if caching:
        assert stats["prefix_cache_hit_blocks"] > 0


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10**6), mode=st.sampled_from(["recompute", "swap"]),
       caching=st.booleans(), inflight=st.integers(1, 4),
       policy=st.sampled_from(["fcfs", "priority", "fair"]))
def test_random_operations_property(seed: int, mode: str, caching: bool, inflight: int, policy: str) -> None:
    run_random(seed, mode, caching, inflight, policy, ops=400)


def test_every_request_finishes_under_a_tiny_kv_budget() -> None:
    # 4 blocks of 4 tokens; each request needs up to 4 blocks alone.
    eng = FakeEngine(num_blocks=4, max_inflight=2, max_num_batched_tokens=8)
    rng = random.Random(3)
    for _ in range(20):
        eng.add([rng.randrange(50) for _ in range(rng.randint(1, 8))], max_tokens=rng.randint(1, 8))
    eng.drain()
    eng.assert_clean()
    assert all(s.finish_reason == "length" for g in eng.groups for s in g.seqs)
    assert eng.sched.stats()["num_preemptions"] > 0


# -- batching ----------------------------------------------------------------
def _decoding_then_long_prompt(num_blocks: int, budget: int, short_tokens: int):
    """An engine where a 3-token prompt is already decoding and a 20-token prompt waits."""
    eng = FakeEngine(num_blocks=num_blocks, max_num_batched_tokens=budget)
    short = eng.add([1, 2, 3], max_tokens=short_tokens).seqs[0]
    eng.submit()
    eng.complete_oldest()                     # short is now decoding
    long = eng.add(list(range(10, 30)), max_tokens=2).seqs[0]
    return eng, short, long


def test_chunked_prefill_respects_budget_and_decodes_come_first() -> None:
    eng, short, long = _decoding_then_long_prompt(num_blocks=32, budget=8, short_tokens=5)
    chunks = []
    for _ in range(3):
        out = eng.submit()
        assert out.scheduled[0].seq is short and out.scheduled[0].num_new_tokens == 1
        assert out.num_tokens <= 8
        chunks.append((out.scheduled[1].num_new_tokens, out.scheduled[1].sample))
        eng.complete_oldest()
    assert chunks == [(7, False), (7, False), (6, True)]
    assert long.num_output_tokens == 1


def test_prefill_budget_caps_prompt_tokens_not_decodes() -> None:
    eng, short, long = _decoding_then_long_prompt(num_blocks=64, budget=32, short_tokens=8)
    other = eng.add([7] * 6, max_tokens=2).seqs[0]
    out = eng.sched.schedule(prefill_budget=0)
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(short, 1)]
    eng.inflight.append(out)
    eng.complete_oldest()
    out = eng.sched.schedule(prefill_budget=5)    # a chunk of the first prompt only
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(short, 1), (long, 5)]
    eng.inflight.append(out)
    eng.complete_oldest()
    out = eng.sched.schedule(prefill_budget=18)   # the rest of it, then a chunk of the next
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(short, 1), (long, 15), (other, 3)]


def test_engine_throttles_prompt_tokens_to_the_lightest_micro_batch_in_flight() -> None:
    from types import SimpleNamespace

    from pipeserve.scheduler.scheduler import micro_batch_limits

    def batch(*sizes: int) -> SchedulerOutput:
        out = SchedulerOutput()
        out.scheduled = [SimpleNamespace(num_new_tokens=n) for n in sizes]
        return out

    def throttle(*in_flight: SchedulerOutput, gpipe: bool = False, **config) -> int | None:
        sched = SimpleNamespace(config=EngineConfig(block_size=16, max_num_batched_tokens=2048, **config),
                                num_running=8, num_waiting=0, num_swapped=0, num_inflight=4)
        return micro_batch_limits(sched, in_flight, 2, gpipe, 1).get("prefill_budget")
    # 300 prompt tokens in one, none in the other: 0 + a quantum of 1024 // 32
    assert throttle(batch(1, 1, 1, 300), batch(1, 1)) == 32
    assert throttle(batch(1, 900), batch(700, 1)) == 732
    assert throttle(batch(1000)) == 1024                        # never above the budget
    assert throttle() is None                                   # nothing in flight: no throttle
    assert throttle(batch(1, 1), gpipe=True) is None            # gpipe's micro-batches form together
    assert throttle(batch(1, 1), enable_chunked_prefill=False) is None   # prompts run whole


def test_without_chunked_prefill_a_prompt_runs_whole() -> None:
    eng = FakeEngine(num_blocks=32, max_num_batched_tokens=8, enable_chunked_prefill=False)
    eng.add([1] * 6, max_tokens=2)
    eng.add([2] * 6, max_tokens=2)
    out = eng.submit()
    assert [i.num_new_tokens for i in out.scheduled] == [6]


def test_microbatches_in_flight_are_disjoint() -> None:
    eng = FakeEngine(num_blocks=64, max_inflight=3)
    for _ in range(6):
        eng.add([7, 8, 9], max_tokens=4)
    first = eng.submit(max_seqs=2)
    second = eng.submit(max_seqs=2)
    third = eng.submit(max_seqs=2)
    groups = [{i.seq.seq_id for i in o.scheduled} for o in (first, second, third)]
    assert all(len(g) == 2 for g in groups) and len(set().union(*groups)) == 6
    assert eng.submit().is_empty and eng.sched.num_inflight == 6
    eng.complete_oldest()
    fourth = eng.submit()
    assert {i.seq.seq_id for i in fourth.scheduled} == groups[0]   # only the returned ones
    with pytest.raises(RuntimeError, match="not in flight"):
        eng.sched.on_step_done(first)


# -- policies ----------------------------------------------------------------
def test_fcfs_admits_in_arrival_order() -> None:
    eng = FakeEngine(num_blocks=64, max_num_seqs=2)
    rids = [eng.add([i, i + 1, i + 2], max_tokens=3).request_id for i in range(7)]
    eng.drain()
    assert eng.admission_order == rids


def test_priority_admits_lower_value_first_and_preempts_the_lowest() -> None:
    eng = FakeEngine(num_blocks=64, max_num_seqs=2, scheduling_policy="priority")
    prios = [3, 1, 2, 0, 1, 3, 0]
    rids = [eng.add([i, 9, 9], max_tokens=3, priority=p).request_id for i, p in enumerate(prios)]
    eng.drain()
    expected = [rid for _, _, rid in sorted(zip(prios, range(len(rids)), rids))]
    assert eng.admission_order == expected

    tight = FakeEngine(num_blocks=5, scheduling_policy="priority", max_num_batched_tokens=64)
    seqs = [tight.add([p] * 6, max_tokens=8, priority=p).seqs[0] for p in (0, 2, 1)]
    preempted: list[Sequence] = []
    while tight.sched.has_unfinished():
        out = tight.submit()
        for victim in out.preempted:
            running = [s for s in seqs if s.status == SequenceStatus.RUNNING] + [victim]
            assert victim.priority == max(s.priority for s in running)
        preempted += out.preempted
        if tight.inflight:
            tight.complete_oldest()
    assert preempted and seqs[0] not in preempted


def test_fair_policy_bounds_the_share_gap_between_users() -> None:
    def light_share(policy: str) -> float:
        eng = FakeEngine(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64, scheduling_policy=policy)
        heavy = [eng.add([1] * 8, max_tokens=8, user="heavy") for _ in range(16)]
        light = [eng.add([2] * 8, max_tokens=8, user="light") for _ in range(4)]
        del heavy
        while not all(g.is_finished for g in light):
            assert eng.pump()
        total = eng.served["heavy"] + eng.served.get("light", 0)
        return eng.served.get("light", 0) / total

    # While the light user has work, it gets close to half the service under
    # `fair`, but starves behind the heavy user under `fcfs`.
    assert light_share("fair") >= 0.4
    assert light_share("fcfs") < 0.25


# -- KV sharing --------------------------------------------------------------
def test_prefix_cache_hits_through_the_scheduler() -> None:
    eng = FakeEngine(num_blocks=32)
    eng.add(list(range(13)), max_tokens=2)
    eng.pump()
    later = eng.add(list(range(13)) + [40, 41], max_tokens=2).seqs[0]
    out = eng.submit()
    item = next(i for i in out.scheduled if i.seq is later)
    assert item.start == 12 and item.num_new_tokens == 3 and later.num_cached_tokens == 12
    stats = eng.sched.stats()
    assert stats["prefix_cache_hit_tokens"] == 12 and stats["prefix_cache_hit_blocks"] == 3
    eng.drain()
    eng.assert_clean()


def test_n_siblings_fork_from_the_first_sequence() -> None:
    eng = FakeEngine(num_blocks=32, enable_prefix_caching=False)
    group = eng.add(list(range(10)), max_tokens=3, n=3)
    first, *siblings = group.seqs
    out = eng.submit()
    assert [i.seq for i in out.scheduled] == [first]          # siblings wait for the prompt
    eng.complete_oldest()
    out = eng.submit()
    tails = {i.seq.seq_id: i for i in out.scheduled}
    for sib in siblings:
        assert tails[sib.seq_id].start == 8 and tails[sib.seq_id].num_new_tokens == 2
        assert sib.block_table[:2] == first.block_table[:2]
    assert eng.sched.block_manager.refcount(first.block_table[0]) == 3
    eng.drain()
    eng.assert_clean()
    assert all(s.num_output_tokens == 3 for s in group.seqs)


# -- abort and preemption ----------------------------------------------------
def test_abort_in_flight_frees_after_the_step() -> None:
    eng = FakeEngine(num_blocks=16)
    group = eng.add(list(range(9)), max_tokens=4, n=2)
    eng.add([1, 2], max_tokens=2)
    eng.submit()
    bm = eng.sched.block_manager
    held = bm.num_blocks - bm.num_free_blocks
    ended = eng.sched.abort_request(group.request_id)
    assert {s.seq_id for s in ended} == {s.seq_id for s in group.seqs}
    assert all(s.finish_reason == "abort" and s.is_finished for s in group.seqs)
    assert bm.num_blocks - bm.num_free_blocks == held           # still in flight: kept
    eng.complete_oldest()
    assert group.seqs[0].block_table == [] and group.seqs[0].num_output_tokens == 0
    eng.drain()
    eng.assert_clean()
    assert eng.sched.abort_request(group.request_id) == []


def test_swap_preemption_and_fallback_to_recompute() -> None:
    for host_blocks, kind in ((8, "num_preemptions_swap"), (0, "num_preemptions_recompute")):
        eng = FakeEngine(num_blocks=6, num_host_blocks=host_blocks, preemption_mode="swap",
                         max_num_batched_tokens=64)
        for i in range(4):
            eng.add([i] * 5, max_tokens=10)
        eng.drain()
        eng.assert_clean()
        stats = eng.sched.stats()
        assert stats[kind] > 0 and stats["num_preemptions"] == stats[kind]
        assert (eng.swapped_in_blocks > 0) == (host_blocks > 0)


def test_preempted_tokens_count_the_kv_a_recompute_drops() -> None:
    for host_blocks in (8, 0):
        eng = FakeEngine(num_blocks=6, num_host_blocks=host_blocks, preemption_mode="swap",
                         max_num_batched_tokens=64)
        dropped = []   # each victim's computed tokens as it is preempted, and whether it is swapped
        preempt = eng.sched._preempt

        def recording(seq, out, preempt=preempt, dropped=dropped):
            computed = seq.num_computed_tokens
            preempt(seq, out)
            dropped.append((computed, seq in eng.sched.swapped))

        eng.sched._preempt = recording
        for i in range(4):
            eng.add([i] * 5, max_tokens=10)
        eng.drain()
        eng.assert_clean()
        stats = eng.sched.stats()
        assert dropped and stats["num_preemptions"] == len(dropped)
        assert stats["num_preempted_tokens"] == sum(c for c, swapped in dropped if not swapped)
        assert (stats["num_preempted_tokens"] > 0) == (host_blocks == 0)


def test_can_ever_fit() -> None:
    sched = Scheduler(EngineConfig(block_size=BS), num_blocks=3, num_host_blocks=0, requests={})
    assert sched.can_ever_fit(12) and not sched.can_ever_fit(13)
