"""Turn the scheduler's decision into the ``StepInput`` that the stages execute."""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable
from typing import Any

from pipeserve.sampling.inputs import SeqSampling
from pipeserve.scheduler.output import ScheduledSeq
from pipeserve.sequence import Sequence
from pipeserve.worker.step import SeqStep, StepInput

_step_ids = itertools.count()


def build_step(scheduled, swap_in, swap_out, copies, mask_of: Callable[[int], Any] | None = None, *,
               tokens_from: int = -1, forward_tokens: bool = False) -> StepInput:
    """``scheduled``: the scheduler's ``ScheduledSeq`` list for one micro-batch;
    ``mask_of(seq_id)``: the grammar mask of a constrained sequence's next token, else None;
    ``tokens_from``, ``forward_tokens``: decode ahead (``StepInput``)."""
    seqs = [_seq_step(s, mask_of) for s in scheduled]
    return StepInput(step_id=next(_step_ids), seqs=seqs, swap_in=list(swap_in),
                     swap_out=list(swap_out), copies=list(copies), forward_tokens=forward_tokens,
                     tokens_from=tokens_from)


def _seq_step(item: ScheduledSeq, mask_of) -> SeqStep:
    # The item's own start, not seq.num_computed_tokens: earlier chunks of the same
    # prompt may still be in flight (Scheduler, pipeline_prompt_chunks).
    seq, start, sample = item.seq, item.start, item.sample
    mask = mask_of(seq.seq_id) if sample and mask_of is not None else None
    # A decode ahead takes in the token its item in flight samples: a placeholder until stage 0
    # fills it in, and one more output token than the sequence holds now.
    ahead = start >= seq.num_tokens
    return SeqStep(
        seq_id=seq.seq_id,
        token_ids=[0] if ahead else seq.token_ids[start:start + item.num_new_tokens],
        start_pos=start,
        block_table=list(seq.block_table),
        sampling=sampling_inputs(seq, mask, pending=int(ahead)) if sample else None,
        seq_len=item.seq_len,
    )


def sampling_inputs(seq: Sequence, allowed_token_mask: bytes | None = None, pending: int = 0) -> SeqSampling:
    """``pending``: tokens sampled in flight and not appended yet (a decode ahead: 1); penalties
    read the output tokens, so a sequence that needs them is never decoded ahead."""
    p = seq.params
    penalties = p.needs_penalties
    return SeqSampling(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=sequence_seed(p.seed, seq.index),
        step_index=seq.num_output_tokens + pending,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        prompt_token_ids=seq.prompt_token_ids if penalties else None,
        output_token_ids=seq.output_token_ids if penalties else None,
        banned_token_ids=banned_tokens(seq, pending),
        num_logprobs=p.logprobs,
        allowed_token_mask=allowed_token_mask,
        logit_bias=[(int(t), float(b)) for t, b in p.logit_bias.items()] if p.logit_bias else None,
    )


def sequence_seed(seed: int | None, index: int) -> int | None:
    """The n completions of one seeded request must differ, yet stay reproducible."""
    if seed is None or index == 0:
        return seed
    return zlib.crc32(f"{seed}:{index}".encode())


def banned_tokens(seq: Sequence, pending: int = 0) -> list[int]:
    """EOS and stop ids may not be sampled before ``min_tokens`` are out."""
    p = seq.params
    if seq.num_output_tokens + pending >= p.min_tokens:
        return []
    banned = list(p.stop_token_ids)
    if not p.ignore_eos:
        banned.extend(p.eos_token_ids)
    return banned
