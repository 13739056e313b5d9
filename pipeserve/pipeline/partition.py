"""Which layers each pipeline stage holds: balanced (the default), uniform, manual ("19,11") or auto.

A partition is a list of half-open layer ranges ``[(start, end), ...]``, one per
pipeline chunk, contiguous and covering every decoder layer. With V virtual
stages (the ``interleaved`` schedule) there are P·V chunks and worker ``w``
holds chunks ``w, w + P, w + 2P, ...``.

The math here is plain Python (no torch) so that it is tested alone; the
costs it balances come from the model's shapes (``balanced``: ``shape_costs``),
from ``pipeserve.pipeline.costs`` (``auto``: measured on the device at start-up)
or from the caller. ``min_max_split`` is the one
balancing algorithm: the runtime's ``auto`` runs it on measured costs, the
planner (``pipeserve.plan.analysis``) on its roofline times.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from pipeserve.pipeline.part_costs import PartCosts

if TYPE_CHECKING:
    import torch

    from pipeserve.config import EngineConfig
    from pipeserve.model.config import ModelConfig

logger = logging.getLogger(__name__)

Partition = list[tuple[int, int]]


def counts_to_ranges(counts: list[int]) -> Partition:
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def layer_counts(partition: Partition) -> list[int]:
    return [end - start for start, end in partition]


def check_parts(num_layers: int, parts: int,
                flags: str = "--pipeline-parallel-size or --pp-virtual-stages") -> None:
    """Refuse a chunk count that cannot hold the layers; ``flags`` names what the user can lower."""
    if parts < 1:
        raise ValueError(f"the number of pipeline chunks must be >= 1, got {parts}")
    if parts > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {parts} pipeline chunks (each needs at "
                         f"least one layer): lower {flags}")


def uniform_partition(num_layers: int, parts: int) -> Partition:
    """Equal layer counts; the remainder goes one layer each to the first chunks,
    because the last chunk also carries the LM head."""
    check_parts(num_layers, parts)
    base, extra = divmod(num_layers, parts)
    return counts_to_ranges([base + (1 if i < extra else 0) for i in range(parts)])


def manual_partition(text: str, num_layers: int, parts: int, flag: str = "--pp-partition") -> Partition:
    """``"19,11"`` -> [(0, 19), (19, 30)]: one positive count per chunk, summing to the layers.
    ``flag`` names the option the text came from, for the error messages."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: write balanced, uniform, auto, or one layer count per stage "
                         f"like 19,11") from None
    if len(counts) != parts:
        raise ValueError(f"{flag} {text!r} has {len(counts)} counts; {parts} pipeline chunks "
                         "need one each")
    if min(counts) < 1:
        raise ValueError(f"{flag} {text!r}: every stage needs at least one layer")
    if sum(counts) != num_layers:
        raise ValueError(f"{flag} {text!r} sums to {sum(counts)} layers; the model has "
                         f"{num_layers}")
    return counts_to_ranges(counts)


def parse_stage_speeds(text: str | None, num_stages: int) -> list[float]:
    """``"1,0.5"`` -> [1.0, 0.5] (relative speeds; stage time = cost / speed). None: all 1."""
    if not text:
        return [1.0] * num_stages
    try:
        speeds = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--stage-speeds {text!r}: write one relative speed per stage, like 1,0.5") from None
    if len(speeds) != num_stages or min(speeds) <= 0:
        raise ValueError(f"--stage-speeds {text!r} must be {num_stages} positive numbers, one per stage")
    return speeds


# ``balanced`` assumes the reference workload's mix (prompts of 128-512 tokens,
# answers of 64-256): about two prompt tokens pass the decoder layers for each
# generated token, and only a generated token passes the LM head. For SmolLM2-135M
# the head then weighs ~2.7 layers and the split is 16/14; uniform (15/15) left
# stage 0 waiting 15 % of the time. Mixes far from it still split within ~10 %
# of their own best (decode-heavy: head ~5.6 layers; prefill-heavy: ~0.3).
PROMPT_TOKENS_PER_GENERATED = 2.0


def shape_costs(cfg: ModelConfig, itemsize: int,
                prompt_per_generated: float = PROMPT_TOKENS_PER_GENERATED) -> PartCosts:
    """Costs from parameter counts (a forward's multiply-adds per token are its active
    parameters), per generated token of a workload with ``prompt_per_generated``
    prompt tokens per generated one: every token passes the layers and the embedding,
    one row the head. Deterministic, unlike measured costs, and free at start-up.
    Attention's share (it grows with the context) is left out: it adds to the layers."""
    tokens = 1.0 + prompt_per_generated
    active = [cfg.active_layer_params(i) * tokens for i in range(cfg.num_layers)]
    sizes = tuple(cfg.layer_params(i) * itemsize for i in range(cfg.num_layers))
    return PartCosts(embed=cfg.hidden_size * tokens, layer=max(active, default=0.0),
                     head=float(cfg.head_params()), embed_bytes=cfg.embedding_params() * itemsize,
                     layer_bytes=max(sizes, default=0), head_bytes=cfg.head_params() * itemsize,
                     layer_times=tuple(active) if len(set(active)) > 1 else (),
                     layer_sizes=sizes if len(set(sizes)) > 1 else ())


def chunk_time(costs: PartCosts, start: int, end: int, is_first: bool, is_last: bool,
               speed: float = 1.0) -> float:
    """Time of a chunk holding layers [start, end) (plus the embedding / head at the ends)."""
    head = (costs.head_share if is_first else 0.0) + (1.0 - costs.head_share if is_last else 0.0)
    work = costs.span_time(start, end) + (costs.embed if is_first else 0.0) + costs.head * head
    return work / speed


def chunk_bytes(costs: PartCosts, start: int, end: int, is_first: bool, is_last: bool) -> int:
    return (costs.span_bytes(start, end) + (costs.embed_bytes if is_first else 0)
            + (costs.head_bytes if is_last else 0) + (costs.first_head_bytes if is_first and not is_last else 0))


def stage_times(partition: Partition, costs: PartCosts, speeds: list[float] | None = None) -> list[float]:
    """Predicted time of each chunk (chunk i runs on worker i mod len(speeds))."""
    speeds = speeds or [1.0] * len(partition)
    last = len(partition) - 1
    return [chunk_time(costs, start, end, i == 0, i == last, speeds[i % len(speeds)])
            for i, (start, end) in enumerate(partition)]


def min_max_split(num_layers: int, parts: int,
                  chunk_time: Callable[[int, int, int], float]) -> list[int] | None:
    """Layer counts of the contiguous split into ``parts`` chunks whose slowest chunk is
    fastest, or None when no split fits.

    ``chunk_time(part, start, end)`` is the time of chunk ``part`` holding layers
    [start, end) (the caller adds the embedding / head at the ends), ``inf`` where
    the chunk does not fit (memory). Dynamic programming over (chunks placed, layers
    placed), O(parts · layers²): trivial for real models. Among equally slow splits
    the first found wins.
    """
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(parts + 1)]  # best[p][n]: slowest of chunks < p
    choice = [[0] * (num_layers + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for p in range(1, parts + 1):
        for n in range(p, num_layers - (parts - p) + 1):
            for k in range(1, n - (p - 1) + 1):
                value = max(best[p - 1][n - k], chunk_time(p - 1, n - k, n))
                if value < best[p][n]:
                    best[p][n], choice[p][n] = value, k
    if best[parts][num_layers] == inf:
        return None
    counts, n = [], num_layers
    for p in range(parts, 0, -1):
        counts.append(choice[p][n])
        n -= choice[p][n]
    return counts[::-1]


def auto_partition(num_layers: int, parts: int, costs: PartCosts, speeds: list[float] | None = None,
                   memory_limits: list[int | None] | None = None) -> Partition:
    """Contiguous split minimising the slowest chunk's time under each chunk's memory limit."""
    check_parts(num_layers, parts)
    speeds = speeds or [1.0] * parts
    limits = memory_limits or [None] * parts

    def time_if_fits(part: int, start: int, end: int) -> float:
        first, last = part == 0, part == parts - 1
        limit = limits[part]
        if limit is not None and chunk_bytes(costs, start, end, first, last) > limit:
            return float("inf")
        return chunk_time(costs, start, end, first, last, speeds[part])

    counts = min_max_split(num_layers, parts, time_if_fits)
    if counts is None:
        raise ValueError(_no_fit_message(num_layers, parts, costs, limits))
    return counts_to_ranges(counts)


def _no_fit_message(num_layers: int, parts: int, costs: PartCosts, limits: list[int | None]) -> str:
    return (f"no split of {num_layers} layers into {parts} pipeline chunks fits the memory limits "
            f"{limits} (one layer takes {max(costs.layer_sizes, default=costs.layer_bytes)} bytes, "
            f"the embedding {costs.embed_bytes}, "
            f"the LM head {costs.head_bytes}): add stages or raise the limits")


def choose_partition(mode: str, num_layers: int, num_stages: int, virtual_stages: int = 1,
                     costs: PartCosts | None = None, speeds: list[float] | None = None,
                     memory_limits: list[int | None] | None = None) -> Partition:
    """Dispatch on ``--pp-partition`` (balanced | uniform | auto | "a,b,c"); ``balanced``
    and ``auto`` balance ``costs`` (shape or measured).

    With V virtual stages there are P·V chunks; chunk c runs on worker c mod P,
    so it gets that worker's speed, and a worker's memory limit is shared
    equally by its V chunks (conservative: exact sharing would couple chunks).
    """
    parts = num_stages * virtual_stages
    if mode == "uniform":
        return uniform_partition(num_layers, parts)
    if mode in ("auto", "balanced"):
        if costs is None:
            raise ValueError(f"--pp-partition {mode} needs layer costs (shape_costs, or "
                             "pipeserve.pipeline.costs.measure_layer_costs)")
        chunk_speeds = [(speeds or [1.0] * num_stages)[c % num_stages] for c in range(parts)]
        chunk_limits = None
        if memory_limits is not None:
            chunk_limits = [None if memory_limits[c % num_stages] is None
                            else memory_limits[c % num_stages] // virtual_stages for c in range(parts)]
        return auto_partition(num_layers, parts, costs, chunk_speeds, chunk_limits)
    return manual_partition(mode, num_layers, parts)


def log_partition(partition: Partition, costs: PartCosts | None, speeds: list[float] | None) -> None:
    layers = [end - start for start, end in partition]
    if costs is None:
        logger.info("pipeline partition %s (layers per chunk %s)", partition, layers)
        return
    # Relative loads: balanced's costs are multiply-adds, auto's seconds.
    times = stage_times(partition, costs, speeds)
    loads = [f"{t / max(times):.2f}" for t in times]
    logger.info("pipeline partition %s (layers per chunk %s), predicted chunk loads %s of the slowest",
                partition, layers, loads)


def partition_for_config(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype,
                         memory_limits: list[int | None] | None = None) -> Partition:
    """The engine's entry point: resolve ``--pp-partition`` for this model and log it.

    ``balanced`` balances the model's shape costs (``shape_costs``); ``auto`` first
    measures the costs on stage 0's device (about a second).
    """
    num_stages = config.pipeline_parallel_size
    speeds = parse_stage_speeds(config.stage_speeds, num_stages)
    costs = None
    if config.pp_partition == "balanced":
        costs = shape_costs(cfg, dtype.itemsize)
    elif config.pp_partition == "auto":
        import torch as _torch  # only auto needs the device

        from pipeserve.pipeline.costs import measure_layer_costs
        device = _torch.device("cuda:0" if config.device == "cuda" else "cpu")
        threads = _torch.get_num_threads()
        _torch.set_num_threads(config.stage_threads)  # measure as a stage will run
        try:
            # Cost ratios depend on the batch and the mix: for SmolLM2 the LM head
            # is ~7 layers at 8 decode tokens, ~5 at 64, ~3 once the prompt tokens
            # that pass every layer but not the head are counted. Measure at a
            # serving-sized micro-batch, with one prompt token per generated
            # token, taking the best of several repeats (timings are noisy).
            batch = max(8, min(128, config.max_num_seqs // num_stages))
            costs = measure_layer_costs(cfg, dtype, device, batch=batch, context=256,
                                        prefill_tokens=min(2048, config.max_num_batched_tokens),
                                        block_size=config.block_size, repeats=5,
                                        attention_backend=config.attention_backend)
        finally:
            _torch.set_num_threads(threads)
    if costs is not None and config.pp_lm_head == "shared":   # each end runs about half the heads
        costs = dataclasses.replace(costs, head_share=0.5,
                                    first_head_bytes=0 if cfg.tie_word_embeddings else costs.head_bytes)
    virtual = config.pp_virtual_stages if config.pp_schedule == "interleaved" else 1
    partition = choose_partition(config.pp_partition, cfg.num_layers, num_stages, virtual,
                                 costs, speeds, memory_limits)
    log_partition(partition, costs, [speeds[c % num_stages] for c in range(len(partition))])
    return partition
