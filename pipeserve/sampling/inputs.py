"""What the sampler needs of one sequence at one step: plain data, no torch.

The engine fills it (``engine/step_builder.py``) from the request's
``SamplingParams`` and the sequence; it travels to the last stage inside the
step (``worker/step.py``, ``SeqStep.sampling``), where ``sampler.py`` reads it.
It lives here, with its reader, so that ``sampling`` needs nothing from
``worker``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SeqSampling:
    """Sampling inputs of one sequence that produces a token this step."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None                 # per-request seed (None = engine RNG)
    step_index: int                  # number of tokens generated so far (seeded RNG offset)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Only filled when a penalty is active (they need the token history).
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    # Token ids masked out (set to -inf) this step: EOS/stop ids while < min_tokens.
    banned_token_ids: list[int] = field(default_factory=list)
    num_logprobs: int | None = None  # top-N logprobs to return (None = none)
    # Grammar mask (structured outputs): ceil(vocab/32) packed little-endian int32 words,
    # bit t % 32 of word t // 32 set when token t may be sampled. None = unconstrained.
    allowed_token_mask: bytes | None = None
    # (token id, bias) pairs added to the logits first (OpenAI's logit_bias). None = none.
    logit_bias: list[tuple[int, float]] | None = None
