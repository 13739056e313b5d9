"""The C attention kernels (``--attention-backend cpu``) against the PyTorch backend."""

from __future__ import annotations

import ctypes
import logging
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from pipeserve.kernels import build
from pipeserve.model.attention import TorchPagedAttention
from pipeserve.model.cpu_attention import CpuPagedAttention, select_backend
from tests.kernels import kernel_missing, skip_without_kernel

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


needs_kernel = skip_without_kernel("paged_attention")

# Builds a test can force on any x86 CPU: the native one, AVX-512 switched off (the
# AVX2 paths, on a CPU that has them), and no AVX2 (the portable C paths).
KERNEL_ISAS = {"native": [], "avx2": ["-mno-avx512f"], "portable": ["-mno-avx2"]}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":")[1].split()}


def expected_isa(name: str, native: str) -> str | None:
    """The path a build forced to ``name`` compiles here (None: this CPU cannot say, skip)."""
    if name == "native":
        return native
    if name == "portable":
        return "portable"
    return "avx2" if {"avx2", "fma", "f16c"} <= _cpu_flags() else None


def check_forced_isa(name: str, reported: str) -> None:
    """A kernel built under ``kernel_isa`` = ``name`` reports the path asked for (skip where this CPU cannot say)."""
    expected = expected_isa(name, reported)
    if expected is None:
        pytest.skip("this CPU has no AVX2 + FMA + F16C: the avx2 build is the portable one (covered there)")
    assert reported == expected


def compiler_with_flags(path: Path, flags: list[str]) -> str:
    """A CC that is the real compiler with ``flags`` appended (after build.py's -march=native)."""
    real = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or "cc"
    path.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ]; then exec {real} --version; fi\n'
                    f'exec {real} "$@" {" ".join(flags)}\n')
    path.chmod(0o755)
    return str(path)


@pytest.fixture(scope="session")
def isa_compilers(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """(CC, kernel cache) of each forced build, made once: each build is compiled once a session."""
    out = {}
    for name, flags in KERNEL_ISAS.items():
        if flags:
            folder = tmp_path_factory.mktemp(name)
            out[name] = (compiler_with_flags(folder / "cc", flags), str(folder / "cache"))
    return out


@pytest.fixture(params=list(KERNEL_ISAS))
def kernel_isa(request, isa_compilers, monkeypatch):
    """Runs a test once per build of KERNEL_ISAS (each in its own kernel cache); yields its name.

    Function-scoped: a module-scoped one stays active between its tests, so that a test of the
    module that does not ask for it (a native kernel's) would run on the last forced build."""
    if request.param in isa_compilers:
        cc, cache = isa_compilers[request.param]
        monkeypatch.setenv("CC", cc)
        monkeypatch.setenv("PIPESERVE_CACHE_DIR", cache)
    build.forget_loaded()
    try:
        yield request.param
    finally:
        build.forget_loaded()


def cpu_backend_on(isa: str) -> CpuPagedAttention:
    """The cpu backend of the build ``kernel_isa`` forced, after checking it compiled the path asked for."""
    backend = CpuPagedAttention()
    check_forced_isa(isa, backend.isa)
    return backend


def random_paged_batch(rng: random.Random, query_lens: list[int], context_lens: list[int], block_size: int,
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
                   kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                   cpu: CpuPagedAttention | None = None):
    """(torch backend output, cpu backend output) for one random step of this shape."""
    cache, tables = random_paged_batch(rng, query_lens, context_lens, block_size, kv_heads, head_dim, dtype)
    total = sum(query_lens)
    q = torch.randn(total, heads, head_dim).to(dtype)
    k = torch.randn(total, kv_heads, head_dim).to(dtype)
    v = torch.randn(total, kv_heads, head_dim).to(dtype)
    ref, cpu = TorchPagedAttention(), cpu or CpuPagedAttention()
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
    (40, 5, 64, 16),    # AVX-512: a pass of 4 kv heads (32 query heads) and one of the fifth
    (32, 1, 64, 16),    # MQA: one kv head of 32 query heads
    (4, 4, 32, 5),      # MHA, a head_dim with the generic vector path, blocks not a multiple of 16
    (6, 2, 24, 16),     # head_dim not a multiple of 16: the scalar path
])
def test_decodes_match_torch_backend(kernel_isa, dtype, heads, kv_heads, head_dim, block_size):
    cpu = cpu_backend_on(kernel_isa)
    rng = random.Random(f"{dtype}-{heads}-{head_dim}")   # hash() of a str differs per process
    torch.manual_seed(rng.randrange(1 << 30))
    # Contexts from 1 token to several blocks, not multiples of the block size.
    context_lens = [1, 2, 15, 16, 17, 33, 100, 257]
    expected, got = _both_backends(rng, [1] * len(context_lens), context_lens, heads, kv_heads, head_dim,
                                   block_size, dtype, cpu)
    assert (got.float() - expected.float()).abs().max().item() < TOLERANCE[dtype]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_lens,context_lens", [
    ([1, 20, 7, 1], [40, 20, 30, 3]),          # decode, fresh prompt, chunk after cached tokens, decode
    ([1, 1, 1, 20, 7], [40, 3, 77, 20, 30]),   # the decodes first, one run of rows: written in place
])
def test_mixed_prefill_and_decode_batch_matches_torch_backend(dtype, query_lens, context_lens):
    rng = random.Random(7)
    torch.manual_seed(7)
    expected, got = _both_backends(rng, query_lens, context_lens, 9, 3, 64, 16, dtype)
    assert (got.float() - expected.float()).abs().max().item() < TOLERANCE[dtype]


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

PREFILL_PATHS = ("amx", "avx512-bf16")


def prefill_backend(path: str) -> CpuPagedAttention:
    """The cpu backend with its prompts on the AMX tiles ("amx") or the vdpbf16ps loop."""
    backend = CpuPagedAttention()
    if path == "amx" and backend.prefill_amx is None:
        pytest.skip("this CPU (or Linux) gives no AMX-BF16 tiles: prompts run the vdpbf16ps loop (the other param)")
    if path != "amx":
        backend.prefill_amx = None
    return backend


@needs_prefill_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),     # SmolLM2's shape
    (8, 2, 128, 16),    # Llama-3-style GQA, head_dim 128
    (4, 4, 32, 5),      # MHA, blocks not a multiple of the kernel's 16-key tiles
    (4, 1, 256, 16),    # MQA, head_dim 256
])
@pytest.mark.parametrize("path", PREFILL_PATHS)
def test_bf16_prefills_match_torch_backend(path, heads, kv_heads, head_dim, block_size):
    rng = random.Random(head_dim * 31 + heads)
    torch.manual_seed(rng.randrange(1 << 30))
    # Fresh prompts (one token short of, at, and past tile edges), chunks after
    # cached tokens (a prefix hit / a later chunk), and a decode in between.
    query_lens = [2, 16, 17, 100, 1, 7, 40]
    context_lens = [2, 16, 17, 100, 50, 30, 333]
    expected, got = _both_backends(rng, query_lens, context_lens, heads, kv_heads, head_dim, block_size,
                                   torch.bfloat16, prefill_backend(path))
    assert (got.float() - expected.float()).abs().max().item() < TOLERANCE[torch.bfloat16]


@needs_prefill_kernel
def test_prefill_kernel_leaves_other_dtypes_to_torch():
    cpu = CpuPagedAttention()
    assert not cpu.prefill_kernel_applies(torch.float32, 64)
    assert not cpu.prefill_kernel_applies(torch.float16, 64)
    assert not cpu.prefill_kernel_applies(torch.bfloat16, 48)


# -- sliding windows and soft-capped scores, both backends against a float64 reference --------------

def reference_attention(q: torch.Tensor, cache, tables: list[list[int]], query_lens: list[int],
                        context_lens: list[int], block_size: int, scale: float, window: int | None,
                        softcap: float | None) -> torch.Tensor:
    """float64, one sequence at a time, every key read back by its position
    (transformers' rule: the query at position i sees keys j with i - window < j <= i)."""
    k_cache, v_cache = cache
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kv_heads
    out, row = torch.empty(q.shape, dtype=torch.float64), 0
    for q_len, ctx, table in zip(query_lens, context_lens, tables):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        keys = k_cache.reshape(-1, kv_heads, head_dim)[slots].double().repeat_interleave(group, dim=1)
        values = v_cache.reshape(-1, kv_heads, head_dim)[slots].double().repeat_interleave(group, dim=1)
        queries = q[row:row + q_len].double()                                    # [q_len, heads, D]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale             # [heads, q_len, ctx]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        pos_q = torch.arange(ctx - q_len, ctx).unsqueeze(1)
        pos_k = torch.arange(ctx).unsqueeze(0)
        seen = (pos_k <= pos_q) & ((pos_k > pos_q - window) if window is not None else True)
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
        out[row:row + q_len] = torch.einsum("hqk,khd->qhd", probs, values)
        row += q_len
    return out


def _attend(backend, rng: random.Random, query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype,
            window, softcap):
    """(backend output, float64 reference) for one random step."""
    cache, tables = random_paged_batch(rng, query_lens, context_lens, block_size, kv_heads, head_dim, dtype)
    total = sum(query_lens)
    # Queries 4x the usual spread: scores of several units, so a soft cap of 5 bends them.
    q = (4 * torch.randn(total, heads, head_dim)).to(dtype)
    k = torch.randn(total, kv_heads, head_dim).to(dtype)
    v = torch.randn(total, kv_heads, head_dim).to(dtype)
    meta = backend.build_metadata(query_lens, context_lens, tables, block_size, torch.device("cpu"))
    scale = head_dim ** -0.5
    with torch.inference_mode():
        got = backend.forward(q, k, v, cache, meta, scale, sliding_window=window, logit_softcap=softcap)
    return got, reference_attention(q, cache, tables, query_lens, context_lens, block_size, scale, window, softcap)


# Decodes (1 key .. many blocks), fresh prompts, and chunks after cached tokens (a prefix hit / a later chunk).
WINDOW_QUERY_LENS = [1, 1, 1, 1, 1, 2, 40, 7, 40, 1]
WINDOW_CONTEXT_LENS = [1, 15, 16, 17, 100, 2, 40, 30, 333, 257]
WINDOW_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 6e-2}   # bf16: scores of several units, rounded


WINDOW_CASES = pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),     # SmolLM2's shape (bf16: the AVX512_BF16 decode and prefill kernels)
    (4, 4, 32, 5),      # MHA, blocks not a multiple of 16: windows start inside blocks and tiles
    (6, 2, 24, 16),     # head_dim not a multiple of 16: the scalar decode path, torch prefills
])


def _window_and_softcap_check(backend, dtype, window, softcap, heads, kv_heads, head_dim, block_size) -> None:
    rng = random.Random(f"{head_dim}-{window}-{softcap}")   # hash(None) differs per process
    torch.manual_seed(rng.randrange(1 << 30))
    got, expected = _attend(backend, rng, WINDOW_QUERY_LENS, WINDOW_CONTEXT_LENS, heads, kv_heads, head_dim,
                            block_size, dtype, window, softcap)
    assert got.dtype == dtype
    assert (got.double() - expected).abs().max().item() < WINDOW_TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, None), (1, None), (37, None), (8, 5.0)])
@WINDOW_CASES
def test_window_and_softcap_match_reference_torch(dtype, window, softcap, heads, kv_heads, head_dim, block_size):
    _window_and_softcap_check(TorchPagedAttention(), dtype, window, softcap, heads, kv_heads, head_dim, block_size)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, None), (1, None), (37, None), (8, 5.0)])
@WINDOW_CASES
def test_window_and_softcap_match_reference_cpu(kernel_isa, dtype, window, softcap, heads, kv_heads, head_dim,
                                                block_size):
    _window_and_softcap_check(cpu_backend_on(kernel_isa), dtype, window, softcap, heads, kv_heads, head_dim,
                              block_size)


def test_window_and_softcap_change_the_reference():
    """The reference is sensitive to both, far beyond the tolerances (so the test above can fail)."""
    def reference(window, softcap):
        torch.manual_seed(3)
        return _attend(TorchPagedAttention(), random.Random(3), [1, 40], [100, 40], 4, 2, 32, 16,
                       torch.float32, window, softcap)[1]
    plain, windowed, capped = reference(None, None), reference(8, None), reference(8, 5.0)
    assert (plain - windowed).abs().max() > 0.3 and (windowed - capped).abs().max() > 0.3


@needs_prefill_kernel
@pytest.mark.parametrize("path", PREFILL_PATHS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (4, 1, 256)])
def test_bf16_prefill_follows_a_max_that_keeps_growing(path, heads, kv_heads, head_dim):
    """Keys scaled up with their position: each later block of keys holds scores several units
    above every earlier one, so the kernel's reference max moves again and again (what
    RESCALE_SLACK lets it skip for scores that stay close) and what was summed is rescaled."""
    rng = random.Random(head_dim)
    torch.manual_seed(head_dim)
    query_lens, context_lens, block_size = [300, 40, 17], [300, 200, 17], 16
    cache, tables = random_paged_batch(rng, query_lens, context_lens, block_size, kv_heads, head_dim,
                                       torch.bfloat16)
    total = sum(query_lens)
    ramp = torch.cat([torch.arange(ctx - n, ctx) for n, ctx in zip(query_lens, context_lens)]).float()
    q = torch.randn(total, heads, head_dim).abs().to(torch.bfloat16)
    k = (torch.randn(total, kv_heads, head_dim).abs() * (1 + ramp / 8).view(-1, 1, 1)).to(torch.bfloat16)
    v = torch.randn(total, kv_heads, head_dim).to(torch.bfloat16)
    for table, ctx, n in zip(tables, context_lens, query_lens):   # cached keys ramp up too
        for p in range(ctx - n):
            block, row = table[p // block_size], p % block_size
            cache[0][block, row] = (cache[0][block, row].float().abs() * (1 + p / 8)).to(torch.bfloat16)
    backend = prefill_backend(path)
    meta = backend.build_metadata(query_lens, context_lens, tables, block_size, torch.device("cpu"))
    scale = head_dim ** -0.5
    with torch.inference_mode():
        got = backend.forward(q, k, v, cache, meta, scale)
    expected = reference_attention(q, cache, tables, query_lens, context_lens, block_size, scale, None, None)
    assert (got.double() - expected).abs().max().item() < WINDOW_TOLERANCE[torch.bfloat16]


@needs_prefill_kernel
@pytest.mark.parametrize("path", PREFILL_PATHS)
@pytest.mark.parametrize("window,softcap", [(None, None), (1, None), (37, None), (8, 5.0), (None, 5.0)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 32, 5), (8, 2, 128, 16)])
def test_bf16_prefill_windows_and_softcaps_match_reference(path, window, softcap, heads, kv_heads, head_dim,
                                                           block_size):
    """Both prompt paths (the AMX tiles, the vdpbf16ps loop) with sliding windows that start
    inside blocks and tiles, and soft-capped scores, against the float64 reference."""
    _window_and_softcap_check(prefill_backend(path), torch.bfloat16, window, softcap, heads, kv_heads, head_dim,
                              block_size)


@needs_prefill_kernel
def test_prompts_take_the_amx_tiles_where_the_cpu_has_them():
    """On a CPU with AMX-BF16 the backend's prompts run pipeserve_paged_prefill_amx, within
    bfloat16 rounding of the vdpbf16ps loop's output (same staging; float32 summation order and
    the exponential's polynomial differ)."""
    backend = CpuPagedAttention()
    if "amx_bf16" not in _cpu_flags():
        assert backend.prefill_amx is None
        pytest.skip("this CPU has no AMX-BF16: only the vdpbf16ps loop runs (checked that it is the one bound)")
    assert backend.prefill_amx is not None
    calls = []
    amx = backend.prefill_amx
    backend.prefill_amx = lambda *args: calls.append(args) or amx(*args)
    rng = random.Random(5)
    torch.manual_seed(5)
    expected, got = _both_backends(rng, [40, 300], [60, 300], 9, 3, 64, 16, torch.bfloat16, backend)
    assert len(calls) == 1 and (got.float() - expected.float()).abs().max().item() < TOLERANCE[torch.bfloat16]
    loop = prefill_backend("avx512-bf16")
    rng = random.Random(5)
    torch.manual_seed(5)
    _, other = _both_backends(rng, [40, 300], [60, 300], 9, 3, 64, 16, torch.bfloat16, loop)
    assert 0 < (got.float() - other.float()).abs().max().item() < 2 ** -6


# -- split-K: one long decode cut into key ranges over threads, merged ------------------------------

def _split_span(context_lens: list[int], window: int | None, block_size: int, threads: int) -> int:
    lib = build.load_kernel("paged_attention")
    fn = lib.pipeserve_decode_split_span
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    fn.restype = ctypes.c_int64
    lens = torch.tensor(context_lens, dtype=torch.int64)
    return fn(lens.data_ptr(), len(context_lens), window or 0, block_size, threads)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, None), (333, None), (None, 5.0)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 32, 5), (6, 2, 24, 16)])
def test_a_long_decode_split_over_threads_matches_one_thread_and_the_reference(kernel_isa, dtype, window, softcap,
                                                                                heads, kv_heads, head_dim,
                                                                                block_size):
    cpu_backend_on(kernel_isa)
    context_lens = [1500, 3, 40]   # one long request next to short ones: it is cut, they are not
    threads = 4
    span = _split_span(context_lens, window, block_size, threads)
    assert 0 < span < 1500 and span % block_size == 0 and span >= 128   # the long one is split
    assert _split_span(context_lens, window, block_size, 1) == 0           # one thread: never
    outs = {}
    for n in (1, threads):
        rng = random.Random(f"{head_dim}-{window}-{softcap}")   # the same data for both
        torch.manual_seed(rng.randrange(1 << 30))
        old = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            outs[n] = _attend(cpu_backend_on(kernel_isa), rng, [1] * len(context_lens), context_lens, heads, kv_heads,
                              head_dim, block_size, dtype, window, softcap)
        finally:
            torch.set_num_threads(old)
    (one, expected), (split, expected_again) = outs[1], outs[threads]
    assert torch.equal(expected, expected_again)
    assert (split.double() - expected).abs().max().item() < WINDOW_TOLERANCE[dtype]
    # Only the order of the float32 sums differs (bf16 outputs: at most one rounding step
    # apart, and a bf16 step is 2**-7 of the value's magnitude, at least 2**-7 below 1).
    if dtype == torch.float32:
        assert (split - one).abs().max().item() <= 1e-5
    else:
        step = one.float().abs().clamp(min=1.0) * 2 ** -7
        assert bool(((split.float() - one.float()).abs() <= step).all())


def test_decode_only_metadata_matches_the_general_path():
    """A step of decodes alone takes ``build_metadata``'s one-tensor path; a prefill in the
    step takes the general one. Both must describe the decodes alike."""
    block_size, tables = 4, [[7, 3, 9], [2], [5, 6, 1, 8]]
    context_lens = [10, 3, 13]
    backend, cpu = TorchPagedAttention(), torch.device("cpu")
    fast = backend.build_metadata([1, 1, 1], context_lens, tables, block_size, cpu)
    # The prefill (2 new tokens, 5 in context) spans no more blocks than the widest decode.
    general = backend.build_metadata([1, 1, 1, 2], [*context_lens, 5], [*tables, [4, 0]], block_size, cpu)
    assert fast.prefills == [] and len(general.prefills) == 1
    assert fast.slot_mapping.tolist() == general.slot_mapping[:3].tolist() == [9 * 4 + 1, 2 * 4 + 2, 8 * 4 + 0]
    for name in ("query_index", "block_index", "context_lens"):
        assert torch.equal(getattr(fast.decodes, name), getattr(general.decodes, name)), name
    assert fast.decodes.block_index.tolist() == [[7, 3, 9, 0], [2, 0, 0, 0], [5, 6, 1, 8]]
    assert (fast.query_lens, fast.context_lens, fast.block_tables) == ([1, 1, 1], context_lens, tables)
    with pytest.raises(ValueError, match="cannot hold"):
        backend.build_metadata([1], [5], [[1]], block_size, cpu)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 100])
def test_many_decodes_over_threads_match_the_reference(kernel_isa, dtype, window):
    """A batch over the parallel threshold (PARALLEL_MIN_ROWS) on two threads, one long
    sequence split into key ranges beside 36 short ones (the other decode tests run on
    one thread, below the threshold, or split a single long sequence)."""
    cpu = cpu_backend_on(kernel_isa)
    rng = random.Random(f"many-{dtype}-{window}")
    torch.manual_seed(rng.randrange(1 << 30))
    context_lens = [rng.randrange(1, 300) for _ in range(36)] + [2000]
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got, expected = _attend(cpu, rng, [1] * len(context_lens), context_lens, 9, 3, 64, 16, dtype, window, None)
    finally:
        torch.set_num_threads(old)
    assert (got.double() - expected).abs().max().item() < WINDOW_TOLERANCE[dtype]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("late", [300, 650])
def test_a_decode_whose_largest_score_comes_late_matches_the_reference(kernel_isa, dtype, late):
    """One thread, one 700-key sequence (no split: the AVX512_BF16 path folds it in chunks of 256
    keys): one key per kv head is made to score ~20 (in the second chunk, or the third) and another
    ~10 (in the second), so the running max grows between chunks and what was summed before must be
    rescaled; a wrong rescale weights the early chunks by up to e^20."""
    cpu = cpu_backend_on(kernel_isa)
    rng = random.Random(f"late-{dtype}-{late}")
    torch.manual_seed(rng.randrange(1 << 30))
    heads, kv_heads, head_dim, block_size, ctx = 9, 3, 64, 16, 700
    group = heads // kv_heads
    cache, tables = random_paged_batch(rng, [1], [ctx], block_size, kv_heads, head_dim, dtype)
    u = torch.randn(kv_heads, head_dim)                                   # each kv head's query direction
    q = (u.repeat_interleave(group, 0) + 0.1 * torch.randn(heads, head_dim)).unsqueeze(0).to(dtype)
    for key, score in ((280, 10.0), (late, 20.0)):                       # q . k * head_dim ** -0.5 ~ score
        row = tables[0][key // block_size], key % block_size
        cache[0][row] = (u * (score * head_dim ** 0.5) / u.norm(dim=-1, keepdim=True) ** 2).to(dtype)
    k = torch.randn(1, kv_heads, head_dim).to(dtype)
    v = torch.randn(1, kv_heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        meta = cpu.build_metadata([1], [ctx], tables, block_size, torch.device("cpu"))
        with torch.inference_mode():
            got = cpu.forward(q, k, v, cache, meta, scale)
    finally:
        torch.set_num_threads(old)
    expected = reference_attention(q, cache, tables, [1], [ctx], block_size, scale, None, None)
    assert (got.double() - expected).abs().max().item() < WINDOW_TOLERANCE[dtype]


# -- bfloat16 queries and outputs through the kernel (pipeserve_paged_decode_io) -----------------

def _decode_both_entry_points(cpu: CpuPagedAttention, rng: random.Random, context_lens: list[int], heads: int,
                              kv_heads: int, head_dim: int, block_size: int, cache_dtype: torch.dtype):
    """(bfloat16-io output, float32-entry-point output) of one decode step of a bfloat16 model."""
    from pipeserve.model.attention import ScoreShape
    from pipeserve.model.kv_quant import quantize
    cache, tables = random_paged_batch(rng, [1] * len(context_lens), context_lens, block_size, kv_heads, head_dim,
                                       torch.float32)
    if cache_dtype == torch.int8:
        cache = tuple(quantize(c, torch.int8) for c in cache)
    else:
        cache = tuple(c.to(cache_dtype) for c in cache)
    q = (4 * torch.randn(len(context_lens), heads, head_dim)).to(torch.bfloat16)
    meta = cpu.build_metadata([1] * len(context_lens), context_lens, tables, block_size, torch.device("cpu"))
    shape = ScoreShape(head_dim ** -0.5)
    io = cpu.attend_decodes(q, cache[0], cache[1], meta.decodes, shape)
    kernel, cpu.decode_io_kernel = cpu.decode_io_kernel, None    # the float32 entry point and torch's .to
    try:
        plain = cpu.attend_decodes(q, cache[0], cache[1], meta.decodes, shape)
    finally:
        cpu.decode_io_kernel = kernel
    return io, plain


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2), (16, 2)])   # GQA ratios 1, 3, 4, 8
def test_bf16_io_decode_equals_the_float32_entry_point(kernel_isa, cache_dtype, threads, heads, kv_heads):
    """A bfloat16 model's decodes read q and write out as bfloat16 in the kernel: bit for bit
    what the float32 entry point gives after torch's conversions (both round to nearest even),
    at context 1, block boundaries, a long split sequence, and many sequences over threads."""
    cpu = cpu_backend_on(kernel_isa)
    rng = random.Random(f"io-{cache_dtype}-{threads}-{heads}-{kv_heads}")
    torch.manual_seed(rng.randrange(1 << 30))
    context_lens = [1, 15, 16, 17, 31, 32, 33, 2500] + [rng.randrange(1, 200) for _ in range(40)]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        io, plain = _decode_both_entry_points(cpu, rng, context_lens, heads, kv_heads, 64, 16, cache_dtype)
    finally:
        torch.set_num_threads(old)
    assert io.dtype == plain.dtype == torch.bfloat16
    assert torch.equal(io, plain)


@needs_kernel
def test_decode_pool_concurrent_and_repeated_calls_match_one_thread():
    """The decode's thread pool: many calls in a row (each a new job of the same helpers), and
    calls from several Python threads at once (one owns the pool, the others run on their
    callers), all equal to the same step on one thread up to the split's merge order."""
    import threading
    from pipeserve.model.attention import ScoreShape
    cpu = CpuPagedAttention()
    rng = random.Random("pool")
    torch.manual_seed(rng.randrange(1 << 30))
    context_lens = [3000, 5, 700]     # over PARALLEL_MIN_ROWS: two threads split the long one
    cache, tables = random_paged_batch(rng, [1] * 3, context_lens, 16, 3, 64, torch.float32)
    q = torch.randn(3, 9, 64)
    shape = ScoreShape(0.125)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.attend_decodes(q, *cache, cpu.build_metadata([1] * 3, context_lens, tables, 16,
                                                              torch.device("cpu")).decodes, shape)
        torch.set_num_threads(2)
        g = cpu.build_metadata([1] * 3, context_lens, tables, 16, torch.device("cpu")).decodes
        first = cpu.attend_decodes(q, *cache, g, shape)
        results, errors = [], []

        def calls() -> None:
            try:
                for _ in range(20):
                    results.append(cpu.attend_decodes(q, *cache, g, shape))
            except Exception as exc:   # surfaced below: a thread's exception is otherwise lost
                errors.append(exc)

        threads = [threading.Thread(target=calls) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(old)
    assert not errors and len(results) == 60
    assert (first - one).abs().max().item() <= 1e-5
    # Same plan (the step's threads), so the same ranges and merge order whoever ran the items.
    assert all(torch.equal(r, first) for r in results)


def _plan(context_lens: list[int], window: int, block_size: int, threads: int, heads: int = 9, kv_heads: int = 3,
          head_dim: int = 64) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """A decode plan's items (sequence, first key, end) and each thread's share (i0, i1)."""
    lib = build.load_kernel("paged_attention")
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.pipeserve_decode_plan_bytes.argtypes = [i64, i64, i64, ctypes.c_int]
    lib.pipeserve_decode_plan_bytes.restype = i64
    lib.pipeserve_decode_plan.argtypes = [p, p, i64, i64, i64, i64, i64, i64, ctypes.c_int]
    lib.pipeserve_decode_plan.restype = i64
    lens = torch.tensor(context_lens, dtype=torch.int64)
    buf = torch.empty(lib.pipeserve_decode_plan_bytes(len(context_lens), heads, head_dim, threads) + 64,
                      dtype=torch.uint8)
    addr = (buf.data_ptr() + 63) // 64 * 64
    items = lib.pipeserve_decode_plan(addr, lens.data_ptr(), len(context_lens), heads, kv_heads, head_dim, block_size,
                                      window, threads)
    assert items > 0
    out = [i64(), i64(), i64()]
    found = []
    for c in range(items):
        lib.pipeserve_decode_item(p(addr), i64(c), *(ctypes.byref(v) for v in out))
        found.append(tuple(v.value for v in out))
    shares = []
    for t in range(threads):
        lib.pipeserve_decode_share(p(addr), ctypes.c_int(t), ctypes.byref(out[0]), ctypes.byref(out[1]))
        shares.append((out[0].value, out[1].value))
    return found, shares


@needs_kernel
@pytest.mark.parametrize("context_lens,window,threads", [
    ([300], 0, 2), ([129], 0, 2), ([384, 7], 0, 2), ([1500, 3, 40], 0, 4), ([1500, 3, 40], 333, 4),
    ([200] * 57, 0, 2), ([40, 900, 35, 600, 2, 77], 100, 3), ([5000], 0, 2), ([520, 520], 0, 5)])
def test_each_thread_of_the_fused_stage_gets_its_share_of_the_keys(context_lens, window, threads):
    """decode_stage.c hands thread t the plan's items share[t]..share[t + 1]: they tile every
    sequence's keys in order (from its window's start), and each share holds 1 / threads of
    the step's keys to within a block, however few the sequences (one alone was split at 128
    keys a range: a 300-key decode gave one thread 172 keys and the other 128)."""
    block_size = 16
    items, shares = _plan(context_lens, window, block_size, threads)
    starts = [max(0, ctx - window) if window else 0 for ctx in context_lens]
    pos = {}
    for seq, lo, hi in items:                       # in sequence order, each range after the last
        assert lo == pos.get(seq, starts[seq]) and lo < hi <= context_lens[seq]
        pos[seq] = hi
    assert pos == dict(enumerate(context_lens))
    assert [seq for seq, _, _ in items] == sorted(seq for seq, _, _ in items)
    assert shares[0][0] == 0 and shares[-1][1] == len(items)
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
    total = sum(ctx - s for ctx, s in zip(context_lens, starts))
    for i0, i1 in shares:
        keys = sum(hi - lo for _, lo, hi in items[i0:i1])
        assert abs(keys - total / threads) <= block_size, (keys, total / threads)


@needs_kernel
def test_a_small_step_is_shared_out_in_whole_sequences():
    """Under 64 keys a thread (SHARE_MIN_KEYS) no sequence is cut: each share is whole
    sequences, the nearest cut to an even split (so a few short decodes keep one range each,
    and the fused stage's result is the Python layers' bit for bit)."""
    items, shares = _plan([20, 31, 25, 30], 0, 16, 2)
    assert [(lo, hi) for _, lo, hi in items] == [(0, 20), (0, 31), (0, 25), (0, 30)]
    assert shares == [(0, 2), (2, 4)]
    items, shares = _plan([100], 0, 16, 2)          # 50 keys a thread: one range, one thread
    assert items == [(0, 0, 100)] and shares in ([(0, 0), (0, 1)], [(0, 1), (1, 1)])
