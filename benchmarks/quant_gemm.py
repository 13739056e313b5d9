"""Many-row (prefill / batched decode) matmul against kept-quantized weights vs bf16 ``F.linear``.

For each SmolLM2-135M matrix shape and 16 / 64 / 256 / 512 activation rows:
bfloat16 ``F.linear`` on the dequantized weight (what ``--quantization none
--dtype bfloat16`` runs), the old tiled path (dequantize ~1 MB row tiles to
bfloat16, then PyTorch's matmul) and the fused kernel of
pipeserve/kernels/quant_gemm.c (``gemm``), with Q4_1-like (q4, with minimum)
and Q8_0-like (q8) weights. GFLOP/s = 2·M·N·K / time, min of repeats, all
timed in turn in one process (the machine is shared: read the ratios).

    PYTHONPATH=$PWD python benchmarks/quant_gemm.py [--threads 2] [--rows 16,64,256,512]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pipeserve.model.quant.cpu_kernels import cpu_kernels
from pipeserve.model.quant.packed import dequantize, quantize_weight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}


def timed(fn, budget_s: float = 0.3, max_reps: int = 30) -> float:
    fn()
    times, start = [], time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="16,64,256,512")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    k = cpu_kernels()
    has_gemm = k is not None and getattr(k, "gemm_isa", None) is not None
    print(f"threads={torch.get_num_threads()} isa={k.isa} gemm={getattr(k, 'gemm_isa', None)}")
    cols = ["bf16"] + [f"{q} {p}" for q in ("q4", "q8") for p in (("tiled", "gemm") if has_gemm else ("tiled",))]
    print(f"{'shape':8} {'rows':>4} " + " ".join(f"{c:>9}" for c in cols) + "   (GFLOP/s; ratio gemm/bf16)")
    for name in args.shapes.split(","):
        n, kdim = SHAPES[name]
        w = torch.randn(n, kdim, generator=torch.Generator().manual_seed(0)) * 0.05
        q4, q8 = quantize_weight(w, 4, 32), quantize_weight(w, 8, 32)
        wb = dequantize(q4, torch.bfloat16)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, kdim).bfloat16()
            flop = 2 * rows * n * kdim
            ts = [timed(lambda: F.linear(x, wb))]
            for q in (q4, q8):
                ts.append(timed(lambda: k.tiled(q, x)))
                if has_gemm:
                    ts.append(timed(lambda: k.gemm(q, x)))
            g = [flop / t / 1e9 for t in ts]
            ratio = f"   q4 {g[2] / g[0]:.2f} q8 {g[4] / g[0]:.2f}" if has_gemm else ""
            print(f"{name:8} {rows:>4} " + " ".join(f"{v:9.1f}" for v in g) + ratio, flush=True)


if __name__ == "__main__":
    main()
