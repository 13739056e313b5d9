"""Inverse-CDF draws: one uniform per row picks a token from its weights.

The draw is two-level so that no float64 copy or full-length cumulative sum
of the [R, V] weights is needed: block sums (float64, accumulated while
reading the weights once) pick a block of ``_BLOCK`` tokens, then a float64
cumulative sum inside that one block picks the token. Summing per block
keeps the float64 resolution of a full cumulative sum, so unlikely tokens
keep their odds; the cost is one read of the weights instead of ~5 passes.

A token of weight 0 (masked) is never the first to exceed a target, so it is
never drawn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_BLOCK = 1024


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the token ``i`` with cdf[i-1] <= u * total < cdf[i]: [R].

    ``weights`` [R, V] are non-negative and unnormalised; ``u`` [R] float64 in [0, 1)."""
    rows, vocab = weights.shape
    if vocab % _BLOCK:
        weights = F.pad(weights, (0, _BLOCK - vocab % _BLOCK))               # zeros: never drawn
    blocks = weights.view(rows, -1, _BLOCK)                                # [R, NB, B]
    block_sums = blocks.sum(dim=-1, dtype=torch.float64)                   # [R, NB]
    block_cdf = block_sums.cumsum(dim=-1)                                  # [R, NB]
    target = u * block_cdf[:, -1]                                          # [R]
    block = _first_exceeding(block_cdf, target, block_sums)               # [R]
    # Mass of the blocks before the chosen one (0 for the first block).
    before = F.pad(block_cdf, (1, 0)).gather(1, block[:, None]).squeeze(1)  # [R]
    inside = blocks[torch.arange(rows, device=weights.device), block]      # [R, B]
    inner_cdf = inside.to(torch.float64).cumsum_(dim=-1)                   # [R, B]
    token = _first_exceeding(inner_cdf, target - before, inside)
    return block * _BLOCK + token


def _first_exceeding(cdf: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """First index with cdf > target per row: [R]. Rounding can push the target
    to (or past) the row's total; then the last index of positive weight is
    the right answer."""
    idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)   # [R]
    over = idx >= cdf.shape[1]
    if bool(over.any()):
        positions = torch.arange(cdf.shape[1], device=cdf.device)
        idx[over] = ((weights[over] > 0) * positions).argmax(dim=-1)
    return idx
