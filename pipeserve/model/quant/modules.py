"""Linear and embedding layers whose weights stay quantized in memory.

A fused projection (q/k/v, gate/up) is one ``PackedWeight`` when its parts
share a layout, otherwise several whose outputs are concatenated (K-quant
mixes often store attn_v as Q6_K beside Q4_K q/k). The codes and scales are
buffers, so ``.to(device)`` and the resident-bytes count see them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeserve.model.quant.cpu_kernels import _DTYPES as _KERNEL_DTYPES, GEMM_MIN_ROWS, amx_from, cpu_kernels
from pipeserve.model.quant.cuda_kernels import cuda_kernels
from pipeserve.model.quant.packed import PackedWeight, dequantize


class _Packed(nn.Module):
    """Holds PackedWeights as buffers (``qs{i}``, ``qh{i}``, ``scale{i}``, ``minv{i}``)."""

    def _register(self, parts: list[PackedWeight]) -> None:
        self._meta = [(p.kind, p.group, p.source, p.minv is not None, p.zero) for p in parts]
        for i, p in enumerate(parts):
            self.register_buffer(f"qs{i}", p.qs)
            self.register_buffer(f"qh{i}", p.qh)
            self.register_buffer(f"scale{i}", p.scale)
            self.register_buffer(f"minv{i}", p.minv)
        self._parts: list[PackedWeight] | None = None

    @property
    def parts(self) -> list[PackedWeight]:
        if self._parts is None:   # built once per placement: forward runs per layer per step
            self._parts = [PackedWeight(kind, group, getattr(self, f"qs{i}"), getattr(self, f"scale{i}"),
                                        getattr(self, f"minv{i}") if has_min else None, source,
                                        getattr(self, f"qh{i}"), zero)
                           for i, (kind, group, source, has_min, zero) in enumerate(self._meta)]
        return self._parts

    def _apply(self, fn, recurse: bool = True):
        self._parts = None   # .to(...) replaces the buffers
        self._decode = None
        return super()._apply(fn, recurse)

    @property
    def sources(self) -> list[str]:
        return [meta[2] for meta in self._meta]


class QuantLinear(_Packed):
    def __init__(self, parts: list[PackedWeight], bias: nn.Parameter | None = None) -> None:
        super().__init__()
        self._register(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = bias

    _decode = None   # (the bound gemvs of the parts, or False), built at the first decode call
    _decode_rows = GEMM_MIN_ROWS   # below this many rows of x: those gemvs (below the 8-bit kernel's rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, in] -> [n, out] in x's dtype."""
        decode = self._decode
        if decode and x.shape[0] < self._decode_rows and x.is_cpu and x.dtype in _KERNEL_DTYPES and x.is_contiguous():
            out = decode(x)   # one decode gemv (~120 per step): the weight's C arguments bound once
            return out if self.bias is None else out + self.bias
        if decode is None:
            self._decode = self._bind_decode()
        parts = self._parts or self.parts
        kernels = cpu_kernels() if x.is_cpu else None
        if kernels is not None and kernels.applies(x):
            if len(parts) == 1:
                out = kernels.matmul(parts[0], x)
            else:
                i8_from = self._i8_from(kernels, parts)
                # the AMX kernel for all the parts or none, from the largest part's rows (decode_stage.c)
                amx_rows = (max(amx_from(p.out_features) for p in parts)
                            if kernels.gemm_amx_isa and all(kernels.gemm_applies(p, x) for p in parts) else -1)
                out = torch.cat([kernels.matmul(p, x, i8_from, amx_rows) for p in parts], dim=-1)
        else:
            gpu = cuda_kernels() if x.is_cuda else None
            outs = [gpu.matmul(p, x) for p in parts] if gpu is not None and gpu.applies(x) else [None]
            if any(o is None for o in outs):   # no Triton, or its kernel failed (logged): PyTorch's ops
                outs = [F.linear(x, dequantize(p, x.dtype)) for p in parts]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out if self.bias is None else out + self.bias

    def _bind_decode(self):
        parts = self.parts
        kernels = cpu_kernels() if parts[0].qs.is_cpu else None
        if kernels is None:
            return False
        gemvs = [kernels.decode_fn(p) for p in parts]
        # from the rows where matmul gives the parts to the 8-bit kernel on, the general path: the
        # fused decode stage multiplies those rows there too
        i8_from = self._i8_from(kernels, parts)
        self._decode_rows = min(GEMM_MIN_ROWS, i8_from) if i8_from else GEMM_MIN_ROWS
        if len(gemvs) == 1:
            return gemvs[0]
        cat = torch.cat
        return lambda x: cat([gemv(x) for gemv in gemvs], dim=-1)

    @staticmethod
    def _i8_from(kernels, parts) -> int:
        """The rows from which the parts multiply in the 8-bit kernel (0: never): the largest part's,
        all together, as the fused decode stage decides a linear's parts."""
        return max(kernels.gemm_i8_from(p) for p in parts)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, types={'+'.join(self.sources)}"


class QuantEmbedding(_Packed):
    """Looks up rows and dequantizes only those."""

    def __init__(self, weight: PackedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self._register([weight])
        self.dtype = dtype

    def forward(self, ids: torch.Tensor | list[int]) -> torch.Tensor:
        """ids [n] (int64, or a list of ints) -> [n, hidden] in the model's dtype: on CPU one C
        call (a decode step's lookup took ~90 us through PyTorch's gather and float ops, ~35 in
        C, both cold after the step's weights went through the caches; a tensor of a list's ids
        ~60 us more), else PyTorch's ops."""
        w = self._parts or self.parts
        listed = isinstance(ids, list)
        kernels = (cpu_kernels() if (listed or (ids.is_cpu and ids.dtype == torch.int64)) and w[0].qs.is_cpu
                   else None)
        out = kernels.lookup(w[0], ids, self.dtype) if kernels is not None else None
        if out is not None:
            return out
        if listed:
            ids = torch.tensor(ids, dtype=torch.int64, device=w[0].qs.device)
        return dequantize(w[0].rows(ids), self.dtype)

    def extra_repr(self) -> str:
        return f"types={self.sources[0]}"
