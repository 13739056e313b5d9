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

Two ways to form micro-batches (``SimConfig.batcher``):
- ``engine`` (default): the runtime's own scheduler with the engine's per-micro-batch
  limits (``plan/batching.py``): KV blocks allocated as sequences grow, preemption by
  recompute (or by swap, given ``SimConfig.swap_capacity_tokens``), the prompt-token
  throttle, any ready sequence in any micro-batch;
- ``slots``: a model of it: each request in one of K balanced slots, its whole KV
  reserved at admission.

Time-sharing (a cost model with ``cpu_sharing()``, the CPU host): the stage processes
and the driver are jobs on a node's C cores, run by processor sharing. A job's work is
a serial part (one thread: per-op dispatch, per-step bookkeeping, collectives' waits) and
a parallel part (the kernels, on the process's k threads), both in seconds on one core.
A process keeps one thread runnable in its serial part and k in its parallel part.
With n runnable threads on the node each gets f = min(1, C / n) of a core; a serial
part runs at f, a parallel one at k·f cores' worth, 1 + (k·f − 1)·e above one core
(e: parallel efficiency). So an idle stage lends its cores to the busy ones, and P
stages + the driver on C < P cores slow each other only while they all run.
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
BATCHERS = ("engine", "slots")
_ARRIVE, _READY, _DONE, _RETURN, _LAUNCH, _TICK = range(6)


@dataclass(frozen=True)
class CpuSharing:
    """Who shares which cores: worker w is ``ranks[w]`` processes (its TP ranks, each doing
    its share of the work in step) of ``threads[w]`` threads each, on node ``node_of[w]``
    with ``cores[node]`` cores; the driver (one thread) runs on node 0. With more runnable
    threads than cores, the cores deliver ``oversubscribed`` of their time (switching)."""
    cores: tuple[float, ...]
    node_of: tuple[int, ...]
    threads: tuple[int, ...]
    efficiency: float
    oversubscribed: float = 1.0
    ranks: tuple[int, ...] | None = None      # None: one process per worker
    barrier: float = 1.0                      # Hardware.oversubscribed_barrier
    contention: float = 0.0                   # Hardware.memory_contention
    layer_wait: float = 0.0                   # Hardware.oversubscribed_layer_wait (0: barrier's model)

    def runnable(self, worker: int) -> int:
        """Threads worker w keeps runnable while it computes (all its ranks')."""
        return self.threads[worker] * (self.ranks[worker] if self.ranks else 1)

    def rate(self, threads: int, parallel: bool, runnable: int, node: int, layer_work: float = 0.0) -> float:
        """Speed (cores' worth) of a job with ``threads`` threads among ``runnable``
        runnable threads on ``node``. With more runnable threads than cores, a process's
        threads are not running together, and each op's parallel region ends at a barrier
        that waits for the thread the scheduler left out. Two models of that wait: in
        proportion to the work (``barrier`` 1: the parallel part advances at one thread's
        share, the others' slices going to waiting; 0: at its threads' shares, no wait;
        between, in proportion), or, where ``layer_wait`` is set, a fixed wait per layer
        whatever its length (the thread left out gets its turn within a scheduler slice or
        so): a layer of ``layer_work`` seconds (on one core) runs at its threads' shares and
        then waits ``layer_wait``, which weighs on short layers (decodes) and vanishes into
        long ones (prefill chunks)."""
        cores = self.cores[node]
        share = 1.0 if runnable <= cores else cores * self.oversubscribed / runnable
        if not parallel:
            return share
        cpu = threads * share
        free = cpu if cpu <= 1.0 else 1.0 + (cpu - 1.0) * self.efficiency
        if runnable <= cores or threads == 1:
            return free
        if self.layer_wait > 0.0:
            return layer_work / (layer_work / free + self.layer_wait) if layer_work > 0.0 else free
        return share + (1.0 - self.barrier) * (free - share)


class _Job:
    """Work left on a time-shared node: serial seconds, then parallel seconds (on one core)."""
    __slots__ = ("node", "threads", "runnable", "serial", "parallel", "done", "layer_work")

    def __init__(self, node: int, threads: int, serial: float, parallel: float, done, runnable: int = 0,
                 layers: int = 1) -> None:
        """``threads``: of the process whose speed the work runs at (one rank); ``runnable``:
        threads it keeps busy on the node (all ranks'; default ``threads``); ``layers``: the
        layers its parallel part is split over (each ends at its kernels' barriers)."""
        self.node, self.threads, self.serial, self.parallel, self.done = node, threads, serial, parallel, done
        self.runnable = runnable or threads
        self.layer_work = parallel / max(1, layers)

    def processes(self) -> int:
        return max(1, self.runnable // self.threads)

    def streaming(self) -> bool:
        """In its parallel part (the kernels)."""
        return self.serial <= 0.0 and self.parallel > 0.0

    def busy_threads(self) -> int:
        """Threads it keeps runnable now: in its serial part one per process (the kernels'
        other threads wait asleep for the next parallel region), then all of them."""
        return self.runnable if self.serial <= 0.0 else self.processes()


class CostModel(Protocol):
    num_workers: int

    @property
    def num_chunks(self) -> int: ...
    def worker_of(self, chunk: int) -> int: ...
    def chunk_time(self, chunk: int, shape: BatchShape) -> float: ...
    def hop_time(self, chunk: int, shape: BatchShape) -> float: ...
    # Optional: the driver's work per micro-batch (0 when a cost model leaves it out).
    # def driver_time(self, shape: BatchShape) -> float: ...
    # Optional, time-shared cores: cpu_sharing() -> CpuSharing | None,
    # chunk_work(chunk, shape) -> (serial s, parallel s) on one core, and chunk_layers
    # (layers per chunk, for CpuSharing.layer_wait; absent: one per chunk).


@dataclass(frozen=True)
class SimConfig:
    schedule: str = "async"
    micro_batches: int = 2                 # async: slots in flight; gpipe/interleaved: M per step
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048     # token budget of one micro-batch
    kv_capacity_tokens: float = math.inf
    # engine batcher: the host pool preemptions swap into (0: they recompute, as the engine
    # does on CUDA, across hosts, and with --preemption-mode recompute)
    swap_capacity_tokens: float = 0.0
    enable_prefix_caching: bool = True
    record_intervals: bool = True
    # engine: the runtime's scheduler, max_num_batched_tokens is the engine's (split over
    # the micro-batches in flight by the batcher); slots: the budget of one micro-batch.
    batcher: str = "engine"

    def __post_init__(self) -> None:
        if self.batcher not in BATCHERS:
            raise PlanInputError(f"batcher must be one of {', '.join(BATCHERS)}, got {self.batcher!r}")
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
                if self.batcher is not None:
                    self.batcher.add(*data)
                else:
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
            elif kind == _TICK:
                if data == self.ps_version:
                    self._ps_tick(now)
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
        self.batcher = None
        if self.cfg.batcher == "engine":
            from pipeserve.plan.batching import BLOCK_SIZE, EngineBatcher
            # An unbounded cache: blocks for every request of the trace at once.
            whole = sum(t.prompt_len + t.output_len + BLOCK_SIZE for t in trace)
            self.batcher = EngineBatcher(
                kv_capacity_tokens=min(self.cfg.kv_capacity_tokens, whole), max_num_seqs=self.cfg.max_num_seqs,
                max_num_batched_tokens=self.cfg.max_num_batched_tokens, max_inflight=self.cfg.micro_batches,
                # As the engine: only gpipe waits for the whole step; interleaved tops the
                # pipeline up like async (its micro-batches go round the ring V times).
                gpipe=self.cfg.schedule == "gpipe" and self.cfg.micro_batches > 1,
                enable_prefix_caching=self.cfg.enable_prefix_caching,
                swap_capacity_tokens=self.cfg.swap_capacity_tokens)
        # Time-sharing: jobs on the nodes' cores (None: every worker has its own device).
        self.sharing: CpuSharing | None = getattr(self.costs, "cpu_sharing", lambda: None)()
        self.jobs: list[_Job] = []
        self.ps_time = 0.0
        self.ps_version = 0
        self.driver_queue: deque[tuple[int, float]] = deque()
        self.driver_job: _Job | None = None
        self.chunk_layers: list[int] | None = getattr(self.costs, "chunk_layers", None)
        for rid, item in enumerate(trace):
            self._push(item.arrival, _ARRIVE, (rid, item) if self.batcher is not None else _Req(rid, item))

    def _push(self, time: float, kind: int, data) -> None:
        self.counter += 1
        heapq.heappush(self.events, (time, self.counter, kind, data))

    @property
    def _running(self) -> int:
        return sum(len(s) for s in self.slots)

    # -- forming and launching micro-batches ---------------------------------
    def _launch(self, now: float) -> None:
        if self.batcher is not None:
            for key, shape in self.batcher.fill():
                self._start(now, key, shape, None)
            return
        busy_slots = {slot_items[0] for slot_items, _ in self.in_flight.values()}
        if self.cfg.schedule != "async" and busy_slots:
            return  # gpipe / interleaved: wait for the whole step
        for slot in range(self.cfg.micro_batches):
            if slot in busy_slots:
                continue
            items = self._form(slot)
            if items:
                shape = EMPTY
                for req, tokens in items:
                    shape = shape + req.shape(tokens)
                self._start(now, self.next_mb, shape, (slot, items))

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

    def _start(self, now: float, mb: int, shape: BatchShape, slot_items) -> None:
        self.next_mb += 1
        self.in_flight[mb] = (slot_items, shape)
        self.result.micro_batches += 1
        seconds = self.driver_time(shape)
        self.result.driver_busy += seconds
        if self.sharing is not None:
            self.driver_queue.append((mb, seconds))
            self._driver_next(now)
            return
        # The driver forms micro-batches one at a time.
        self.driver_free = max(now, self.driver_free) + seconds
        self._push(self.driver_free, _READY, (mb, 0))

    # -- the driver and the workers on time-shared cores ---------------------
    def _driver_next(self, now: float) -> None:
        if self.driver_job is not None or not self.driver_queue:
            return
        mb, seconds = self.driver_queue.popleft()

        def formed(t: float, mb: int = mb) -> None:
            self.driver_job = None
            self._push(t, _READY, (mb, 0))
            self._driver_next(t)

        self.driver_job = _Job(0, 1, seconds, 0.0, formed)
        self._ps_add(now, self.driver_job)

    def _ps_add(self, now: float, job: _Job) -> None:
        self._ps_advance(now)
        self.jobs.append(job)
        self._ps_schedule(now)

    def _ps_rates(self) -> list[float]:
        runnable: dict[int, int] = {}
        streams: dict[int, int] = {}    # processes in their kernels, which stream weights and KV
        for job in self.jobs:
            runnable[job.node] = runnable.get(job.node, 0) + job.busy_threads()
            if job.streaming():
                streams[job.node] = streams.get(job.node, 0) + job.processes()
        rates = []
        for job in self.jobs:
            rate = self.sharing.rate(job.threads, job.serial <= 0.0, runnable[job.node], job.node, job.layer_work)
            if job.streaming():
                # the node's memory bandwidth is shared by every process in its kernels
                rate /= 1.0 + self.sharing.contention * (streams[job.node] - 1)
            rates.append(rate)
        return rates

    def _ps_advance(self, now: float) -> None:
        elapsed = now - self.ps_time
        self.ps_time = now
        if elapsed <= 0.0 or not self.jobs:
            return
        for job, rate in zip(self.jobs, self._ps_rates()):
            # A part within a rounding error of done is done (its tick is now).
            if job.serial > 0.0:
                job.serial = _left(job.serial, rate * elapsed)
            else:
                job.parallel = _left(job.parallel, rate * elapsed)

    def _ps_schedule(self, now: float) -> None:
        self.ps_version += 1
        if not self.jobs:
            return
        left = min((job.serial if job.serial > 0.0 else job.parallel) / rate
                   for job, rate in zip(self.jobs, self._ps_rates()))
        self._push(now + left, _TICK, self.ps_version)

    def _ps_tick(self, now: float) -> None:
        self._ps_advance(now)
        finished = [job for job in self.jobs if job.serial <= 0.0 and job.parallel <= 0.0]
        self.jobs = [job for job in self.jobs if job not in finished]
        for job in finished:
            job.done(now)
        self._ps_schedule(now)

    def _dispatch(self, worker: int, now: float) -> None:
        queue = self.queues[worker]
        if self.worker_busy[worker] or not queue:
            return
        # FIFO by ready time; on a tie the later chunk first, to drain the pipe.
        pick = min(range(len(queue)), key=lambda i: (queue[i][0], -queue[i][2]))
        _, mb, chunk = queue.pop(pick)
        shape = self.in_flight[mb][1]
        self.worker_busy[worker] = True
        self.result.first_start = min(self.result.first_start, now)
        if self.sharing is not None:
            serial, parallel = self.costs.chunk_work(chunk, shape)
            job = _Job(self.sharing.node_of[worker], self.sharing.threads[worker], serial, parallel,
                       lambda t: self._finish_chunk(t, worker, mb, chunk, now), self.sharing.runnable(worker),
                       self.chunk_layers[chunk] if self.chunk_layers else 1)
            self._ps_add(now, job)
            return
        duration = self.costs.chunk_time(chunk, shape)
        self._push(now + duration, _DONE, (worker, mb, chunk, now))

    def _finish_chunk(self, now: float, worker: int, mb: int, chunk: int, start: float) -> None:
        shape = self.in_flight[mb][1]
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
        slot_items, _ = self.in_flight.pop(mb)
        self.result.last_end = now
        if self.batcher is not None:
            for t, first, end in self.batcher.complete(mb, now):
                self.result.requests.append(RequestTimes(t.arrival, first, end, t.prompt_len, t.output_len))
            self.result.preemptions = self.batcher.preemptions
            self.result.swaps = self.batcher.swaps
        else:
            for req, tokens in slot_items[1]:
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


def _left(work: float, done: float) -> float:
    left = work - done
    return left if left > 1e-12 * max(1.0, work) else 0.0
