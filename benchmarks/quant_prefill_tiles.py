"""The prefill tile path (dequantize a tile of rows, then PyTorch's float32 matmul) vs a dense
float32 ``F.linear``, where many-row matmuls with quantized weights run on CPUs without
AVX512_BF16 (AVX2 ones).

For SmolLM2-135M's layer shapes (``--shapes llama``: a 2048-wide Llama's, FFN 5632) with
Q4_1-like (q4) and Q8_0-like (q8) weights: the dense matmul, the tiled path at several tile
sizes (``TILE_BYTES`` of dequantized weight per tile, each tile's product x @ W_tile^T), the
tiles turned round (``turned``: 512-row tiles, W_tile @ x^T into the output's transpose, what
float32 rows up to ``TRANSPOSED_MAX_ROWS`` take on more than one thread, for weights at
least ``TRANSPOSED_MIN_IN`` wide), the dequantizing
alone (the whole matrix, the part the tile path adds), and the decode kernel in passes of
``GEMV_MAX_ROWS`` rows (what up to ``GEMV_PASSES_MAX_ROWS`` rows take where it has integer
activations) and in one call (``gemv 1``: AVX2 builds run the passes over tiles of weight rows,
as the fused decode stage does up to ``GEMV_ONE_CALL_MAX_ROWS``), at 16 to 512 activation rows. Best of repeated calls, side by side in one run:
the ratios are what to read on a shared machine. ``--compare REV`` also times the
dequantizing of quant_matmul.c as of git revision REV.

    PYTHONPATH=$PWD python benchmarks/quant_prefill_tiles.py [--threads 2] [--shapes llama] [--compare REV]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import pipeserve.model.quant.cpu_kernels as quant_cpu
from pipeserve.model.quant.packed import quantize_weight
from quant_gemv_bw import kernels_at

SHAPES = {"smollm2": {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536)},
          "llama": {"qkv": (3072, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}}
TILES = (256 << 10, 1 << 20, 4 << 20, 8 << 20)    # 8 MiB: each of these shapes in one tile


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--compare", metavar="REV", help="also time dequantizing with quant_matmul.c as of REV")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    k = quant_cpu.cpu_kernels()
    ref = kernels_at(args.compare) if args.compare else None
    print(f"threads={args.threads} isa={k.isa}; ms, best of {args.repeats}")
    tiles = " ".join(f"tile {t >> 10:>4}K" for t in TILES)
    one_call = k.fused_max_rows > quant_cpu.GEMV_PASSES_MAX_ROWS
    print(f"{'shape':8} {'kind':4} {'rows':>4} {'dense':>9} {tiles} {'turned':>9} {'dequant':>9} {'gemv x8':>9}"
          + (f" {'gemv 1':>9}" if one_call else "")
          + (f" {'@' + args.compare:>9}" if ref else ""))
    quant_cpu.TRANSPOSED_MAX_ROWS = 0     # the tile columns: x @ W_tile^T at every row count
    for name, (n, kd) in SHAPES[args.shapes].items():
        w = torch.randn(n, kd) * 0.05
        for bits in (4, 8):
            q = quantize_weight(w, bits, 32)
            dq = lambda kern=k: kern.dequant_rows(q, 0, n, torch.float32)   # noqa: E731
            for rows in (16, 24, 32, 64, 256, 512):
                x = torch.randn(rows, kd)
                cols = [best_ms(lambda: F.linear(x, w), args.repeats)]
                for tile in TILES:
                    quant_cpu.TILE_BYTES, quant_cpu.TILE_MIN_ROWS = tile, 16
                    cols.append(best_ms(lambda: k.tiled(q, x), args.repeats))
                cols.append(best_ms(lambda: k._tiled_transposed(q, x), args.repeats))
                cols.append(best_ms(dq, args.repeats))
                step = quant_cpu.GEMV_MAX_ROWS       # the decode kernel in passes (rows up to
                cols.append(best_ms(lambda: [k.gemv(q, x[r:r + step])   # GEMV_PASSES_MAX_ROWS take it)
                                             for r in range(0, rows, step)], args.repeats))
                if one_call:
                    cols.append(best_ms(lambda: k.gemv(q, x), args.repeats))
                if ref:
                    cols.append(best_ms(lambda: dq(ref), args.repeats))
                print(f"{name:8} q{bits:<3} {rows:>4} " + " ".join(f"{c:9.3f}" for c in cols))


if __name__ == "__main__":
    main()
