"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeserve.structured.params import StructuredOutputsParams


# Tokens one request may bias (OpenAI documents no bound; each entry rides on every step's plan).
MAX_LOGIT_BIAS = 1024


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request.

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 disables top-k.
    Invalid values raise ``ValueError`` naming the parameter.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Added to the token's logit before anything else (OpenAI's logit_bias; -100 bans, 100 forces).
    logit_bias: dict[int, float] | None = None
    # Grammar-constrained output (vLLM's current name; ``guided_decoding`` is its older one).
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = field(default=None, repr=False)
    # Filled by the engine: the model's end-of-sequence ids.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.guided_decoding is not None:
            if self.structured_outputs is not None and self.structured_outputs != self.guided_decoding:
                raise ValueError("SamplingParams.guided_decoding and structured_outputs are the same "
                                 "setting (old and new name): give one")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias", "must map token ids to biases")
            self.logit_bias = dict(self.logit_bias) or None
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
               f"must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty}")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               f"must be an integer >= 0, got {self.min_tokens!r}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
               "logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        _check(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers")
        for token, bias in (self.logit_bias or {}).items():
            _check(isinstance(token, int) and not isinstance(token, bool) and token >= 0, "logit_bias",
                   f"keys must be token ids (non-negative integers), got {token!r}")
            _check(isinstance(bias, (int, float)) and not isinstance(bias, bool) and -100.0 <= bias <= 100.0,
                   "logit_bias", f"values must be numbers in [-100, 100], got {bias!r} for token {token}")
        _check(len(self.logit_bias or ()) <= MAX_LOGIT_BIAS, "logit_bias",
               f"may bias at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias or ())}")

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {message}")
