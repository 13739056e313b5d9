"""The prompt attention kernel (``pipeserve_paged_prefill``) of one or more builds, side by side.

Build each ``paged_attention.c`` to compare (this tree's, a base worktree's)::

    gcc -O3 -march=native -fopenmp -fPIC -shared -std=gnu11 -Ipipeserve/kernels X.c -o X.so -lm

then ``python benchmarks/prefill_attention.py base.so new.so``: the builds take turns on the
same step (prompts of ``--lens`` tokens, a bf16 cache whose blocks are handed out in random
order), one thread, and each prints its median and best GFLOP/s of the causal work
(4 * heads * head_dim per (query, key) pair a query sees) and its largest difference from the
first build's output. ``X.so:amx`` runs that build's ``pipeserve_paged_prefill_amx`` (AMX tiles)
instead: ``python benchmarks/prefill_attention.py new.so new.so:amx``.
``--cold``: a cache of ``--blocks`` blocks and a 64 MiB sweep before every
call, so the staging reads the rows from memory, as a stage does after the decodes' traffic.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import torch

from pipeserve.model.cpu_attention import PREFILL_ARGTYPES

BF16 = 1   # the kernel's dtype code for a bfloat16 cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("libs", nargs="+", help="builds of paged_attention.c (.so; .so:amx for the AMX entry point)")
    ap.add_argument("--lens", default="320,200,450,128", help="prompt lengths of the step (comma-separated)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=5461, help="cache blocks with --cold (SmolLM2's 1 GiB stage)")
    ap.add_argument("--cold", action="store_true", help="rows from memory: a big cache, swept between calls")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()

    torch.manual_seed(0)
    lens = [int(n) for n in args.lens.split(",")]
    bs, kvh, d = args.block_size, args.kv_heads, args.head_dim
    need = [-(-n // bs) for n in lens]
    nblocks = max(sum(need) + 8, args.blocks if args.cold else 0)
    k_cache = (torch.randn(nblocks, bs, kvh, d) * 0.5).to(torch.bfloat16)
    v_cache = torch.randn(nblocks, bs, kvh, d).to(torch.bfloat16)
    order = torch.randperm(nblocks).tolist()
    tables = torch.zeros(len(lens), max(need), dtype=torch.int64)
    seqs, row = [], 0
    for i, (n, nb) in enumerate(zip(lens, need)):
        tables[i, :nb] = torch.tensor([order.pop() for _ in range(nb)])
        seqs.append([row, n, n, 0])
        row += n
    seqs_t = torch.tensor(seqs, dtype=torch.int64)
    q = torch.randn(row, args.heads, d).to(torch.bfloat16)
    flops = sum(4 * args.heads * d * (n * (n + 1) // 2) for n in lens)
    sweep = torch.zeros(16 << 20) if args.cold else None     # 64 MiB

    kernels = []
    for path in args.libs:
        lib, _, entry = path.partition(":")
        fn = getattr(ctypes.CDLL(os.path.abspath(lib)), "pipeserve_paged_prefill_amx" if entry == "amx"
                     else "pipeserve_paged_prefill")
        fn.argtypes, fn.restype = PREFILL_ARGTYPES, ctypes.c_int
        kernels.append((path, fn, torch.zeros_like(q), []))

    def call(fn, out) -> None:
        rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), BF16, seqs_t.data_ptr(), len(lens),
                tables.data_ptr(), tables.shape[1], args.heads, kvh, d, bs, d ** -0.5, 0, 0.0, out.data_ptr(), 1)
        if rc != 0:
            raise SystemExit(f"the prefill kernel returned {rc} (no AVX512_BF16 or AMX kernel in this build?)")

    for _, fn, out, _ in kernels:
        call(fn, out)
    for _ in range(args.reps):
        for _, fn, out, times in kernels:
            if sweep is not None:
                sweep.add_(1)
            t0 = time.perf_counter()
            call(fn, out)
            times.append(time.perf_counter() - t0)
    first = kernels[0][2].float()
    print(f"prompts {lens}, heads {args.heads}/{kvh}, head_dim {d}, {'cold' if args.cold else 'hot'}, "
          f"{args.reps} calls each")
    for path, _, out, times in kernels:
        med = statistics.median(times)
        print(f"{path}: median {med * 1e3:.3f} ms  {flops / med / 1e9:.1f} GFLOP/s  "
              f"(best {flops / min(times) / 1e9:.1f})  max |out - first| {(out.float() - first).abs().max():.3g}")


if __name__ == "__main__":
    main()
