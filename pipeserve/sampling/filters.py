"""Truncation of a distribution to its likely tokens: min-p, top-k, top-p.

All three work on temperature-scaled logits ``x`` [R, V] and mask removed
tokens with -inf, in place. Order (as vLLM's V1 sampler): min-p on the full
distribution, then top-k, then top-p on what top-k left. A threshold keeps
every token tied with the last kept one, so ties can keep a few extra tokens.
"""

from __future__ import annotations

import math

import torch

# top-p looks for its nucleus among the best 256 tokens, then 4096; only rows
# whose nucleus is larger still (very flat distributions) pay for a full sort.
_TOP_P_CANDIDATES = (256, 4096)


def apply_min_p(x: torch.Tensor, min_p: list[float]) -> None:
    """Keep tokens with prob >= min_p * max prob, i.e. logit >= max + log(min_p)."""
    rows = [i for i, m in enumerate(min_p) if m > 0.0]
    if not rows:
        return
    sub = _rows_of(x, rows)                                               # [R', V]
    log_min = torch.tensor([math.log(min_p[i]) for i in rows], dtype=x.dtype, device=x.device)
    cutoff = sub.amax(dim=-1, keepdim=True) + log_min[:, None]            # [R', 1]
    _mask_below(x, rows, sub, sub < cutoff)


def apply_top_k(x: torch.Tensor, top_k: list[int]) -> None:
    """Keep the ``k`` highest logits of each row (k <= 0: keep all)."""
    vocab = x.shape[1]
    rows = [i for i, k in enumerate(top_k) if 0 < k < vocab]
    if not rows:
        return
    ks = torch.tensor([top_k[i] for i in rows], device=x.device)
    sub = _rows_of(x, rows)                                               # [R', V]
    best = sub.topk(int(ks.max()), dim=-1).values                         # [R', kmax], descending
    kth = best.gather(1, (ks - 1)[:, None])                               # [R', 1]
    _mask_below(x, rows, sub, sub < kth)


def apply_top_p(x: torch.Tensor, top_p: list[float]) -> None:
    """Keep the smallest set of best tokens whose probability reaches ``p``.

    As vLLM: a token is kept while the probability mass strictly above it is
    below ``p``, so the token that crosses ``p`` is kept and at least one
    token always survives."""
    rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if not rows:
        return
    sub = _rows_of(x, rows)                                               # [R', V]
    probs = torch.softmax(sub, dim=-1)
    p = torch.tensor([top_p[i] for i in rows], dtype=probs.dtype, device=x.device)[:, None]
    cutoff = _nucleus_cutoff(probs, p)                                    # [R', 1]
    _mask_below(x, rows, sub, probs < cutoff)


def _nucleus_cutoff(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Probability of the last token kept in each row's nucleus: [R, 1]."""
    cutoff = torch.empty_like(p)
    pending = torch.arange(probs.shape[0], device=probs.device)   # rows not settled yet
    for k in _TOP_P_CANDIDATES + (probs.shape[1],):
        k = min(k, probs.shape[1])
        best = probs[pending].topk(k, dim=-1).values                    # [R', k], descending
        # The nucleus lies among the k best iff they hold at least p.
        found = (best.sum(dim=-1, keepdim=True) >= p[pending]).squeeze(1) | (k == probs.shape[1])
        cutoff[pending[found]] = _cutoff_in_sorted(best[found], p[pending[found]])
        pending = pending[~found]
        if pending.numel() == 0:
            break
    return cutoff


def _cutoff_in_sorted(sorted_desc: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    mass_above = sorted_desc.cumsum(dim=-1) - sorted_desc                 # exclusive prefix sums
    num_kept = (mass_above < p).sum(dim=-1, keepdim=True).clamp_(min=1)   # [R, 1]
    return sorted_desc.gather(1, num_kept - 1)


def _rows_of(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x`` itself when every row is selected (no copy), else a copy of the rows."""
    return x if len(rows) == x.shape[0] else x[rows]


def _mask_below(x: torch.Tensor, rows: list[int], sub: torch.Tensor, drop: torch.Tensor) -> None:
    sub.masked_fill_(drop, float("-inf"))
    if sub is not x:
        x[rows] = sub
