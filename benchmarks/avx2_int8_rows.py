"""The integer-activation gemv on kept-quantized weights, alone: GFLOP/s and ms per call for
SmolLM2's and 2048-wide Llama shapes, one thread (``kernels.gemv(w, x, int8_act=True)``: on AVX2
builds q4's many-row kernel from 16 rows, the passes of 8 rows below and for the other kinds).
Weights are GGUF blocks through the loader's repack (benchmarks/gemv_avx2_bench.py's
``gguf_weight``); the best of ``--rounds`` rounds of ``--repeats`` calls. Run the two commits'
trees in turn on one machine to compare them (benchmarks/README.md, fifty-second session).

    PYTHONPATH=$PWD python benchmarks/avx2_int8_rows.py [--many 128,512] [--decode 1,4,8]
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np
import torch

from benchmarks.gemv_avx2_bench import gguf_weight, side_by_side
from pipeserve.model.quant.cpu_kernels import cpu_kernels

T = gguf.GGMLQuantizationType
MANY = [("Q4_1", 3072, 576), ("Q4_1", 960, 576), ("Q4_1", 576, 1536), ("Q4_1", 3072, 1536), ("Q4_1", 2048, 2048)]
DECODE = [("Q8_0", 49152, 576), ("Q8_0", 2048, 2048), ("Q6_K", 2048, 5632), ("Q6_K", 512, 2048),
          ("Q5_K", 2048, 2048), ("Q5_0", 2048, 2048)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--many", default="128", help="row counts for the q4 many-row shapes")
    parser.add_argument("--decode", default="1,4,8", help="row counts for the decode shapes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    kernels = cpu_kernels()
    if kernels is None or not kernels.has_integer_activations:
        raise SystemExit("this build has no integer-activation gemv")
    rng = np.random.default_rng(0)
    print(f"{kernels.isa}, one thread, best of {args.rounds} rounds of {args.repeats} calls")
    for cases, rows_arg in ((MANY, args.many), (DECODE, args.decode)):
        for name, n, k in cases:
            w = gguf_weight(T[name], n, k, rng)
            for rows in (int(r) for r in rows_arg.split(",")):
                x = torch.randn(rows, k)
                t = side_by_side({"gemv": lambda: kernels.gemv(w, x, int8_act=True)}, args.rounds, args.repeats)["gemv"]
                print(f"{name:5} {n:>5}x{k:<5} rows {rows:4}: {t * 1e3:8.3f} ms {2 * n * k * rows / t / 1e9:7.1f} GFLOP/s",
                      flush=True)


if __name__ == "__main__":
    main()
