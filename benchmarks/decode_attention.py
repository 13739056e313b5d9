"""Decode attention against the machine's memory bandwidth, in one run.

Each case is one decode step's attention of one layer (SmolLM2-135M's shape by
default: 9 query heads, 3 kv heads, head_dim 64, blocks of 16 tokens) through
an attention backend's ``attend_decodes``, Python glue included, as the
engine calls it. So that the KV comes from memory and not from the caches,
every case owns enough layers' caches (all different tensors, blocks in a
random order as a busy block pool hands them out) that one sweep over them
reads at least ``--working-set-mb`` MiB, and each timing walks that sweep.

Bandwidth = KV bytes a call must read (K and V rows of every attended token)
/ time per call; "of read" divides it by a plain memory read measured in
the same run, right before the case (``torch.sum`` over a float32 tensor of
the same working set, same threads, best of its tries). A call's time is the
median of ``--rounds`` sweeps ("best" beside it); within a round every backend
and cache dtype of a case takes its turn, so before/after (``--compare-kernel``)
share the machine's load.

``--kernel-only`` adds, per cpu backend, the C entry point called straight
through ctypes with its arguments made once (backend name + ``/C``): no
``attend_decodes`` glue (the query's conversion, the output tensor, the argument
checks), so the gap between the two rows is what the glue costs per call.

``--kv-cache-dtypes auto,int8,fp8`` also times 8-bit caches (``--kv-cache-dtype``:
head_dim one-byte codes and a float32 scale per row) for each query dtype; the
cache dtypes of one case are timed in alternating rounds, and "x auto" is the
model-dtype cache's time over this one's (same run, so it holds on a loaded
machine). Their GB/s count the bytes actually read (codes and scales).

    PYTHONPATH=$PWD python benchmarks/decode_attention.py --backends cpu,torch
    PYTHONPATH=$PWD python benchmarks/decode_attention.py --dtypes bfloat16 --kv-cache-dtypes auto,int8,fp8
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import time

import torch

from pipeserve.model.attention import DecodeBatch, ScoreShape, block_index_of
from pipeserve.model.cpu_attention import CpuPagedAttention, select_backend
from pipeserve.model.kv_quant import cache_dtype, is_quantized, quantize, row_bytes, row_elements
from pipeserve.worker.model_runner import zeros_on_huge_pages

CASES = [(1, 128), (1, 512), (1, 1024), (1, 2048), (1, 4096), (64, 512)]   # (batch, context)


def memory_read_gbs(mib: int, rounds: int) -> float:
    """GB/s of torch.sum over a float32 tensor of ``mib`` MiB (a plain streaming read)."""
    x = torch.ones(mib * 2 ** 18)
    x.sum()
    best = float("inf")
    for _ in range(rounds * 3):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


class Case:
    """``layers`` independent layer caches of one (batch, context) decode step."""

    def __init__(self, batch: int, ctx: int, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                 block_size: int, working_set_mb: int, seed: int, kv_dtype: torch.dtype | None = None) -> None:
        """``kv_dtype``: the cache's (None: ``dtype``; int8 / float8_e4m3fn: 8-bit rows)."""
        rng = random.Random(seed)
        kv_dtype = kv_dtype or dtype
        blocks_per_seq = (ctx + block_size - 1) // block_size
        self.kv_bytes = 2 * batch * ctx * kv_heads * row_bytes(head_dim, kv_dtype)
        self.layers = max(1, working_set_mb * 2 ** 20 // self.kv_bytes)
        pool = batch * blocks_per_seq + 16                # a pool a little larger than the step needs
        # One allocation for all layers, on huge pages where the kernel allows, as the engine's cache.
        shape = (self.layers * pool, block_size, kv_heads, row_elements(head_dim, kv_dtype))
        k_all, v_all = zeros_on_huge_pages(shape, kv_dtype), zeros_on_huge_pages(shape, kv_dtype)
        for t in (k_all, v_all):
            for chunk in t.split(4096):
                values = torch.randn(*chunk.shape[:-1], head_dim)
                if is_quantized(kv_dtype):
                    chunk.view(torch.uint8).copy_(quantize(values, kv_dtype).view(torch.uint8))
                else:
                    chunk.copy_(values)
        self.caches, self.batches = [], []
        for layer in range(self.layers):
            k, v = k_all[layer * pool:(layer + 1) * pool], v_all[layer * pool:(layer + 1) * pool]
            order = list(range(pool))
            rng.shuffle(order)
            tables = [order[b * blocks_per_seq:(b + 1) * blocks_per_seq] for b in range(batch)]
            self.caches.append((k, v))
            self.batches.append(DecodeBatch(torch.arange(batch), block_index_of(tables, [ctx] * batch, block_size),
                                            torch.full((batch,), ctx, dtype=torch.int64), block_size))
        self.q = torch.randn(batch, heads, head_dim).to(dtype)
        # The C entry point's query and output (kernel_calls): one pair per case, as every
        # backend's calls point at them.
        self.q32 = self.q.float().contiguous()
        self.out32 = torch.empty_like(self.q32)
        self.shape = ScoreShape(head_dim ** -0.5)

    def seconds_per_call(self, backend) -> float:
        """One sweep over the layers through ``attend_decodes``: seconds per call."""
        start = time.perf_counter()
        for (k, v), g in zip(self.caches, self.batches):
            backend.attend_decodes(self.q, k, v, g, self.shape)
        return (time.perf_counter() - start) / self.layers

    def kernel_calls(self, backend: CpuPagedAttention) -> list[tuple]:
        """Per layer, the arguments of ``pipeserve_paged_decode``, for timing the C entry point
        without ``attend_decodes``' glue."""
        return [backend.decode_kernel_args(self.q32, k, v, backend.decode_args(g), self.shape, self.out32,
                                           bf16_math=self.q.dtype == torch.bfloat16)
                for (k, v), g in zip(self.caches, self.batches)]


def kernel_seconds_per_call(decode, calls: list[tuple]) -> float:
    """One sweep of the C entry point ``decode`` over the layers' ``calls``: seconds per call."""
    start = time.perf_counter()
    for args in calls:
        if decode(*args) != 0:
            raise MemoryError("paged decode kernel could not allocate its work buffer")
    return (time.perf_counter() - start) / len(calls)


def with_decode_from(path: str) -> CpuPagedAttention:
    """The cpu backend, its decode entry point taken from the library at ``path`` (same C signature)."""
    backend = CpuPagedAttention()
    lib = ctypes.CDLL(path)
    other = lib.pipeserve_paged_decode
    other.argtypes, other.restype = backend.decode_kernel.argtypes, backend.decode_kernel.restype
    backend.decode_kernel = other
    # Builds before pipeserve_paged_decode_io: bfloat16 queries take the float32 entry point, as then.
    other_io = getattr(lib, "pipeserve_paged_decode_io", None)
    if other_io is not None:
        other_io.argtypes, other_io.restype = backend.decode_io_kernel.argtypes, backend.decode_io_kernel.restype
    backend.decode_io_kernel = other_io
    return backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="cpu", help="comma-separated --attention-backend names")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="query (model) dtypes")
    parser.add_argument("--kv-cache-dtypes", default="auto",
                        help="comma-separated --kv-cache-dtype values per query dtype: auto, int8, fp8")
    parser.add_argument("--cases", default=",".join(f"{b}x{c}" for b, c in CASES), help="BATCHxCONTEXT,...")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--working-set-mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare-kernel", metavar="SO", action="append", default=[],
                        help="also time the decode entry point of another build of paged_attention.c "
                             "(e.g. an older one from ~/.cache/pipeserve/kernels), as backend 'other'; "
                             "repeat it for more builds (other2, other3, ...)")
    parser.add_argument("--kernel-only", action="store_true",
                        help="also time each cpu backend's C entry point without attend_decodes' glue")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    backends = {name: select_backend(name, "cpu") for name in args.backends.split(",")}
    for i, path in enumerate(args.compare_kernel):
        backends["other" + (str(i + 1) if i else "")] = with_decode_from(path)
    print(f"read = plain memory read (torch.sum, float32, {args.working_set_mb} MiB, {args.threads} threads), "
          f"measured before each case; block size {args.block_size}; us/call: median of {args.rounds} rounds "
          f"(best beside it); /C = the C entry point without attend_decodes' glue")
    kv_names = args.kv_cache_dtypes.split(",")
    print(f"{'dtype':9} {'cache':>5} {'batch x ctx':>12} {'KV/call':>9} {'read GB/s':>9} {'backend':>8} "
          f"{'us/call':>9} {'best':>7} {'GB/s':>6} {'of read':>8} {'ns/key/kvh':>10} {'x auto':>7}")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for spec in args.cases.split(","):
            batch, ctx = (int(x) for x in spec.split("x"))
            cases = {kv: Case(batch, ctx, dtype, args.heads, args.kv_heads, args.head_dim, args.block_size,
                              args.working_set_mb, seed=batch * 100003 + ctx, kv_dtype=cache_dtype(kv, dtype))
                     for kv in kv_names}
            read = memory_read_gbs(args.working_set_mb, args.rounds)   # next to each case: the load drifts
            timers = case_timers(backends, cases, args.kernel_only)
            for timer in timers.values():
                timer()                                  # warm-up (kernel build, allocator)
            times = {key: [] for key in timers}
            for _ in range(args.rounds):                 # everything of a case alternates: the load hits it alike
                for key, timer in timers.items():
                    times[key].append(timer())
            for (name, kv), ts in times.items():
                t, best = statistics.median(ts), min(ts)
                case = cases[kv]
                gbs = case.kv_bytes / t / 1e9
                per_key = t / (batch * ctx * args.kv_heads) * 1e9
                auto = times.get((name, "auto"))
                vs_auto = f"{statistics.median(auto) / t:6.2f}x" if auto else "-"
                print(f"{dtype_name:9} {kv:>5} {f'{batch} x {ctx}':>12} {case.kv_bytes / 2 ** 20:7.2f}Mi "
                      f"{read:9.1f} {name:>8} {t * 1e6:9.1f} {best * 1e6:7.1f} {gbs:6.2f} {gbs / read:8.0%} "
                      f"{per_key:10.1f} {vs_auto:>7}", flush=True)
            del cases, timers


def case_timers(backends: dict, cases: dict, kernel_only: bool) -> dict:
    """(backend name, cache dtype) -> a function timing one sweep of that case (seconds per call)."""
    timers = {}
    for name, backend in backends.items():
        for kv, case in cases.items():
            timers[name, kv] = lambda backend=backend, case=case: case.seconds_per_call(backend)
            if kernel_only and isinstance(backend, CpuPagedAttention):
                calls = case.kernel_calls(backend)
                timers[f"{name}/C", kv] = lambda decode=backend.decode_kernel, calls=calls: (
                    kernel_seconds_per_call(decode, calls))
    return timers

if __name__ == "__main__":
    main()
