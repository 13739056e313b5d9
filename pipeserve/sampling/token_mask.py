"""Grammar masks on the last stage: tokens whose bit is clear get -inf before sampling."""

from __future__ import annotations

import torch

# Bit b of a word: 1 << b, for b in 0..31 (int32 words; bit 31 is the sign bit).
_BITS = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64), torch.arange(32)).to(torch.int32)


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``words`` [..., ceil(V/32)] int32 -> allowed [..., V] bool (bit t%32 of word t//32)."""
    bits = (words[..., :, None] & _BITS.to(words.device)) != 0      # [..., W, 32]
    return bits.flatten(-2)[..., :vocab_size]


def apply_token_masks(logits: torch.Tensor, masks: list[bytes | None]) -> None:
    """In place: row i of ``logits`` [S, V] keeps only the tokens ``masks[i]`` allows
    (packed little-endian int32 words, as ``SeqSampling.allowed_token_mask``).
    Rows without a mask are not touched."""
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return
    width = (logits.shape[1] + 31) // 32
    if any(len(masks[i]) != 4 * width for i in rows):
        raise ValueError(f"a token mask must have {4 * width} bytes for a vocabulary of {logits.shape[1]}")
    packed = b"".join(masks[i] for i in rows)
    words = torch.frombuffer(bytearray(packed), dtype=torch.int32).view(len(rows), width).to(logits.device)
    allowed = unpack_bitmask(words, logits.shape[1])                 # [R, V]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
