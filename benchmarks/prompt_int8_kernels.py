"""A prompt's matmul on kept-quantized weights, per GGUF type: the integer-activation gemv (AVX2:
int8 activations, the many-row kernels of quant_gemv_avx2.h) against the float tiles
(``QuantKernels.tiled``: a tile of the weight dequantized to float32, PyTorch's matmul), which
layouts outside ``PROMPT_INT8_KINDS`` take beyond GEMV_PASSES_MAX_ROWS rows.

Per type (repacked from GGUF blocks as the loader does, benchmarks/gemv_avx2_bench.py's
``gguf_weight``), shape and row count: the best of ``--rounds`` alternating rounds of each path
(``--repeats`` calls each), ms and the ratio gemv / tiles; below 1 the gemv is faster. Shapes:
SmolLM2-135M's q/k/v, gate/up, down and LM head (the built-in file's is Q8_0); a 2048-wide
Llama's (benchmarks/gguf_mixes.py's llama: a Q4_K_M file's Q6_K attn_v and ffn_down among them). Weights stay in cache between calls
(a SmolLM2 matrix) or not (a Llama one); read the ratios on a shared machine.

    PYTHONPATH=$PWD python benchmarks/prompt_int8_kernels.py [--types Q5_K,Q6_K] [--rows 32,128,512] [--threads 1]
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np
import torch

from benchmarks.gemv_avx2_bench import gguf_weight, side_by_side
from pipeserve.model.quant.cpu_kernels import cpu_kernels

T = gguf.GGMLQuantizationType
SHAPES = {   # name: (out, in)
    "smollm2 qkv": (960, 576), "smollm2 gate_up": (3072, 576), "smollm2 down": (576, 1536),
    "smollm2 head": (49152, 576),
    "llama attn_v": (512, 2048), "llama qkv": (3072, 2048), "llama down": (2048, 5632),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q5_0,Q5_1")
    parser.add_argument("--rows", default="32,128,512")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels()
    if not kernels.has_integer_activations:
        raise SystemExit(f"this build ({kernels.isa}) has no integer-activation gemv to compare")
    rng = np.random.default_rng(0)
    print(f"{kernels.isa}, {args.threads} thread(s), best of {args.rounds} alternating rounds, ms")
    print(f"{'type':5} {'shape':16} {'N x K':>11} {'rows':>4} {'tiles':>8} {'gemv':>8} {'gemv/tiles':>10}")
    for name in args.types.split(","):
        ttype = T[name]
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            try:
                w = gguf_weight(ttype, n, k, rng)
            except ValueError as exc:   # the K-quants' two-level scales need rows of whole 256s
                print(f"{name:5} {shape:16} {n:>5}x{k:<5} not a {name} shape: {exc}")
                continue
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k)
                t = side_by_side({"tiles": lambda: kernels.tiled(w, x),
                                  "gemv": lambda: kernels.gemv(w, x, int8_act=True)}, args.rounds, args.repeats)
                print(f"{name:5} {shape:16} {n:>5}x{k:<5} {rows:>4} {t['tiles'] * 1e3:8.2f} {t['gemv'] * 1e3:8.2f} "
                      f"{t['gemv'] / t['tiles']:10.2f}", flush=True)


if __name__ == "__main__":
    main()
