"""The C attention kernels (``--attention-backend cpu``) against the PyTorch backend."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from pipeserve.kernels import build
from pipeserve.model.attention import TorchPagedAttention
from pipeserve.model.cpu_attention import CpuPagedAttention, select_backend
from tests.kernels import kernel_missing, skip_without_kernel

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


needs_kernel = skip_without_kernel("paged_attention")


def _random_batch(rng: random.Random, query_lens: list[int], context_lens: list[int], block_size: int,
                  kv_heads: int, head_dim: int, dtype: torch.dtype):
    """A KV cache with blocks handed out in random order, and block tables into it."""
    need = [-(-ctx // block_size) for ctx in context_lens]
    ids = list(range(sum(need) + 3))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    shape = (len(ids), block_size, kv_heads, head_dim)
    cache = (torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
    return cache, tables


def _both_backends(rng: random.Random, query_lens: list[int], context_lens: list[int], heads: int,
                   kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype):
    """(torch backend output, cpu backend output) for one random step of this shape."""
    cache, tables = _random_batch(rng, query_lens, context_lens, block_size, kv_heads, head_dim, dtype)
    total = sum(query_lens)
    q = torch.randn(total, heads, head_dim).to(dtype)
    k = torch.randn(total, kv_heads, head_dim).to(dtype)
    v = torch.randn(total, kv_heads, head_dim).to(dtype)
    ref, cpu = TorchPagedAttention(), CpuPagedAttention()
    meta = ref.build_metadata(query_lens, context_lens, tables, block_size, torch.device("cpu"))
    with torch.inference_mode():
        expected = ref.forward(q, k, v, (cache[0].clone(), cache[1].clone()), meta, head_dim ** -0.5)
        got = cpu.forward(q, k, v, cache, meta, head_dim ** -0.5)
    assert got.dtype == dtype and got.shape == expected.shape
    return expected, got


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),     # SmolLM2's shape
    (8, 2, 128, 16),    # Llama-3-style GQA, head_dim 128
    (4, 4, 32, 5),      # MHA, a head_dim with the generic vector path, blocks not a multiple of 16
    (6, 2, 24, 16),     # head_dim not a multiple of 16: the scalar path
])
def test_decodes_match_torch_backend(dtype, heads, kv_heads, head_dim, block_size):
    rng = random.Random(hash((str(dtype), heads, head_dim)) & 0xFFFF)
    torch.manual_seed(rng.randrange(1 << 30))
    # Contexts from 1 token to several blocks, not multiples of the block size.
    context_lens = [1, 2, 15, 16, 17, 33, 100, 257]
    expected, got = _both_backends(rng, [1] * len(context_lens), context_lens, heads, kv_heads, head_dim,
                                   block_size, dtype)
    assert (got.float() - expected.float()).abs().max().item() < TOLERANCE[dtype]


@needs_kernel
def test_mixed_prefill_and_decode_batch_matches_torch_backend():
    rng = random.Random(7)
    torch.manual_seed(7)
    # decode, fresh prompt, prompt chunk after cached tokens, decode
    expected, got = _both_backends(rng, [1, 20, 7, 1], [40, 20, 30, 3], 9, 3, 64, 16, torch.float32)
    assert (got - expected).abs().max().item() < 1e-5


def test_auto_falls_back_to_torch_without_a_compiler(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PIPESERVE_CACHE_DIR", str(tmp_path / "cache"))
    build.forget_loaded()
    try:
        with caplog.at_level(logging.WARNING):
            backend = select_backend("auto", "cpu")
        assert type(backend) is TorchPagedAttention
        assert "C decode kernel unavailable" in caplog.text
        with pytest.raises(build.KernelBuildError, match="C compiler"):
            select_backend("cpu", "cpu")
    finally:
        build.forget_loaded()


@needs_kernel
def test_backend_names_are_checked():
    assert isinstance(select_backend("auto", "cpu"), CpuPagedAttention)
    assert type(select_backend("torch", "cpu")) is TorchPagedAttention
    with pytest.raises(ValueError, match="auto, torch, cpu"):
        select_backend("flash", "cpu")


def _prefill_kernel_missing() -> str | None:
    missing = kernel_missing("paged_attention")
    if missing:
        return missing
    if not CpuPagedAttention().prefill_kernel_applies(torch.bfloat16, 64):
        return "this CPU has no AVX512_BF16: bf16 prefills use the torch path (covered elsewhere)"
    return None


needs_prefill_kernel = pytest.mark.skipif(_prefill_kernel_missing() is not None,
                                          reason=str(_prefill_kernel_missing()))


@needs_prefill_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),     # SmolLM2's shape
    (8, 2, 128, 16),    # Llama-3-style GQA, head_dim 128
    (4, 4, 32, 5),      # MHA, blocks not a multiple of the kernel's 16-key tiles
    (4, 1, 256, 16),    # MQA, head_dim 256
])
def test_bf16_prefills_match_torch_backend(heads, kv_heads, head_dim, block_size):
    rng = random.Random(head_dim * 31 + heads)
    torch.manual_seed(rng.randrange(1 << 30))
    # Fresh prompts (one token short of, at, and past tile edges), chunks after
    # cached tokens (a prefix hit / a later chunk), and a decode in between.
    query_lens = [2, 16, 17, 100, 1, 7, 40]
    context_lens = [2, 16, 17, 100, 50, 30, 333]
    expected, got = _both_backends(rng, query_lens, context_lens, heads, kv_heads, head_dim, block_size,
                                   torch.bfloat16)
    assert (got.float() - expected.float()).abs().max().item() < TOLERANCE[torch.bfloat16]


@needs_prefill_kernel
def test_prefill_kernel_leaves_other_dtypes_to_torch():
    cpu = CpuPagedAttention()
    assert not cpu.prefill_kernel_applies(torch.float32, 64)
    assert not cpu.prefill_kernel_applies(torch.float16, 64)
    assert not cpu.prefill_kernel_applies(torch.bfloat16, 48)
