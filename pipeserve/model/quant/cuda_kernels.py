"""Triton kernels for kept-quantized weights on CUDA: a matmul that dequantizes inside its loop.

On the GPU a ``QuantLinear`` used to dequantize each part in PyTorch ops (``packed.dequantize``:
a dozen launches and two full-size float temporaries per linear per step) and hand the result to
``F.linear``; on an H200 that ran a kept Q4_K_M model at 0.48x the dequantized one
(benchmarks/README.md, twenty-fifth session). With these kernels: 1.27x that at 64 requests, 2.4x
at one (twenty-seventh session). Every layout of packed.py is one Triton function,
``_weight_groups``, that builds a float32 tile of a weight row from its codes and scales, the
formulas of ``packed.dequantize``, as [runs of 32, 2, 16]: each run's bytes loaded as they lie (a
q4 run's 16 bytes once for both nibbles) and its scales once per run or per 16. Two kernels use it:

- ``_qgemv``: ``y = x @ W^T`` for up to ``FUSED_MAX_ROWS`` rows of x, a program per weight row:
  the row's codes read once and dequantized in registers, every row of x multiplied against
  them, so only the quantized bytes come from memory (decode: bandwidth-bound);
- ``_dequant``: the whole weight into the activations' dtype in one launch, for ``F.linear``
  (cuBLAS) on more rows (prefill: compute-bound, the dequantizing paid once per step for all rows).

Two earlier tile shapes ran slower on an H200 (benchmarks/README.md): [32, 128] tiles for
``tl.dot`` built by element-wise gathers (~30 GB/s of Q4_K: 64-bit pointers per element), and a
vector of columns whose every element loaded its own byte and scales (twenty-seventh session;
the run tiles took the 1-row gemv from 98 to 66 us on a Q4_K 4096 x 4096, from 241 to 112 on a
Q6_K 14336 x 4096, and the engine's dequantizing from 27 to 10 us a call, twenty-eighth).

float32 activations multiply in IEEE float32 (no TF32); bfloat16 / float16 ones round the weight
tile to their dtype first, as ``F.linear(x, dequantize(w, x.dtype))`` does, and accumulate in
float32. Results differ from that reference by summation order (and the fused multiply-adds the
compiler forms in the scale arithmetic): tests/test_cuda.py bounds it.

Without Triton (or when a kernel fails to compile: logged once) the PyTorch path stays.
``PIPESERVE_CUDA_QUANT=torch`` chooses it; ``PIPESERVE_CUDA_FUSED_MAX_ROWS`` moves the crossover.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from pipeserve.model.quant.packed import IQ4_VALUES, PackedWeight

log = logging.getLogger(__name__)

# packed.py's layouts as the kernels' compile-time KIND
KINDS = {"q8": 0, "q4": 1, "q5": 2, "q6": 3, "i4": 4, "q2": 5, "q3": 6}
# the gemv beat dequantize + cuBLAS at 1 row on all six weights timed on an H200 and lost at 4 rows
# on four of them (benchmarks/README.md, twenty-seventh session)
FUSED_MAX_ROWS = int(os.environ.get("PIPESERVE_CUDA_FUSED_MAX_ROWS", "1"))
GEMV_BK, DEQUANT_BK = 512, 1024   # weights of a row per loop step / per program
GEMV_ACC = 4096                    # the gemv's float32 partial sums per program (rows of x times columns)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

try:
    import triton
    import triton.language as tl
except ImportError:   # the CPU wheel of torch comes without it; CUDA builds bring it
    triton = None

if triton is not None:
    @triton.jit
    def _weight_groups(qs, qh, sc, mn, lut, n, g, h, i, K, qs_row, qh_row, sc_row,
                       KIND: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
                       TWO: tl.constexpr):
        """Row n's weights 32 g + 16 h + i in float32 as a [G, 2, 16] tile (n: an int64 row; g
        [G, 1, 1]: runs of 32 in range; h [1, 2, 1]; i [1, 1, 16]): a run's bytes loaded as they
        lie (q4's 16 bytes once for both nibbles), each scale once per run or per 16. Every
        layout's rows are whole runs of 32 (packed.py's ``SUB``), so a run never straddles K."""
        q_row = qs + n * qs_row
        h_row = qh + n * qh_row
        s_row = sc + n * sc_row
        m_row = mn + n * sc_row
        # where q5 / q6's high bits start in a row of ``qh``: after the sub-scales on two-level ones
        if TWO:
            high_at = K // 16
        else:
            high_at = 0
        if KIND == 0:                                      # q8
            q = tl.load(q_row + g * 32 + h * 16 + i).to(tl.float32)
        elif KIND == 1 or KIND == 2 or KIND == 4:          # q4 / q5 / i4: run byte i holds weights i, 16 + i
            c = (tl.load(q_row + g * 16 + i).to(tl.int32) >> (4 * h)) & 15
            if KIND == 2:                                  # bit 16 h + i of the run's 32-bit plane
                hb = tl.load(h_row + high_at + g * 4 + h * 2 + i // 8).to(tl.int32)
                c = c | (((hb >> (i % 8)) & 1) << 4)
            if KIND == 4:
                q = tl.load(lut + c).to(tl.float32)       # IQ4's codebook
            else:
                q = (c - ZERO).to(tl.float32)
        elif KIND == 3:                                    # q6: run g of its 128 is nibble (g % 4) // 2, pair g % 4
            b = tl.load(q_row + (g // 4) * 64 + (g % 2) * 32 + h * 16 + i).to(tl.int32)
            hb = tl.load(h_row + high_at + (g // 4) * 32 + h * 16 + i).to(tl.int32)
            c = ((b >> (4 * ((g % 4) // 2))) & 15) | (((hb >> (2 * (g % 4))) & 3) << 4)
            q = (c - ZERO).to(tl.float32)
        else:                                              # q2 / q3: bit pair g % 4, q3's hmask bit g % 8
            c = (tl.load(q_row + (g // 4) * 32 + h * 16 + i).to(tl.int32) >> (2 * (g % 4))) & 3
            if KIND == 6:
                hm = tl.load(h_row + (g // 8) * 48 + h * 16 + i).to(tl.int32)
                c = c | (((hm >> (g % 8)) & 1) << 2)
            q = (c - ZERO).to(tl.float32)
        # scales (and minimums), as packed.py's k4 / k6 / k2_group_scales compute them: exact products
        if KIND == 5:                                      # Q2_K: sub-scale and sub-minimum per 16
            d = tl.load(s_row + g // 8).to(tl.float32)
            sub = tl.load(h_row + (g // 8) * 16 + (g % 8) * 2 + h).to(tl.int32)
            w = q * (d * (sub & 15).to(tl.float32)) + tl.load(m_row + g // 8).to(tl.float32) * (sub >> 4).to(tl.float32)
        elif KIND == 6:                                    # Q3_K: int8 sub-scale per 16
            d = tl.load(s_row + g // 8).to(tl.float32)
            sub = tl.load(h_row + (g // 8) * 48 + 32 + (g % 8) * 2 + h).to(tl.int8, bitcast=True)
            w = q * (d * sub.to(tl.float32))
        elif TWO and KIND == 3:                            # Q6_K: int8 sub-scale per 16
            d = tl.load(s_row + g // 8).to(tl.float32)
            sub = tl.load(h_row + g * 2 + h).to(tl.int8, bitcast=True)
            w = q * (d * sub.to(tl.float32))
        elif TWO:                                          # Q4_K / Q5_K: 6-bit sub-scale and minimum per run
            at = h_row + (g // 8) * 16 + g % 8
            d = tl.load(s_row + g // 8).to(tl.float32)
            dmin = tl.load(m_row + g // 8).to(tl.float32)
            w = q * (d * tl.load(at).to(tl.float32)) + dmin * tl.load(at + 8).to(tl.float32)
        else:                                              # a scale (and minimum) per GROUP, a multiple of 32
            w = q * tl.load(s_row + (g * 32) // GROUP).to(tl.float32)
            if HAS_MIN:
                w = w + tl.load(m_row + (g * 32) // GROUP).to(tl.float32)
        return w

    @triton.jit
    def _qgemv(x, y, qs, qh, sc, mn, lut, M, K, x_row, y_row, qs_row, qh_row, sc_row,
               KIND: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
               TWO: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, ROUND: tl.constexpr):
        """y[:, n] = x @ W[n] for the program's row n: the row's codes read once, every row of x
        (at most BM) against them; products summed per lane, lanes at the end."""
        n = tl.program_id(0).to(tl.int64)
        rm = tl.arange(0, BM)[:, None, None, None]
        rg = tl.arange(0, BK // 32)[:, None, None]
        rh = tl.arange(0, 2)[None, :, None]
        ri = tl.arange(0, 16)[None, None, :]
        acc = tl.zeros((BM, BK // 32, 2, 16), dtype=tl.float32)
        for k0 in range(0, K, BK):
            g = k0 // 32 + rg
            w = _weight_groups(qs, qh, sc, mn, lut, n, tl.minimum(g, K // 32 - 1), rh, ri, K, qs_row, qh_row,
                               sc_row, KIND, GROUP, ZERO, HAS_MIN, TWO)   # runs past K meet zeros of x
            if ROUND:                                          # as F.linear(x, dequantize(w, x.dtype))
                w = w.to(x.dtype.element_ty).to(tl.float32)
            k = (g * 32 + rh * 16 + ri)[None, :, :, :]
            a = tl.load(x + rm * x_row + k, mask=(rm < M) & (k < K), other=0.0)
            acc += a.to(tl.float32) * w[None, :, :, :]
        rows = tl.arange(0, BM)
        tl.store(y + rows * y_row + n, tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1).to(y.dtype.element_ty),
                 mask=rows < M)

    @triton.jit
    def _dequant(out, qs, qh, sc, mn, lut, K, qs_row, qh_row, sc_row,
                 KIND: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
                 TWO: tl.constexpr, BK: tl.constexpr):
        """Row n = program 0's, columns of program 1's chunk, into ``out``'s dtype."""
        n = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1) * (BK // 32) + tl.arange(0, BK // 32)[:, None, None]
        rh = tl.arange(0, 2)[None, :, None]
        ri = tl.arange(0, 16)[None, None, :]
        w = _weight_groups(qs, qh, sc, mn, lut, n, tl.minimum(g, K // 32 - 1), rh, ri, K, qs_row, qh_row, sc_row,
                           KIND, GROUP, ZERO, HAS_MIN, TWO)
        k = g * 32 + rh * 16 + ri
        tl.store(out + n * K + k, w.to(out.dtype.element_ty), mask=k < K)


def _args(w: PackedWeight) -> tuple[tuple, tuple, dict]:
    """The kernels' tensor arguments, row strides and compile-time constants for ``w`` (kept on it)."""
    args = w.cache.get("triton")
    if args is None:
        qs, scale = w.qs.contiguous(), w.scale.contiguous()   # (no copies: the loaders' tensors are)
        lut = torch.tensor(IQ4_VALUES, dtype=torch.int8, device=qs.device) if w.kind == "i4" else qs
        qh = w.qh.contiguous() if w.qh is not None else qs     # an unused pointer must still be a tensor
        mn = w.minv.contiguous() if w.minv is not None else scale
        strides = (qs.stride(0), qh.stride(0), scale.stride(0))
        consts = dict(KIND=KINDS[w.kind], GROUP=w.group, ZERO=w.zero, HAS_MIN=w.minv is not None,
                      TWO=w.two_level)
        args = w.cache["triton"] = ((qs, qh, scale, mn, lut), strides, consts)
    return args


def matmul(w: PackedWeight, x: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """x [m, in] (CUDA, float32 / bfloat16 / float16) -> x @ W^T [m, out] in x's dtype; ``fused``
    forces a path (benchmarks/cuda_quant_matmul.py), else up to ``FUSED_MAX_ROWS`` rows are."""
    x = x.contiguous()
    m, k = x.shape
    if m == 0:   # an expert that no token chose
        return x.new_empty(0, w.out_features)
    if not (m <= FUSED_MAX_ROWS if fused is None else fused):
        return F.linear(x, dequantize(w, x.dtype))
    ptrs, strides, consts = _args(w)
    y = torch.empty(m, w.out_features, dtype=x.dtype, device=x.device)
    bm = triton.next_power_of_2(m)
    _qgemv[(w.out_features,)](x, y, *ptrs, m, k, x.stride(0), y.stride(0), *strides, **consts,
                              BM=bm, BK=max(32, min(GEMV_BK, GEMV_ACC // bm)), ROUND=x.dtype != torch.float32)
    return y


def dequantize(w: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """[out, in] in ``dtype`` on the weight's device, in one launch (the tests' view of the tiles)."""
    n, k = w.out_features, w.in_features
    out = torch.empty(n, k, dtype=dtype, device=w.qs.device)
    ptrs, strides, consts = _args(w)
    _dequant[(n, triton.cdiv(k, DEQUANT_BK))](out, *ptrs, k, *strides, **consts, BK=DEQUANT_BK)
    return out


class _Kernels:
    """The Triton path, or None where it cannot run; a failed launch falls back for good, logged once."""

    def __init__(self) -> None:
        self.failed: str | None = None

    def applies(self, x: torch.Tensor) -> bool:
        return self.failed is None and x.is_cuda and x.dtype in _DTYPES and x.dim() == 2

    def matmul(self, w: PackedWeight, x: torch.Tensor) -> torch.Tensor | None:
        try:
            return matmul(w, x)
        except torch.OutOfMemoryError:   # the step's, not the kernel's: PyTorch's ops would need more
            raise
        except Exception as e:   # a compiler or driver that cannot take a kernel: PyTorch's ops stay correct
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("the Triton quantized matmul failed on %s (%s); dequantizing in PyTorch ops from now on",
                        w.source, self.failed.splitlines()[0][:300])
            return None


@functools.cache
def cuda_kernels() -> _Kernels | None:
    """The Triton kernels, when Triton imports and they are not turned off (logged once)."""
    choice = os.environ.get("PIPESERVE_CUDA_QUANT", "triton")
    if choice not in ("triton", "torch"):
        raise ValueError(f"PIPESERVE_CUDA_QUANT={choice!r}: expected 'triton' or 'torch'")
    if choice == "torch":
        log.info("quantized weights on CUDA: dequantized in PyTorch ops (PIPESERVE_CUDA_QUANT=torch)")
        return None
    if triton is None:
        log.warning("quantized weights on CUDA: Triton is not installed, so each linear dequantizes in PyTorch "
                    "ops (slower: install the triton package that matches torch)")
        return None
    log.info("quantized weights on CUDA: Triton kernels (a gemv up to %d row(s), then dequantize + cuBLAS); "
             "a GPU with memory to spare runs a dequantized model faster (--quantization none: 18 against 25 ms a "
             "step at 64 requests on an H200, benchmarks/README.md)", FUSED_MAX_ROWS)
    return _Kernels()
