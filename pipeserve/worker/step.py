"""What the driver sends to the stages for one forward step, and what comes back.

Plain dataclasses with a declared wire format (``step_wire.py``): they cross process (and host) boundaries in the
pipeline runtime. The driver decides everything here; stages only execute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeserve.sampling.inputs import SeqSampling

__all__ = ["SampledToken", "SeqSampling", "SeqStep", "StepInput", "StepOutput"]


@dataclass
class SeqStep:
    """One sequence's share of a step: compute KV for ``token_ids`` at positions
    ``start_pos .. start_pos + len(token_ids) - 1``, attending to everything
    before them through ``block_table``."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sampling: SeqSampling | None = None   # None: no token this step (a non-final prefill chunk)
    # Tokens the sequence holds (prompt + generated) when scheduled; None: its context
    # length. Longrope picks its factors by it (transformers picks them by the length
    # it runs), so every chunk of a long prompt rotates as the whole prompt does.
    seq_len: int | None = None


@dataclass
class StepInput:
    step_id: int
    seqs: list[SeqStep]
    # KV block movements executed on every stage before the forward pass.
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host block, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)    # (src block, dst block)
    # Decode ahead (``EngineConfig.pp_decode_ahead``): the last stage sends the tokens it samples
    # for this step straight to stage 0 too (a TOKENS message) ...
    forward_tokens: bool = False
    # ... where a step scheduled before they were known waits for them: >= 0, every sequence's
    # one input token is the one step ``tokens_from`` sampled for it (its ``token_ids`` hold a
    # placeholder until stage 0 fills them in).
    tokens_from: int = -1
    # --pp-lm-head shared: the first stage runs this step's head and samples; the last stage sends
    # it the sampling rows' hidden states instead (pipeline/lm_head.py).
    head_first: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float
    # (token id, logprob) of the top-N, best first; empty unless asked for.
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class StepOutput:
    step_id: int
    sampled: list[SampledToken]
