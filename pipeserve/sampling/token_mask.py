"""Grammar masks on the last stage: tokens whose bit is clear get -inf before sampling."""

from __future__ import annotations

import torch

# Bit b of a word: 1 << b, for b in 0..31 (int32 words; bit 31 is the sign bit).
_BITS = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64), torch.arange(32)).to(torch.int32)


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``words`` [..., ceil(V/32)] int32 -> allowed [..., V] bool (bit t%32 of word t//32)."""
    bits = (words[..., :, None] & _BITS.to(words.device)) != 0      # [..., W, 32]
    return bits.flatten(-2)[..., :vocab_size]


def apply_token_masks(logits: torch.Tensor, masks: list[torch.Tensor | None]) -> None:
    """In place: row i of ``logits`` [S, V] keeps only the tokens ``masks[i]`` allows.
    Rows without a mask are not touched."""
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return
    words = torch.stack([masks[i] for i in rows]).to(logits.device)  # [R, W]
    allowed = unpack_bitmask(words, logits.shape[1])                 # [R, V]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
