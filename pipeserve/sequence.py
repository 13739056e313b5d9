"""Request and sequence state, shared by the engine, the scheduler and the KV manager.

Plain Python: no torch. A *request* (``SequenceGroup``) holds ``n`` sequences
that share one prompt. Each ``Sequence`` owns a block table into the one
logical KV cache that every pipeline stage indexes the same way.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass

from pipeserve.sampling_params import SamplingParams

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # never run, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"      # preempted by swap: its blocks live in the host pool
    FINISHED = "finished"


class Sequence:
    """One token stream and its KV bookkeeping.

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

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the last sampled token is still to be computed."""
        return self.num_uncomputed_tokens > 1 or self.num_output_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, "
                f"status={self.status.value})")


@dataclass
class SequenceGroup:
    """One request: ``n`` sequences over one prompt."""

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

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
