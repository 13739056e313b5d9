"""ctypes bindings of pipeserve/kernels/quant_matmul.c and the choice between its two shapes.

Decode (at most ``GEMV_MAX_ROWS`` rows of activations): the weights are read
once and dequantized in registers (``pipeserve_quant_gemv``); with integer
activations, up to ``GEMV_PASSES_MAX_ROWS`` rows take it in passes. On AVX2 builds
q4 weights take it at every row count, prompts too, q5/q6 up to 128 rows and q8/i4 up to 48
(``PROMPT_INT8_KINDS``, ``PROMPT_INT8_MAX_ROWS``): their many-row kernels (quant_gemv_avx2.h,
q4_rows_many, u8_rows_many, q8_rows_many) give each row the bits of that row's decode gemv, so a matmul
row does not depend on how many rows its call holds
(attention's float order still depends on the chunking, and the int8 rounding turns
that into a step's noise: benchmarks/README.md, twelfth session). Prefill (more
rows, other layouts): tiles of ``TILE_BYTES`` of the weight are dequantized into bfloat16 (or
float32) scratch and multiplied by PyTorch's dense matmul, so the dequantizing
is paid once per tile for all rows. With bfloat16 activations on an AVX512_BF16
CPU, more rows take ``pipeserve_quant_gemm`` (pipeserve/kernels/quant_gemm.c)
instead: 16-row weight panels dequantized to bfloat16 in cache and vdpbf16ps,
with no dequantized tile written to memory or handed to PyTorch; it rounds
each weight to bfloat16 as ``dequantize(w, bfloat16)`` does, so it differs from
``x @ dequantize(w, bfloat16).T`` by summation order and the output's bfloat16
rounding only (tests/test_quant_gemm.py). On AVX512-VNNI CPUs bfloat16 rows beyond
``GEMV_MAX_ROWS`` of every kept layout (q4/q5/q6k/q8, i4, q2/q3; all but q8 from fewer rows,
``gemm_i8_from``) take ``gemm_i8`` instead
(pipeserve/kernels/quant_gemm_i8.c, ``GEMM_I8``):
the rows quantized to int8 per block of 32, 16-row panels of codes unpacked to bytes in cache,
vpdpbusd; within ``sum_k |w_k| * step(k) / 2`` of ``x @ dequantize(w).T``
(tests/test_quant_gemm_i8.py). The log line names the many-row paths. The crossover was measured
(benchmarks/README.md, "Quantized weights"); the tile size was measured on an
AVX2 CPU (``TILE_BYTES``). Accumulation is float32 on both
paths; results differ from ``dequantize(w) @ x`` only by summation order
(and, on the tile path, by the bfloat16 rounding of the dequantized weight
when the activations are bfloat16, as a bfloat16 ``F.linear`` would).

Decode on an AVX512-VNNI CPU ("avx512-vnni" in the log line) or an AVX2 + FMA +
F16C one ("avx2") quantizes each activation row per block of 32 and takes integer
dot products, as llama.cpp does. VNNI: int16 (one term, step max|x| / 32767)
against q4 codes, two int8 terms (step max|x| / (127 * 256)) against q8 codes
(quant_matmul.c); AVX2: int16 against q8 codes, int8 (step max|x| / 127)
against q4's, the compact q5/q6 and Q2_K/Q3_K's q2/q3 ones (quant_gemv_avx2.h: vpmaddubsw on
their raw codes; q2/q3 in quant_k2.h, times their integer sub-scales in vpmaddwd) and IQ4's i4 codebook values (|w| against x with w's signs, as llama.cpp).
Each activation moves by at most half its block's step, so
``|y - x @ W^T| <= sum_k |w_k| * step(k) / 2`` (plus float32 rounding): about
1.5e-5 of the block's largest activation for the int16 codes, finer than bfloat16;
4e-3 for AVX2's q4/q5/q6/i4/q2/q3 (llama.cpp's Q8_0/Q8_K step), coarser than bfloat16 but
below the 4-6-bit weights' own quantization error. The rounding is discontinuous: a change of
x by float32 rounding (another summation order upstream, as tensor parallelism's) moves
the few activations at a step's edge by a whole step, so such runs differ by another draw of
this noise (SmolLM2 Q4_1 with int8: a median 0.02 in teacher-forced log-probabilities, as far
as from float activations; int16: 1e-4; benchmarks/activation_rounding_drift.py), and tests
compare them as vLLM does (tests/test_tensor_parallel_quant.py). float32 and bfloat16 activations both take it
(float32 is what CPUs without native bfloat16 compute in, AVX2 ones included);
``gemv(..., int8_act=False)`` keeps float dot products. q8 codes in groups of 16
(Q6_K) take it too. The compact 5/6-bit layouts (q5/q6, packed.py) and IQ4's i4 are
expanded to q8's int8 codes inside the kernels (in registers on the VNNI, AVX2 integer
and many-row paths, into a cached scratch row on the float and tiled paths), so every path computes
on them exactly what it computes on ``to_q8(w)`` (tests/test_quant_kernels.py), but AVX2's
integer path, whose activations are int8 for them and int16 for q8. Q2_K's and Q3_K's q2/q3
keep the files' integer sub-scales under a float16 per 256 weights: their float and tiled paths
dequantize a row exactly (float32 d * sub, the values of ``dequantize``), where ``to_q8`` rounds
d * sub to float16, so they are tested against ``dequantize`` rather than their q8 expansion.
AVX512-VNNI builds take i4, q2 and q3 through AVX2's kernels (int8 activations, AVX2's bound:
``act_int8``) and their bfloat16 prompt rows through ``gemm`` (quant_gemm.c expands them as AVX2
does), so every build keeps IQ4, Q3_K and Q2_K at their compact size (``takes``).
"""

from __future__ import annotations

import ctypes
import logging

import torch

from pipeserve.kernels.build import kernel_cache
from pipeserve.model.quant.packed import PackedWeight

log = logging.getLogger(__name__)

GEMV_MAX_ROWS = 8
# The prefill path's dequantized tile: a whole SmolLM2 matrix, a few hundred rows of a 70B
# one. The matmul on a tile wants many output columns more than a tile that fits in L2
# (AVX2, 512 KiB L2, 64-512 rows: 1 MiB tiles were 1.1-1.6x slower than one tile of the
# whole weight; benchmarks/README.md, "Many-row tiles on AVX2").
TILE_BYTES = 8 << 20
TILE_MIN_ROWS = 256
# With integer activations, up to this many rows take the gemv in passes of GEMV_MAX_ROWS
# instead of tiles: each pass reads the quantized bytes, a tile writes and reads float32
# (AVX2, 2 threads, 16 rows: SmolLM2's Q8_0 LM head 22 vs 56 ms, Q4_1 gate_up 0.9 vs 1.4 ms;
# even at 32 rows; benchmarks/README.md, "Many-row tiles on AVX2").
GEMV_PASSES_MAX_ROWS = 24
# On AVX2 builds these layouts take the integer gemv for prompts too (up to
# PROMPT_INT8_MAX_ROWS rows where it names the layout, else at any number): q4's many-row
# kernel (register-blocked: 4 rows of x per weight row, quant_gemv_avx2.h) was 0.4-0.95x the
# tiles' time on SmolLM2's and a 2048-wide Llama's shapes at 32-512 rows, one thread
# (benchmarks/README.md, "q4 prompts on a many-row integer kernel"); q5/q6's (Q5_0, Q5_1, Q5_K,
# Q6_K: u8_rows_many) 0.24-0.91x at 32 rows, a median 0.80-0.90x per GGUF type at 128 (0.5-1.6x
# by shape), medians 1.04-1.18x at 256 and 0.97-1.18x at 512 (benchmarks/prompt_int8_kernels.py,
# benchmarks/notes_q56many.md), so beyond 128 rows they keep the tiles. q8 (int16 activations,
# passes of 8 rows over L1-sized tiles of weight rows, one call) since its loops were unrolled,
# against the tiles' time (`benchmarks/prompt_int8_kernels.py --types Q8_0 --rows 32,48,64`, one
# thread, AVX2 Zen 3, two runs): SmolLM2's Q8_0 LM head 0.59-0.83x at 32 rows, 0.73-0.81x at 48,
# 0.88-0.94x at 64; the other SmolLM2 and 2048-wide Llama shapes 0.71-1.10x at 32, 0.79-1.20x at
# 48, 0.88-1.26x at 64; in the engine (two stages, one core each) the head's calls of 25-48 rows
# went from 22.6 to 32.3 GFLOP/s (benchmarks/README.md, fifty-second session): up to 48 rows.
# Since then q8 and i4 (IQ4_NL/IQ4_XS, u8_rows_many with w's signs) have 4-row many-row kernels
# (q8_rows_many, fifty-third session: 1.03-1.38x the passes' speed at 16-64 rows; i4 1.01-1.18x
# at 16-48), which leave q8's limit where it was and give i4 the same 48: i4 against the tiles
# (`--types IQ4_XS,IQ4_NL`) 0.41-0.64x at 16 rows, 0.59-0.95x at 32, 0.77-1.24x at 64.
# q2/q3 keep the tiles beyond GEMV_PASSES_MAX_ROWS: no many-row kernel yet.
PROMPT_INT8_KINDS = ("q4", "q5", "q6", "q8", "i4")
PROMPT_INT8_MAX_ROWS = {"q5": 128, "q6": 128, "q8": 48, "i4": 48}
# Where the kernel takes many rows in one call (AVX2 builds: it runs the passes over tiles of
# weight rows, so the weights come from memory once), the fused decode stage takes steps of up
# to this many decodes. SmolLM2's Q4_1 shapes at 2 threads, q4 with int8 activations: 64 rows
# 0.45-0.51x the tiles' time, 128 rows 0.56-0.87x, 256 rows 0.67-1.19x (with int16 ones 64 rows
# were 0.66-1.24x); 96 requests at once 1.05x the throughput of a 64-decode limit
# (benchmarks/README.md, "128 decodes in one fused step"). matmul keeps
# GEMV_PASSES_MAX_ROWS for the layouts outside PROMPT_INT8_KINDS: their prompt rows (and a step
# mixing them with decodes) take the tiles' float activations from 25 rows; AVX2's q4 takes the
# integer gemv at every row count.
GEMV_ONE_CALL_MAX_ROWS = 128
# Up to this many float32 rows on more than one thread, a weight at least TRANSPOSED_MIN_IN wide
# takes its tiles' products as W_tile @ x^T into the output's transpose, over tiles of
# TRANSPOSED_TILE_ROWS rows: the matmul then splits the tile's many rows between the threads,
# where x @ W_tile^T split the few rows of x (AVX2, 2 threads, a 2048-wide Llama's shapes:
# 1.1-2.8x at 32-64 rows, 1.0-1.4x at 256; no gain at one thread, beyond 256 rows, or on
# SmolLM2's 576/1536-wide matrices, 0.8-1.05x; benchmarks/README.md, "Prefill tiles turned round").
TRANSPOSED_MAX_ROWS = 256
TRANSPOSED_MIN_IN = 2048
TRANSPOSED_TILE_ROWS = 512
# bfloat16 activations from this many rows take quant_gemm.c where it applies: measured
# (benchmarks/README.md, "Many-row kernel") even with gemv at 4 rows, 1.4-2x faster from 6.
GEMM_MIN_ROWS = 5
# Whether bfloat16 rows beyond GEMV_MAX_ROWS of the layouts quant_gemm_i8.c takes (q4: Q4_0, Q4_1,
# Q4_K; q5: Q5_0, Q5_1, Q5_K; q8: Q8_0; int8/int4; i4: IQ4_NL/XS; per 16: Q6_K, Q3_K, Q2_K)
# multiply in 8-bit integers on AVX512-VNNI CPUs, in the Python layers and in the fused decode
# stage (cpu_decode.py), instead of quant_gemm.c's bfloat16 kernel or the gemv's passes:
# 1.17-1.33x the bfloat16 kernel's speed from 64 rows, 2-4x the passes' at 16-64 (q4;
# benchmarks/README.md, twentieth session; the K-quants and IQ4 1.1-1.5x, twenty-first).
# Activations are int8 per block of 32 there, as on AVX2 builds' prompts and in llama.cpp.
# False: the bfloat16 kernel.
GEMM_I8 = True
# On CPUs with AMX-BF16 (Intel Sapphire Rapids and later) bfloat16 activations of at least
# amx_from(out_features) rows take quant_gemm.c's AMX kernel (the bfloat16 panels multiplied by
# tiles) before the 8-bit kernel. Measured on SmolLM2's shapes (benchmarks/gemm_i8.py, one thread,
# weights from memory; benchmarks/README.md, thirty-fifth session), AMX over the 8-bit kernel:
# the layers 0.78-1.12x at 48 rows, 0.93-1.39x at 64 (1.07x summed over a layer's four), 1.77-2.79x
# at 256-512; the 49152-row head 0.66x at 64, 1.06-1.15x from 256 (dequantizing the panels,
# once a call, does not pay for few rows). After the grouped panels (thirty-sixth session, same
# command): the head 0.74x at 64, 0.84x at 96, 0.98x at 128, 1.27x at 192, 1.41x at 256, so a tall
# weight takes it from out_features / 320 rows (the head from 153). With the panels' next rows
# prefetched and a run's group found once for the 16 rows (dequant_panel, thirty-ninth session;
# same command): the layers 0.97-1.00x at 24 rows, 1.08-1.21x at 32, 1.38-1.60x at 64; the head
# 0.88x at 24, 1.00x at 32, 1.32x at 64: every weight from 32 rows, a taller one than 1536 x 32
# rows from out_features / 1536 (a 128k-row head from 83; not measured there).
AMX_MIN_ROWS = 32
AMX_OUT_PER_ROW = 1536


def amx_from(out_features: int) -> int:
    """The rows of bfloat16 x from which a kept weight of ``out_features`` rows takes the AMX kernel
    (the fused decode stage's rule too: decode_stage.c, many_rows)."""
    return max(AMX_MIN_ROWS, out_features // AMX_OUT_PER_ROW)


_DTYPES = (torch.float32, torch.bfloat16)

# On a CPU without native bfloat16 (AVX2, AVX-512 without BF16) PyTorch's bfloat16 matmul
# converts in software: SmolLM2's Q8_0 LM head against 64-320 bfloat16 rows ran at 7-8 GFLOP/s
# on one Zen 3 core, through float32 tiles at 36-49 (benchmarks/bf16_tiles.py), so
# bfloat16 rows there take the tiles in float32 (the weights dequantized to float32, not rounded
# to bfloat16; the product rounded to bfloat16 once) (benchmarks/README.md, fifty-first session).
# None: decided from the CPU's flags at the first call.
TILES_IN_FLOAT32: bool | None = None


def _tiles_in_float32() -> bool:
    global TILES_IN_FLOAT32
    if TILES_IN_FLOAT32 is None:
        from pipeserve.config import cpu_has_native_bf16
        TILES_IN_FLOAT32 = not cpu_has_native_bf16()
    return TILES_IN_FLOAT32


class QuantKernels:
    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        """``lib``: another build of quant_matmul.c (benchmarks compare two); default this tree's."""
        if lib is None:
            from pipeserve.kernels.build import load_kernel
            lib = load_kernel("quant_matmul")
        i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        self._gemv = lib.pipeserve_quant_gemv
        # q5/q6's high bits and the code offset come last: a build from before them
        # (benchmarks' --compare) ignores them and still serves q4/q8 weights with zero 0
        self._gemv.argtypes = [i32, ptr, ptr, ptr, i64, i64, i64, ptr, i32, i64, ptr, i32, i32, i32, ptr, i32]
        self._gemv.restype = i32
        self._dequant = lib.pipeserve_quant_dequant
        self._dequant.argtypes = [i32, ptr, ptr, ptr, i64, i64, i64, i64, ptr, i32, i32, ptr, i32]
        self._dequant.restype = i32
        # a build from before it (benchmarks' --compare): lookups take the PyTorch path
        self._dequant_at = getattr(lib, "pipeserve_quant_dequant_at", None)
        if self._dequant_at is not None:
            self._dequant_at.argtypes = [i32, ptr, ptr, ptr, i64, i64, i64, ptr, i64, ptr, i32, ptr, i32]
            self._dequant_at.restype = i32
        self._i8_applies = lib.pipeserve_quant_i8_applies
        self._i8_applies.argtypes = [i64, i64, i64]
        self._i8_applies.restype = i32
        # a build from before the i4 layout (benchmarks' --compare) has no such question: q4/q8/q5/q6
        self._takes = getattr(lib, "pipeserve_quant_takes", None)
        if self._takes is not None:
            self._takes.argtypes, self._takes.restype = [i32], i32
        lib.pipeserve_quant_isa.restype = ctypes.c_char_p
        self.isa = lib.pipeserve_quant_isa().decode()
        # a build from before the question: AVX2's int8 kinds, VNNI's none
        act_int8 = getattr(lib, "pipeserve_quant_act_int8", None)
        if act_int8 is not None:
            act_int8.argtypes, act_int8.restype = [i32], i32
        self._act_int8 = act_int8
        # whether decode quantizes activations at all here (VNNI or AVX2 builds): asked of the
        # kernel for the simplest layout it takes (blocks and groups of 32, one row)
        self.has_integer_activations = bool(self._i8_applies(32, 32, 1))
        # the most decodes a fused decode stage step takes (cpu_decode.py): in one pass where
        # the kernel takes many rows in one call, else in passes
        self.fused_max_rows = GEMV_ONE_CALL_MAX_ROWS if self._i8_applies(32, 32, GEMV_ONE_CALL_MAX_ROWS) \
            else GEMV_PASSES_MAX_ROWS
        self._gemm, self.gemm_isa, (self._gemm_amx, self.gemm_amx_isa) = _load_gemm()
        self._gemm_i8, self._gemm_i8_takes, self._gemm_i8_from, self.gemm_i8_isa = _load_gemm_i8()

    def takes(self, kind: str) -> bool:
        """Whether this build's kernels take the layout ``kind`` (every build takes all seven; a
        library from before i4/q2/q3, as benchmarks' --compare loads, takes q4/q8/q5/q6)."""
        return bool(self._takes(_KINDS[kind])) if self._takes is not None else kind not in _LATER_KINDS

    def act_int8(self, kind: str) -> bool:
        """Whether the integer activations of layout ``kind`` are one int8 each (step max|x| / 127
        of a block of 32): AVX2 builds' q4/q5/q6/i4/q2/q3 and AVX512-VNNI builds' i4/q2/q3 (which
        take AVX2's kernels, quant_gemv_avx2.h); the others' are int16 or two int8 terms, finer."""
        if self._act_int8 is None:
            return self.isa == "avx2" and kind != "q8"
        return bool(self._act_int8(_KINDS[kind]))

    @staticmethod
    def applies(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in _DTYPES

    def matmul(self, w: PackedWeight, x: torch.Tensor, i8_from: int = 0, amx_rows: int = 0) -> torch.Tensor:
        """x [M, K] (float32 or bfloat16) -> x @ W^T [M, N] in x's dtype. ``i8_from``: the rows
        from which the 8-bit kernel runs where it takes w (default ``gemm_i8_from(w)``; a fused
        linear passes its parts' largest, as the fused decode stage decides per linear); ``amx_rows``
        likewise for the AMX kernel (default ``amx_from(w.out_features)``; -1: not at all)."""
        x = x.contiguous()
        if (self._gemm_amx is not None and x.shape[0] >= (amx_rows or amx_from(w.out_features)) > 0
                and self.gemm_applies(w, x)):
            return self.gemm(w, x, amx=True)
        if self.gemm_i8_applies(w, x):   # below its rows the gemv reads the codes as they are: faster
            return self.gemm_i8(w, x) if x.shape[0] >= (i8_from or self.gemm_i8_from(w)) else self.gemv(w, x)
        if x.shape[0] >= GEMM_MIN_ROWS and self.gemm_applies(w, x):
            return self.gemm(w, x)
        rows = x.shape[0]
        if rows <= GEMV_MAX_ROWS:
            return self.gemv(w, x)
        if self.prompt_takes_int8(w, x):   # AVX2 q4 (q5/q6: up to 128 rows), each row as its decode
            return self.gemv(w, x)
        if rows <= GEMV_PASSES_MAX_ROWS and self.int8_activations(w, x[:GEMV_MAX_ROWS]):
            if self._i8_applies(w.in_features, w.group, rows):   # AVX2: the passes in one call
                return self.gemv(w, x)
            return torch.cat([self.gemv(w, x[r:r + GEMV_MAX_ROWS]) for r in range(0, rows, GEMV_MAX_ROWS)])
        return self.tiled(w, x)

    def prompt_takes_int8(self, w: PackedWeight, x: torch.Tensor) -> bool:
        """Whether ``x``'s rows take the integer-activation gemv (one call), as a decode does:
        on AVX2 builds q4 at every row count, q5/q6/q8/i4 up to ``PROMPT_INT8_MAX_ROWS``, where their
        many-row kernels (quant_gemv_avx2.h: q4_rows_many, u8_rows_many, q8_rows_many) beat the tiles
        (``PROMPT_INT8_KINDS``); they give each row the bits of its one-row gemv, whatever the
        call's row count."""
        return (self.isa == "avx2" and w.kind in PROMPT_INT8_KINDS
                and x.shape[0] <= PROMPT_INT8_MAX_ROWS.get(w.kind, x.shape[0])
                and self.int8_activations(w, x[:GEMV_MAX_ROWS]))

    def gemm_applies(self, w: PackedWeight, x: torch.Tensor) -> bool:
        """Whether ``gemm`` (quant_gemm.c, AVX512_BF16) takes these bfloat16 activations."""
        return (self._gemm is not None and x.dtype == torch.bfloat16 and w.in_features % 32 == 0
                and w.kind in _GEMM_KINDS and w.group % (32 if w.kind == "q4" else 16) == 0
                and (w.kind not in ("q2", "q3") or (w.group == 256 and w.in_features % 256 == 0)))

    def gemm(self, w: PackedWeight, x: torch.Tensor, amx: bool = False) -> torch.Tensor:
        """Many rows, bfloat16 in and out: weight panels dequantized to bfloat16 in cache and
        multiplied with vdpbf16ps, or with AMX tiles (``amx``, where ``gemm_amx_isa``)
        (pipeserve/kernels/quant_gemm.c)."""
        if not self.gemm_applies(w, x):
            raise ValueError(f"the bfloat16 many-row kernel does not apply to {w.source} "
                             f"(in_features {w.in_features}, group {w.group}) with {x.dtype} activations")
        if amx and self._gemm_amx is None:
            raise ValueError("no AMX-BF16 many-row kernel on this CPU (or the kernel refused the tile state)")
        x = x.contiguous()
        out = torch.empty(x.shape[0], w.out_features, dtype=torch.bfloat16)
        fn = self._gemm_amx if amx else self._gemm
        rc = fn(_kind(w), w.qs.data_ptr(), w.scale.data_ptr(), _ptr(w.minv), w.out_features, w.in_features,
                w.group, x.data_ptr(), x.shape[0], out.data_ptr(), torch.get_num_threads(), _ptr(w.qh), w.zero)
        if rc == -1:
            raise MemoryError("quantized many-row matmul: cannot allocate its scratch")
        if rc != 0:
            raise RuntimeError(f"quantized many-row matmul refused its arguments (code {rc})")
        return out

    def gemm_i8_applies(self, w: PackedWeight, x: torch.Tensor) -> bool:
        """Whether ``gemm_i8`` (quant_gemm_i8.c, AVX512-VNNI) takes these bfloat16 activations:
        ``GEMM_I8`` on, and a layout it takes (every kept one: q4, q5 and q8 in groups of 32k, i4,
        the K-quants' two levels, q2/q3 in super-blocks of 256)."""
        return self.gemm_i8_takes(w) and x.dtype == torch.bfloat16

    def gemm_i8_takes(self, w: PackedWeight) -> bool:
        """Whether the 8-bit many-row kernel runs here and takes ``w``'s layout (``GEMM_I8`` on)."""
        return self.gemm_i8_from(w) > 0

    def gemm_i8_from(self, w: PackedWeight) -> int:
        """The rows of x from which ``matmul`` gives w to ``gemm_i8`` (0 where it does not take w):
        IQ4's i4 from 2, q4 (Q4_0, Q4_1), Q4_K and q8 from 4, the other layouts from 5
        (quant_gemm_i8.c, ``pipeserve_quant_gemm_i8_from``).
        The kernel's answer for the layout is kept on the weight, as its C arguments are
        (``matmul`` asks for every linear layer of a step)."""
        if not GEMM_I8 or self._gemm_i8 is None:
            return 0
        first = w.cache.get("i8_from")
        if first is None:
            kind = _kind(w)
            first = w.cache["i8_from"] = (int(self._gemm_i8_from(kind))
                                          if self._gemm_i8_takes(kind, w.in_features, w.group) else 0)
        return first

    def gemm_i8(self, w: PackedWeight, x: torch.Tensor) -> torch.Tensor:
        """Many rows, bfloat16 in and out, in 8-bit integers: each row of x quantized per block of
        32 (step max|x| / 127), the weight's codes unpacked per 16-row panel in cache, vpdpbusd
        (pipeserve/kernels/quant_gemm_i8.c). |out - x @ W^T| <= sum_k |w_k| * step(k) / 2, plus
        float32 rounding and the output's bfloat16 rounding."""
        if not self.gemm_i8_applies(w, x):
            raise ValueError(f"the 8-bit many-row kernel does not apply to {w.source} ({w.kind}, in_features "
                             f"{w.in_features}, group {w.group}) with {x.dtype} activations")
        rc, out = run_gemm_i8(self._gemm_i8, w, x.contiguous(), torch.get_num_threads())
        if rc == -1:
            raise MemoryError("quantized 8-bit many-row matmul: cannot allocate its scratch")
        if rc != 0:
            raise RuntimeError(f"quantized 8-bit many-row matmul refused its arguments (code {rc})")
        return out

    def int8_activations(self, w: PackedWeight, x: torch.Tensor) -> bool:
        """Whether ``gemv`` quantizes these activations to integers by default (VNNI or AVX2
        builds, groups of 32k or 16, at most ``GEMV_MAX_ROWS`` rows)."""
        return (x.dtype in _DTYPES and bool(self._i8_applies(w.in_features, w.group, x.shape[0]))
                and (w.kind != "q4" or w.group % 32 == 0))

    def gemv(self, w: PackedWeight, x: torch.Tensor, int8_act: bool | None = None) -> torch.Tensor:
        """``int8_act`` None: integer activations where the kernel has them;
        True/False forces the choice (tests, benchmarks). Decode calls this ~120 times a
        token, so the weight's arguments are built once (``_weight_args``)."""
        kind, qs, scale, minv, n, k, group, qh, zero = _weight_args(w)
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        bf16 = int(x.dtype == torch.bfloat16)
        act_i8 = 1 if int8_act is None else int(int8_act)
        _check(self._gemv(kind, qs, scale, minv, n, k, group, x.data_ptr(), bf16, x.shape[0], out.data_ptr(), bf16,
                          act_i8, torch.get_num_threads(), qh, zero), w)
        return out

    def decode_fn(self, w: PackedWeight):
        """A function x -> x @ W^T for the decode shape (contiguous CPU float32/bfloat16 x of
        fewer than ``GEMM_MIN_ROWS`` rows and than ``gemm_i8_from``'s, where ``matmul`` always takes
        ``gemv`` with its default activations), with the weight's arguments bound once: the ~120 gemvs of a
        decode step then cost one Python frame each instead of three (QuantLinear.forward)."""
        gemv = self._gemv
        kind, qs, scale, minv, n, k, group, qh, zero = _weight_args(w)
        bf16_dtype, empty, threads = torch.bfloat16, torch.empty, torch.get_num_threads

        def run(x: torch.Tensor) -> torch.Tensor:
            rows = x.shape[0]
            out = empty(rows, n, dtype=x.dtype)
            bf16 = int(x.dtype == bf16_dtype)
            rc = gemv(kind, qs, scale, minv, n, k, group, x.data_ptr(), bf16, rows, out.data_ptr(), bf16, 1,
                      threads(), qh, zero)
            if rc:
                _check(rc, w)
            return out
        return run

    def dequant_rows(self, w: PackedWeight, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [r0, r1) of the weight, dequantized: [r1 - r0, K]."""
        out = torch.empty(r1 - r0, w.in_features, dtype=dtype)
        _check(self._dequant(_kind(w), w.qs.data_ptr(), w.scale.data_ptr(), _ptr(w.minv), w.in_features, w.group,
                             r0, r1, out.data_ptr(), int(dtype == torch.bfloat16), torch.get_num_threads(),
                             _ptr(w.qh), w.zero), w)
        return out

    def lookup(self, w: PackedWeight, ids: torch.Tensor | list[int], dtype: torch.dtype) -> torch.Tensor | None:
        """Rows ``ids`` (int64 [n] on CPU, or a list of ints) of the weight dequantized, [n, K] in
        ``dtype`` (float32 or bfloat16): an embedding's lookup in one C call. None where this
        build has no such call or does not take the layout (the caller dequantizes with PyTorch)."""
        if self._dequant_at is None or not self.takes(w.kind) or dtype not in _DTYPES:
            return None
        listed = isinstance(ids, list)
        if listed:
            array = (ctypes.c_int64 * len(ids))(*ids)    # no tensor of them: ~60 us a step, cold
            count, at = len(ids), ctypes.addressof(array)
        else:
            ids = ids.contiguous()
            count, at = ids.shape[0], ids.data_ptr()
        out = torch.empty(count, w.in_features, dtype=dtype)
        kind, qs, scale, minv, n, k, group, qh, zero = _weight_args(w)
        rc = self._dequant_at(kind, qs, scale, minv, n, k, group, at, count, out.data_ptr(),
                              int(dtype == torch.bfloat16), qh, zero)
        if rc == -4:
            low, high = (min(ids), max(ids)) if listed else (ids.min().item(), ids.max().item())
            raise IndexError(f"token id out of range: {w.source} has {n} rows, got ids {low}..{high}")
        if rc in (-2, -3):   # a layout or shape the C dequantize does not take
            return None
        if rc:
            _check(rc, w)
        return out

    def tiled(self, w: PackedWeight, x: torch.Tensor) -> torch.Tensor:
        """Many rows through dequantized tiles and PyTorch's matmul. bfloat16 rows on a CPU
        without native bfloat16 multiply in float32 (``TILES_IN_FLOAT32``)."""
        if x.dtype == torch.bfloat16 and _tiles_in_float32():
            return self.tiled(w, x.float()).to(torch.bfloat16)
        if (x.dtype == torch.float32 and x.shape[0] <= TRANSPOSED_MAX_ROWS and w.in_features >= TRANSPOSED_MIN_IN
                and torch.get_num_threads() > 1):
            return self._tiled_transposed(w, x)
        rows = max(TILE_MIN_ROWS, TILE_BYTES // (w.in_features * x.element_size()))
        if rows >= w.out_features:     # one tile: no copy of the output into place
            return x @ self.dequant_rows(w, 0, w.out_features, x.dtype).t()
        out = torch.empty(x.shape[0], w.out_features, dtype=x.dtype)
        for r0 in range(0, w.out_features, rows):
            r1 = min(r0 + rows, w.out_features)
            out[:, r0:r1] = x @ self.dequant_rows(w, r0, r1, x.dtype).t()   # [M, rows]
        return out

    def _tiled_transposed(self, w: PackedWeight, x: torch.Tensor) -> torch.Tensor:
        out_t = torch.empty(w.out_features, x.shape[0], dtype=x.dtype)
        xt = x.t()
        for r0 in range(0, w.out_features, TRANSPOSED_TILE_ROWS):
            r1 = min(r0 + TRANSPOSED_TILE_ROWS, w.out_features)
            torch.mm(self.dequant_rows(w, r0, r1, x.dtype), xt, out=out_t[r0:r1])
        return out_t.t().contiguous()


def _weight_args(w: PackedWeight) -> tuple:
    """(kind, codes, scales, minimums, out, in, group, high bits, zero) as the C functions take
    them, kept on the weight (its tensors are fixed for its lifetime: ``map`` makes a new PackedWeight)."""
    args = w.cache.get("c_args")
    if args is None:
        args = w.cache["c_args"] = (_kind(w), w.qs.data_ptr(), w.scale.data_ptr(), _ptr(w.minv), w.out_features,
                                    w.in_features, w.group, _ptr(w.qh), w.zero)
    return args


def _load_gemm():
    """(pipeserve_quant_gemm, "avx512-bf16", (pipeserve_quant_gemm_amx, "amx-bf16")), with None for
    what quant_gemm.c cannot give: no build or no AVX512_BF16 (then many rows take the tiled path),
    no AMX-BF16 or no tile permission from the kernel (then the AMX pair is (None, None))."""
    from pipeserve.kernels.build import KernelBuildError, load_kernel
    try:
        lib = load_kernel("quant_gemm")
    except KernelBuildError as exc:
        log.warning("quantized weights, many rows: quant_gemm.c unavailable (%s); tiled dequantize path", exc)
        return None, None, (None, None)
    lib.pipeserve_quant_gemm_isa.restype = ctypes.c_char_p
    isa = lib.pipeserve_quant_gemm_isa().decode()
    if isa == "none":
        return None, None, (None, None)
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fn, amx = lib.pipeserve_quant_gemm, lib.pipeserve_quant_gemm_amx
    for f in (fn, amx):
        f.argtypes = [i32, ptr, ptr, ptr, i64, i64, i64, ptr, i64, ptr, i32, ptr, i32]
        f.restype = i32
    lib.pipeserve_quant_gemm_amx_isa.restype = ctypes.c_char_p
    amx_isa = lib.pipeserve_quant_gemm_amx_isa().decode()
    return fn, isa, (amx, amx_isa) if amx_isa != "none" else (None, None)


def bind_gemm_i8(lib: ctypes.CDLL):
    """``pipeserve_quant_gemm_i8`` of a loaded quant_gemm_i8.c build, its C signature set (the
    benchmarks and tests bind builds for other CPUs or from older sources the same way)."""
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fn = lib.pipeserve_quant_gemm_i8
    fn.argtypes, fn.restype = [i32, ptr, ptr, ptr, i64, i64, i64, ptr, i32, i64, ptr, i32, i32, ptr, i32], i32
    return fn


def run_gemm_i8(fn, w: PackedWeight, x: torch.Tensor, threads: int) -> tuple[int, torch.Tensor]:
    """(return code, out [M, N] bfloat16) of a bound ``pipeserve_quant_gemm_i8`` on contiguous bfloat16 x."""
    out = torch.empty(x.shape[0], w.out_features, dtype=torch.bfloat16)
    kind, qs, scale, minv, n, k, group, qh, zero = _weight_args(w)
    return fn(kind, qs, scale, minv, n, k, group, x.data_ptr(), 1, x.shape[0], out.data_ptr(), 1, threads, qh,
              zero), out


def _load_gemm_i8():
    """(pipeserve_quant_gemm_i8, pipeserve_quant_gemm_i8_takes, pipeserve_quant_gemm_i8_from,
    "avx512-vnni"), or Nones where quant_gemm_i8.c cannot be built or this CPU has no AVX512-VNNI."""
    from pipeserve.kernels.build import KernelBuildError, load_kernel
    try:
        lib = load_kernel("quant_gemm_i8")
    except KernelBuildError as exc:
        log.warning("quantized weights, many rows: quant_gemm_i8.c unavailable (%s); bfloat16 or tiled path", exc)
        return None, None, None, None
    lib.pipeserve_quant_gemm_i8_isa.restype = ctypes.c_char_p
    isa = lib.pipeserve_quant_gemm_i8_isa().decode()
    if isa == "none":
        return None, None, None, None
    i32, i64 = ctypes.c_int, ctypes.c_int64
    fn, takes = bind_gemm_i8(lib), lib.pipeserve_quant_gemm_i8_takes
    takes.argtypes, takes.restype = [i32, i64, i64], i32
    first = lib.pipeserve_quant_gemm_i8_from
    first.argtypes, first.restype = [i32], i64
    return fn, takes, first, isa


_KINDS = {"q4": 4, "q8": 8, "q5": 5, "q6": 6, "i4": 9, "q2": 2, "q3": 3}
_LATER_KINDS = ("i4", "q2", "q3")      # builds from before pipeserve_quant_takes have no kernels for these
_GEMM_KINDS = ("q4", "q8", "q5", "q6", "i4", "q2", "q3")  # quant_gemm.c's (AVX512_BF16 builds)


# q4 / q5 / q6 with Q4_K's / Q5_K's / Q6_K's two-level scales (packed.py): quant_codes.h's QUANT_Q4K / _Q5K / _Q6K
TWO_LEVEL_KINDS = {"q4": 10, "q5": 12, "q6": 11}


def _kind(w: PackedWeight) -> int:
    """The layout as the C functions take it (a two-level q4, q5 or q6 is its own, "q4k" / "q5k" / "q6k")."""
    return TWO_LEVEL_KINDS[w.kind] if w.two_level else _KINDS[w.kind]


def _check(rc: int, w: PackedWeight) -> None:
    """A gemv's or dequantize's return code as the exception it means."""
    if rc == -1:
        raise MemoryError("quantized matmul: cannot allocate its activation or code scratch")
    if rc == -2:
        raise ValueError(f"this build of the quantized kernels does not take the {w.kind} layout of {w.source} "
                         "(IQ4, Q3_K and Q2_K are widened to q8 at load where it does not)")
    if rc == -3:
        raise ValueError(f"{w.source} ({w.kind}): q2/q3 weights and q4/q5/q6 with two-level scales come in whole "
                         f"super-blocks of 256 (q4/q5 in groups of 32, q6 of 16), not in_features {w.in_features} "
                         f"in groups of {w.group}")
    if rc != 0:
        raise RuntimeError(f"quantized matmul refused its arguments (code {rc})")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@kernel_cache
def cpu_kernels() -> QuantKernels | None:
    """The C kernels, or None (then quantized layers dequantize with PyTorch ops);
    logs once which path runs."""
    from pipeserve.kernels.build import KernelBuildError
    try:
        kernels = QuantKernels()
    except KernelBuildError as exc:
        log.warning("quantized weights: C kernel unavailable (%s); dequantizing with PyTorch per call", exc)
        return None
    many = [f"{kernels.gemm_amx_isa} tiles for bfloat16 from {AMX_MIN_ROWS} rows (a weight of N rows from "
            f"N / {AMX_OUT_PER_ROW})"] if kernels.gemm_amx_isa else []
    many += [f"{kernels.gemm_i8_isa} 8-bit kernel for bfloat16 kept layouts from "
            f"{kernels._gemm_i8_from(_KINDS['q6'])} rows (Q8_0, Q4_0/Q4_1, Q4_K from "
            f"{kernels._gemm_i8_from(_KINDS['q4'])}, IQ4 from {kernels._gemm_i8_from(_KINDS['i4'])})"] \
        if kernels.gemm_i8_isa and GEMM_I8 else []
    many.append(f"{kernels.gemm_isa} fused kernel for bfloat16, tiled dequantize otherwise" if kernels.gemm_isa
                else "tiled dequantize + PyTorch matmul (no AVX512_BF16 kernel)")
    log.info("quantized weights: C kernel, %s decode path (%s activations); many rows: %s", kernels.isa,
             "integer" if kernels.has_integer_activations else "float", "; ".join(many))
    return kernels
