"""Fused elementwise ops for CPUs (pipeserve/kernels/elementwise.c), bfloat16 and float32.

RMSNorm (with the residual add before it), RoPE and SiLU-times-up are each a
handful of PyTorch passes with float32 copies in between; on a 2-core CPU they
take ~10% of a decoder layer. The C versions make one pass per row and round
to bfloat16 at the same points as the PyTorch code in ``pipeserve.model.layers``;
the float32 versions do the same math unrounded (RoPE exact, RMSNorm up to the
order of its sum of squares, SiLU up to exp's last bit). bfloat16 and float32
CPU tensors take this path; every other dtype or device stays on PyTorch.

The kernels belong to the model (``LlamaModel`` asks ``cpu_elementwise``), not
to the attention backend: ``--attention-backend torch`` keeps them, and a
failed build of another kernel file does not switch them off.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from pipeserve.kernels.build import kernel_cache

log = logging.getLogger(__name__)


class CpuElementwise:
    def __init__(self) -> None:
        from pipeserve.kernels.build import load_kernel
        lib = load_kernel("elementwise")
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        isa = lib.pipeserve_elementwise_isa
        isa.argtypes, isa.restype = [], ctypes.c_char_p
        self.isa = isa().decode()   # SiLU's explicit vector path: avx512, avx2 or portable
        self._rmsnorm, self._silu_mul, self._rope = {}, {}, {}
        for dtype, suffix in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
            self._rmsnorm[dtype] = _bind(lib, f"pipeserve_rmsnorm_{suffix}", [ptr, ptr, ptr, ptr, ptr, i64, i64, f32])
            self._silu_mul[dtype] = _bind(lib, f"pipeserve_silu_mul_{suffix}", [ptr, ptr, i64, i64])
            self._rope[dtype] = _bind(lib, f"pipeserve_rope_{suffix}", [ptr, i64, ptr, i64, i64, i64, ptr, ptr])

    @staticmethod
    def applies(x: torch.Tensor) -> bool:
        return x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu"

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); without a residual, (norm(x), x).
        x, residual: [n, dim] contiguous, bfloat16 or float32 (the weight's dtype)."""
        x = x.contiguous()
        out = torch.empty_like(x)
        rows, dim = x.shape
        fn = self._rmsnorm[x.dtype]
        if residual is None:
            fn(x.data_ptr(), None, None, weight.data_ptr(), out.data_ptr(), rows, dim, eps)
            return out, x
        residual = residual.contiguous()
        summed = torch.empty_like(x)
        fn(x.data_ptr(), residual.data_ptr(), summed.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, dim, eps)
        return out, summed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2·inter] -> silu(gate) * up, [n, inter]."""
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._silu_mul[gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [n, heads, D], rows may be strided (a slice of the qkv output);
        cos/sin: float32 [n, 1, D]. Returns the rotated x, contiguous."""
        n, heads, head_dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != head_dim or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("rope kernel needs heads laid out contiguously within a row")
        out = torch.empty(n, heads, head_dim, dtype=x.dtype)
        self._rope[x.dtype](x.data_ptr(), x.stride(0), out.data_ptr(), n, heads, head_dim, cos.data_ptr(),
                            sin.data_ptr())
        return out


def _bind(lib: ctypes.CDLL, name: str, argtypes: list) -> ctypes._CFuncPtr:
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, None
    return fn


@kernel_cache
def cpu_elementwise() -> CpuElementwise | None:
    """The fused kernels, or None (the layers then run their PyTorch ops); a
    failed build is logged once per process."""
    from pipeserve.kernels.build import KernelBuildError
    try:
        ops = CpuElementwise()
    except KernelBuildError as exc:
        log.warning("fused RMSNorm/RoPE/SiLU kernels unavailable, using PyTorch ops: %s", exc)
        return None
    log.info("fused RMSNorm/RoPE/SiLU kernels (%s path)", ops.isa)
    return ops
