"""Building blocks of a Llama-family decoder: norm, linear, embedding, RoPE, MLP.

Parameters are allocated with ``torch.empty``: every weight comes from a
checkpoint, so random initialisation would only cost load time.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pipeserve.model import packed_linear


class RMSNorm(nn.Module):
    # Fused CPU kernels (pipeserve.model.cpu_ops.CpuElementwise), set by the model
    # when its attention backend provides them; used for bfloat16 CPU tensors only.
    ops = None

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device,
                 unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        # Gemma scales by (1 + weight), in float32 before rounding; the fused
        # kernel does Llama's weight * round(x), so it is not used then.
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_norm(x)[0]

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); without a residual (norm(x), x)."""
        if self.ops is not None and not self.unit_offset and self.ops.applies(x):
            return self.ops.rmsnorm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        # Statistics in float32 even for half-precision activations, as the
        # reference implementation does; otherwise bf16 drifts visibly.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype), x
        return self.weight * x32.to(x.dtype), x


class Linear(nn.Module):
    """x @ weight^T + bias. bfloat16 on the CPU runs with the weight packed once
    (``packed_linear``: our bf16_gemm.c kernel, or oneDNN without its per-call
    reorder) under --prepack-weights, else its decode rows (a few rows of x) by
    bf16_gemv.c on the plain weight; every other dtype, device and shape is ``F.linear``."""

    prepack = False  # --prepack-weights sets it per layer (ModelRunner); benchmarks flip the class default

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.packed = packed_linear.PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if packed_linear.applies(x, self.weight):
            out = (self.packed.forward(x, self.weight, self.bias) if self.prepack
                   else packed_linear.decode_rows(x, self.weight, self.bias))
            if out is not None:
                return out
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor | list[int]) -> torch.Tensor:
        """ids: int64 [n], or a list of ints (a runner's step: ``QuantEmbedding`` looks those up
        without a tensor of them)."""
        if isinstance(ids, list):
            ids = torch.tensor(ids, dtype=torch.int64, device=self.weight.device)
        return F.embedding(ids, self.weight)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up fused into one matmul. With
    ``act="gelu_pytorch_tanh"`` the gate is GELU (tanh approximation): GeGLU (Gemma)."""

    ops = None   # as RMSNorm.ops (SiLU only)

    def __init__(self, hidden_size: int, intermediate_size: int,
                 dtype: torch.dtype, device: torch.device, act: str = "silu") -> None:
        super().__init__()
        if act not in GATE_ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported (supported: {', '.join(GATE_ACTIVATIONS)})")
        self.act = act
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, False, dtype, device)
        self.down_proj = Linear(intermediate_size, hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # .forward, not __call__: no hooks here, ~1.5 us a call saved (LlamaModel.forward)
        gate_up = self.gate_up_proj.forward(x)                                  # [n, 2 * inter]
        if self.act == "silu" and self.ops is not None and self.ops.applies(gate_up):
            return self.down_proj.forward(self.ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)                # [n, inter] each
        return self.down_proj.forward(GATE_ACTIVATIONS[self.act](gate) * up)


GATE_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the Hugging Face layout), with optional llama3/linear scaling
    or per-dimension frequency factors (a GGUF's ``rope_freqs``).

    cos/sin of a step's positions are rows of a table of every position up to the
    furthest seen (grown by doubling, computed by the same float32 ops as the rows
    themselves would be: one lookup a step instead of five small ops, ~50 us of a
    decode token), up to TABLE_MAX_POSITIONS; beyond it they are computed per step
    from the positions (a 128k-context model's whole table would be ~130 MB a stage).
    """

    TABLE_MAX_POSITIONS = 16384

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, device: torch.device,
                 freq_factors: tuple[float, ...] | None = None) -> None:
        super().__init__()
        inv_freq = scaled_inv_freq(rope_inv_freq(head_dim, theta), scaling)  # [head_dim / 2]
        if freq_factors is not None:  # llama.cpp's rope_freqs: theta_i = pos * inv_freq_i / factor_i
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self._cos = self._sin = None   # [positions, head_dim] float32, on inv_freq's device

    def forward(self, positions: torch.Tensor, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] -> (cos, sin), each float32 [n, 1, head_dim]. ``limit``: more than
        the largest position (then they come from the table, where it reaches that far)."""
        table = None if limit is None else self.table(limit)
        if table is not None:
            return table[0].index_select(0, positions).unsqueeze(1), table[1].index_select(0, positions).unsqueeze(1)
        return self._compute(positions)

    def table(self, limit: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) of every position below at least ``limit``, each float32 [positions, head_dim]
        (the rows ``forward`` looks up), or None past TABLE_MAX_POSITIONS: the fused decode stage
        picks a step's rows itself."""
        if limit > self.TABLE_MAX_POSITIONS:
            return None
        if self._cos is None or self._cos.shape[0] < limit or self._cos.device != self.inv_freq.device:
            self._grow(limit)
        return self._cos, self._sin

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [n, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)                 # [n, 1, head_dim]
        return emb.cos(), emb.sin()

    def _grow(self, limit: int) -> None:
        have = 0 if self._cos is None else self._cos.shape[0]
        size = min(self.TABLE_MAX_POSITIONS, max(1024, 2 * have, 1 << (limit - 1).bit_length()))
        cos, sin = self._compute(torch.arange(size, device=self.inv_freq.device))
        self._cos, self._sin = cos.squeeze(1), sin.squeeze(1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 ops=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [n, heads, D], k: [n, kv_heads, D]; rope from ``RotaryEmbedding``;
    ``ops``: fused CPU kernels (bfloat16 CPU tensors only)."""
    cos, sin = rope
    if ops is not None and ops.applies(q):
        return ops.rope(q, cos, sin), ops.rope(k, cos, sin)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # In the activation dtype, as the Hugging Face reference does (cos/sin cast down).
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta ** exponents)


def scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """Apply a ``rope_scaling`` dictionary; refuse kinds we do not implement."""
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band in
    # between interpolated smoothly (Llama 3.1's context extension).
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * slowed / factor + smooth * slowed
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, slowed)
