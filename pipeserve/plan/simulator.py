"""Discrete-event simulator of the pipeline schedules over a request trace.

Continuous batching: requests are admitted while sequences, KV tokens and the
per-micro-batch token budget allow; prefill is chunked. Each request belongs to
one micro-batch *slot* (as vLLM's virtual engines), slots are kept balanced, and
a slot has at most one micro-batch in flight.

- ``async``: a slot forms its next micro-batch as soon as its last one returns;
  each worker runs whichever chunk is ready, FIFO. No step-wide barrier.
- ``gpipe``: a step forms all M slots at once, pushes them through and waits for
  every one to return before the next step.
- ``interleaved``: as gpipe, but the cost model has P·V chunks, chunk c on worker
  c mod P, so each micro-batch goes round the ring V times.

The driver is one more serial resource: forming a micro-batch (scheduling it,
building its step, taking its tokens back) costs ``driver_time(shape)`` before
its first chunk is ready; micro-batches formed together queue for the driver.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from pipeserve.plan.presets import PlanInputError
from pipeserve.plan.roofline import EMPTY, BatchShape
from pipeserve.plan.sim_result import Interval, RequestTimes, SimResult
from pipeserve.plan.workload import TraceRequest

SCHEDULES = ("async", "gpipe", "interleaved")
_ARRIVE, _READY, _DONE, _RETURN, _LAUNCH = range(5)


class CostModel(Protocol):
    num_workers: int

    @property
    def num_chunks(self) -> int: ...
    def worker_of(self, chunk: int) -> int: ...
    def chunk_time(self, chunk: int, shape: BatchShape) -> float: ...
    def hop_time(self, chunk: int, shape: BatchShape) -> float: ...
    # Optional: the driver's work per micro-batch (0 when a cost model leaves it out).
    # def driver_time(self, shape: BatchShape) -> float: ...


@dataclass(frozen=True)
class SimConfig:
    schedule: str = "async"
    micro_batches: int = 2                 # async: slots in flight; gpipe/interleaved: M per step
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048     # token budget of one micro-batch
    kv_capacity_tokens: float = math.inf
    enable_prefix_caching: bool = True
    record_intervals: bool = True

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise PlanInputError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.micro_batches < 1:
            raise PlanInputError(f"micro-batches must be >= 1, got {self.micro_batches}")


class _Req:
    def __init__(self, rid: int, trace: TraceRequest) -> None:
        self.id, self.trace = rid, trace
        self.cached = 0          # prompt tokens served by the prefix cache
        self.prefilled = 0       # prompt tokens computed so far (beyond the cache)
        self.generated = 0
        self.first_token = math.nan
        self.slot = -1

    @property
    def to_prefill(self) -> int:
        return max(1, self.trace.prompt_len - self.cached) - self.prefilled

    def shape(self, tokens: int) -> BatchShape:
        """This request's part of a micro-batch computing ``tokens`` tokens."""
        if self.to_prefill > 0:
            start = self.cached + self.prefilled
            done = tokens == self.to_prefill
            pairs = tokens * start + tokens * (tokens + 1) / 2
            return BatchShape(1, tokens, pairs, start, 1 if done else 0)
        return BatchShape.decode(1, self.trace.prompt_len + self.generated)


class PipelineSimulator:
    def __init__(self, costs: CostModel, cfg: SimConfig) -> None:
        self.costs, self.cfg = costs, cfg

    def run(self, trace: list[TraceRequest]) -> SimResult:
        self._reset(trace)
        while self.events:
            now, _, kind, data = heapq.heappop(self.events)
            if kind == _ARRIVE:
                self.waiting.append(data)
                if not self.launch_pending:
                    # Launch after every arrival of this instant, so they share micro-batches.
                    self.launch_pending = True
                    self._push(now, _LAUNCH, None)
            elif kind == _LAUNCH:
                self.launch_pending = False
                self._launch(now)
            elif kind == _READY:
                self.queues[self.costs.worker_of(data[1])].append((now, data[0], data[1]))
                self._dispatch(self.costs.worker_of(data[1]), now)
            elif kind == _DONE:
                self._finish_chunk(now, *data)
            elif kind == _RETURN:
                self._complete(now, data)
        return self.result

    # -- bookkeeping ---------------------------------------------------------
    def _reset(self, trace: list[TraceRequest]) -> None:
        too_long = [t for t in trace if t.prompt_len + t.output_len > self.cfg.kv_capacity_tokens]
        if too_long:
            raise PlanInputError(f"a request needs {too_long[0].prompt_len + too_long[0].output_len} "
                                 f"KV tokens but the cache holds {self.cfg.kv_capacity_tokens:.0f}")
        workers = self.costs.num_workers
        self.events: list = []
        self.counter = 0
        self.waiting: deque[_Req] = deque()
        self.slots: list[list[_Req]] = [[] for _ in range(self.cfg.micro_batches)]
        self.in_flight: dict[int, tuple[int, list[tuple[_Req, int]], BatchShape]] = {}
        self.queues: list[list[tuple[float, int, int]]] = [[] for _ in range(workers)]
        self.worker_busy = [False] * workers
        self.kv_used = 0.0
        self.cached_prefixes: set[int] = set()
        self.next_mb = 0
        self.launch_pending = False
        self.driver_free = 0.0
        self.driver_time = getattr(self.costs, "driver_time", lambda shape: 0.0)
        self.result = SimResult(self.cfg.schedule, workers, busy=[0.0] * workers,
                                first_start=math.inf)
        for rid, item in enumerate(trace):
            self._push(item.arrival, _ARRIVE, _Req(rid, item))

    def _push(self, time: float, kind: int, data) -> None:
        self.counter += 1
        heapq.heappush(self.events, (time, self.counter, kind, data))

    @property
    def _running(self) -> int:
        return sum(len(s) for s in self.slots)

    # -- forming and launching micro-batches ---------------------------------
    def _launch(self, now: float) -> None:
        busy_slots = {slot for slot, _, _ in self.in_flight.values()}
        if self.cfg.schedule != "async" and busy_slots:
            return  # gpipe / interleaved: wait for the whole step
        for slot in range(self.cfg.micro_batches):
            if slot in busy_slots:
                continue
            items = self._form(slot)
            if items:
                self._start(now, slot, items)

    def _form(self, slot: int) -> list[tuple[_Req, int]]:
        budget = self.cfg.max_num_batched_tokens
        items = []
        for req in self.slots[slot]:
            if budget <= 0:
                break
            tokens = min(req.to_prefill, budget) if req.to_prefill > 0 else 1
            items.append((req, tokens))
            budget -= tokens
        share = math.ceil((self._running + len(self.waiting)) / self.cfg.micro_batches)
        while budget > 0 and self.waiting and self._can_admit(slot, share):
            req = self.waiting.popleft()
            self._admit(req, slot)
            tokens = min(req.to_prefill, budget)
            items.append((req, tokens))
            budget -= tokens
        return items

    def _can_admit(self, slot: int, share: int) -> bool:
        need = self.waiting[0].trace.prompt_len + self.waiting[0].trace.output_len
        return (len(self.slots[slot]) < share and self._running < self.cfg.max_num_seqs
                and self.kv_used + need <= self.cfg.kv_capacity_tokens)

    def _admit(self, req: _Req, slot: int) -> None:
        req.slot = slot
        self.slots[slot].append(req)
        self.kv_used += req.trace.prompt_len + req.trace.output_len
        if self.cfg.enable_prefix_caching and req.trace.prefix_id in self.cached_prefixes:
            req.cached = req.trace.prefix_len

    def _start(self, now: float, slot: int, items: list[tuple[_Req, int]]) -> None:
        shape = EMPTY
        for req, tokens in items:
            shape = shape + req.shape(tokens)
        mb = self.next_mb
        self.next_mb += 1
        self.in_flight[mb] = (slot, items, shape)
        self.result.micro_batches += 1
        # The driver forms micro-batches one at a time.
        seconds = self.driver_time(shape)
        self.driver_free = max(now, self.driver_free) + seconds
        self.result.driver_busy += seconds
        self._push(self.driver_free, _READY, (mb, 0))

    # -- workers ---------------------------------------------------------------
    def _dispatch(self, worker: int, now: float) -> None:
        queue = self.queues[worker]
        if self.worker_busy[worker] or not queue:
            return
        # FIFO by ready time; on a tie the later chunk first, to drain the pipe.
        pick = min(range(len(queue)), key=lambda i: (queue[i][0], -queue[i][2]))
        _, mb, chunk = queue.pop(pick)
        duration = self.costs.chunk_time(chunk, self.in_flight[mb][2])
        self.worker_busy[worker] = True
        self.result.first_start = min(self.result.first_start, now)
        self._push(now + duration, _DONE, (worker, mb, chunk, now))

    def _finish_chunk(self, now: float, worker: int, mb: int, chunk: int, start: float) -> None:
        shape = self.in_flight[mb][2]
        self.worker_busy[worker] = False
        self.result.busy[worker] += now - start
        if self.cfg.record_intervals:
            self.result.intervals.append(Interval(worker, start, now, mb, chunk, shape.new_tokens > shape.num_seqs))
        hop = self.costs.hop_time(chunk, shape)
        if chunk + 1 < self.costs.num_chunks:
            self._push(now + hop, _READY, (mb, chunk + 1))
        else:
            self._push(now + hop, _RETURN, mb)
        self._dispatch(worker, now)

    def _complete(self, now: float, mb: int) -> None:
        """The micro-batch's sampled tokens reached the driver."""
        slot, items, _ = self.in_flight.pop(mb)
        self.result.last_end = now
        for req, tokens in items:
            self._advance(now, req, tokens)
        self._launch(now)

    def _advance(self, now: float, req: _Req, tokens: int) -> None:
        if req.to_prefill > 0:
            req.prefilled += tokens
            if req.to_prefill > 0:
                return
            req.first_token = now
            self.cached_prefixes.add(req.trace.prefix_id)
        req.generated += 1
        if req.generated >= req.trace.output_len:
            self.slots[req.slot].remove(req)
            self.kv_used -= req.trace.prompt_len + req.trace.output_len
            t = req.trace
            self.result.requests.append(RequestTimes(t.arrival, req.first_token, now,
                                                     t.prompt_len, t.output_len))
