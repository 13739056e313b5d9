"""Which stage runs a step's LM head (``--pp-lm-head``): the last, or the first and the last in turn.

A prompt token passes every decoder layer and, unless it is a prompt's last, not the head; a
generated token passes the layers and the head (for SmolLM2, a 49,152 x 576 matmul: the
multiply-adds of eight layers). So the last stage's share of the work grows with the share of
decodes in the micro-batches, and no fixed split of the layers balances both a burst's prompts
and its decodes (the reference mix at P = 2, 16 / 14: stage 0 limited the first half of the
run, stage 1 idling 8-18 %; stage 1 the second, stage 0 idling 12-16 %).

``shared``: stage 0 holds the head too (its embedding, where the model ties them: no more
memory), and the driver decides, step by step, which of the two runs it (``HeadBalance``).
For a step whose head is stage 0's (``StepInput.head_first``) the last stage sends the hidden
states of the rows that sample (a HOP to chunk ``len(partition)``, a few KiB a decode) instead
of sampling, and stage 0 applies the final norm and the head, samples, sends the result to the
driver and keeps the tokens for the decode ahead that waits for them (``HeadRunner``). The
layers are split as if each stage ran half the heads (``partition.py``, ``head_share``).
"""

from __future__ import annotations

from typing import Any

from pipeserve.config import EngineConfig
from pipeserve.model.config import ModelConfig
from pipeserve.worker.step import StepInput


def resolve_lm_head(config: EngineConfig, model_cfg: ModelConfig, runner_factory: Any = None) -> str:
    """``--pp-lm-head`` resolved to ``last`` or ``shared``. ``shared`` where it cannot apply is
    refused, naming why; ``auto`` shares where it costs no memory (a head tied to the embedding)."""
    why_not = None
    if config.pipeline_parallel_size < 2:
        why_not = "one stage runs the whole model (PP = 1)"
    elif config.pp_schedule == "interleaved":
        why_not = "--pp-schedule interleaved: a stage holds several chunks"
    elif config.tensor_parallel_size > 1:
        why_not = "--tensor-parallel-size > 1: the head is split over a stage's ranks"
    elif runner_factory is not None:
        why_not = "the stages run a custom runner"
    if config.pp_lm_head == "shared" and why_not is not None:
        raise ValueError(f"--pp-lm-head shared does not apply: {why_not}")
    if config.pp_lm_head == "last" or why_not is not None:
        return "last"
    if config.pp_lm_head == "auto" and not model_cfg.tie_word_embeddings:
        return "last"     # stage 0 would hold a second copy of the head
    return "shared"


class HeadBalance:
    """The driver's choice of each step's head: the stage with less work so far.

    Work is counted in multiply-adds per token from the model's shapes: the first and the last
    stage's layers for every token of a step, and the head (its parameters) for each row that
    samples. The running difference between the two stages' work decides where the next
    step's head goes; with equal layer counts the heads alternate, weighted by their rows.
    The difference carried over is at most the last step's head: work done long ago is done
    (the stage that waited then does not get its time back), so when a burst's prompts give way
    to its decodes the heads move within a step or two."""

    def __init__(self, model_cfg: ModelConfig, partition: list[tuple[int, int]]) -> None:
        first, last = partition[0], partition[-1]
        layer = lambda i: model_cfg.active_layer_params(i)   # noqa: E731
        self.first = sum(layer(i) for i in range(*first))
        self.last = sum(layer(i) for i in range(*last))
        self.head = float(model_cfg.head_params())
        self.lead = 0.0           # the first stage's work minus the last's, so far
        self.first_heads = self.heads = 0

    def place(self, step: StepInput, alone: bool = False) -> None:
        """Mark ``step.head_first`` where stage 0 should run its head. ``alone``: fewer live
        sequences than micro-batches, so the stages run one after the other and no balance is
        to be had: the head stays on the last stage, whose token reaches stage 0 in one message
        either way (one request: its handing the head to stage 0 cost ~0-5 % a token)."""
        if alone:
            return
        rows = sum(1 for s in step.seqs if s.sampling is not None)
        tokens = step.num_tokens
        self.lead += (self.first - self.last) * tokens
        if not rows:
            return
        head = self.head * rows
        step.head_first = self.lead < 0
        self.lead = min(head, max(-head, self.lead + (head if step.head_first else -head)))
        self.heads += 1
        self.first_heads += step.head_first


class HeadRunner:
    """Stage 0's runner of a step's head (chunk ``len(partition)``): the final norm, the head
    and the sampler of stage 0's own ``ModelRunner`` on the rows the last stage sent."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def execute(self, step: StepInput, rows) -> Any:
        return self.runner.sample(step, rows)
