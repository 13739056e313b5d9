"""What every stage needs to know, and where stages live.

The driver publishes one ``PipelineSpec`` (pickled) in its store; every stage,
local or on another host, reads it there. So a worker node needs only the
master's address to join: ``pipeserve worker --nnodes 2 --node-rank 1
--master-addr A --master-port Q``.

Ranks: 0 is the driver, stage s is rank s + 1. Stages are split evenly over
nodes in order (node 0, which runs the driver, gets the first ones).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeserve.config import EngineConfig
from pipeserve.metrics.timeline import Interval
from pipeserve.model.config import ModelConfig
from pipeserve.worker.step import StepInput

SPEC_KEY = "pipeserve/spec"


def joined_key(rank: int) -> str:
    return f"pipeserve/joined/{rank}"


def ready_key(rank: int) -> str:
    return f"pipeserve/ready/{rank}"


def failed_key(rank: int) -> str:
    return f"pipeserve/failed/{rank}"


@dataclass(frozen=True)
class PipelineSpec:
    config: EngineConfig
    source: Any                      # a ModelSource (or whatever the runner factory takes)
    model_cfg: ModelConfig
    partition: list[tuple[int, int]]  # P·V chunks
    num_blocks: int
    num_host_blocks: int
    # Called in the stage process as ModelRunner is: factory(source, cfg, start_layer=..., ...).
    # None: pipeserve.worker.model_runner.ModelRunner. Must be picklable (a module-level name).
    runner_factory: Callable | None = None

    @property
    def num_stages(self) -> int:
        return self.config.pipeline_parallel_size

    @property
    def virtual_stages(self) -> int:
        return len(self.partition) // self.num_stages

    def chunks_of(self, stage: int) -> list[int]:
        """Worker ``stage`` holds chunks stage, stage + P, stage + 2P, ..."""
        return list(range(stage, len(self.partition), self.num_stages))


@dataclass
class StepEnvelope:
    """A micro-batch on its way round the pipeline: the driver's metadata travels
    with the activations, so each stage gets exactly one message per chunk."""

    step: StepInput
    chunk: int                                  # the chunk that runs it next
    intervals: list[Interval] = field(default_factory=list)  # piggybacked timeline, stage clocks


def validate_partition(partition: list[tuple[int, int]], num_layers: int, num_stages: int) -> None:
    if not partition or len(partition) % num_stages:
        raise ValueError(f"a partition for {num_stages} stages needs a multiple of {num_stages} chunks "
                         f"(P · virtual stages); got {len(partition)}: {partition}")
    expected = 0
    for start, end in partition:
        if start != expected or end <= start:
            raise ValueError(f"partition {partition} must be contiguous non-empty layer ranges from 0")
        expected = end
    if expected != num_layers:
        raise ValueError(f"partition {partition} covers {expected} layers; the model has {num_layers}")


def stages_of_node(num_stages: int, nnodes: int, node_rank: int) -> list[int]:
    """Stages split evenly over nodes, in order; the first nodes take the remainder."""
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} must be in [0, --nnodes {nnodes})")
    if num_stages < nnodes:
        raise ValueError(f"{num_stages} pipeline stages cannot cover {nnodes} nodes: every node needs "
                         f"at least one stage (raise --pipeline-parallel-size or lower --nnodes)")
    base, extra = divmod(num_stages, nnodes)
    start = node_rank * base + min(node_rank, extra)
    return list(range(start, start + base + (1 if node_rank < extra else 0)))


def node_of_stage(num_stages: int, nnodes: int, stage: int) -> int:
    for node in range(nnodes):
        if stage in stages_of_node(num_stages, nnodes, node):
            return node
    raise ValueError(f"stage {stage} is outside the {num_stages} stages")
