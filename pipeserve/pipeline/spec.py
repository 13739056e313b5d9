"""What every stage needs to know, and where stages live.

The driver sends one ``PipelineSpec`` (as a ``SpecWire``: declared fields, no
pickle) to every stage that joins, local or on another host. So a worker node
needs only the master's address (and the cluster key) to join: ``pipeserve
worker --nnodes 2 --node-rank 1 --master-addr A --master-port Q``.

Ranks: 0 is the driver, stage s is rank s + 1. Stages are split evenly over
nodes in order (node 0, which runs the driver, gets the first ones).
"""

from __future__ import annotations

import dataclasses
import importlib
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeserve.comm import messages
from pipeserve.comm.transport import Kind
from pipeserve.config import EngineConfig
from pipeserve.metrics.profile import StageProfile
from pipeserve.metrics.timeline import Interval
from pipeserve.model.config import ModelConfig
from pipeserve.worker.step import SampledToken, StepInput, StepOutput

@dataclass(frozen=True)
class PipelineSpec:
    config: EngineConfig
    source: Any                      # a ModelSource (or whatever the runner factory takes)
    model_cfg: ModelConfig
    partition: list[tuple[int, int]]  # P·V chunks
    num_blocks: int
    num_host_blocks: int
    # Called in the stage process as ModelRunner is: factory(source, cfg, start_layer=..., ...).
    # None: pipeserve.worker.model_runner.ModelRunner. Must be a module-level name of an
    # importable module (not __main__): stages import it by name.
    runner_factory: Callable | None = None
    # The stages replace a generation that failed (PipelineExecutor.recover): the engine waits
    # on them, so each maps its KV cache in for a shorter time before it serves (ModelRunner).
    replacement: bool = False

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
class SpecWire:
    """A ``PipelineSpec`` as it travels: plain fields, and the source's class and the
    runner factory as ``module:name`` references that the stage imports. Only the
    authenticated driver sends it (docs/ARCHITECTURE.md, trust model)."""

    config: EngineConfig              # without the cluster key: secrets never travel
    source_type: str                  # module:Class of a dataclass
    source: list                      # its fields, as step_wire writes a dataclass
    model_cfg: ModelConfig
    partition: list[tuple[int, int]]
    num_blocks: int
    num_host_blocks: int
    runner_factory: str | None = None
    replacement: bool = False

    @classmethod
    def of(cls, spec: PipelineSpec) -> "SpecWire":
        from pipeserve.worker.step_wire import to_wire
        if not dataclasses.is_dataclass(spec.source):
            raise TypeError(f"the model source must be a dataclass to reach the stages; got "
                            f"{type(spec.source).__name__}")
        factory = None if spec.runner_factory is None else _reference(spec.runner_factory)
        return cls(spec.config.replace(cluster_key=None), _reference(type(spec.source)), to_wire(spec.source),
                   spec.model_cfg, list(spec.partition), spec.num_blocks, spec.num_host_blocks, factory,
                   spec.replacement)

    def to_spec(self) -> PipelineSpec:
        from pipeserve.worker.step_wire import from_wire
        source_cls = _resolve(self.source_type)
        if not dataclasses.is_dataclass(source_cls):
            raise TypeError(f"model source type {self.source_type} is not a dataclass")
        factory = None if self.runner_factory is None else _resolve(self.runner_factory)
        return PipelineSpec(self.config, from_wire(source_cls, self.source, "spec.source"), self.model_cfg,
                            [tuple(p) for p in self.partition], self.num_blocks, self.num_host_blocks, factory,
                            self.replacement)


def _reference(obj: Any) -> str:
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        raise ValueError(f"{obj!r} must be a module-level name of an importable module (not __main__ or a "
                         f"local function): stage processes import it by name")
    return f"{module}:{name}"


def _resolve(reference: str) -> Any:
    module, _, name = reference.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class StepEnvelope:
    """A micro-batch as a stage runs it: the driver's step, the chunk that runs it next, and
    the timeline intervals that travel with it. The driver sends stage 0 one (a STEP); the
    other stages get the step ahead (a PLAN) and then its activations as a ``Hop``."""

    step: StepInput
    chunk: int                                  # the chunk that runs it next
    intervals: list[Interval] = field(default_factory=list)  # piggybacked timeline, stage clocks


@dataclass
class Hop:
    """A step's activations from one stage to the next (a HOP): the step itself reached the
    receiver ahead of them (a PLAN from the driver, or, for its later chunks, its own earlier
    run), so only its id travels with them. Sent whole, a 128-decode step took ~0.7 ms to
    encode on the sending stage and ~1.0 ms to decode on the receiving one (warm; a
    one-request step ~0.03 each), and the receiver built its metadata only once it arrived
    (~0.08 ms cold for one request)."""

    step_id: int
    chunk: int                                  # the chunk that runs it next
    intervals: list[Interval] = field(default_factory=list)


# What the pipeline's own message kinds carry (``comm`` declares the transport's).
messages.register_payloads({
    Kind.STEP: StepEnvelope, Kind.RESULT: tuple[StepOutput, list[Interval]], Kind.SPEC: SpecWire,
    Kind.PROFILE: StageProfile, Kind.TOKENS: tuple[int, list[tuple[int, int]]], Kind.PLAN: StepInput,
    Kind.HOP: Hop,
})

# A hop, a step's tokens and its result go packed (``messages.register_compact``): one request
# sends all three on every token at P >= 2, each end right after a compute, and the last stage
# sends a result of up to a micro-batch's tokens on every step. One carrying intervals (every
# ``SHIP_EVERY_S``) or top logprobs goes as JSON.
_HOP = struct.Struct("!qi")


def _hop_bytes(hop: Hop) -> bytes | None:
    return None if hop.intervals else _HOP.pack(hop.step_id, hop.chunk)


def _hop_of(body: bytes) -> Hop:
    return Hop(*_HOP.unpack(body))


def _tokens_bytes(tokens: tuple[int, list[tuple[int, int]]]) -> bytes | None:
    step_id, pairs = tokens
    try:
        return struct.pack(f"!{1 + 2 * len(pairs)}q", step_id, *[x for pair in pairs for x in pair])
    except struct.error:       # an id past int64 (none is): the JSON form says what is wrong
        return None


def _tokens_of(body: bytes) -> tuple[int, list[tuple[int, int]]]:
    if len(body) % 16 != 8:
        raise ValueError(f"{len(body)} bytes are not a step id and (sequence, token) pairs")
    values = struct.unpack(f"!{len(body) // 8}q", body)
    return values[0], list(zip(values[1::2], values[2::2]))


def _result_bytes(result: tuple[StepOutput, list[Interval]]) -> bytes | None:
    out, intervals = result
    sampled = out.sampled
    if intervals or any(t.top_logprobs for t in sampled):
        return None
    try:
        return struct.pack(f"!{1 + 2 * len(sampled)}q{len(sampled)}d", out.step_id,
                           *[x for t in sampled for x in (t.seq_id, t.token_id)], *[t.logprob for t in sampled])
    except struct.error:
        return None


def _result_of(body: bytes) -> tuple[StepOutput, list[Interval]]:
    n, extra = divmod(len(body) - 8, 24)
    if n < 0 or extra:
        raise ValueError(f"{len(body)} bytes are not a step id and (sequence, token, logprob) triples")
    values = struct.unpack(f"!{1 + 2 * n}q{n}d", body)
    ids, logprobs = values[1:1 + 2 * n], values[1 + 2 * n:]
    return StepOutput(values[0], [SampledToken(s, t, lp) for s, t, lp in zip(ids[::2], ids[1::2], logprobs)]), []


messages.register_compact(Kind.HOP, _hop_bytes, _hop_of)
messages.register_compact(Kind.TOKENS, _tokens_bytes, _tokens_of)
messages.register_compact(Kind.RESULT, _result_bytes, _result_of)


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
