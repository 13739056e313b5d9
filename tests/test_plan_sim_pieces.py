"""The simulator's issue-18 pieces against closed forms, on fixed-time stand-in stages:
the tail of a run (the batch shrinks to the long-output stragglers), the runtime
scheduler's prefill/decode mix, and P stage processes + the driver time-sharing C cores."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pipeserve.plan.roofline import BatchShape
from pipeserve.plan.simulator import CpuSharing, PipelineSimulator, SimConfig
from pipeserve.plan.workload import TraceRequest


@dataclass
class LinearCosts:
    """One worker per stage; a chunk costs a + c·(sequences in the micro-batch)."""
    stages: int = 1
    a: float = 1.0
    c: float = 0.0
    driver: float = 0.0

    @property
    def num_workers(self) -> int:
        return self.stages

    @property
    def num_chunks(self) -> int:
        return self.stages

    def worker_of(self, chunk: int) -> int:
        return chunk

    def chunk_time(self, chunk: int, shape: BatchShape) -> float:
        return self.a + self.c * shape.num_seqs

    def hop_time(self, chunk: int, shape: BatchShape) -> float:
        return 0.0

    def driver_time(self, shape: BatchShape) -> float:
        return self.driver


@dataclass
class SharedCosts(LinearCosts):
    """The stages and the driver on ``cores`` cores: a chunk is ``serial`` s on one thread
    then ``parallel`` s of kernels (both at one core); each stage runs ``threads`` threads."""
    serial: float = 0.0
    parallel: float = 1.0
    cores: float = 2.0
    threads: int = 1
    efficiency: float = 0.8
    oversubscribed: float = 1.0
    barrier: float = 1.0
    contention: float = 0.0
    layers: int = 1            # per stage: its parallel part is split evenly over them
    layer_wait: float = 0.0

    @property
    def chunk_layers(self) -> list[int]:
        return [self.layers] * self.stages

    def chunk_work(self, chunk: int, shape: BatchShape) -> tuple[float, float]:
        return self.serial, self.parallel

    def cpu_sharing(self) -> CpuSharing:
        return CpuSharing((self.cores,), (0,) * self.stages, (self.threads,) * self.stages,
                          self.efficiency, self.oversubscribed, barrier=self.barrier, contention=self.contention,
                          layer_wait=self.layer_wait)


def _at_once(lengths: list[int], prompt: int = 8) -> list[TraceRequest]:
    return [TraceRequest(0.0, prompt, out) for out in lengths]


@pytest.mark.parametrize("batcher", ["engine", "slots"])
def test_the_tail_shrinks_to_the_stragglers(batcher: str) -> None:
    # n requests at once, k of them long: L1 steps at n sequences, then L2 - L1 at k.
    n, k, l1, l2, a, c = 12, 3, 5, 20, 0.5, 0.1
    trace = _at_once([l1] * (n - k) + [l2] * k)
    result = PipelineSimulator(LinearCosts(1, a, c), SimConfig("async", micro_batches=1, batcher=batcher)).run(trace)
    duration = l1 * (a + c * n) + (l2 - l1) * (a + c * k)
    assert result.summary()["duration_s"] == pytest.approx(duration)
    assert result.summary()["output_tokens_per_s"] == pytest.approx(((n - k) * l1 + k * l2) / duration)


def test_a_prompt_fills_what_the_decodes_leave_of_the_budget() -> None:
    # One request decoding; a second arrives with a prompt of P tokens. The runtime's
    # scheduler puts the decode first and chunks the prompt into the rest of the budget B:
    # its first token comes ceil(P / (B - 1)) steps after it arrives.
    budget, prompt = 64, 200
    trace = [TraceRequest(0.0, 8, 40), TraceRequest(10.0, prompt, 2)]
    cfg = SimConfig("async", micro_batches=1, max_num_batched_tokens=budget)
    result = PipelineSimulator(LinearCosts(1, 1.0, 0.0), cfg).run(trace)
    second = next(r for r in result.requests if r.prompt_len == prompt)
    assert second.first_token - second.arrival == pytest.approx(-(-prompt // (budget - 1)))


def test_the_engine_batcher_preempts_when_blocks_run_out() -> None:
    # 4 requests of 8 + 40 tokens on 8 blocks of 16: all admitted (1 block each), then
    # their growth runs the cache out, and the runtime's scheduler preempts (recompute).
    trace = _at_once([40] * 4)
    cfg = SimConfig("async", micro_batches=1, kv_capacity_tokens=8 * 16)
    result = PipelineSimulator(LinearCosts(1, 1.0, 0.0), cfg).run(trace)
    assert len(result.requests) == 4 and result.preemptions > 0
    slots = PipelineSimulator(LinearCosts(1, 1.0, 0.0), SimConfig("async", micro_batches=1, batcher="slots",
                                                                   kv_capacity_tokens=8 * 16)).run(trace)
    assert slots.preemptions == 0   # the slot model reserves each request's KV at admission


def test_with_a_host_pool_the_engine_batcher_swaps_instead_of_recomputing() -> None:
    # The same run with a host pool (the engine's --preemption-mode auto on one CPU host):
    # the victims' blocks go to the pool and come back, so no prompt is computed twice and
    # the run takes fewer prompt tokens' steps; without the pool every preemption recomputes.
    trace = _at_once([40] * 4)
    costs = LinearCosts(1, 1.0, 0.0)
    recompute = PipelineSimulator(costs, SimConfig("async", micro_batches=1, kv_capacity_tokens=8 * 16)).run(trace)
    swap = PipelineSimulator(costs, SimConfig("async", micro_batches=1, kv_capacity_tokens=8 * 16,
                                              swap_capacity_tokens=8 * 16)).run(trace)
    assert len(swap.requests) == 4 and swap.preemptions > 0
    assert swap.swaps == swap.preemptions and recompute.swaps == 0 and recompute.preemptions > 0
    assert swap.summary()["swaps"] == swap.swaps


@pytest.mark.parametrize("p,cores,threads", [(3, 2, 1), (4, 2, 1), (2, 2, 2), (3, 1, 1)])
def test_p_stages_on_c_cores_all_busy(p: int, cores: int, threads: int) -> None:
    # P micro-batches keep all P stages busy: runnable threads n = P·threads, each gets
    # C / n of a core; above the cores a stage's threads wait for each other at every op,
    # so it advances at one thread's share, C / n, whatever its threads (2 stages × 2
    # threads on 2 cores: half a core each); the last stage returns one micro-batch per
    # w / rate; s sequences each: s · rate / w tokens/s.
    w, s, steps = 1.0, 4, 300
    costs = SharedCosts(stages=p, parallel=w, cores=cores, threads=threads)
    result = PipelineSimulator(costs, SimConfig("async", micro_batches=p)).run(_at_once([steps] * (s * p)))
    rate = min(1.0, cores / (p * threads))
    assert result.summary()["output_tokens_per_s"] == pytest.approx(s * rate / w, rel=0.02)


@pytest.mark.parametrize("cores,tpot", [(4, 1 / 1.8), (2, 2.0)])
def test_threads_above_the_cores_add_nothing(cores: int, tpot: float) -> None:
    # Two 2-thread stages, both busy (two micro-batches), w of work each per token. On 4
    # cores every thread has a core: a stage runs at 1 + e = 1.8 cores. On 2 cores the 4
    # threads are never all running; each op waits for the one left out, so a stage
    # advances at one thread's share, 2 / 4 of a core: w / 0.5 per token, twice as slow
    # as two 1-thread stages on the same cores, not (1 + (2·0.5 − 1)·e)⁻¹ = 1.
    w = 1.0
    costs = SharedCosts(stages=2, parallel=w, cores=cores, threads=2, efficiency=0.8)
    result = PipelineSimulator(costs, SimConfig("async", micro_batches=2)).run(_at_once([200] * 2))
    assert result.summary()["tpot_s"]["p50"] == pytest.approx(2 * w * tpot, rel=0.02)


@pytest.mark.parametrize("barrier", [0.0, 0.5, 1.0])
def test_the_barrier_sets_what_oversubscribed_threads_deliver(barrier: float) -> None:
    # Two 2-thread stages on 2 cores, both busy: each thread gets C / n = 1/2 core. Waiting
    # at every op's barrier (1), a stage advances at one thread's share, 1/2 core; with
    # threads that do not wait on each other (0), at both shares, 2 · 1/2 = 1 core (no
    # parallel loss at one core's worth); between, in proportion. A token passes both
    # stages: 2 · w / rate.
    w = 1.0
    costs = SharedCosts(stages=2, parallel=w, cores=2, threads=2, efficiency=0.8, barrier=barrier)
    result = PipelineSimulator(costs, SimConfig("async", micro_batches=2)).run(_at_once([200] * 2))
    rate = 0.5 + (1.0 - barrier) * (1.0 - 0.5)
    assert result.summary()["tpot_s"]["p50"] == pytest.approx(2 * w / rate, rel=0.02)


@pytest.mark.parametrize("layers,wait,tpot", [(10, 0.02, 2 * (1.0 + 10 * 0.02)), (2, 0.02, 2 * (1.0 + 2 * 0.02)),
                                               (10, 0.5, 2 * (1.0 + 10 * 0.5)), (10, 0.0, 2 * 2 * 1.0)])
def test_a_fixed_wait_per_layer_weighs_on_short_layers(layers: int, wait: float, tpot: float) -> None:
    # Two 2-thread stages on 2 cores, both busy, w = 1 of kernels a stage over L layers.
    # At its threads' shares (2 · 1/2 core = 1 core) a layer takes w / L, then waits s at
    # its barriers whatever its length: a token costs 2 · (w + L · s), so the same work in
    # 10 short layers waits 5x more than in 2 long ones, and a wait longer than the layers
    # (0.5) costs more than the proportional barrier would. Without it (0), the barrier's
    # model (1 here): one thread's share, 1/2 core, 2 · 2w a token.
    costs = SharedCosts(stages=2, parallel=1.0, cores=2, threads=2, efficiency=0.8, layers=layers, layer_wait=wait)
    result = PipelineSimulator(costs, SimConfig("async", micro_batches=2)).run(_at_once([200] * 2))
    assert result.summary()["tpot_s"]["p50"] == pytest.approx(tpot, rel=0.02)


def test_one_thread_processes_do_not_wait_at_barriers() -> None:
    # Three 1-thread stages on 2 cores, all busy: no process has a second thread to wait
    # for, so the layer wait changes nothing (s · rate / w tokens/s, rate = C / P, as in
    # test_p_stages_on_c_cores_all_busy).
    s, w = 4, 1.0
    costs = SharedCosts(stages=3, parallel=w, cores=2, threads=1, layers=10, layer_wait=0.5)
    result = PipelineSimulator(costs, SimConfig("async", micro_batches=3)).run(_at_once([300] * (s * 3)))
    assert result.summary()["output_tokens_per_s"] == pytest.approx(s * (2 / 3) / w, rel=0.02)


@pytest.mark.parametrize("stages,micro_batches", [(1, 1), (2, 2), (2, 1)])
def test_processes_in_their_kernels_together_share_the_memory(stages: int, micro_batches: int) -> None:
    # 1-thread stages on 2 cores, w of kernels each, memory_contention c: a stage's kernels
    # run 1 + c·(others in their kernels) slower. Alone (PP = 1, or PP = 2 with one
    # micro-batch, the stages taking turns) a token costs stages · w; PP = 2 with both busy:
    # each stage runs at 1 / (1 + c), a token 2 · w · (1 + c).
    w, c = 1.0, 0.3
    costs = SharedCosts(stages=stages, parallel=w, cores=2, contention=c)
    result = PipelineSimulator(costs, SimConfig("async", micro_batches=micro_batches)).run(
        _at_once([200] * micro_batches))
    together = stages > 1 and micro_batches > 1
    assert result.summary()["tpot_s"]["p50"] == pytest.approx(stages * w * (1 + c if together else 1), rel=0.02)


def test_oversubscribed_cores_deliver_their_efficiency() -> None:
    p, cores, eta, w, s = 3, 2, 0.8, 1.0, 4
    costs = SharedCosts(stages=p, parallel=w, cores=cores, oversubscribed=eta)
    result = PipelineSimulator(costs, SimConfig("async", micro_batches=p)).run(_at_once([300] * (s * p)))
    assert result.summary()["output_tokens_per_s"] == pytest.approx(s * cores * eta / p / w, rel=0.02)


@pytest.mark.parametrize("threads", [1, 2])
def test_an_idle_stage_lends_its_cores(threads: int) -> None:
    # One micro-batch: one stage runs at a time, alone on the C = 2 cores, so a token
    # costs P · (serial + parallel / speed), speed = 1 + (k − 1)·e with k = min(threads, C).
    p, serial, parallel, e = 3, 0.2, 1.0, 0.8
    costs = SharedCosts(stages=p, serial=serial, parallel=parallel, threads=threads, efficiency=e)
    result = PipelineSimulator(costs, SimConfig("async", micro_batches=1)).run(_at_once([6]))
    speed = 1 + (min(threads, 2) - 1) * e
    assert result.summary()["tpot_s"]["p50"] == pytest.approx(p * (serial + parallel / speed))


def test_the_driver_takes_its_share_of_the_cores() -> None:
    # Two one-thread stages and the driver on ONE core, two micro-batches in flight. Per
    # token of each micro-batch the core does d (driver) + 2·w (stages) of work, all of it
    # time-shared, so the core's whole time goes round: 2 micro-batches of s sequences
    # per 2·(d + 2w) seconds.
    d, w, s = 0.5, 1.0, 3
    costs = SharedCosts(stages=2, parallel=w, cores=1, driver=d)
    result = PipelineSimulator(costs, SimConfig("async", micro_batches=2)).run(_at_once([200] * (2 * s)))
    assert result.summary()["output_tokens_per_s"] == pytest.approx(2 * s / (2 * (d + 2 * w)), rel=0.02)
    assert result.driver_busy == pytest.approx(d * result.micro_batches)


def test_tp_ranks_share_the_cores_but_each_runs_its_own_shard() -> None:
    # One stage of T = 2 one-thread ranks (each with w of work: its shard) on C cores. On 2
    # cores each rank has a core: a token costs w. On 1 core the 2 runnable threads halve
    # it: 2w. (Counting the ranks as one 2-thread process would give w / (1 + e) instead.)
    w = 1.0
    for cores, tpot in ((2, w), (1, 2 * w)):
        sharing = CpuSharing((float(cores),), (0,), (1,), 0.8, 1.0, ranks=(2,))
        costs = SharedCosts(stages=1, parallel=w, cores=cores)
        costs.cpu_sharing = lambda sharing=sharing: sharing
        result = PipelineSimulator(costs, SimConfig("async", micro_batches=1)).run(_at_once([5]))
        assert result.summary()["tpot_s"]["p50"] == pytest.approx(tpot)


def test_a_serial_part_keeps_one_thread_per_process_runnable() -> None:
    # Two 2-thread stages, both busy (two micro-batches), each chunk s of serial work only,
    # on 2 cores. In a serial part only the process's main thread runs (its kernel threads
    # sleep until the next parallel region): 2 runnable threads, a core each, so a token
    # costs 2·s; counting all 4 threads would halve each stage's speed (4·s).
    s = 1.0
    costs = SharedCosts(stages=2, serial=s, parallel=0.0, cores=2, threads=2)
    result = PipelineSimulator(costs, SimConfig("async", micro_batches=2)).run(_at_once([200] * 2))
    assert result.summary()["tpot_s"]["p50"] == pytest.approx(2 * s, rel=0.02)
