"""GGUF types kept in layouts other than their own blocks: IQ4_NL and IQ4_XS as ``i4``
(their nibbles as they are), Q3_K as ``q3`` and Q2_K as ``q2`` (their code bytes and integer
sub-scales as they are) where the kernels take those layouts, else as byte-per-code ``q8`` rows.

IQ4's codes are 4-bit indices into a 16-value signed codebook, in q4's nibble order:
``i4`` (packed.py) keeps the file's nibbles and a float16 scale per 32 weights (IQ4_NL:
the block's d; IQ4_XS: d times its 6-bit sub-scale less 32), 4.5 bits a weight, 1.0x
IQ4_NL's file bytes and 1.06x IQ4_XS's. Q3_K's codes (-4..3) are 2-bit pairs and a bit of
its hmask, Q2_K's (0..3) the pairs alone: ``q3`` / ``q2`` keep those bytes, the sub-scales
per 16 weights as integers (Q2_K: its scale bytes as they are, a 4-bit scale and minimum each;
Q3_K: its 6-bit scales, packed in 12 bytes, unpacked to an int8 each, less 32) and the float16
d (Q2_K: and dmin, negated) per 256: 1.036x Q3_K's file bytes (114 a block against 110) and
1.00x Q2_K's (84). The kernels of every build take all three (``keeps``; AVX-512 ones through
the AVX2 expansions since the fourteenth session); a build that did not would be given ``q8``:

A weight of each is a scale times a small integer code, plus a minimum for Q2_K,
per group of 16 or 32 weights: Q2_K's codes are 0..3, Q3_K's -4..3 and IQ4's
entries of its 16-value codebook (-127..113). So the ``q8`` layout holds them
exactly, as int8 codes with a float16 scale (and minimum) per group, and every
q8 kernel runs them unchanged, integer activations included: 8 bits a code plus the
scales, 1.9x IQ4_NL's bytes in the file, 2.0x IQ4_XS, 2.6x Q3_K and 3.8x Q2_K.

Widened, and in IQ4_XS's i4, the two-level scales (a float16 times a 4- or 6-bit integer) are
multiplied out and rounded to float16, as for the K-quants in ``gguf_repack``: a relative change
of at most 2^-11 of a scale. q2 / q3 keep them apart: exact.

``kernels/gguf_widen.c`` does it in one pass on the stage's threads; the numpy
functions below are its reference and the fallback without a compiler (they give the
compact layouts, widened by ``to_q8``).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import gguf
import numpy as np
import torch

from pipeserve.kernels.build import kernel_cache
from pipeserve.model.quant.cpu_kernels import cpu_kernels
from pipeserve.model.quant.packed import PackedWeight, to_q8

log = logging.getLogger(__name__)
T = gguf.GGMLQuantizationType
IQ4 = (T.IQ4_NL, T.IQ4_XS)
U8 = np.uint8
SHIFT2 = (2 * np.arange(4, dtype=U8))          # the four 2-bit codes of a byte
SHIFT4 = np.array([0, 4], dtype=U8)             # its two nibbles


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte ``offset`` of each block, as float32 [rows, blocks, 1]."""
    return _f16_bytes(blocks, offset).astype(np.float32)


def _i4(source: str, nibbles: np.ndarray, scale: np.ndarray, rows: int) -> PackedWeight:
    """nibbles uint8 [rows, ..., 16 bytes a run of 32] (q4's order, as IQ4 stores them);
    scale float32 [rows, ..., a run]."""
    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a.reshape(rows, -1)))
    return PackedWeight("i4", 32, t(nibbles), t(scale.astype(np.float16)), None, source)


def _iq4_nl(blocks: np.ndarray, rows: int) -> PackedWeight:
    """Block of 32: d (float16), 16 bytes of nibbles."""
    return _i4("IQ4_NL", blocks[..., 2:18], _f16(blocks, 0), rows)


def _iq4_xs(blocks: np.ndarray, rows: int) -> PackedWeight:
    """Block of 256: d (float16), scales_h (uint16: 2 bits a run), scales_l (4 bytes: a
    nibble a run), 128 bytes of nibbles (8 runs of 32); run j's scale is d * (6-bit - 32)."""
    n = blocks.shape[1]
    high = blocks[..., 2:4].copy().view(np.uint16)                               # [rows, n, 1]
    low = ((blocks[..., 4:8, None] >> SHIFT4) & U8(15)).reshape(rows, n, 8)
    high = ((high >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(U8)
    ls = (low | (high << U8(4))).astype(np.float32)
    scale = _f16(blocks, 0) * (ls - 32)                                          # [rows, n, 8]
    return _i4("IQ4_XS", blocks[..., 8:136], scale, rows)


def _q3_k(blocks: np.ndarray, rows: int) -> PackedWeight:
    """Block of 256: hmask (32 bytes), qs (64 bytes of 2-bit codes), 12 bytes of sixteen
    6-bit scales, d (float16). Weight 128h + 32j + l (h < 2, j < 4, l < 32) is bits 2j of
    qs[32h + l] minus 4 where bit 4h + j of hmask[l] is clear, in group 8h + 2j + l // 16:
    q3's ``qs`` as they are, its ``qh`` the hmask and the scales less 32 as int8, ``zero`` 4."""
    n = blocks.shape[1]
    hmask, qs, sc = blocks[..., :32], blocks[..., 32:96], blocks[..., 96:108]
    low = ((sc[..., None, :8] >> SHIFT4[:, None]) & U8(15)).reshape(rows, n, 16)  # scales 0-7, 8-15: low 4 bits
    high = ((sc[..., None, 8:12] >> SHIFT2[:, None]) & U8(3)).reshape(rows, n, 16)   # scale 4i + k: byte 8 + k >> 2i
    sub = (low | (high << U8(4))) - U8(32)                                       # int8's bytes: -32..31
    return PackedWeight("q3", 256, _rows(qs, rows), _rows(_f16_bytes(blocks, 108), rows), None, "Q3_K",
                        _rows(np.concatenate([hmask, sub], axis=-1), rows), 4)


def _q2_k(blocks: np.ndarray, rows: int) -> PackedWeight:
    """Block of 256: 16 bytes of scales (low nibble: scale, high: minimum, a group of 16
    each), qs (64 bytes of 2-bit codes), d and dmin (float16). Weight 128h + 32j + l is bits
    2j of qs[32h + l], in group 8h + 2j + l // 16: d * sc * code - dmin * m. q2's bytes as they
    are, dmin negated (its sign bit: exact)."""
    sc, qs = blocks[..., :16], blocks[..., 16:80]
    return PackedWeight("q2", 256, _rows(qs, rows), _rows(_f16_bytes(blocks, 80), rows),
                        _rows(-_f16_bytes(blocks, 82), rows), "Q2_K", _rows(sc, rows))


def _f16_bytes(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte ``offset`` of each block, as it is: float16 [rows, blocks, 1]."""
    return blocks[..., offset:offset + 2].copy().view(np.float16)


def _rows(a: np.ndarray, rows: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a.reshape(rows, -1)))


# type -> (numpy function, C function, the compact layout and per 256 weights in it: code bytes,
#          qh bytes, float16 arrays (scale, minimum) and entries in each; weights per scale widened)
_TYPES = {T.IQ4_NL: (_iq4_nl, "pipeserve_widen_iq4_nl", "i4", 128, 0, 1, 8, 32),
          T.IQ4_XS: (_iq4_xs, "pipeserve_widen_iq4_xs", "i4", 128, 0, 1, 8, 32),
          T.Q3_K: (_q3_k, "pipeserve_widen_q3_k", "q3", 64, 48, 1, 1, 16),
          T.Q2_K: (_q2_k, "pipeserve_widen_q2_k", "q2", 64, 16, 2, 1, 16)}


@kernel_cache
def _c_widen() -> ctypes.CDLL | None:
    """kernels/gguf_widen.c, or None: the numpy path, with the reason logged once."""
    from pipeserve.kernels.build import KernelBuildError, load_kernel
    try:
        return load_kernel("gguf_widen")
    except KernelBuildError as exc:
        log.warning("GGUF IQ4/Q3_K/Q2_K widening in numpy (slower loads): %s", str(exc).splitlines()[0])
        return None


def keeps(kind: str) -> bool:
    """Whether tensors of the compact layout ``kind`` (i4, q3, q2) stay in it: where the CPU
    kernels take the layout (every build's do), or there are none (PyTorch's ``dequantize``
    takes every layout). Kernels that answered no would be given IQ4, Q3_K and Q2_K widened
    to q8 (logged once)."""
    kernels = cpu_kernels()
    if kernels is None or kernels.takes(kind):
        return True
    _log_widened(kernels.isa)
    return False


@functools.lru_cache(maxsize=None)
def _log_widened(isa: str) -> None:
    log.info("IQ4_NL/IQ4_XS, Q3_K and Q2_K weights widened to a byte per code (2-4x the file's bytes): the %s "
             "quantized kernels take no 4-bit codebook (i4) or 2/3-bit (q2/q3) layout", isa)


def _widen(ttype: T, blocks: np.ndarray, rows: int) -> PackedWeight:
    """IQ4 as i4, Q3_K as q3, Q2_K as q2 where the kernels take them (``keeps``), else as q8: in
    C where it builds, else numpy."""
    numpy_path, name, kind, code_bytes, high_bytes, arrays, scales, wide_group = _TYPES[ttype]
    compact = keeps(kind)
    lib = _c_widen()
    if lib is None:
        w = numpy_path(blocks, rows)
        return w if compact else to_q8(w)
    weights = gguf.GGML_QUANT_SIZES[ttype][0] * blocks.shape[1]      # a row's
    if compact:
        codes = torch.empty(rows, weights * code_bytes // 256, dtype=torch.uint8)
        qh = torch.empty(rows, weights * high_bytes // 256, dtype=torch.uint8) if high_bytes else None
        group = 256 // scales
    else:
        codes, qh, group = torch.empty(rows, weights, dtype=torch.int8), None, wide_group
    halves = [torch.empty(rows, weights // group, dtype=torch.float16) for _ in range(arrays)]
    data = np.ascontiguousarray(blocks)                                # held: the C call reads it
    p = ctypes.c_void_p
    high = (p(None if qh is None else qh.data_ptr()),) if high_bytes else ()
    getattr(lib, name)(p(data.ctypes.data), ctypes.c_int64(rows * blocks.shape[1]), p(codes.data_ptr()), *high,
                       *(p(h.data_ptr()) for h in halves), ctypes.c_int(compact), ctypes.c_int(torch.get_num_threads()))
    return PackedWeight(kind if compact else "q8", group, codes, halves[0], halves[1] if arrays == 2 else None,
                        ttype.name, qh, 4 if compact and ttype == T.Q3_K else 0)


WIDENED = {ttype: functools.partial(_widen, ttype) for ttype in _TYPES}
