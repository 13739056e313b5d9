"""Search PP × TP splits of the same device count and pick the best for a target."""

from __future__ import annotations

import dataclasses
import math

from pipeserve.model.config import ModelConfig
from pipeserve.plan.analysis import PlanEstimate, PlanRequest, evaluate
from pipeserve.plan.hardware import Hardware
from pipeserve.plan.memory import stage_weight_bytes
from pipeserve.plan.presets import PlanInputError
from pipeserve.plan.quantization import weight_format
from pipeserve.plan.roofline import tp_shards
from pipeserve.plan.stages import PipelineCosts

TARGETS = ("throughput", "latency")


def candidate_splits(model: ModelConfig, hw: Hardware, devices: int, block: int = 1) -> list[tuple[int, int]]:
    """(P, T) with P·T = devices, T within one node and one the runtime can split the model
    over (unevenly where T does not divide the heads), P ≤ layers."""
    splits = []
    for tp in range(1, devices + 1):
        pp = devices // tp
        if devices % tp or tp > hw.gpus_per_node or pp > model.num_layers:
            continue
        try:
            tp_shards(model, tp, block)
        except ValueError:
            continue
        if hw.gpus_per_node % tp:
            continue
        splits.append((pp, tp))
    return splits


def score(est: PlanEstimate, target: str) -> float:
    """Larger is better: tokens/s for throughput, minus end-to-end seconds for latency."""
    if target == "throughput":
        return est.throughput
    return -est.latency["T"]


def recommend(model: ModelConfig, hw: Hardware, base: PlanRequest,
              target: str) -> tuple[PlanEstimate | None, list[PlanEstimate]]:
    """Best fitting configuration (or None when nothing fits) and every candidate evaluated."""
    if target not in TARGETS:
        raise PlanInputError(f"--target must be throughput or latency, got {target!r}")
    results = []
    block = weight_format(base.quantization).block if base.quantization else 1
    for pp, tp in candidate_splits(model, hw, base.pp * base.tp, block):
        req = dataclasses.replace(base, pp=pp, tp=tp, micro_batches=None,
                                  partition="auto" if base.partition not in ("uniform",) else "uniform")
        try:
            results.append(evaluate(model, hw, req))
        except PlanInputError:
            continue  # this split is impossible (e.g. too many chunks); others may work
    fitting = [r for r in results if r.fits]
    best = max(fitting, key=lambda r: score(r, target), default=None)
    return best, results


def model_weight_bytes(model: ModelConfig, hw: Hardware, req: PlanRequest) -> float:
    """Bytes of all the model's weights in ``req``'s dtype and quantization (one copy)."""
    costs = PipelineCosts(model, hw, [model.num_layers], 1, 1, req.dtype, quantization=req.quantization)
    return stage_weight_bytes(model, costs.costs, model.num_layers, True, True)


def fewest_stages(model: ModelConfig, hw: Hardware, base: PlanRequest) -> PlanEstimate | None:
    """The smallest P (stages of ``base.tp`` devices each, auto partition, async) at which
    every stage holds its weights, its activations and the KV of at least one sequence;
    None when even one layer per stage is too much."""
    start = max(1, math.ceil(model_weight_bytes(model, hw, base) / base.tp / hw.usable_bytes))
    for pp in range(start, model.num_layers + 1):
        req = dataclasses.replace(base, pp=pp, micro_batches=None, partition="auto", schedule="async",
                                  virtual_stages=1)
        try:
            est = evaluate(model, hw, req)
        except PlanInputError:
            continue
        if est.fits:
            return est
    return None
