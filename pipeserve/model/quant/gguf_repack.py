"""GGUF block-quantized tensors -> ``PackedWeight`` without expanding them to floats.

Q4_0/Q4_1 keep their bytes (the q4 layout is their block order; Q4_0's offset
of 8 becomes ``zero``, so no minimum is stored), Q5_0/Q5_1
keep theirs as q5 (nibbles and the 32 high bits of a block are that layout;
Q5_0's offset of 16 becomes ``zero``), Q8_0 keeps its int8 codes; the scales
move into their own float16 array. The K-quants are re-laid out once at load:

- Q4_K -> q4 with its two-level scales as the file holds them (packed.py: d and -dmin per
  256 weights, the 6-bit sub-scales and sub-minimums a byte each in ``qh``; 4.625 bits per
  weight, file 4.5);
- Q5_K -> q5 with its two-level scales held as Q4_K's (packed.py: d and -dmin per 256, the
  sub-scales and sub-minimums a byte each before a row's high-bit planes in ``qh``; 5.625 bits per
  weight, file 5.5);
- Q6_K -> q6 with its code bytes and two-level scales as they are (packed.py: d per 256 weights,
  the int8 sub-scales per 16 before a row's high bits in ``qh``) and ``zero`` 32: 6.5625 bits per
  weight, the file's.
No K-quant's scales are multiplied out here: the kernels make d * sub in float32, exact, as ggml
dequantizes them.
"""

from __future__ import annotations

import ctypes
import logging

import gguf
import numpy as np
import torch

from pipeserve.kernels.build import kernel_cache
from pipeserve.model.quant.gguf_widen import WIDENED
from pipeserve.model.quant.packed import K4_HIGH, K6_SUB, PackedWeight, pack_nibbles, pack_planes

log = logging.getLogger(__name__)
T = gguf.GGMLQuantizationType
# The last four are re-laid out by gguf_widen.py: IQ4 as i4 where the kernels take it, else q8 rows.
KEPT_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, *WIDENED)


def repack(ttype: T, raw: np.ndarray) -> PackedWeight:
    """raw: uint8 [rows, row_bytes] as the file stores it -> the kept layout."""
    if ttype not in _REPACK:
        raise ValueError(f"GGUF type {ttype.name} is not kept quantized (kept: "
                         f"{', '.join(t.name for t in KEPT_TYPES)})")
    block_size, type_size = gguf.GGML_QUANT_SIZES[ttype]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, type_size)   # [rows, blocks, bytes]
    return _REPACK[ttype](blocks, rows)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte ``offset`` of every block: [rows, blocks]."""
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0]


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _q4_0(blocks: np.ndarray, rows: int) -> PackedWeight:
    return PackedWeight("q4", 32, _t(blocks[..., 2:18].reshape(rows, -1)), _t(_f16(blocks, 0)), None, "Q4_0",
                        zero=8)


def _q4_1(blocks: np.ndarray, rows: int) -> PackedWeight:
    return PackedWeight("q4", 32, _t(blocks[..., 4:20].reshape(rows, -1)), _t(_f16(blocks, 0)),
                        _t(_f16(blocks, 2)), "Q4_1")


def _q8_0(blocks: np.ndarray, rows: int) -> PackedWeight:
    qs = blocks[..., 2:34].reshape(rows, -1).view(np.int8)
    return PackedWeight("q8", 32, _t(qs), _t(_f16(blocks, 0)), None, "Q8_0")


def _q5_0(blocks: np.ndarray, rows: int) -> PackedWeight:
    return PackedWeight("q5", 32, _t(blocks[..., 6:22].reshape(rows, -1)), _t(_f16(blocks, 0)), None, "Q5_0",
                        _t(blocks[..., 2:6].reshape(rows, -1)), 16)


def _q5_1(blocks: np.ndarray, rows: int) -> PackedWeight:
    return PackedWeight("q5", 32, _t(blocks[..., 8:24].reshape(rows, -1)), _t(_f16(blocks, 0)), _t(_f16(blocks, 2)),
                        "Q5_1", _t(blocks[..., 4:8].reshape(rows, -1)))


@kernel_cache
def _c_repack() -> ctypes.CDLL | None:
    """kernels/gguf_repack.c (the K-quants in one pass, bit for bit the numpy path below), or
    None: the numpy path, with the reason logged once."""
    from pipeserve.kernels.build import KernelBuildError, load_kernel
    try:
        lib = load_kernel("gguf_repack")
    except KernelBuildError as exc:
        log.warning("GGUF K-quant repack in numpy (slower loads): %s", str(exc).splitlines()[0])
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.pipeserve_repack_q4_k.argtypes = [p, i64, p, p, p, p, ctypes.c_int]
    lib.pipeserve_repack_q5_k.argtypes = [p, i64, p, p, p, p, i64, ctypes.c_int]
    lib.pipeserve_repack_q6_k.argtypes = [p, i64, p, p, p, i64, ctypes.c_int]
    return lib


def _c_k_quant(kind: str, blocks: np.ndarray, rows: int) -> PackedWeight | None:
    """The K-quant ``kind`` repacked by the C kernel on the stage's threads, or None where it
    is not available."""
    lib = _c_repack()
    if lib is None:
        return None
    per_row = blocks.shape[1]                                    # blocks of 256 weights a row
    n = rows * per_row
    qs = torch.empty(rows, per_row * 128, dtype=torch.uint8)
    scale = torch.empty(rows, per_row, dtype=torch.float16)   # d per 256 (each keeps its two levels)
    data = np.ascontiguousarray(blocks)                          # held: the C call reads it
    src, threads = data.ctypes.data, torch.get_num_threads()
    if kind == "Q6_K":
        qh = torch.empty(rows, per_row * (64 + K6_SUB), dtype=torch.uint8)
        lib.pipeserve_repack_q6_k(src, n, qs.data_ptr(), qh.data_ptr(), scale.data_ptr(), per_row, threads)
        return PackedWeight("q6", 16, qs, scale, None, "Q6_K", qh, 32)
    minv = torch.empty_like(scale)
    if kind == "Q5_K":
        qh = torch.empty(rows, per_row * (K4_HIGH + 32), dtype=torch.uint8)   # sub-scales, then high bits
        lib.pipeserve_repack_q5_k(src, n, qs.data_ptr(), qh.data_ptr(), scale.data_ptr(), minv.data_ptr(),
                                  per_row, threads)
        return PackedWeight("q5", 32, qs, scale, minv, "Q5_K", qh)
    qh = torch.empty(rows, per_row * K4_HIGH, dtype=torch.uint8)
    lib.pipeserve_repack_q4_k(src, n, qs.data_ptr(), scale.data_ptr(), minv.data_ptr(), qh.data_ptr(), threads)
    return PackedWeight("q4", 32, qs, scale, minv, "Q4_K", qh)


def _q4_k(blocks: np.ndarray, rows: int) -> PackedWeight:
    fast = _c_k_quant("Q4_K", blocks, rows)
    if fast is not None:
        return fast
    # 4 chunks of 32 bytes: chunk c holds run 2c in its low nibbles and run 2c + 1 in its high
    # ones, weight j of a run in byte j. q4 holds weights j and j + 16 of a run in byte j, so
    # each run's bytes are its nibbles from bytes j and j + 16, moved without widening.
    qs = blocks[..., 16:144].reshape(rows, -1, 4, 2, 16)
    lo, hi = qs[..., 0, :], qs[..., 1, :]                               # bytes j, j + 16 of each chunk
    runs = np.stack([(lo & 15) | (hi << 4), (lo >> 4) | (hi & 0xF0)], axis=3)   # [rows, blocks, 4, 2, 16]
    minv = -_f16(blocks, 2)                                              # exact: a sign
    return PackedWeight("q4", 32, _t(runs.reshape(rows, -1)), _t(_f16(blocks, 0)), _t(minv), "Q4_K",
                        _t(_k4_sub(blocks, rows)))


def _k4_sub(blocks: np.ndarray, rows: int) -> np.ndarray:
    """Q4_K / Q5_K blocks' 6-bit sub-scales and sub-minimums, a byte each (per block 8 then 8):
    uint8 [rows, blocks * 16], a two-level q4's ``qh`` and the head of a two-level q5's."""
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))   # [rows * blocks, 8] each
    sub = np.concatenate([sc.reshape(rows, -1, 8), m.reshape(rows, -1, 8)], axis=2).astype(np.uint8)
    return np.ascontiguousarray(sub.reshape(rows, -1))


def _q5_k(blocks: np.ndarray, rows: int) -> PackedWeight:
    fast = _c_k_quant("Q5_K", blocks, rows)
    if fast is not None:
        return fast
    qh = blocks[..., 16:48].reshape(rows, -1, 1, 32)
    qs = blocks[..., 48:176].reshape(rows, -1, 4, 1, 32)
    low = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 15).reshape(rows, -1, 8, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1              # [rows, blocks, 8, 32]
    qs, planes = pack_nibbles(_t(low.reshape(rows, -1))), pack_planes(high.reshape(rows, -1))
    sub = _k4_sub(blocks, rows)
    return PackedWeight("q5", 32, qs, _t(_f16(blocks, 0)), _t(-_f16(blocks, 2)), "Q5_K",
                        torch.cat([_t(sub), planes], dim=1))


def _q6_k(blocks: np.ndarray, rows: int) -> PackedWeight:
    fast = _c_k_quant("Q6_K", blocks, rows)
    if fast is not None:
        return fast
    qs = _t(np.ascontiguousarray(blocks[..., 0:128]).reshape(rows, -1))    # Q6_K's own bytes: packed.py's q6
    high, sub = blocks[..., 128:192].reshape(rows, -1), blocks[..., 192:208].reshape(rows, -1)
    qh = _t(np.concatenate([sub, high], axis=1))                              # a row's sub-scales, then high bits
    return PackedWeight("q6", 16, qs, _t(_f16(blocks, 208)), None, "Q6_K", qh, 32)


_REPACK = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
           T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k, **WIDENED}
