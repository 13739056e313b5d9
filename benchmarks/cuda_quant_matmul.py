"""Kept-quantized matmuls on a CUDA GPU: the Triton kernels beside PyTorch's ops and a dense weight.

For a few weight types and shapes, and rows of activations from decode's 1 to prefill's 1024,
times (CUDA events, median of ``--iters`` after warm-up):

- ``fused``: cuda_kernels.py's gemv (a program per weight row, dequantized in registers; to 64 rows);
- ``deq+mm``: its dequantize kernel into the activations' dtype, then ``F.linear`` (cuBLAS);
- ``torch``: ``packed.dequantize`` in PyTorch ops, then ``F.linear`` (the path before the kernels);
- ``dense``: ``F.linear`` on the weight already dequantized (what ``--quantization none`` runs).

First, per type, the host's side on a small weight: each path's first call (Triton's compilation)
and its wall time per call back to back (the launch cost a decode step of ~60 matmuls pays).

GB/s is the quantized weight's bytes over the fused kernel's time (decode reads them once), to
compare with the GPU's memory bandwidth. The engine takes ``fused`` up to
``PIPESERVE_CUDA_FUSED_MAX_ROWS`` rows (1), then ``deq+mm``: this table is where that number comes from.

    python benchmarks/cuda_quant_matmul.py [--dtype bfloat16] [--types Q4_K,Q8_0] [--shapes 4096x4096,14336x4096]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from pipeserve.model.quant import cuda_kernels as ck
from pipeserve.model.quant.gguf_repack import T, repack
from pipeserve.model.quant.packed import dequantize
from tests.checkpoints import random_quant_blocks   # random blocks, scales of a trained model's size


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():   # a dry run of the script on the CPU (TRITON_INTERPRET=1)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def host_costs(name: str, dtype, device: str, calls: int = 200) -> None:
    """A 256 x 256 weight, so the GPU's work is negligible: the first call of each path (Triton
    compiles, or loads from its cache, a kernel variant then) and the wall time per call of
    ``calls`` back to back with one synchronization (the host's launch cost, which bounds a
    step of many small matmuls)."""
    rng = np.random.default_rng(1)
    w = repack(T[name], random_quant_blocks(T[name], 256, 256, rng)).map(lambda t: t.to(device))
    dense = dequantize(w, dtype)
    cases = {"gemv": lambda x: ck.matmul(w, x, fused=True), "deq+mm": lambda x: ck.matmul(w, x, fused=False),
             "torch": lambda x: F.linear(x, dequantize(w, dtype)), "dense": lambda x: F.linear(x, dense)}
    line = []
    for label, fn in cases.items():
        x = torch.randn(1 if label == "gemv" else 2, 256, device=device).to(dtype)
        start = time.perf_counter()
        fn(x)
        sync(device)
        first = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        sync(device)
        line.append(f"{label} first {first * 1e3:.0f} ms, {(time.perf_counter() - start) / calls * 1e6:.1f} us/call")
    print(f"host, {name} 256 x 256: " + "; ".join(line), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--types", default="Q4_K,Q8_0,Q6_K")
    ap.add_argument("--shapes", default="4096x4096,14336x4096", help="out x in, comma-separated")
    ap.add_argument("--rows", default="1,4,16,64,256,1024")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    rng = np.random.default_rng(0)
    print(f"device {torch.cuda.get_device_name(0) if args.device.startswith('cuda') else args.device}, "
          f"activations {args.dtype}; times in microseconds (median of {args.iters})")
    for name in args.types.split(","):
        host_costs(name, dtype, args.device)
    print(f"{'type':6} {'shape':>11} {'MB':>6} {'rows':>5} {'fused':>8} {'deq+mm':>8} {'torch':>8} {'dense':>8} "
          f"{'fused GB/s':>10}")
    for name in args.types.split(","):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            w = repack(T[name], random_quant_blocks(T[name], n, k, rng)).map(lambda t: t.to(args.device))
            dense = dequantize(w, dtype)
            mb = w.nbytes / 1e6
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, device=args.device).to(dtype)
                fused = time_ms(lambda: ck.matmul(w, x, fused=True), args.iters) if m <= 64 else float("nan")
                deq = time_ms(lambda: ck.matmul(w, x, fused=False), args.iters)
                old = time_ms(lambda: F.linear(x, dequantize(w, dtype)), args.iters)
                mm = time_ms(lambda: F.linear(x, dense), args.iters)
                print(f"{name:6} {shape:>11} {mb:6.1f} {m:5d} {fused * 1e3:8.1f} {deq * 1e3:8.1f} {old * 1e3:8.1f} "
                      f"{mm * 1e3:8.1f} {mb / 1e3 / (fused / 1e3):10.0f}", flush=True)


if __name__ == "__main__":
    main()
