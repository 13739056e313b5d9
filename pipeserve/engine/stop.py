"""When does a sequence stop, and how much of its text may be streamed yet.

The engine calls ``check_stop`` once after each new output token of a
sequence, with the output text already extended by that token's stable text
delta (``num_new_chars`` characters; see ``IncrementalDetokenizer``). The
result is ``None`` (keep going) or a ``StopDecision``:

  - ``finish_reason="stop"``: an EOS id (``stop_reason=None``; not when
    ``ignore_eos``), a ``stop_token_ids`` id (``stop_reason`` = that id), or a
    stop string (``stop_reason`` = that string);
  - ``finish_reason="length"``: ``max_tokens`` output tokens, or the sequence
    filled ``max_model_len`` (checked even before ``min_tokens``: the KV cache
    cannot grow past it).

Stop ids and stop strings only count once ``min_tokens`` output tokens exist.
When several conditions hold, the first in the order above wins (vLLM's).

``truncate_to`` is the output text length to keep: for a stop string, the
text is cut just before it (or just after it with
``include_stop_str_in_output``); for a stop id or EOS, the token's own text is
dropped unless ``include_stop_str_in_output``. ``None`` keeps the text.

Stop strings are searched only in the new characters plus ``len(stop) - 1``
before them, so a string spanning two tokens is found exactly once. Until a
sequence finishes, the engine streams only ``streamable_length(text, stops)``
characters: a tail that could still become a stop string is held back.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class StopDecision:
    finish_reason: str                    # "stop" | "length"
    stop_reason: int | str | None = None  # stop string or stop token id; None for EOS/length
    truncate_to: int | None = None        # new output text length; None = keep all


def check_stop(params: SamplingParams, *, token_id: int, num_output_tokens: int,
               text: str, num_new_chars: int, num_tokens: int,
               max_model_len: int) -> StopDecision | None:
    """Decide whether a sequence finishes after its newest token.

    ``num_output_tokens`` counts the new token; ``num_tokens`` is prompt +
    output; ``text`` is the whole output text including the new characters."""
    if num_output_tokens >= params.min_tokens:
        decision = _stop_by_token(params, token_id, text, num_new_chars)
        decision = decision or _stop_by_string(params, text, num_new_chars)
        if decision is not None:
            return decision
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return StopDecision("length")
    if num_tokens >= max_model_len:
        return StopDecision("length")
    return None


def streamable_length(text: str, stop: list[str]) -> int:
    """How many leading characters of an unfinished output may be streamed:
    all but the longest tail that is a proper prefix of some stop string."""
    held = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return len(text) - held


def _stop_by_token(params: SamplingParams, token_id: int, text: str,
                   num_new_chars: int) -> StopDecision | None:
    is_eos = not params.ignore_eos and token_id in params.eos_token_ids
    if not is_eos and token_id not in (params.stop_token_ids or []):
        return None
    truncate_to = None
    if num_new_chars and not params.include_stop_str_in_output:
        truncate_to = len(text) - num_new_chars
    return StopDecision("stop", None if is_eos else token_id, truncate_to)


def _stop_by_string(params: SamplingParams, text: str, num_new_chars: int) -> StopDecision | None:
    """The earliest stop string that ends inside the new characters."""
    best: tuple[int, str] | None = None
    for s in params.stop or []:
        start = max(0, len(text) - num_new_chars - len(s) + 1)
        at = text.find(s, start)
        if at != -1 and (best is None or at < best[0]):
            best = (at, s)
    if best is None:
        return None
    at, s = best
    cut = at + len(s) if params.include_stop_str_in_output else at
    return StopDecision("stop", s, cut)
