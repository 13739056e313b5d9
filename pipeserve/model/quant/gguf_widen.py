"""GGUF types kept in layouts other than their own blocks: IQ4_NL and IQ4_XS as ``i4``
(their nibbles as they are) where the kernels take it, else, with Q3_K and Q2_K, as
byte-per-code ``q8`` rows.

IQ4's codes are 4-bit indices into a 16-value signed codebook, in q4's nibble order:
``i4`` (packed.py) keeps the file's nibbles and a float16 scale per 32 weights (IQ4_NL:
the block's d; IQ4_XS: d times its 6-bit sub-scale less 32), 4.5 bits a weight, 1.0x
IQ4_NL's file bytes and 1.06x IQ4_XS's. The AVX2 and portable kernels take it
(``keeps_i4``); AVX-512 builds have no i4 kernels (their VNNI and many-row paths would
need their own expansion), so there IQ4 is widened to ``q8`` as below.

A weight of each is a scale times a small integer code, plus a minimum for Q2_K,
per group of 16 or 32 weights: Q2_K's codes are 0..3, Q3_K's -4..3 and IQ4's
entries of its 16-value codebook (-127..113). So the ``q8`` layout holds them
exactly, as int8 codes with a float16 scale (and minimum) per group, and every
q8 kernel runs them unchanged, integer activations included. The two-level
scales (a float16 times a 4- or 6-bit integer) are multiplied out and rounded
to float16, as for the K-quants in ``gguf_repack``: a relative change of at most
2^-11 of a scale.

Memory: 8 bits a code plus the scales: 1.9x IQ4_NL's bytes in the file, 2.0x
IQ4_XS (widened), 2.6x Q3_K and 3.8x Q2_K, against 7-12x for float32 (what a 70B IQ4_XS
or Q3_K_M file became before). Q3_K's and Q2_K's own compact layouts (2- and 3-bit
planes) would need kernels of their own.

``kernels/gguf_widen.c`` does it in one pass on the stage's threads; the numpy
functions below are its reference and the fallback without a compiler (IQ4's give
``i4``, widened by ``to_q8``).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import gguf
import numpy as np
import torch

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
    return blocks[..., offset:offset + 2].copy().view(np.float16).astype(np.float32)


def _packed(source: str, group: int, codes: np.ndarray, scale: np.ndarray, minv: np.ndarray | None,
            rows: int) -> PackedWeight:
    """codes int8 [rows, blocks, weights]; scale / minv float32 [rows, blocks, groups a block]."""
    def half(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a.reshape(rows, -1).astype(np.float16)))
    return PackedWeight("q8", group, torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, -1))), half(scale),
                        None if minv is None else half(minv), source)


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
    qs[32h + l] minus 4 where bit 4h + j of hmask[l] is clear, in group 8h + 2j + l // 16."""
    n = blocks.shape[1]
    hmask, qs, sc = blocks[..., :32], blocks[..., 32:96], blocks[..., 96:108]
    low = ((sc[..., None, :8] >> SHIFT4[:, None]) & U8(15)).reshape(rows, n, 16)  # scales 0-7, 8-15: low 4 bits
    high = ((sc[..., None, 8:12] >> SHIFT2[:, None]) & U8(3)).reshape(rows, n, 16)   # scale 4i + k: byte 8 + k >> 2i
    scale = _f16(blocks, 108) * ((low | (high << U8(4))).astype(np.float32) - 32)
    codes = ((qs.reshape(rows, n, 2, 1, 32) >> SHIFT2[:, None]) & U8(3)).view(np.int8)   # [rows, n, h, j, l]
    bit = (hmask[..., None, :] >> np.arange(8, dtype=U8)[:, None]) & U8(1)         # [rows, n, 4h + j, l]
    codes = codes - ((U8(1) - bit) << U8(2)).view(np.int8).reshape(rows, n, 2, 4, 32)
    return _packed("Q3_K", 16, codes, scale, None, rows)


def _q2_k(blocks: np.ndarray, rows: int) -> PackedWeight:
    """Block of 256: 16 bytes of scales (low nibble: scale, high: minimum, a group of 16
    each), qs (64 bytes of 2-bit codes), d and dmin (float16). Weight 128h + 32j + l is bits
    2j of qs[32h + l], in group 8h + 2j + l // 16: d * sc * code - dmin * m."""
    n = blocks.shape[1]
    sc, qs = blocks[..., :16], blocks[..., 16:80]
    scale = _f16(blocks, 80) * (sc & U8(15)).astype(np.float32)
    minv = -_f16(blocks, 82) * (sc >> U8(4)).astype(np.float32)
    codes = ((qs.reshape(rows, n, 2, 1, 32) >> SHIFT2[:, None]) & U8(3)).view(np.int8)
    return _packed("Q2_K", 16, codes, scale, minv, rows)


# type -> (numpy function, C function, weights a group; float16 arrays a group: scale (+ minimum))
_TYPES = {T.IQ4_NL: (_iq4_nl, "pipeserve_widen_iq4_nl", 32, 1), T.IQ4_XS: (_iq4_xs, "pipeserve_widen_iq4_xs", 32, 1),
          T.Q3_K: (_q3_k, "pipeserve_widen_q3_k", 16, 1), T.Q2_K: (_q2_k, "pipeserve_widen_q2_k", 16, 2)}


@functools.lru_cache(maxsize=1)
def _c_widen() -> ctypes.CDLL | None:
    """kernels/gguf_widen.c, or None: the numpy path, with the reason logged once."""
    from pipeserve.kernels.build import KernelBuildError, load_kernel
    try:
        return load_kernel("gguf_widen")
    except KernelBuildError as exc:
        log.warning("GGUF IQ4/Q3_K/Q2_K widening in numpy (slower loads): %s", str(exc).splitlines()[0])
        return None


def keeps_i4() -> bool:
    """Whether IQ4 tensors stay ``i4``: where the CPU kernels take the layout (AVX2 and
    portable builds), or there are none (PyTorch's ``dequantize`` takes every layout).
    AVX-512 builds have no i4 kernels: IQ4 is widened to q8 there (logged once)."""
    kernels = cpu_kernels()
    if kernels is None or kernels.takes("i4"):
        return True
    _log_widened(kernels.isa)
    return False


@functools.lru_cache(maxsize=None)
def _log_widened(isa: str) -> None:
    log.info("IQ4_NL/IQ4_XS weights widened to a byte per code (about 2x the file's bytes): the %s "
             "quantized kernels take no 4-bit codebook (i4) layout", isa)


def _widen(ttype: T, blocks: np.ndarray, rows: int) -> PackedWeight:
    """IQ4 as i4 (``keeps_i4``) or q8, Q3_K / Q2_K as q8: in C where it builds, else numpy."""
    numpy_path, name, group, arrays = _TYPES[ttype]
    nibbles = ttype in IQ4 and keeps_i4()
    lib = _c_widen()
    if lib is None:
        w = numpy_path(blocks, rows)
        return to_q8(w) if w.kind == "i4" and not nibbles else w
    weights = gguf.GGML_QUANT_SIZES[ttype][0] * blocks.shape[1]      # a row's
    codes = torch.empty(rows, weights // 2 if nibbles else weights, dtype=torch.uint8 if nibbles else torch.int8)
    halves = [torch.empty(rows, weights // group, dtype=torch.float16) for _ in range(arrays)]
    data = np.ascontiguousarray(blocks)                                # held: the C call reads it
    p = ctypes.c_void_p
    flag = (ctypes.c_int(nibbles),) if ttype in IQ4 else ()
    getattr(lib, name)(p(data.ctypes.data), ctypes.c_int64(rows * blocks.shape[1]), p(codes.data_ptr()),
                       *(p(h.data_ptr()) for h in halves), *flag, ctypes.c_int(torch.get_num_threads()))
    return PackedWeight("i4" if nibbles else "q8", group, codes, halves[0], halves[1] if arrays == 2 else None,
                        ttype.name)


WIDENED = {ttype: functools.partial(_widen, ttype) for ttype in _TYPES}
