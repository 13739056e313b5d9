"""Requests in: prompts (text, token ids, or a dict of either) to validated sequence groups."""

from __future__ import annotations

import time
from dataclasses import replace

from pipeserve.sampling_params import SamplingParams
from pipeserve.sequence import Sequence, SequenceGroup

PromptType = str | list[int] | dict


class RequestRejected(ValueError):
    """A request that can never be served as asked (too long, too big for the KV cache, bad ids)."""


def prompt_to_ids(prompt: PromptType, tokenizer) -> tuple[str | None, list[int]]:
    """Returns (prompt text or None, prompt token ids)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _as_ids(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt_to_ids(prompt["prompt"], tokenizer)
        raise RequestRejected("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)):
        return None, _as_ids(prompt)
    raise RequestRejected(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")


def _as_ids(ids) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RequestRejected("prompt_token_ids must be a list of integers")
    return list(ids)


def make_group(request_id: str, prompt: str | None, ids: list[int], params: SamplingParams, *,
               vocab_size: int, max_model_len: int, eos_token_ids: tuple[int, ...],
               fits_in_cache, priority: int = 0, user: str | None = None,
               arrival_time: float | None = None) -> SequenceGroup:
    """Validate one request and build its ``n`` sequences.

    ``fits_in_cache(num_tokens) -> bool`` tells whether one sequence of that
    length could ever hold its KV (the scheduler knows the block count).
    """
    check_prompt(ids, vocab_size=vocab_size, max_model_len=max_model_len)
    bad = [t for t in (params.logit_bias or ()) if t >= vocab_size]
    if bad:
        raise RequestRejected(f"logit_bias names token id {bad[0]}, out of range for a vocabulary of {vocab_size}")
    if not fits_in_cache(len(ids) + 1):
        raise RequestRejected(
            f"the prompt has {len(ids)} tokens, which can never fit in the KV cache; "
            "raise --kv-cache-memory or send a shorter prompt")
    params = replace(params, eos_token_ids=tuple(eos_token_ids))
    arrival = time.time() if arrival_time is None else arrival_time
    seqs = [Sequence(request_id, i, ids, params, arrival_time=arrival, priority=priority, user=user)
            for i in range(params.n)]
    return SequenceGroup(request_id=request_id, prompt=prompt, prompt_token_ids=list(ids), params=params,
                         seqs=seqs, arrival_time=arrival, priority=priority, user=user or "")


def check_prompt(ids: list[int], *, vocab_size: int, max_model_len: int) -> None:
    if not ids:
        raise RequestRejected("the prompt is empty: give at least one token")
    if len(ids) >= max_model_len:
        raise RequestRejected(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{len(ids)} tokens (room is needed for at least one generated token)")
    bad = [t for t in ids if t < 0 or t >= vocab_size]
    if bad:
        raise RequestRejected(f"token id {bad[0]} is out of range for a vocabulary of {vocab_size}")
