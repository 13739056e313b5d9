"""bfloat16 rows through the dequantized tiles (``QuantKernels.tiled``) on a CPU without native
bfloat16: the tiles in bfloat16 (PyTorch's matmul converting in software) against the tiles in
float32 (``TILES_IN_FLOAT32``, what such a CPU now takes), and float32 rows beside them.

SmolLM2-135M's Q8_0 LM head (49152 x 576, the matrix that takes the tiles there at every row
count beyond the gemv's passes) and its layers' shapes as Q8_0 (q/k/v, gate/up, down), at 64, 128
and 320 rows: the best of ``--rounds`` alternating rounds of each arm, ms and GFLOP/s. On a CPU
with native bfloat16 the tiles never take bfloat16 rows where quant_gemm.c or quant_gemm_i8.c
applies; the script still runs there (read it as PyTorch's bfloat16 against float32).

    PYTHONPATH=$PWD python benchmarks/bf16_tiles.py [--threads 1] [--rounds 3] [--rows 64,128,320]
"""

from __future__ import annotations

import argparse
import time

import torch

import pipeserve.model.quant.cpu_kernels as quant_cpu
from pipeserve.config import cpu_has_native_bf16
from pipeserve.model.quant.packed import quantize_weight

SHAPES = {"head": (49152, 576), "qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default="64,128,320")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = quant_cpu.cpu_kernels()
    print(f"native bfloat16: {cpu_has_native_bf16()}, quantized kernels: {kernels.isa}, threads {args.threads}")
    gen = torch.Generator().manual_seed(0)

    def bf16_tiles(w, x):
        quant_cpu.TILES_IN_FLOAT32 = False
        return kernels.tiled(w, x.bfloat16())

    def f32_tiles(w, x):
        quant_cpu.TILES_IN_FLOAT32 = True
        return kernels.tiled(w, x.bfloat16())

    arms = {"bf16 rows, bf16 tiles": bf16_tiles, "bf16 rows, f32 tiles": f32_tiles,
            "f32 rows": lambda w, x: kernels.tiled(w, x)}
    print(f"{'shape':8} {'rows':>5} " + " ".join(f"{name:>28}" for name in arms))
    for name, (out, inp) in SHAPES.items():
        w = quantize_weight(torch.randn(out, inp, generator=gen) * 0.05, 8, 32)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, inp, generator=gen)
            best = dict.fromkeys(arms, float("inf"))
            for arm in arms.values():
                arm(w, x)                                  # warm: the tiles' buffers, the matmul's
            for _ in range(args.rounds):
                for arm_name, arm in arms.items():
                    best[arm_name] = min(best[arm_name], _timed(lambda: arm(w, x)))
            flop = 2 * rows * out * inp
            print(f"{name:8} {rows:5d} " + " ".join(
                f"{best[a] * 1e3:12.2f} ms {flop / best[a] / 1e9:6.1f} GF/s " for a in arms), flush=True)
    quant_cpu.TILES_IN_FLOAT32 = None


if __name__ == "__main__":
    main()
