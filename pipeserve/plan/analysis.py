"""Evaluate one pipeline configuration with the analytic model (the five formulas)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipeserve.model.config import ModelConfig
from pipeserve.pipeline.partition import (check_parts, choose_partition, layer_counts, manual_partition,
                                          min_max_split, shape_costs, uniform_partition)
from pipeserve.plan import formulas
from pipeserve.plan.hardware import Hardware
from pipeserve.plan.memory import StageMemory, kv_token_capacity, stage_memory, stage_weight_bytes
from pipeserve.plan.presets import PlanInputError
from pipeserve.plan.quantization import weight_format
from pipeserve.plan.roofline import BatchShape, tp_shards
from pipeserve.plan.stages import PipelineCosts


@dataclass(frozen=True)
class PlanRequest:
    """One configuration to evaluate (the CLI flags)."""
    pp: int
    tp: int = 1
    micro_batches: int | None = None     # K (async in flight) or M (gpipe); None: choose
    schedule: str = "async"
    virtual_stages: int = 1              # V (interleaved)
    partition: str = "auto"              # auto | balanced | uniform | "19,11"
    dtype: str | None = None             # default: the hardware's
    quantization: str | None = None      # weights' format (q4_k_m, int8 ...); None: the dtype
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    input_len: int = 1024                # S_in, mean prompt tokens
    output_len: int = 256                # S_out, mean generated tokens
    request_rate: float = math.inf       # λ for T_queue


@dataclass
class PlanEstimate:
    req: PlanRequest
    chunk_layers: list[int]
    memory: list[StageMemory]
    batch: int                 # B_total: sequences decoding concurrently
    micro_batches: int         # K (or M)
    micro_batch_size: int      # b = ceil(B_total / K)
    t_stage: list[float]       # decode forward per worker for one micro-batch (s)
    t_comm: float              # slowest activation hop for one micro-batch (s)
    t_return: float            # token ids back to the driver (s)
    eta: float
    alpha: float
    gain: float
    b_opt: int
    b_opt_cost: float          # s per sequence-token at B_opt
    kv_bytes: float            # M_KV for B_total sequences of S tokens, whole model
    latency: dict[str, float] = field(default_factory=dict)
    throughput: float = 0.0    # output tokens/s, decode steady state

    @property
    def fits(self) -> bool:
        return all(m.fits for m in self.memory) and self.batch >= 1

    @property
    def t_max(self) -> float:
        return max(self.t_stage)


def _chunks(req: PlanRequest, model: ModelConfig, hw: Hardware) -> list[int]:
    """Layers per chunk: the runtime's own partitioner, fed the planner's times."""
    parts = req.pp * req.virtual_stages
    try:
        check_parts(model.num_layers, parts, flags="--pp or --virtual-stages")
        if req.partition == "uniform":
            return layer_counts(uniform_partition(model.num_layers, parts))
        if req.partition == "balanced":   # the runtime's default: its own split by the model's shape
            return layer_counts(choose_partition("balanced", model.num_layers, req.pp, req.virtual_stages,
                                                 shape_costs(model, 2)))
        if req.partition != "auto":
            return layer_counts(manual_partition(req.partition, model.num_layers, parts, flag="--partition"))
    except ValueError as exc:
        raise PlanInputError(str(exc)) from None
    probe = PipelineCosts(model, hw, [1] * parts, req.pp, req.tp, req.dtype, quantization=req.quantization)
    shape = BatchShape.decode(max(1, req.max_num_seqs // req.pp), req.input_len + req.output_len / 2)
    per_layer = [probe.layer_time(shape, probe.worker_of(c)) for c in range(parts)]
    fixed = [probe.chunk_time(c, shape) - per_layer[c] for c in range(parts)]
    cap = _memory_cap(req, model, hw, probe)

    def time(c: int, start: int, end: int) -> float:
        return fixed[c] + (end - start) * per_layer[c]

    def time_if_fits(c: int, start: int, end: int) -> float:
        return time(c, start, end) if end - start <= cap else math.inf

    # Nothing fits: still balance time, and let the memory table say "NO".
    return (min_max_split(model.num_layers, parts, time_if_fits)
            or min_max_split(model.num_layers, parts, time))


def _memory_cap(req: PlanRequest, model: ModelConfig, hw: Hardware, probe: PipelineCosts) -> int:
    """Most layers a chunk may hold so its worker's weights and activations fit."""
    per_layer = stage_weight_bytes(model, probe.costs, 1, False, False)
    ends = stage_weight_bytes(model, probe.costs, 0, True, False) + stage_weight_bytes(
        model, probe.costs, 0, False, True)
    room = hw.usable_bytes - ends
    return max(1, int(room / per_layer / req.virtual_stages)) if room > 0 else 1


def check_tp(model: ModelConfig, tp: int, quantization: str | None = None) -> None:
    """Refuse a T the runtime cannot split this model over (its message); T need not
    divide the heads: the runtime splits them unevenly (``roofline.tp_shards``)."""
    block = weight_format(quantization).block if quantization else 1
    try:
        tp_shards(model, tp, block)
    except ValueError as exc:
        raise PlanInputError(f"--tp {tp}: {exc}") from None


def evaluate(model: ModelConfig, hw: Hardware, req: PlanRequest) -> PlanEstimate:
    check_tp(model, req.tp, req.quantization)
    chunks = _chunks(req, model, hw)
    costs = PipelineCosts(model, hw, chunks, req.pp, req.tp, req.dtype, quantization=req.quantization)
    worker_layers = [sum(chunks[c] for c in range(len(chunks)) if costs.worker_of(c) == w)
                     for w in range(req.pp)]
    seq_len = req.input_len + req.output_len
    wanted = req.max_num_seqs * seq_len
    memory = stage_memory(model, hw, costs.costs, worker_layers, wanted, req.max_num_batched_tokens)
    capacity = kv_token_capacity(memory, costs.costs)
    batch = int(min(req.max_num_seqs, capacity // seq_len))
    memory = stage_memory(model, hw, costs.costs, worker_layers, batch * seq_len,
                          req.max_num_batched_tokens)
    k = req.micro_batches or _choose_micro_batches(costs, req, max(batch, 1))
    return _fill(model, hw, req, costs, chunks, memory, max(batch, 0), k)


def _decode_shape(req: PlanRequest, b: int) -> BatchShape:
    return BatchShape.decode(b, req.input_len + req.output_len / 2)


def step_time(costs: PipelineCosts, req: PlanRequest, batch: int, k: int) -> float:
    """Seconds for all ``batch`` sequences to gain one token, in steady state."""
    b = math.ceil(batch / k)
    shape = _decode_shape(req, b)
    times = costs.stage_times(shape)
    hops = sum(costs.hop_time(c, shape) for c in range(costs.num_chunks))
    if req.schedule == "async":
        return max(k * max(times), sum(times) + hops)
    # Each of the V rounds lasts max(M, P) chunk times (a micro-batch must come back
    # round the ring before worker 0 can run its next chunk); the last round drains.
    chunk, v = max(times) / req.virtual_stages, req.virtual_stages
    return ((v - 1) * max(k, req.pp) + k + req.pp - 1) * chunk + hops


def _choose_micro_batches(costs: PipelineCosts, req: PlanRequest, batch: int) -> int:
    """K (or M) with the shortest step; ties keep the smaller K (larger micro-batches)."""
    top = min(batch, 4 * req.pp)
    options = range(1, max(1, top) + 1)
    return min(options, key=lambda k: (round(step_time(costs, req, batch, k), 12), k))


def _fill(model: ModelConfig, hw: Hardware, req: PlanRequest, costs: PipelineCosts,
          chunks: list[int], memory: list[StageMemory], batch: int, k: int) -> PlanEstimate:
    b = max(1, math.ceil(max(batch, 1) / k))
    shape = _decode_shape(req, b)
    t_stage = costs.stage_times(shape)
    t_comm = costs.activation_hop_time(shape)
    t_return = costs.hop_time(costs.num_chunks - 1, shape)
    t_max = max(t_stage)
    eta = formulas.pipeline_efficiency(k, req.pp, t_max, t_comm)
    alpha = t_comm / (req.pp * t_max) if t_max > 0 else 0.0
    cands = sorted({2**i for i in range(12) if 2**i <= max(batch, 1)} | {max(batch, 1)})
    b_opt, b_cost = formulas.best_micro_batch(
        req.pp, lambda x: max(costs.stage_times(_decode_shape(req, x))),
        lambda x: costs.activation_hop_time(_decode_shape(req, x)), cands)
    kv = formulas.kv_memory(model.num_layers, model.num_kv_heads, model.head_dim, batch,
                            req.input_len + req.output_len, costs.costs.bytes)
    est = PlanEstimate(req, chunks, memory, batch, k, b, t_stage, t_comm, t_return, eta, alpha,
                       formulas.throughput_gain(req.pp, eta, alpha), b_opt, b_cost, kv)
    step = step_time(costs, req, max(batch, 1), k)
    est.throughput = batch / step if batch else 0.0
    est.latency = _latency(costs, req, est, step, batch)
    return est


def _latency(costs: PipelineCosts, req: PlanRequest, est: PlanEstimate, step: float,
             batch: int) -> dict[str, float]:
    """One request's T = T_queue + T_prefill + T_decode + T_comm (seconds)."""
    chunk = min(req.input_len, req.max_num_batched_tokens)
    pieces = math.ceil(req.input_len / chunk)
    pre = BatchShape.prefill(1, chunk, cached=(pieces - 1) * chunk // 2)
    pre_times = costs.stage_times(pre)
    # Chunks of one prompt follow each other down the pipe: fill once, then the slowest stage.
    t_prefill = sum(pre_times) + (pieces - 1) * max(pre_times)
    hops_pre = sum(costs.hop_time(c, pre) for c in range(costs.num_chunks))
    t_decode = formulas.decode_time(req.output_len, req.pp, est.t_max)
    hops_dec = est.t_comm * (req.pp - 1) + est.t_return
    t_comm = hops_pre + max(0, req.output_len - 1) * hops_dec
    service = (step * req.output_len + t_prefill) / max(batch, 1)  # s of pipe time per request
    t_queue = 0.0 if math.isinf(req.request_rate) else formulas.md1_queue_wait(req.request_rate, service)
    total = formulas.request_latency(t_queue, t_prefill, t_decode, t_comm)
    return {"T_queue": t_queue, "T_prefill": t_prefill, "T_decode": t_decode, "T_comm": t_comm,
            "T": total, "TTFT": t_queue + t_prefill + hops_pre,
            "TPOT": (t_decode + t_comm - hops_pre) / max(1, req.output_len - 1)}
