"""One-call predictions: analytic estimate + simulation of a configuration on a workload."""

from __future__ import annotations

import dataclasses

from pipeserve.model.config import ModelConfig
from pipeserve.plan.analysis import PlanEstimate, PlanRequest, evaluate
from pipeserve.plan.hardware import Hardware
from pipeserve.plan.simulator import PipelineSimulator, SimConfig
from pipeserve.plan.sim_result import SimResult
from pipeserve.plan.stages import PipelineCosts
from pipeserve.plan.workload import Workload


def simulate(model: ModelConfig, hw: Hardware, est: PlanEstimate, workload: Workload,
             record_intervals: bool = True, kv_capacity_tokens: float | None = None,
             threads_per_rank: int | None = None, batcher: str = "engine",
             time_sharing: bool = True, swap_capacity_tokens: float = 0.0) -> SimResult:
    """Run the simulator for an evaluated configuration (its partition, K and KV
    capacity; ``kv_capacity_tokens`` overrides the capacity the plan derives from
    the hardware's memory, e.g. with the block count a real engine allocated;
    ``threads_per_rank`` as the engine's ``--threads-per-stage``; ``batcher``: the
    runtime's scheduler, or ``slots``, the older model of it; ``time_sharing=False``:
    the older static split of shared cores, kept to measure what time-sharing changes;
    ``swap_capacity_tokens``: the engine's host pool, where its preemptions swap rather than
    recompute, e.g. the pool a real engine allocated)."""
    req = est.req
    trace = workload.build()
    capacity = kv_capacity_tokens or est.batch * (req.input_len + req.output_len)
    longest = max(t.prompt_len + t.output_len for t in trace)
    # As the engine: --max-num-batched-tokens is the budget of all micro-batches in flight
    # (the engine batcher splits it itself; the slot model gets one micro-batch's share).
    budget = req.max_num_batched_tokens
    if batcher == "slots":
        budget = max(1, budget // est.micro_batches)
    cfg = SimConfig(schedule=req.schedule, micro_batches=est.micro_batches,
                    max_num_seqs=req.max_num_seqs, max_num_batched_tokens=budget,
                    kv_capacity_tokens=max(capacity, longest), record_intervals=record_intervals,
                    batcher=batcher, swap_capacity_tokens=swap_capacity_tokens)

    def costs(scale: float) -> PipelineCosts:
        made = PipelineCosts(model, hw, est.chunk_layers, req.pp, req.tp, req.dtype, compute_scale=scale,
                             quantization=req.quantization, threads_per_rank=threads_per_rank)
        if not time_sharing:
            made.cpu_sharing = lambda: None
        return made

    if time_sharing or not (hw.shared_compute and req.pp > 1):
        # On shared compute the simulator time-shares the node's cores between the stage
        # processes and the driver (processor sharing): the driver's share is simulated.
        return _with_band(PipelineSimulator(costs(1.0), cfg).run(trace), hw)
    # The static split: the driver's busy share of the previous round's span is taken from
    # the stages' compute, repeated to a fixed point.
    scale, result = 1.0, None
    for _ in range(_DRIVER_ROUNDS):
        result = PipelineSimulator(costs(scale), cfg).run(trace)
        driver_cores = result.driver_busy / result.span
        if driver_cores == 0.0:
            break
        scale = max(0.1, (hw.cores - driver_cores) / hw.cores)
    return _with_band(result, hw)


def _with_band(result: SimResult, hw: Hardware) -> SimResult:
    """Attach the hardware file's validated error band (python -m pipeserve.plan.validate --heldout)."""
    if hw.validated_runs > 0:
        result.validated_ratio = (hw.validated_ratio_low, hw.validated_ratio_high, hw.validated_runs)
    return result


# Fixed-point rounds for the driver's share of statically split cores (the change after 3 is < 1%).
_DRIVER_ROUNDS = 3


def predict_throughput(model: ModelConfig, hardware: Hardware, pp: int, schedule: str,
                       workload: Workload, *, tp: int = 1, micro_batches: int | None = None,
                       virtual_stages: int | None = None, partition: str = "uniform",
                       max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                       dtype: str | None = None, kv_capacity_tokens: float | None = None,
                       threads_per_rank: int | None = None, quantization: str | None = None,
                       batcher: str = "engine", time_sharing: bool = True,
                       swap_capacity_tokens: float = 0.0) -> dict:
    """Predict a pipeline run: simulated throughput/TTFT/TPOT/bubbles plus the analytic terms.

    ``virtual_stages`` defaults to 2 for ``interleaved`` and 1 otherwise; ``partition``
    is ``uniform`` (the engine's default), ``auto`` or ``"19,11"``.
    """
    v = virtual_stages or (2 if schedule == "interleaved" else 1)
    req = PlanRequest(pp=pp, tp=tp, micro_batches=micro_batches, schedule=schedule,
                      virtual_stages=v, partition=partition, dtype=dtype,
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      input_len=workload.input_len, output_len=workload.output_len,
                      request_rate=workload.request_rate, quantization=quantization)
    est = evaluate(model, hardware, req)
    result = simulate(model, hardware, est, workload, record_intervals=False,
                      kv_capacity_tokens=kv_capacity_tokens, threads_per_rank=threads_per_rank,
                      batcher=batcher, time_sharing=time_sharing,
                      swap_capacity_tokens=swap_capacity_tokens).summary()
    result.update(analytic_output_tokens_per_s=est.throughput, eta=est.eta, alpha=est.alpha,
                  gain=est.gain, micro_batches=est.micro_batches, partition=est.chunk_layers,
                  stage_forward_s=est.t_stage, t_comm_s=est.t_comm, fits=est.fits,
                  config=dataclasses.asdict(req))
    return result
