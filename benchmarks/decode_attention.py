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
the same working set, same threads). The machine is shared: the best of
``--rounds`` is reported for both.

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
        self.shape = ScoreShape(head_dim ** -0.5)

    def seconds_per_call(self, backend, rounds: int) -> float:
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            for (k, v), g in zip(self.caches, self.batches):
                backend.attend_decodes(self.q, k, v, g, self.shape)
            best = min(best, (time.perf_counter() - start) / self.layers)
        return best


def with_decode_from(path: str) -> CpuPagedAttention:
    """The cpu backend, its decode entry point taken from the library at ``path`` (same C signature)."""
    backend = CpuPagedAttention()
    other = ctypes.CDLL(path).pipeserve_paged_decode
    other.argtypes, other.restype = backend._decode.argtypes, backend._decode.restype
    backend._decode = other
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
    parser.add_argument("--compare-kernel", metavar="SO", default=None,
                        help="also time the decode entry point of another build of paged_attention.c "
                             "(e.g. an older one from ~/.cache/pipeserve/kernels), as backend 'other'")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    backends = {name: select_backend(name, "cpu") for name in args.backends.split(",")}
    if args.compare_kernel:
        backends["other"] = with_decode_from(args.compare_kernel)
    print(f"read = plain memory read (torch.sum, float32, {args.working_set_mb} MiB, {args.threads} threads), "
          f"measured before each case; block size {args.block_size}")
    kv_names = args.kv_cache_dtypes.split(",")
    print(f"{'dtype':9} {'cache':>5} {'batch x ctx':>12} {'KV/call':>9} {'read GB/s':>9} {'backend':>8} "
          f"{'us/call':>9} {'GB/s':>6} {'of read':>8} {'ns/key/kvh':>10} {'x auto':>7}")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for spec in args.cases.split(","):
            batch, ctx = (int(x) for x in spec.split("x"))
            cases = {kv: Case(batch, ctx, dtype, args.heads, args.kv_heads, args.head_dim, args.block_size,
                              args.working_set_mb, seed=batch * 100003 + ctx, kv_dtype=cache_dtype(kv, dtype))
                     for kv in kv_names}
            read = memory_read_gbs(args.working_set_mb, args.rounds)   # next to each case: the load drifts
            for name, backend in backends.items():
                best = {}
                for case in cases.values():
                    case.seconds_per_call(backend, 1)   # warm-up (kernel build, allocator)
                for _ in range(args.rounds):           # cache dtypes alternate: the load hits them alike
                    for kv, case in cases.items():
                        best[kv] = min(best.get(kv, float("inf")), case.seconds_per_call(backend, 1))
                for kv, case in cases.items():
                    t = best[kv]
                    gbs = case.kv_bytes / t / 1e9
                    per_key = t / (batch * ctx * args.kv_heads) * 1e9
                    vs_auto = f"{best['auto'] / t:6.2f}x" if "auto" in best else "-"
                    print(f"{dtype_name:9} {kv:>5} {f'{batch} x {ctx}':>12} {case.kv_bytes / 2 ** 20:7.2f}Mi "
                          f"{read:9.1f} {name:>8} {t * 1e6:9.1f} {gbs:6.2f} {gbs / read:8.0%} {per_key:10.1f} "
                          f"{vs_auto:>7}", flush=True)
            del cases


if __name__ == "__main__":
    main()
