"""Request and sequence state, shared by the engine, the scheduler and the KV manager.

Plain Python: no torch. A *request* (``SequenceGroup``) holds ``n`` sequences
that share one prompt; it is the one record of a request's state, kept in the
engine's table ``LLMEngine.requests`` (request id -> record), which the
scheduler reads too. Each ``Sequence`` owns a block table into the one logical
KV cache that every pipeline stage indexes the same way, and its output text.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass
from typing import Protocol

from pipeserve.outputs import Logprob
from pipeserve.sampling_params import SamplingParams

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # never run, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"      # preempted by swap: its blocks live in the host pool
    FINISHED = "finished"


class Detokenizer(Protocol):
    """Turns a stream's new token ids into newly stable text (``engine/detokenizer.py``)."""

    def step(self, new_token_ids: list[int]) -> str: ...

    def flush(self) -> str: ...


class Sequence:
    """One token stream, its KV bookkeeping and its output text.

    Invariants:
      - ``token_ids`` = prompt + generated tokens.
      - ``num_computed_tokens`` tokens have their KV in the cache (positions
        0 .. num_computed_tokens-1); the next step computes from there.
      - ``block_table`` covers at least ``num_computed_tokens`` slots.
    """

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float | None = None,
                 priority: int = 0, user: str | None = None) -> None:
        self.seq_id: int = next(_seq_counter)
        self.request_id = request_id
        self.index = index                   # which of the n completions
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0           # prompt tokens served by the prefix cache
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.params = params
        self.priority = priority
        self.user = user or ""
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Output text, kept by the engine's output processor.
        self.detokenizer: Detokenizer | None = None
        self.output_text = ""                # cut at a stop string once finished
        self.output_logprobs: list[dict[int, Logprob]] | None = None   # None: not asked for
        self.cumulative_logprob = 0.0

    # -- sizes -------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    # The scheduler reads these for every sequence on every step: each is one
    # expression, not a chain of properties.
    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the last sampled token is still to be computed."""
        n = len(self.token_ids)
        return n - self.num_computed_tokens > 1 or n == self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, "
                f"status={self.status.value})")


@dataclass
class SequenceGroup:
    """One request: ``n`` sequences over one prompt, and every fact the engine keeps
    about it. Each timestamp is set in one place: ``arrival_time`` when the request
    is made (``input_processor.make_group``), ``first_scheduled_time`` when the
    scheduler first admits one of its sequences, ``first_token_time`` /
    ``last_token_time`` when the output processor takes a token, ``finished_time``
    when it makes the final output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float
    priority: int = 0
    user: str = ""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None
    # The first sequence has computed the shared prompt, so its siblings may fork
    # from its blocks (the scheduler sets it; a replay after a stage failure clears it).
    prefilled: bool = False

    @property
    def is_finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:       # n = 1, the common case: no generator per call
            return seqs[0].status is SequenceStatus.FINISHED
        return all(s.is_finished for s in seqs)
