"""The CPU attention backend: decodes through a C kernel that reads the paged
KV cache in place; prefills as the PyTorch backend (SDPA, compute-bound).

Why: a decode is memory-bound, and the PyTorch path copies every attended KV
block per layer per step (index_select) before multiplying; the kernel reads
each key and value row once, straight from its block (pipeserve/kernels/
paged_decode.c). ``select_backend`` picks it for ``--attention-backend auto``
on CPU when a C compiler is present, and says why when it falls back.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from pipeserve.model.attention import AttentionBackend, DecodeBatch, TorchPagedAttention

logger = logging.getLogger(__name__)

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ATTENTION_BACKENDS = ("auto", "torch", "cpu")


class CpuPagedAttention(TorchPagedAttention):
    def __init__(self) -> None:
        from pipeserve.kernels.build import load_kernel
        fn = load_kernel("paged_decode").pipeserve_paged_decode
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, ptr, ctypes.c_int, ptr, i64, ptr, i64, i64, i64, i64, i64,
                       ctypes.c_float, ptr, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._decode = fn

    def attend_decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       g: DecodeBatch, scale: float) -> torch.Tensor:
        if k_cache.device.type != "cpu" or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the cpu attention backend needs contiguous KV caches in CPU memory; "
                             "use --attention-backend torch")
        code = _DTYPE_CODES.get(k_cache.dtype)
        if code is None:
            raise ValueError(f"the cpu attention backend does not handle {k_cache.dtype} caches; "
                             "use --attention-backend torch")
        qb = q.index_select(0, g.query_index).float().contiguous()            # [B, heads, D]
        out = torch.empty_like(qb)
        bsz, heads, head_dim = qb.shape
        block_index = g.block_index.contiguous()
        lens = g.context_lens.contiguous()
        rc = self._decode(qb.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), code,
                          block_index.data_ptr(), block_index.shape[1], lens.data_ptr(),
                          bsz, heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale,
                          out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise MemoryError("paged decode kernel could not allocate its work buffer")
        return out.to(q.dtype)


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
        return CpuPagedAttention()
    except KernelBuildError as exc:
        if name == "cpu":
            raise
        logger.warning("C decode kernel unavailable, using the PyTorch attention backend: %s", exc)
        return TorchPagedAttention()
