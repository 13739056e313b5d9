"""What ``LLM.generate`` and the engine return, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token, with its rank and decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    # One dict per generated token: token id -> Logprob (the sampled one and the top-N).
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and each completion so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: None = field(default=None, repr=False)
