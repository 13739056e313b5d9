"""The CPU attention backend: C kernels that read the paged KV cache in place.

Decodes: a decode is memory-bound, and the PyTorch path copies every attended
KV block per layer per step (index_select) before multiplying; the kernel
reads each key and value row once, straight from its block.
Prefills (bfloat16 caches on CPUs with AVX512_BF16): a flash-attention loop on
vdpbf16ps, about 3x PyTorch's CPU SDPA on SmolLM2's shapes (head_dim 64, where
SDPA reaches ~35 GFLOP/s), and on CPUs with AMX-BF16 the same loop with its
products on AMX tiles (~4x the vdpbf16ps loop there); other dtypes and CPUs
prefill through SDPA.
Both kernels take the layer's sliding window (a decode reads only the blocks
its window touches) and logit soft cap.
Both live in pipeserve/kernels/paged_attention.c. (The fused RMSNorm, RoPE
and SiLU kernels are the model's, ``pipeserve.model.cpu_ops``, whatever the
attention backend.) ``select_backend`` picks this backend for
``--attention-backend auto`` on CPU when the kernel builds, and says why when
it falls back.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from pipeserve.model.attention import (AttentionBackend, DecodeBatch, ScoreShape, TorchAttentionMetadata,
                                      TorchPagedAttention, block_index_of)
from pipeserve.model.kv_quant import row_elements

logger = logging.getLogger(__name__)

# Cache dtypes the C kernels read; int8 / float8_e4m3fn: 8-bit rows with a scale (kv_quant.py).
CACHE_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, torch.float8_e4m3fn: 4}
KV_8BIT = (torch.int8, torch.float8_e4m3fn)
ATTENTION_BACKENDS = ("auto", "torch", "cpu")


# pipeserve_paged_prefill's parameters (paged_attention.c; benchmarks/prefill_attention.py binds its builds with them).
PREFILL_ARGTYPES = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + \
    [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]


class CpuPagedAttention(TorchPagedAttention):
    def __init__(self) -> None:
        from pipeserve.kernels.build import load_kernel
        lib = load_kernel("paged_attention")
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.decode_kernel = lib.pipeserve_paged_decode
        self.decode_kernel.argtypes = [ptr, ptr, ptr, ctypes.c_int, ptr, i64, ptr, i64, i64, i64, i64, i64,
                                 ctypes.c_float, i64, ctypes.c_float, ptr, ctypes.c_int, ctypes.c_int]
        self.decode_kernel.restype = ctypes.c_int
        # The same with bfloat16 q and out (a bfloat16 model's decodes, no conversions around the call).
        self.decode_io_kernel = lib.pipeserve_paged_decode_io
        self.decode_io_kernel.argtypes = [*self.decode_kernel.argtypes, ctypes.c_int]
        self.decode_io_kernel.restype = ctypes.c_int
        self._prefill = lib.pipeserve_paged_prefill
        self._prefill.argtypes, self._prefill.restype = PREFILL_ARGTYPES, ctypes.c_int
        # The same on AMX tiles where the CPU has AMX-BF16 and Linux grants the tile state
        # (3.7-4.6x the vdpbf16ps loop there; benchmarks/README.md, thirty-sixth session).
        amx_isa = lib.pipeserve_prefill_amx_isa
        amx_isa.argtypes, amx_isa.restype = [], ctypes.c_char_p
        self.prefill_amx = None
        if amx_isa().decode() != "none":
            self.prefill_amx = lib.pipeserve_paged_prefill_amx
            self.prefill_amx.argtypes, self.prefill_amx.restype = PREFILL_ARGTYPES, ctypes.c_int
        isa = lib.pipeserve_decode_isa
        isa.argtypes, isa.restype = [], ctypes.c_char_p
        self.isa = isa().decode()   # the decode path compiled here: avx512, avx2 or portable
        self._write_rows_strided = lib.pipeserve_write_rows_strided
        self._write_rows_strided.argtypes = [ptr, ptr, i64, ptr, i64, i64]
        self._write_rows_strided.restype = None
        self._int8_writer: ctypes._CFuncPtr | None | bool = False   # decode_stage.c's, loaded at first use
        self._prefill_supported = lib.pipeserve_prefill_supported
        self._prefill_supported.argtypes = [ctypes.c_int, i64]
        self._prefill_supported.restype = ctypes.c_int

    def prefill_kernel_applies(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Does the C prefill kernel handle this cache dtype and head size on this CPU?
        (bfloat16 queries: a bfloat16 cache, or an 8-bit one, staged as bfloat16.)"""
        code = CACHE_DTYPE_CODES.get(dtype)
        return code is not None and bool(self._prefill_supported(code, head_dim))

    def attend_prefills(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: TorchAttentionMetadata, shape: ScoreShape,
                        out: torch.Tensor) -> None:
        if not (q.dtype == torch.bfloat16 and k_cache.dtype in (torch.bfloat16, *KV_8BIT)
                and k_cache.device.type == "cpu" and q.is_contiguous()
                and out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
                and self.prefill_kernel_applies(k_cache.dtype, q.shape[2])):
            super().attend_prefills(q, k, v, k_cache, v_cache, meta, shape, out)
            return
        args = meta.backend_state.get("prefill")
        if args is None:   # once per step, shared by every layer
            args = meta.backend_state["prefill"] = _prefill_args(meta)
        seqs, tables = args
        prefill = self.prefill_amx or self._prefill
        rc = prefill(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), CACHE_DTYPE_CODES[k_cache.dtype],
                     seqs.data_ptr(), seqs.shape[0],
                     tables.data_ptr(), tables.shape[1], q.shape[1], k_cache.shape[2], q.shape[2],
                     k_cache.shape[1], shape.scale, shape.window or 0, shape.softcap or 0.0, out.data_ptr(),
                     torch.get_num_threads())
        if rc != 0:
            raise MemoryError("paged prefill kernel could not allocate its scratch"
                              if rc == -1 else f"paged prefill kernel refused the shape (code {rc})")

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not (k.dtype == v.dtype and k_cache.device.type == "cpu" and _rows_dense(k) and _rows_dense(v)
                and k_cache.is_contiguous() and v_cache.is_contiguous() and slots.dtype == torch.int64
                and (k.dtype == k_cache.dtype and k.shape[1:] == k_cache.shape[2:]
                     or k_cache.dtype == torch.int8 and k.dtype in (torch.bfloat16, torch.float32)
                     and k_cache.shape[2:] == (k.shape[1], row_elements(k.shape[2], torch.int8))
                     and self.int8_writer() is not None)):
            return super().write_kv(k_cache, v_cache, slots, k, v)   # fp8 caches quantize in PyTorch
        if k_cache.dtype == torch.int8:   # quantized in C; returned as the cache holds them (write_rows)
            return self._write_int8(k_cache, slots, k), self._write_int8(v_cache, slots, v)
        n, row = slots.shape[0], k_cache.shape[2] * k_cache.shape[3] * k.element_size()
        for cache, x in ((k_cache, k), (v_cache, v)):   # rows of a fused qkv (v's) lie a qkv row apart
            self._write_rows_strided(cache.data_ptr(), slots.data_ptr(), n, x.data_ptr(), x.stride(0) * x.element_size(),
                                     row)
        return k, v

    def int8_writer(self) -> ctypes._CFuncPtr | None:
        """decode_stage.c's ``pipeserve_write_kv_int8``, or None where it does not build (the
        PyTorch quantizer then writes, as for fp8)."""
        if self._int8_writer is False:
            from pipeserve.kernels.build import KernelBuildError, load_kernel
            try:
                fn = load_kernel("decode_stage").pipeserve_write_kv_int8
            except KernelBuildError as exc:
                logger.warning("int8 KV rows are quantized in PyTorch (the C quantizer is unavailable: %s)", exc)
                fn = None
            else:
                i64, ptr = ctypes.c_int64, ctypes.c_void_p
                fn.argtypes, fn.restype = [ptr, i64, ctypes.c_int, ptr, i64, i64, i64, ptr, ptr], None
            self._int8_writer = fn
        return self._int8_writer

    def _write_int8(self, cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        back = torch.empty(x.shape, dtype=x.dtype)
        self._int8_writer(x.data_ptr(), x.stride(0) * x.element_size(), int(x.dtype == torch.bfloat16),
                          slots.data_ptr(), slots.shape[0], x.shape[1], x.shape[2], cache.data_ptr(), back.data_ptr())
        return back

    @staticmethod
    def decode_args(g: DecodeBatch) -> _DecodeStep:
        """The decode kernel's per-step arguments: built once per step, shared by every layer
        (and by the fused decode stage, pipeserve/model/cpu_decode.py)."""
        step = g.backend_state.get("decode")
        if step is None:
            step = g.backend_state["decode"] = _DecodeStep(g)
        return step

    @staticmethod
    def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        if k_cache.device.type != "cpu" or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the cpu attention backend needs contiguous KV caches in CPU memory; "
                             "use --attention-backend torch")
        if k_cache.dtype not in CACHE_DTYPE_CODES:
            raise ValueError(f"the cpu attention backend does not handle {k_cache.dtype} caches; "
                             "use --attention-backend torch")

    def attend_decodes_into(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            g: DecodeBatch, shape: ScoreShape, out: torch.Tensor) -> None:
        """A bfloat16 step whose decodes are one run of rows (the scheduler puts them first): the
        kernel reads their rows of q and writes theirs of ``out`` in place, without the gather,
        the float32 round trip and the scatter of the general case."""
        step = self.decode_args(g)
        if (step.first_row < 0 or q.dtype != torch.bfloat16 or self.decode_io_kernel is None
                or not (q.is_contiguous() and out.is_contiguous())):
            super().attend_decodes_into(q, k_cache, v_cache, g, shape, out)
            return
        self._check_cache(k_cache, v_cache)
        rows = slice(step.first_row, step.first_row + step.batch)
        rc = self.decode_io_kernel(*self.decode_kernel_args(q[rows], k_cache, v_cache, step, shape, out[rows], True),
                                   1)
        if rc != 0:
            raise MemoryError("paged decode kernel could not allocate its work buffer")

    def attend_decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       g: DecodeBatch, shape: ScoreShape) -> torch.Tensor:
        self._check_cache(k_cache, v_cache)
        step = self.decode_args(g)
        bf16 = q.dtype == torch.bfloat16
        # Every row a decode, in batch order (query_index is increasing): q is the kernel's as it is.
        in_order = q.shape[0] == step.batch and q.is_contiguous()
        if in_order and bf16 and self.decode_io_kernel is not None:
            out = torch.empty(q.shape, dtype=torch.bfloat16)
            rc = self.decode_io_kernel(*self.decode_kernel_args(q, k_cache, v_cache, step, shape, out, True), 1)
        else:
            qb = q if in_order and q.dtype == torch.float32 else q.index_select(0, g.query_index).float().contiguous()
            out = torch.empty(qb.shape, dtype=torch.float32)                  # [B, heads, D]
            rc = self.decode_kernel(*self.decode_kernel_args(qb, k_cache, v_cache, step, shape, out, bf16))
            out = out if q.dtype == torch.float32 else out.to(q.dtype)
        if rc != 0:
            raise MemoryError("paged decode kernel could not allocate its work buffer")
        return out

    @staticmethod
    def decode_kernel_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: _DecodeStep,
                           shape: ScoreShape, out: torch.Tensor, bf16_math: bool) -> tuple:
        """``decode_kernel``'s arguments: q and out [B, heads, D] float32 contiguous (bfloat16 for
        ``decode_io_kernel``, which takes one more: 1), a cache dtype the kernel reads
        (``attend_decodes`` checks both); bf16_math: the model is bfloat16, so an 8-bit cache may be
        read through bf16 products."""
        return (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), CACHE_DTYPE_CODES[k_cache.dtype], step.tables_ptr,
                step.max_blocks, step.lens_ptr, step.batch, q.shape[1], k_cache.shape[2], q.shape[2],
                step.block_size, shape.scale, shape.window or 0, shape.softcap or 0.0, out.data_ptr(), step.threads,
                bf16_math)


def _rows_dense(x: torch.Tensor) -> bool:
    """[n, heads, D] whose every row is one dense run (the rows themselves may lie apart)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) >= x.shape[1] * x.shape[2]


class _DecodeStep:
    """The decode kernel's arguments that hold for every layer of one step."""

    def __init__(self, g: DecodeBatch) -> None:
        self.tables = g.block_index.contiguous()        # [B, max_blocks]; kept alive for the pointer
        self.lens = g.context_lens.contiguous()         # [B]
        self.tables_ptr, self.lens_ptr = self.tables.data_ptr(), self.lens.data_ptr()
        self.batch, self.max_blocks = self.tables.shape
        self.block_size = g.block_size
        self.threads = torch.get_num_threads()
        # The decodes' first row when they are one run of rows in order (query_index increases), else -1.
        first, last = int(g.query_index[0]), int(g.query_index[-1])
        self.first_row = first if last - first == self.batch - 1 else -1


def _prefill_args(meta: TorchAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(seqs [n, 4]: first row, q_len, context_len, 0; block tables [n, max_blocks]) of the prefills."""
    seqs = torch.tensor([[p.start, p.q_len, p.context_len, 0] for p in meta.prefills], dtype=torch.int64)
    tables = block_index_of([p.table for p in meta.prefills], [p.context_len for p in meta.prefills],
                            meta.block_size)
    return seqs, tables


def select_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """``--attention-backend``: torch (portable), cpu (the C decode kernel), or
    auto (cpu on a CPU device when the kernel builds, else torch)."""
    from pipeserve.kernels.build import KernelBuildError
    device = torch.device(device)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "torch" or (name == "auto" and device.type != "cpu"):
        return TorchPagedAttention()
    if device.type != "cpu":
        raise ValueError(f"--attention-backend cpu runs on CPU devices only, not {device}")
    try:
        backend = CpuPagedAttention()
    except KernelBuildError as exc:
        if name == "cpu":
            raise
        logger.warning("C decode kernel unavailable, using the PyTorch attention backend: %s", exc)
        return TorchPagedAttention()
    logger.info("attention: C decode kernel (%s path)", backend.isa)
    return backend
