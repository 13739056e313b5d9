"""Fused bfloat16 elementwise ops for CPUs (pipeserve/kernels/elementwise.c).

RMSNorm (with the residual add before it), RoPE and SiLU-times-up are each a
handful of PyTorch passes with float32 copies in between; on a 2-core CPU they
take ~10% of a decoder layer. The C versions make one pass per row and round
to bfloat16 at the same points as the PyTorch code in ``pipeserve.model.layers``.
Only bfloat16 CPU tensors take this path: float32 (the token-identity
reference) and every other dtype or device stay on PyTorch.

The kernels belong to the model (``LlamaModel`` asks ``cpu_elementwise``), not
to the attention backend: ``--attention-backend torch`` keeps them, and a
failed build of another kernel file does not switch them off.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

log = logging.getLogger(__name__)


class CpuElementwise:
    def __init__(self) -> None:
        from pipeserve.kernels.build import load_kernel
        lib = load_kernel("elementwise")
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._rmsnorm = lib.pipeserve_rmsnorm_bf16
        self._rmsnorm.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, f32]
        self._rmsnorm.restype = None
        self._silu_mul = lib.pipeserve_silu_mul_bf16
        self._silu_mul.argtypes = [ptr, ptr, i64, i64]
        self._silu_mul.restype = None
        self._rope = lib.pipeserve_rope_bf16
        self._rope.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ptr]
        self._rope.restype = None

    @staticmethod
    def applies(x: torch.Tensor) -> bool:
        return x.dtype == torch.bfloat16 and x.device.type == "cpu"

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); without a residual, (norm(x), x).
        x, residual: [n, dim] contiguous bfloat16."""
        x = x.contiguous()
        out = torch.empty_like(x)
        rows, dim = x.shape
        if residual is None:
            self._rmsnorm(x.data_ptr(), None, None, weight.data_ptr(), out.data_ptr(), rows, dim, eps)
            return out, x
        residual = residual.contiguous()
        summed = torch.empty_like(x)
        self._rmsnorm(x.data_ptr(), residual.data_ptr(), summed.data_ptr(), weight.data_ptr(), out.data_ptr(),
                      rows, dim, eps)
        return out, summed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2·inter] -> silu(gate) * up, [n, inter]."""
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [n, heads, D], rows may be strided (a slice of the qkv output);
        cos/sin: float32 [n, 1, D]. Returns the rotated x, contiguous."""
        n, heads, head_dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != head_dim or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("rope kernel needs heads laid out contiguously within a row")
        out = torch.empty(n, heads, head_dim, dtype=x.dtype)
        self._rope(x.data_ptr(), x.stride(0), out.data_ptr(), n, heads, head_dim, cos.data_ptr(), sin.data_ptr())
        return out


@functools.lru_cache(maxsize=1)
def cpu_elementwise() -> CpuElementwise | None:
    """The fused kernels, or None (the layers then run their PyTorch ops); a
    failed build is logged once per process."""
    from pipeserve.kernels.build import KernelBuildError
    try:
        return CpuElementwise()
    except KernelBuildError as exc:
        log.warning("fused RMSNorm/RoPE/SiLU kernels unavailable, using PyTorch ops: %s", exc)
        return None
