"""Per-kernel timings behind the quantized-weight kernel choices (benchmarks/README.md).

For each SmolLM2-135M matrix shape: bf16 F.linear vs the C decode kernel
(gemv: float activations, and int8 activations with VNNI dot products where the
build has them, "i8") and the tiled-dequantize prefill path, for 1 and 64 activation rows,
with Q4_1 (q4) and Q8_0 (q8) weights. Median of repeated calls; side by side
in one run, so the ratios are what to read on a shared machine.

    PYTHONPATH=$PWD python benchmarks/quant_kernels.py [threads, default 1]
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from pipeserve.model.quant.cpu_kernels import cpu_kernels
from pipeserve.model.quant.packed import quantize_weight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e6   # the least disturbed call: this machine is shared


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    k = cpu_kernels()
    print(f"threads={torch.get_num_threads()} isa={k.isa}")
    print(f"{'shape':8} {'rows':>4} {'bf16 us':>9} {'q4 gemv':>9} {'q4 i8':>9} {'q4 tiled':>9} {'q8 gemv':>9} {'q8 i8':>9} {'q8 tiled':>9}")
    for name, (n, kdim) in SHAPES.items():
        w = torch.randn(n, kdim) * 0.05
        wb = w.bfloat16()
        q4, q8 = quantize_weight(w, 4, 32), quantize_weight(w, 8, 32)
        for rows in (1, 4, 64):
            x = torch.randn(rows, kdim).bfloat16()
            reps = 50 if name != "head" else 15
            cols = [timed(lambda: F.linear(x, wb), reps)]
            for q in (q4, q8):
                cols.append(timed(lambda: k.gemv(q, x, int8_act=False), reps))
                cols.append(timed(lambda: k.gemv(q, x, int8_act=True), reps) if rows <= 8 else float("nan"))
                cols.append(timed(lambda: k.tiled(q, x), reps))
            print(f"{name:8} {rows:>4} " + " ".join(f"{c:9.0f}" for c in cols))


if __name__ == "__main__":
    main()
