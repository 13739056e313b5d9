"""The sampler: turns the last stage's logits into one token per sequence.

Per row, in order (as vLLM): the logit bias (OpenAI's ``logit_bias``),
repetition/frequency/presence penalties, banned ids (-inf), then either
argmax (greedy: temperature 0 or top_k 1) or temperature, min-p, top-k,
top-p and a random draw.

The random draw is inverse-CDF sampling (``draw.py``): one uniform ``u`` per
row and the first token whose cumulative probability exceeds ``u``. This is
the distribution ``torch.multinomial`` samples, but it needs one random number
per row instead of one per vocabulary entry: the exponential race (which is
also what ``torch.multinomial`` does on CPU) draws 256 x 49152 exponentials,
~250 ms on our 2-core CPU, against ~1 ms of uniforms plus one read of the
weights here. Because ``u`` alone carries the randomness, a seeded row is
reproducible from (seed, step_index) alone; see ``seeding.py``.

Greedy means temperature 0 or top_k 1; a temperature below 1e-5 also counts
as greedy (dividing by it would overflow the logits), as in vLLM.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from pipeserve.kernels.build import KernelBuildError, kernel_cache, load_kernel
from pipeserve.sampling.draw import inverse_cdf
from pipeserve.sampling.filters import apply_min_p, apply_top_k, apply_top_p
from pipeserve.sampling.inputs import SeqSampling
from pipeserve.sampling.penalties import apply_bans, apply_logit_bias, apply_penalties, has_penalty
from pipeserve.sampling.seeding import draw_uniforms
from pipeserve.sampling.token_mask import apply_token_masks

# (sampled token id, its logprob, top-N (token id, logprob) best first)
SampleResult = tuple[int, float, list[tuple[int, float]]]


# Temperatures this small would overflow the scaled logits.
_MIN_TEMPERATURE = 1e-5


def is_greedy(p: SeqSampling) -> bool:
    return p.temperature < _MIN_TEMPERATURE or p.top_k == 1


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the first maximum: [S] int64, as ``logits.argmax(dim=-1)``.

    On CPU, NumPy's argmax: torch's takes ~170 us for one 49152-token float32 row on one
    thread (the largest Python-side cost of a greedy decode token), NumPy's ~8 us (measured).
    Both return the first of equal maxima, and the first NaN when there is one. bfloat16 CPU
    rows (a bfloat16 model's logits as the head gives them) go to elementwise.c's argmax, which
    answers the same without their float32 copy (two torch ops fewer a greedy token)."""
    if logits.device.type == "cpu" and logits.dtype == torch.bfloat16 and logits.dim() == 2:
        fn = _argmax_bf16()
        if fn is not None:
            logits = logits.contiguous()
            out = torch.empty(logits.shape[0], dtype=torch.int64)
            fn(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
            return out
        logits = logits.float()
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.argmax(dim=-1)
    return torch.from_numpy(logits.numpy().argmax(axis=-1).astype(np.int64, copy=False))


@kernel_cache
def _argmax_bf16():
    """elementwise.c's bfloat16 argmax, or None where it does not build (the rows are then
    widened and NumPy takes them; cpu_ops logs the failed build)."""
    try:
        fn = load_kernel("elementwise").pipeserve_argmax_bf16
    except KernelBuildError:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    fn.restype = None
    return fn


class Sampler:
    """Batched sampling with per-row parameters.

    Holds one engine-wide generator for rows without a seed; seeded rows use no
    state of the sampler at all."""

    def __init__(self, seed: int | None = None) -> None:
        self._gen = torch.Generator()
        if seed is None:
            self._gen.seed()
        else:
            self._gen.manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: list[SeqSampling]) -> list[SampleResult]:
        """Sample one token per row of ``logits`` [S, V] (float32, or the model's bfloat16).

        Logprobs are those of the model's RAW distribution, log_softmax of the
        logits before penalties, bans, temperature and truncation (vLLM's
        default), so they describe the model, not the sampling settings.
        ``params[i].num_logprobs`` = N asks for the N best tokens of that raw
        distribution; N = 0 returns only the sampled token's logprob. Rows with
        ``num_logprobs`` None skip the normalisation (a pass over the vocab) and
        report a logprob of 0.0, which the engine does not show.
        """
        if logits.dim() != 2 or logits.shape[0] != len(params):
            raise ValueError(f"Sampler.sample expects logits [S, V] with S = len(params) = "
                             f"{len(params)}, got shape {tuple(logits.shape)}")
        if all(p.num_logprobs is None and is_greedy(p) and not has_penalty(p) and not p.banned_token_ids
               and p.allowed_token_mask is None and not p.logit_bias for p in params):
            # Plain greedy (single-stream decode's case): the argmax alone, no logprob work.
            return [(t, 0.0, []) for t in argmax(logits).tolist()]
        logits = logits.float()
        log_norm = _log_norm(logits, params)                              # [S]
        adjusted = self._adjusted_logits(logits, params)                  # [S, V]
        tokens = self._choose_tokens(adjusted, params)                    # [S]
        return self._results(logits, log_norm, tokens, params)

    # -- steps -------------------------------------------------------------
    @staticmethod
    def _adjusted_logits(logits: torch.Tensor, params: list[SeqSampling]) -> torch.Tensor:
        """Logits after the logit bias, penalties, bans and grammar masks.

        The raw logits stay untouched where they are still read (logprobs). A
        grammar mask alone is applied in place on its rows: it leaves the allowed
        tokens' values as they were, the log-normaliser is already taken, and
        only the chosen (allowed) token's raw logit is read again, unless the row
        wants top-N logprobs. So a constrained row costs its batch mates no copy.
        """
        if not any(has_penalty(p) or p.banned_token_ids or p.logit_bias or p.allowed_token_mask is not None
                   for p in params):
            return logits
        if not any(has_penalty(p) or p.banned_token_ids or p.logit_bias
                   or (p.allowed_token_mask is not None and p.num_logprobs) for p in params):
            apply_token_masks(logits, [p.allowed_token_mask for p in params])
            return logits
        adjusted = logits.clone()
        apply_logit_bias(adjusted, params)
        apply_penalties(adjusted, params)
        apply_bans(adjusted, params)
        apply_token_masks(adjusted, [p.allowed_token_mask for p in params])
        return adjusted

    def _choose_tokens(self, adjusted: torch.Tensor, params: list[SeqSampling]) -> torch.Tensor:
        greedy = [i for i, p in enumerate(params) if is_greedy(p)]
        random = [i for i, p in enumerate(params) if not is_greedy(p)]
        if not random:
            return argmax(adjusted)
        if not greedy:
            return self._sample_random(adjusted, params)
        tokens = torch.empty(len(params), dtype=torch.long, device=adjusted.device)
        tokens[greedy] = argmax(adjusted[greedy])
        tokens[random] = self._sample_random(adjusted[random], [params[i] for i in random])
        return tokens

    def _sample_random(self, adjusted: torch.Tensor, params: list[SeqSampling]) -> torch.Tensor:
        """Draw one token per row of ``adjusted`` [R, V] (left unmodified)."""
        temps = torch.tensor([p.temperature for p in params], dtype=adjusted.dtype,
                             device=adjusted.device)
        x = adjusted / temps[:, None]                                     # [R, V], a new tensor
        apply_min_p(x, [p.min_p for p in params])
        apply_top_k(x, [p.top_k for p in params])
        apply_top_p(x, [p.top_p for p in params])
        u = draw_uniforms([(p.seed, p.step_index) for p in params], self._gen, x.device)
        weights = x.sub_(x.amax(dim=-1, keepdim=True)).exp_()             # [R, V], unnormalised
        return inverse_cdf(weights, u)

    @staticmethod
    def _results(logits: torch.Tensor, log_norm: torch.Tensor, tokens: torch.Tensor,
                 params: list[SeqSampling]) -> list[SampleResult]:
        chosen = logits.gather(1, tokens[:, None]).squeeze(1)            # [S]
        wanted = torch.tensor([p.num_logprobs is not None for p in params], device=logits.device)
        chosen = torch.where(wanted, chosen - log_norm, torch.zeros_like(chosen)).tolist()
        top = _top_logprobs(logits, log_norm, params)
        return [(t, lp, top.get(i, [])) for i, (t, lp) in enumerate(zip(tokens.tolist(), chosen))]


def _log_norm(logits: torch.Tensor, params: list[SeqSampling]) -> torch.Tensor:
    """logsumexp over the vocab for the rows that want logprobs; 0 for the others."""
    rows = [i for i, p in enumerate(params) if p.num_logprobs is not None]
    if len(rows) == len(params):
        return torch.logsumexp(logits, dim=-1)
    norm = torch.zeros(logits.shape[0], dtype=logits.dtype, device=logits.device)
    if rows:
        norm[rows] = torch.logsumexp(logits[rows], dim=-1)
    return norm


def _top_logprobs(logits: torch.Tensor, log_norm: torch.Tensor,
                  params: list[SeqSampling]) -> dict[int, list[tuple[int, float]]]:
    """Row -> its N best (token id, raw logprob), best first, for rows with N > 0."""
    rows = [i for i, p in enumerate(params) if p.num_logprobs]
    if not rows:
        return {}
    n_max = max(params[i].num_logprobs or 0 for i in rows)
    values, ids = logits[rows].topk(min(n_max, logits.shape[1]), dim=-1)   # [R, n_max]
    values = values - log_norm[rows][:, None]
    out: dict[int, list[tuple[int, float]]] = {}
    for r, (vs, ts) in zip(rows, zip(values.tolist(), ids.tolist())):
        n = params[r].num_logprobs or 0
        out[r] = list(zip(ts[:n], vs[:n]))
    return out
