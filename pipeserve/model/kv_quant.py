"""8-bit KV cache rows (``--kv-cache-dtype int8 | fp8``): layout, quantize, dequantize.

With ``auto`` the cache holds the model dtype, as before. With an 8-bit dtype
each cache row (one token, one kv head) is ``head_dim`` one-byte codes followed
by the row's float32 scale, stored in the same tensor, so a layer's cache is
still a pair ``[num_blocks, block_size, kv_heads, head_dim + 4]`` and every
block move (swap to host, copy-on-write, prefix-cache reuse) is unchanged:

- ``int8``: symmetric, scale = max |x| / 127, code = round(x / scale) in
  [-127, 127] (torch.int8 tensor);
- ``fp8``: float8 e4m3 (finite, max 448), scale = max |x| / 448, code =
  x / scale rounded to e4m3 (torch.float8_e4m3fn tensor).

A row reads back as code * scale. The scales are counted in the memory
budget: SmolLM2 (head_dim 64) stores 68 bytes per row instead of 128 in
bfloat16 (1.88x the blocks). The cache tensor's dtype says which format it
holds, so backends and kernels need no other state.
"""

from __future__ import annotations

import torch

from pipeserve.config import KV_CACHE_DTYPES

SCALE_BYTES = 4                       # one float32 per row, after the codes
_CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the cache tensors for ``--kv-cache-dtype``."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _CODES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return _CODES[kv_cache_dtype]


def is_quantized(dtype: torch.dtype) -> bool:
    """Does a cache of this dtype hold 8-bit rows with a trailing scale?"""
    return dtype in _QMAX


def row_elements(head_dim: int, dtype: torch.dtype) -> int:
    """Last dimension of a cache of this dtype: head_dim, plus the scale's bytes when 8-bit."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one cache row (one token, one kv head), scale included."""
    return row_elements(head_dim, dtype) * torch.tensor([], dtype=dtype).element_size()


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> rows [..., head_dim + 4] of ``dtype``."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / _QMAX[dtype], torch.ones_like(amax))     # [..., 1] float32
    scaled = xf / scale
    if dtype == torch.int8:
        codes = scaled.round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        codes = scaled.clamp_(-448, 448).to(dtype).view(torch.uint8)
    return torch.cat([codes, scale.view(torch.uint8)], dim=-1).view(dtype)


def dequantize(rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """rows [..., head_dim + 4] of an 8-bit cache -> [..., head_dim] in ``out_dtype``."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows.view(torch.uint8)[..., head_dim:].contiguous().view(torch.float32)   # [..., 1]
    return (rows[..., :head_dim].float() * scale).to(out_dtype)


def write_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Store x [n, kv_heads, head_dim] at cache slots [n] (quantizing for an 8-bit cache).
    Returns x as the cache holds it (an 8-bit cache: dequantized, in x's dtype), so that a
    fresh prompt attending to its own new keys sees what every later read of them sees."""
    kv_heads, row = cache.shape[2], cache.shape[3]
    if not is_quantized(cache.dtype):
        cache.view(-1, kv_heads, row).index_copy_(0, slots, x.to(cache.dtype))
        return x
    rows = quantize(x, cache.dtype)
    # index_copy_ has no float8 kernel on CPU: move the bytes.
    cache.view(torch.uint8).view(-1, kv_heads, row).index_copy_(0, slots, rows.view(torch.uint8))
    return dequantize(rows, x.dtype)


def gather_rows(cache: torch.Tensor, index: torch.Tensor, dim0: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``cache.view(dim0, -1).index_select(0, index)``, read back as values of ``out_dtype``:
    [len(index), rest] for a model-dtype cache, the same with each row dequantized (so
    ``rest`` counts head_dim per row) for an 8-bit one."""
    if not is_quantized(cache.dtype):
        return cache.view(dim0, -1).index_select(0, index)
    row = cache.shape[3]
    raw = cache.view(torch.uint8).view(dim0, -1).index_select(0, index)
    values = dequantize(raw.view(cache.dtype).view(len(index), -1, row), out_dtype)
    return values.view(len(index), -1)
