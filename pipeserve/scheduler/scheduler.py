"""Iteration-level scheduling with chunked prefill and several micro-batches in flight.

Each ``schedule()`` call forms one micro-batch, in this order (as in vLLM and
Sarathi-Serve):
  1. running sequences, decodes before prefill chunks, so a decode is never
     starved by prefills; when blocks run out, the policy's least valued
     sequence that is not in flight is preempted (swap or recompute);
  2. swapped sequences, resumed before any new admission (skipped in a call
     that preempted: the step would swap out and in at once);
  3. waiting sequences in policy order, stopping at the first that does not
     fit so the order is kept.
For longrope models (Phi-3) a sequence that outgrew the short rotation of its
keys first goes back to waiting, to be recomputed (``rope_switch_len``).
A request under suspicion (``isolate``: it was in a step the model raised on)
runs its next micro-batch alone, so that if the model raises again, the step
names that request and no other (the engine then ends it alone).
``on_step_done`` then advances what the micro-batch computed. In-flight
sequences are never preempted; one aborted in flight keeps its blocks until
its last step in flight is done, since the stages may still be writing them.

A sequence in flight takes part in a later micro-batch only with the next
chunk of its prompt (``pipeline_prompt_chunks``, on by default; a recompute's
"prompt" is its prompt and generated tokens): chunk k + 1 needs only the KV of
chunks <= k, and every schedule (async, gpipe, interleaved, TP inside a stage)
runs a sequence's micro-batches on each stage in submission order (``inflight.py``), so
one long prompt keeps all P stages busy instead of one. Its item starts where
the chunks in flight end (``ScheduledSeq.start``), its blocks are allocated from
there, and only the chunk that reaches the end samples; ``num_computed_tokens``
still advances in ``on_step_done``, chunk by chunk in order, and only computed
full blocks enter the prefix cache (a sibling of n > 1 forks, and another
request hits, only KV that exists). A decode is scheduled beside
something in flight of its sequence only *ahead* (``schedule_ahead``, the
engine's ``pp_decode_ahead``): one decode after the sampling item in flight,
its input token not known yet (the last stage sends it to stage 0 directly).
A stage failure loses every micro-batch in flight; ``on_step_failed`` each of
them, then ``replay_all``.

``max_num_seqs`` and ``max_num_batched_tokens`` bound one micro-batch; an
engine running P micro-batches passes its share via ``max_seqs`` /
``token_budget``.

The scheduler keeps queues of sequences, not requests: a request's record
(``SequenceGroup``) is read from the engine's table, ``requests``, by its id.
The engine adds a record before ``add_request`` and removes it once the
request's final output is made.
"""

from __future__ import annotations

import math
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from pipeserve.config import EngineConfig
from pipeserve.kv_cache.block_manager import BlockManager
from pipeserve.scheduler.inflight import InFlight
from pipeserve.scheduler.output import ScheduledSeq, SchedulerOutput
from pipeserve.scheduler.policy import make_policy
from pipeserve.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = ["Scheduler", "ScheduledSeq", "SchedulerOutput", "lone_prompt_chunk", "micro_batch_limits"]

# Smallest prompt chunk ``lone_prompt_chunk`` cuts. Measured (benchmarks/README.md, twelfth session):
# a 2048-token prompt at PP = 1 on one core takes as long in chunks of 256 as whole, 20 % longer
# in chunks of 128.
MIN_PIPELINED_CHUNK = 256


def lone_prompt_chunk(token_budget: int, num_micro_batches: int) -> int:
    """Prompt tokens per micro-batch when fewer sequences are live than micro-batches in
    flight (one long prompt alone): then only the prompt's own chunks fill the pipeline, and
    it is full after P - 1 chunks, so with n chunks the prompt takes about (n + P - 1) / (n P)
    of its time at PP = 1. Chunks of ``token_budget / P``, but at least ``MIN_PIPELINED_CHUNK``
    (smaller ones cost more than the fill they save)."""
    return min(token_budget, max(MIN_PIPELINED_CHUNK, token_budget // num_micro_batches))


def micro_batch_limits(scheduler: "Scheduler", in_flight, num_micro_batches: int, gpipe: bool,
                       free_slots: int) -> dict:
    """The limits on the next micro-batch (keywords of ``Scheduler.schedule``): each
    micro-batch in flight gets its share of the work. The engine forms its micro-batches
    with it, and the planner's batcher (``plan/batching.py``) with the same call.

    - At most its share of all live sequences (in flight or not) and of the token budget.
      Taking every ready sequence instead lets the micro-batches drift apart (the one
      formed while the other is in flight grabs all newly prefilled sequences), and with P
      micro-batches alternating over P stages the longer one sets the pace while the others
      wait: a bubble on every stage. GPipe splits one step's ready sequences over its
      ``free_slots`` micro-batches.
    - Token throttling (as in gLLM; async and interleaved): at most one quantum more prompt
      tokens than the lightest micro-batch in ``in_flight`` (the ``SchedulerOutput``s in
      flight). Prompts arrive in bursts (a request is admitted when another frees its KV
      blocks), so without it one micro-batch carries a whole budget of prompt tokens while
      the next carries none, and every stage idles for the difference; capped, the prompt
      work ramps up a quantum at a time and stays spread over the micro-batches. Decodes
      are not affected.
    - With fewer live sequences than micro-batches (one long prompt alone), prompt chunks
      are cut to ``lone_prompt_chunk``, so the prompt's own chunks fill the stages.
    """
    if num_micro_batches == 1:
        return {}
    config = scheduler.config
    live = scheduler.num_running + scheduler.num_waiting + scheduler.num_swapped
    ready = live - scheduler.num_inflight
    share = math.ceil(live / num_micro_batches)
    max_seqs = max(1, min(share, math.ceil(ready / free_slots)) if gpipe else share)
    budget = max(1, config.max_num_batched_tokens // num_micro_batches)
    limits = {"max_seqs": min(max_seqs, config.max_num_seqs), "token_budget": budget}
    in_flight = list(in_flight)
    if not gpipe and config.enable_chunked_prefill and in_flight:
        quantum = max(config.block_size, budget // 32)
        lightest = min(sum(item.num_new_tokens for item in sched.scheduled if item.num_new_tokens > 1)
                       for sched in in_flight)
        limits["prefill_budget"] = min(budget, lightest + quantum)
    if config.enable_chunked_prefill and config.pipeline_prompt_chunks and live < num_micro_batches:
        limits["prefill_budget"] = min(limits.get("prefill_budget", budget),
                                       lone_prompt_chunk(budget, num_micro_batches))
    return limits


@dataclass
class _Budget:
    tokens: int
    seqs: int
    prefill: int = 1 << 62    # of ``tokens``, at most this many for prompts (chunks)

    @property
    def exhausted(self) -> bool:
        return self.tokens <= 0 or self.seqs <= 0

    @property
    def prefill_tokens(self) -> int:
        return min(self.tokens, self.prefill)

    def take(self, num_tokens: int, prefill: bool) -> None:
        self.tokens -= num_tokens
        self.seqs -= 1
        if prefill:
            self.prefill -= num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, num_host_blocks: int,
                 requests: dict[str, SequenceGroup], rope_switch_len: int | None = None) -> None:
        """``requests``: the engine's table (request id -> record), read here too;
        ``rope_switch_len``: the model's ``ModelConfig.rope_switch_len`` (longrope)."""
        self.config = config
        self.requests = requests                      # the engine's table: request id -> record
        self._rope_switch = rope_switch_len
        self.block_manager = BlockManager(num_blocks, config.block_size, num_host_blocks,
                                          config.enable_prefix_caching,
                                          self._rope_variant if rope_switch_len is not None else None)
        self._short_rope: set[int] = set()           # seq ids whose KV has longrope's short rotation
        self.policy = make_policy(config.scheduling_policy)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self._inflight = InFlight()                  # seq_id -> its items in flight, oldest first
        self._isolated: set[str] = set()             # request ids whose next micro-batch holds them alone
        self._only: str | None = None                # while forming an isolated request's micro-batch
        # preempted_tokens: tokens whose KV a preemption by recompute dropped (computed again
        # unless the prefix cache still holds their blocks when the sequence comes back)
        self._counters = dict(preemptions_recompute=0, preemptions_swap=0, preempted_tokens=0, steps=0,
                              replayed=0, rope_recomputes=0, decodes_ahead=0)

    # -- requests ------------------------------------------------------------
    def add_request(self, group: SequenceGroup) -> None:
        """Queue the request's sequences; its record is already in ``requests``."""
        if self.requests.get(group.request_id) is not group:
            raise ValueError(f"request {group.request_id!r} is not in the request table")
        for seq in group.seqs:
            if not seq.is_finished:
                seq.status = SequenceStatus.WAITING
                self.waiting.append(seq)

    def abort_request(self, request_id: str) -> list[Sequence]:
        """End every unfinished sequence of a request; returns the ones ended."""
        group = self.requests.get(request_id)
        if group is None:
            return []
        ended = [s for s in group.seqs if not s.is_finished]
        for seq in ended:
            self.finish_seq(seq, "abort")
        return ended

    def finish_seq(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and free its blocks (after its step, if in flight)."""
        if seq.is_finished:
            return
        self._remove_from_queue(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.seq_id not in self._inflight:
            self._release(seq)

    def _remove_from_queue(self, seq: Sequence) -> None:
        queue = {SequenceStatus.WAITING: self.waiting, SequenceStatus.RUNNING: self.running,
                 SequenceStatus.SWAPPED: self.swapped}.get(seq.status)
        if queue is not None and seq in queue:
            queue.remove(seq)

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self._short_rope.discard(seq.seq_id)

    # -- queries -------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def num_live(self) -> int:
        """Sequences not finished: running, swapped out or waiting."""
        return len(self.running) + len(self.swapped) + len(self.waiting)

    @property
    def num_inflight(self) -> int:
        """Sequences in micro-batches that are not done yet."""
        return self._inflight.num_seqs

    @property
    def num_inflight_items(self) -> int:
        """Items in micro-batches that are not done yet (a prompt may have several chunks)."""
        return self._inflight.num_items

    def all_in_flight(self) -> bool:
        """Nothing to schedule outside the micro-batches in flight: no sequence waits or is
        swapped out, and every running one is in flight (none between a prompt's chunks)."""
        return not (self.waiting or self.swapped) and all(s.seq_id in self._inflight for s in self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._inflight)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether one sequence of ``num_tokens`` tokens fits in the KV cache alone;
        the engine refuses requests that do not, or they could never finish."""
        return self.block_manager.can_ever_fit(num_tokens)

    def stats(self) -> dict:
        c = self._counters
        return {
            "num_waiting": self.num_waiting,
            "num_running": self.num_running,
            "num_swapped": self.num_swapped,
            "num_inflight": self.num_inflight,
            "num_pipelined_chunks": self._inflight.num_pipelined,
            "kv_usage": self.block_manager.usage,
            "num_preemptions": c["preemptions_recompute"] + c["preemptions_swap"],
            "num_preemptions_recompute": c["preemptions_recompute"],
            "num_preemptions_swap": c["preemptions_swap"],
            "num_preempted_tokens": c["preempted_tokens"],
            "num_replayed": c["replayed"],
            "num_rope_recomputes": c["rope_recomputes"],
            "num_decodes_ahead": c["decodes_ahead"],
            **self.block_manager.stats(),
            **self.policy.stats(),
        }

    # -- scheduling ----------------------------------------------------------
    def schedule(self, token_budget: int | None = None, max_seqs: int | None = None,
                 prefill_budget: int | None = None) -> SchedulerOutput:
        """Form one micro-batch, and mark its items in flight. A sequence in flight
        takes part only with its prompt's next chunk (``pipeline_prompt_chunks``).

        ``prefill_budget`` caps the prompt tokens (new prompts and chunks) of
        the micro-batch, within ``token_budget``; decodes are not affected."""
        budget = _Budget(token_budget if token_budget is not None else self.config.max_num_batched_tokens,
                         max_seqs if max_seqs is not None else self.config.max_num_seqs)
        if prefill_budget is not None:
            budget.prefill = max(0, prefill_budget)
        out = SchedulerOutput()
        if self._rope_switch is not None:
            self._recompute_past_rope_switch()
        for request_id in self._isolated_ready():
            self._only = request_id
            self._form(budget, out)
            if out.scheduled or out.preempted:
                break
        self._only = None
        if not out.scheduled and not out.preempted:
            self._form(budget, out)
        for item in out.scheduled:
            self._inflight.add(item)
        return out

    def _form(self, budget: _Budget, out: SchedulerOutput) -> None:
        self._schedule_running(budget, out)
        if not out.preempted:
            self._schedule_swapped(budget, out)
            if not self.swapped:
                self._schedule_waiting(budget, out)

    # -- isolation (a request the model raised on) ---------------------------
    def isolate(self, request_ids) -> None:
        """Each of these requests runs its next micro-batch alone."""
        self._isolated.update(r for r in request_ids if r in self.requests)

    def release(self, request_id: str) -> None:
        """A step of ``request_id`` came back (or the request ended): no longer isolated."""
        self._isolated.discard(request_id)

    @property
    def isolated(self) -> AbstractSet[str]:
        """The isolated request ids (read only: ``isolate`` and ``release`` change them)."""
        return self._isolated

    def _isolated_ready(self) -> list[str]:
        """Isolated requests with a sequence that could run now, in queue order."""
        if not self._isolated:
            return []
        seqs = [s for s in self.running if s.seq_id not in self._inflight] + self.swapped + self.waiting
        return list(dict.fromkeys(s.request_id for s in seqs if s.request_id in self._isolated))

    def _considered(self, seq: Sequence) -> bool:
        """While an isolated request's micro-batch forms, only its sequences; otherwise none of
        an isolated request's (their turn is a micro-batch of their own)."""
        if self._only is not None:
            return seq.request_id == self._only
        return not self._isolated or seq.request_id not in self._isolated

    def schedule_ahead(self, seqs: list[Sequence]) -> SchedulerOutput:
        """Decode ahead: one micro-batch of the next decode of each of ``seqs``, whose one
        item in flight samples the token that decode takes in (not known yet: ``start`` is
        ``seq.num_tokens``). Never preempts: a sequence whose next slot needs a block that is
        not free is left out. Not for longrope models (a token may cross the switch length)."""
        out = SchedulerOutput()
        if self._rope_switch is not None:
            return out
        for seq in seqs:
            start = self._inflight.end(seq)
            if (seq.status != SequenceStatus.RUNNING or self._inflight.num_items_of(seq) != 1
                    or start != seq.num_tokens or not self.block_manager.allocate_slots(seq, 1, start)):
                continue
            item = ScheduledSeq(seq, 1, start=start, seq_len=start + 1)
            self._inflight.add(item, ahead=True)
            out.scheduled.append(item)
        self._counters["decodes_ahead"] += len(out.scheduled)
        return out

    def _rope_variant(self, seq: Sequence) -> int:
        """Longrope: 1 once ``seq`` holds more tokens than the switch length (its
        keys rotate with the long factors), else 0 (the short ones)."""
        return int(seq.num_tokens > self._rope_switch)

    def _recompute_past_rope_switch(self) -> None:
        """Longrope: a sequence whose keys have the short rotation and that now holds
        more than the switch length (its last sampled token crossed it) goes back to
        waiting and recomputes every key with the long factors, as transformers'
        Phi-3 ``generate()`` recomputes its cache there (pipeserve/model/longrope.py)."""
        crossed = [s for s in self.running + self.swapped
                   if s.seq_id in self._short_rope and s.seq_id not in self._inflight and self._rope_variant(s)]
        for seq in crossed:
            self._remove_from_queue(seq)
            self.block_manager.free(seq)
            self._short_rope.discard(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.insert(0, seq)
            self._counters["rope_recomputes"] += 1

    def _schedule_running(self, budget: _Budget, out: SchedulerOutput) -> None:
        pipelined = self.config.pipeline_prompt_chunks
        ready = [s for s in self.running if (s.num_uncomputed_tokens > 0 and s.seq_id not in self._inflight)
                 or (pipelined and s.seq_id in self._inflight and self._inflight.end(s) < s.num_tokens)]
        # Decodes first, then prefill chunks, each in policy order.
        ready.sort(key=lambda s: (self._next_is_prefill(s), self.policy.key(s)))
        done: set[int] = set()
        for seq in ready:
            if budget.exhausted:
                break
            if seq.status != SequenceStatus.RUNNING or not self._considered(seq):
                continue                       # preempted earlier in this call, or isolated
            start = self._inflight.end(seq)
            num_new = min(seq.num_tokens - start, budget.tokens)
            if self._next_is_prefill(seq):
                if budget.prefill_tokens <= 0:
                    continue
                num_new = min(num_new, budget.prefill_tokens)
                # A running prefill takes the chunk that fits rather than preempting.
                num_new = min(num_new, self.block_manager.num_fitting_tokens(seq, start)) or num_new
            if self._make_room(seq, start, num_new, ready, done, out):
                self._add(seq, num_new, budget, out)
                done.add(seq.seq_id)

    def _next_is_prefill(self, seq: Sequence) -> bool:
        """``Sequence.is_prefill`` for the next item, which starts after any chunks in flight.
        Only a prompt's (or a recompute's) chunk can follow chunks in flight: a decode needs
        the token the last of them samples."""
        n = seq.num_tokens
        return n - self._inflight.end(seq) > 1 or n == seq.num_prompt_tokens

    def _make_room(self, seq: Sequence, start: int, num_new: int, ready: list[Sequence], done: set[int],
                   out: SchedulerOutput) -> bool:
        """Allocate ``seq``'s slots, preempting others if needed; False if ``seq`` waits.
        A sequence with anything in flight is never preempted, nor preempts for a next chunk."""
        while not self.block_manager.allocate_slots(seq, num_new, start):
            if seq.seq_id in self._inflight:
                return False        # its chunks in flight return; then it asks again
            candidates = [s for s in ready if s.status == SequenceStatus.RUNNING and s.seq_id not in done
                          and s.seq_id not in self._inflight]
            victim = self.policy.pick_victim(candidates)
            if victim is seq and self._inflight:
                return False        # in-flight steps will return blocks; wait for them
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        out.preempted.append(seq)
        if self.config.preemption_mode == "swap" and self.block_manager.can_swap_out(seq):
            out.swap_out.extend(self.block_manager.swap_out(seq))
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self._counters["preemptions_swap"] += 1
            return
        # Recompute: its generated tokens are kept, so the next prefill covers prompt + output.
        self.block_manager.free(seq)
        self._counters["preempted_tokens"] += seq.num_computed_tokens
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._counters["preemptions_recompute"] += 1

    def _schedule_swapped(self, budget: _Budget, out: SchedulerOutput) -> None:
        for seq in self.policy.order(self.swapped):
            if budget.exhausted:
                break
            if not self._considered(seq):
                continue
            num_new = min(seq.num_uncomputed_tokens, budget.tokens)
            if not self.block_manager.can_swap_in(seq, num_new):
                break
            out.swap_in.extend(self.block_manager.swap_in(seq))
            self.block_manager.allocate_slots(seq, num_new)   # room was checked above
            self.swapped.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add(seq, num_new, budget, out)

    def _schedule_waiting(self, budget: _Budget, out: SchedulerOutput) -> None:
        admitted: list[Sequence] = []
        for seq in self.policy.order_waiting(self.waiting):
            if budget.exhausted:
                break
            if self._waits_for_first(seq) or not self._considered(seq):
                continue                # a sibling waits for its first sequence's prefill, or isolated
            if budget.prefill_tokens <= 0:
                break
            num_new = self.block_manager.admit(seq, budget.prefill_tokens, self._allow_partial(seq),
                                               share_from=self._fork_parent(seq))
            if num_new == 0:
                break
            seq.status = SequenceStatus.RUNNING
            admitted.append(seq)
            self._add(seq, num_new, budget, out)
            group = self.requests[seq.request_id]
            if group.first_scheduled_time is None:
                group.first_scheduled_time = time.time()
        if admitted:
            ids = {s.seq_id for s in admitted}
            self.waiting = [s for s in self.waiting if s.seq_id not in ids]
            self.running.extend(admitted)

    def _is_fresh_sibling(self, seq: Sequence) -> bool:
        """A not yet started sequence with index > 0 of an n > 1 request."""
        return seq.index > 0 and seq.num_output_tokens == 0 and not seq.is_finished

    def _waits_for_first(self, seq: Sequence) -> bool:
        """Siblings start only after the first sequence has computed the shared
        prompt once, so they can share its blocks instead of recomputing them."""
        group = self.requests[seq.request_id]
        return self._is_fresh_sibling(seq) and not group.seqs[0].is_finished and not group.prefilled

    def _fork_parent(self, seq: Sequence) -> Sequence | None:
        """The first sequence of the request, if ``seq`` can fork from it now."""
        first = self.requests[seq.request_id].seqs[0]
        if (self._is_fresh_sibling(seq) and first.status == SequenceStatus.RUNNING
                and first.num_computed_tokens >= first.num_prompt_tokens
                and (self._rope_switch is None or self._rope_variant(first) == self._rope_variant(seq))):
            return first
        return None

    def _allow_partial(self, seq: Sequence) -> bool:
        # Without chunked prefill a prompt runs whole, unless it can never fit
        # in one step's budget (then chunking is the only way it finishes).
        return self.config.enable_chunked_prefill or seq.num_tokens > self.config.max_num_batched_tokens

    def _add(self, seq: Sequence, num_new: int, budget: _Budget, out: SchedulerOutput) -> None:
        if self._rope_switch is not None:   # the rotation its keys get (crossing: see above)
            if self._rope_variant(seq):
                self._short_rope.discard(seq.seq_id)
            else:
                self._short_rope.add(seq.seq_id)
        start = self._inflight.end(seq)
        budget.take(num_new, prefill=self._next_is_prefill(seq))
        out.scheduled.append(ScheduledSeq(seq, num_new, start=start))

    # -- step completion -----------------------------------------------------
    def may_finish(self, out: SchedulerOutput) -> bool:
        """Whether ``on_step_done(out)`` may run now: every item of it is its sequence's oldest
        in flight (a result that came back before an older step of one of its sequences waits)."""
        return all(self._inflight.is_oldest(item) for item in out.scheduled)

    def on_step_done(self, out: SchedulerOutput) -> None:
        """The micro-batch ``out`` ran: advance what it computed and register
        the full blocks it completed in the prefix cache. The engine then
        appends each sampled token (items with ``sample``) and calls
        ``finish_seq`` for the sequences that stop."""
        self._counters["steps"] += 1
        for item in out.scheduled:
            seq = item.seq
            self._inflight.take_done(item)
            if seq.is_finished:
                if seq.seq_id not in self._inflight:
                    self._release(seq)  # aborted in flight: its results are dropped
                continue
            if item.start != seq.num_computed_tokens:
                raise RuntimeError(f"{seq}: a chunk from {item.start} is done but only "
                                   f"{seq.num_computed_tokens} tokens were computed before it")
            seq.num_computed_tokens = item.start + item.num_new_tokens
            self.block_manager.register_computed(seq)
            self.policy.record_service(seq, item.num_new_tokens)
            if seq.index == 0 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self.requests[seq.request_id].prefilled = True

    def on_step_failed(self, out: SchedulerOutput) -> None:
        """The micro-batch ``out`` was lost (a stage failed): nothing it computed
        counts; its sequences may be scheduled again or finished by the engine. A
        failure loses every micro-batch in flight: report each of them (a later chunk
        of a prompt is no good without the earlier ones)."""
        for item in out.scheduled:
            seq = item.seq
            self._inflight.take_failed(item)
            if seq.is_finished and seq.seq_id not in self._inflight:
                self._release(seq)

    def replay_all(self) -> int:
        """All KV is lost (a stage was replaced): every running and swapped sequence
        goes back to waiting and recomputes from its token ids, as a preemption by
        recompute does; its generated tokens are kept. Call with nothing in flight
        (``on_step_failed`` each lost micro-batch first). Returns the number replayed."""
        if self._inflight:
            raise RuntimeError(f"{self._inflight.num_seqs} sequences are still in flight: fail their steps first")
        replayed = self.running + self.swapped
        self.block_manager.drop_all_kv(replayed)
        for seq in replayed:
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self.waiting = replayed + self.waiting
        self.running, self.swapped = [], []
        # Fresh siblings wait for their first sequence's prompt again, to share its new blocks.
        for group in self.requests.values():
            group.prefilled = False
        self._counters["replayed"] += len(replayed)
        return len(replayed)

