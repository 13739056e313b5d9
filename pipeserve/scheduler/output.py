"""What one ``Scheduler.schedule()`` call decides: one micro-batch."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeserve.sequence import Sequence


@dataclass
class ScheduledSeq:
    """Compute ``seq.token_ids[start : start + num_new_tokens]`` this step."""

    seq: Sequence
    num_new_tokens: int
    # Set at scheduling time: the engine appends tokens and on_step_done
    # advances num_computed_tokens later, so neither may be read back from seq.
    # The scheduler passes ``start``: with earlier chunks of the prompt in flight
    # it is where they end, not ``seq.num_computed_tokens``.
    start: int = -1
    seq_len: int = -1

    def __post_init__(self) -> None:
        if self.start < 0:
            self.start = self.seq.num_computed_tokens
        if self.seq_len < 0:
            self.seq_len = self.seq.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start:self.start + self.num_new_tokens]

    @property
    def sample(self) -> bool:
        """True when this chunk reaches the end of the sequence: a token is sampled."""
        return self.start + self.num_new_tokens >= self.seq_len


@dataclass
class SchedulerOutput:
    """One micro-batch. Every stage runs ``swap_out``, then ``swap_in``, then
    ``copies``, before the forward pass: blocks freed by a swap-out may be
    written by this very step. One output never holds both swap directions."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)    # (host block, device block)
    swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, host block)
    copies: list[tuple[int, int]] = field(default_factory=list)     # (src block, dst block)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.swap_in or self.swap_out or self.copies)
