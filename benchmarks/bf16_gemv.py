"""bf16_gemv.c against F.linear on a plain bfloat16 weight, at the rows of a decode step.

For each of SmolLM2-135M's layer shapes and its head, the weight is one of enough distinct
copies that they do not fit in the last-level cache (every matrix read from memory once per
call, as in a decode step), timed over all copies, best of 3, at 1 to 8 rows of x and 1 and 2
threads; GB/s = the weight's bytes / time per call.

    PYTHONPATH=$PWD python benchmarks/bf16_gemv.py [--threads 1,2] [--rows 1,2,4,8]

From 5 rows the layers take F.linear (``pipeserve_bf16_gemv_max_rows``): the 8-row column is
what that choice rests on (the kernel is called directly there).
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch
import torch.nn.functional as F

from pipeserve.kernels.build import load_kernel

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
COLD_BYTES = 160 << 20


def _kernel():
    lib = load_kernel("bf16_gemv")
    lib.pipeserve_bf16_gemv_isa.restype = ctypes.c_char_p
    fn = lib.pipeserve_bf16_gemv
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, i64, p, i64, p, p, ctypes.c_int]
    return lib.pipeserve_bf16_gemv_isa().decode(), fn


def _best(fn, weights: list[torch.Tensor]) -> float:
    for w in weights[:2]:
        fn(w)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for w in weights:
            fn(w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="1,2,4,8")
    args = parser.parse_args()
    isa, fn = _kernel()
    print(f"bf16_gemv.c: {isa}")
    if isa == "none":
        return
    gen = torch.Generator().manual_seed(0)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for name, (n, k) in SHAPES.items():
            weights = [torch.randn(n, k, generator=gen).bfloat16() for _ in range(max(1, COLD_BYTES // (n * k * 2)))]
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k, generator=gen).bfloat16()
                out = torch.empty(rows, n, dtype=torch.bfloat16)

                def gemv(w: torch.Tensor) -> None:
                    if fn(w.data_ptr(), n, k, x.data_ptr(), rows, None, out.data_ptr(), threads) != 0:
                        raise RuntimeError("bf16_gemv.c refused the call")

                linear = _best(lambda w: F.linear(x, w), weights)
                ours = _best(gemv, weights)
                print(f"threads={threads} {name:8} {n}x{k} rows={rows}  F.linear {linear * 1e6:8.1f} us "
                      f"{n * k * 2 / linear / 1e9:5.1f} GB/s  bf16_gemv {ours * 1e6:8.1f} us "
                      f"{n * k * 2 / ours / 1e9:5.1f} GB/s  {linear / ours:.2f}x")


if __name__ == "__main__":
    main()
