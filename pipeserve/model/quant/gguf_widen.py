"""GGUF types without a compact layout here, kept as byte-per-code ``q8`` rows:
IQ4_NL, IQ4_XS, Q3_K and Q2_K.

A weight of each is a scale times a small integer code, plus a minimum for Q2_K,
per group of 16 or 32 weights: Q2_K's codes are 0..3, Q3_K's -4..3 and IQ4's
entries of its 16-value codebook (-127..113). So the ``q8`` layout holds them
exactly, as int8 codes with a float16 scale (and minimum) per group, and every
q8 kernel runs them unchanged, integer activations included. The two-level
scales (a float16 times a 4- or 6-bit integer) are multiplied out and rounded
to float16, as for the K-quants in ``gguf_repack``: a relative change of at most
2^-11 of a scale.

Memory: 8 bits a code plus the scales: 1.9x IQ4_NL's bytes in the file, 2.0x
IQ4_XS, 2.6x Q3_K and 3.8x Q2_K, against 7-12x for float32 (what a 70B IQ4_XS
or Q3_K_M file became before). Their own compact layouts (nibbles with a codebook
lookup, 2- and 3-bit planes) would need kernels of their own.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from pipeserve.model.quant.packed import PackedWeight

T = gguf.GGMLQuantizationType
IQ4_VALUES = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.int8)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte ``offset`` of each block, as float32 [rows, blocks, 1]."""
    return blocks[..., offset:offset + 2].copy().view(np.float16).astype(np.float32)


def _packed(source: str, group: int, codes: np.ndarray, scale: np.ndarray, minv: np.ndarray | None,
            rows: int) -> PackedWeight:
    """codes int8 [rows, blocks, weights]; scale / minv float32 [rows, blocks, groups a block]."""
    def half(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a.reshape(rows, -1).astype(np.float16)))
    return PackedWeight("q8", group, torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, -1))), half(scale),
                        None if minv is None else half(minv), source)


def _nibble_codes(qs: np.ndarray) -> np.ndarray:
    """IQ4 nibbles [..., 16 bytes a run of 32] -> codebook entries int8 [..., 32]: the low
    nibbles are weights 0-15 of the run, the high ones 16-31."""
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)
    return IQ4_VALUES[q]


def _iq4_nl(blocks: np.ndarray, rows: int) -> PackedWeight:
    """Block of 32: d (float16), 16 bytes of nibbles."""
    return _packed("IQ4_NL", 32, _nibble_codes(blocks[..., 2:18]), _f16(blocks, 0), None, rows)


def _iq4_xs(blocks: np.ndarray, rows: int) -> PackedWeight:
    """Block of 256: d (float16), scales_h (uint16: 2 bits a run), scales_l (4 bytes: a
    nibble a run), 128 bytes of nibbles (8 runs of 32); run j's scale is d * (6-bit - 32)."""
    n = blocks.shape[1]
    high = blocks[..., 2:4].copy().view(np.uint16).astype(np.int32)             # [rows, n, 1]
    low = blocks[..., 4:8].astype(np.int32)                                      # [rows, n, 4]
    low = np.stack([low & 15, low >> 4], axis=-1).reshape(rows, n, 8)
    ls = low | (((high >> (2 * np.arange(8))) & 3) << 4)
    scale = _f16(blocks, 0) * (ls - 32).astype(np.float32)                       # [rows, n, 8]
    codes = _nibble_codes(blocks[..., 8:136].reshape(rows, n, 8, 16))           # [rows, n, 8, 32]
    return _packed("IQ4_XS", 32, codes, scale, None, rows)


def _q3_k(blocks: np.ndarray, rows: int) -> PackedWeight:
    """Block of 256: hmask (32 bytes), qs (64 bytes of 2-bit codes), 12 bytes of sixteen
    6-bit scales, d (float16). Weight 128h + 32j + l (h < 2, j < 4, l < 32) is bits 2j of
    qs[32h + l] minus 4 where bit 4h + j of hmask[l] is clear, in group 8h + 2j + l // 16."""
    n = blocks.shape[1]
    hmask, qs, sc = blocks[..., :32], blocks[..., 32:96], blocks[..., 96:108].astype(np.int32)
    low = np.concatenate([sc[..., :8] & 15, sc[..., :8] >> 4], axis=-1)           # scales 0-7, 8-15: low 4 bits
    high = (sc[..., 8:12, None] >> (2 * np.arange(4))) & 3                       # [rows, n, 4 bytes, 4]
    scale = _f16(blocks, 108) * ((low | (high.transpose(0, 1, 3, 2).reshape(rows, n, 16) << 4)) - 32)
    shifts = (2 * np.arange(4)).reshape(1, 1, 1, 4, 1)
    low_bits = (qs.reshape(rows, n, 2, 1, 32) >> shifts) & 3                     # [rows, n, h, j, l]
    hbit = (hmask.reshape(rows, n, 1, 1, 32) >> (4 * np.arange(2).reshape(1, 1, 2, 1, 1) + shifts // 2)) & 1
    codes = low_bits.astype(np.int8) - 4 * (1 - hbit).astype(np.int8)
    return _packed("Q3_K", 16, codes, scale.astype(np.float32), None, rows)


def _q2_k(blocks: np.ndarray, rows: int) -> PackedWeight:
    """Block of 256: 16 bytes of scales (low nibble: scale, high: minimum, a group of 16
    each), qs (64 bytes of 2-bit codes), d and dmin (float16). Weight 128h + 32j + l is bits
    2j of qs[32h + l], in group 8h + 2j + l // 16: d * sc * code - dmin * m."""
    n = blocks.shape[1]
    sc, qs = blocks[..., :16].astype(np.float32), blocks[..., 16:80]
    scale = _f16(blocks, 80) * (sc % 16)
    minv = -_f16(blocks, 82) * np.floor(sc / 16)
    codes = (qs.reshape(rows, n, 2, 1, 32) >> (2 * np.arange(4)).reshape(1, 1, 1, 4, 1)) & 3
    return _packed("Q2_K", 16, codes.astype(np.int8), scale, minv, rows)


WIDENED = {T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs, T.Q3_K: _q3_k, T.Q2_K: _q2_k}
