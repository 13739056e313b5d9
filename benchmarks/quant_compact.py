"""Compact codes (q5/q6: nibbles + high-bit planes; q3/q2: Q3_K's / Q2_K's bit pairs + hmask) vs
the same codes a byte each (q8).

For Q5_K and Q6_K weights (``--types``: also Q3_K, Q2_K) of Llama-3-8B-like shapes (a 70B's are the same per
row, wider), random valid K-quant blocks are repacked as the loader does
(``gguf_repack.repack``: the compact layout) and expanded to the byte-per-code
layout the loader used before (``packed.to_q8``). Both are timed in the same
process, alternating call by call, over enough distinct copies of each matrix
that they do not fit in the last-level cache (every decode step reads each
matrix once from DRAM). Decode = 1 bfloat16 row (Q5_K: the VNNI int-activation
path; Q6_K's groups of 16 take the float path), 4 rows, and 64 rows (the
many-row kernel). The ratio byte-per-code time / compact time is what to read
on a shared machine (> 1: compact is faster). ``--compare REV`` also times the
byte-per-code layout through quant_matmul.c as of git revision REV (decode
rows only: the kernel before the compact layouts, e.g. where Q6_K's groups of
16 took the float path).

    PYTHONPATH=$PWD python benchmarks/quant_compact.py [--threads 2] [--repeats 7] [--rows 1,4,64] [--cpu-time]
        [--compare REV] [--types Q5_K,Q6_K,Q3_K,Q2_K]

``--cpu-time`` (one thread only) times with the thread's CPU clock, which other
processes on a loaded machine do not inflate (they still share its memory bus).
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch

from pipeserve.model.quant.cpu_kernels import GEMV_MAX_ROWS, cpu_kernels
from pipeserve.model.quant.gguf_repack import repack
from pipeserve.model.quant.packed import PackedWeight, to_q8

T = gguf.GGMLQuantizationType
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate": (14336, 4096), "down": (4096, 14336)}
COLD_BYTES = 96 << 20   # > 32 MB L3: each call reads DRAM
FLOAT16_OFFSETS = {T.Q6_K: (208,), T.Q3_K: (108,), T.Q2_K: (80, 82)}   # d (and dmin) in a block; others (0, 2)


def kquant_weight(ttype: T, rows: int, cols: int, seed: int) -> PackedWeight:
    """Random valid blocks of ``ttype`` (modest float16 d / dmin), repacked."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[ttype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for off in FLOAT16_OFFSETS.get(ttype, (0, 2)):
        d = (0.01 * rng.uniform(0.5, 1.5, raw.shape[:2])).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return repack(ttype, raw.reshape(rows, -1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", default="1,4,64")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--types", default="Q5_K,Q6_K", help="GGUF types, of Q5_K, Q6_K, Q3_K, Q2_K")
    parser.add_argument("--cpu-time", action="store_true", help="time with the thread's CPU clock (one thread)")
    parser.add_argument("--compare", metavar="REV", help="also time q8 through quant_matmul.c as of this revision")
    args = parser.parse_args()
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time measures one thread: use it with --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    k = cpu_kernels()
    old = None
    if args.compare:
        import sys
        from pathlib import Path
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from quant_gemv_bw import kernels_at
        old = kernels_at(args.compare)
    print(f"threads={args.threads} isa={k.isa} gemm={k.gemm_isa} clock={'thread CPU' if args.cpu_time else 'wall'}")
    rev = f"q8@{args.compare[:7]} us" if old else ""
    print(f"{'type':5} {'shape':8} {'rows':>4} {'compact MB':>10} {'q8 MB':>7} {'compact us':>11} {'q8 us':>9} "
          f"{'q8/compact':>10}" + (f" {rev:>14} {'rev/compact':>11}" if old else ""))
    for ttype in (T[name] for name in args.types.split(",")):
        for name in args.shapes.split(","):
            n, kd = SHAPES[name]
            w = kquant_weight(ttype, n, kd, seed=n + kd)
            layouts = {"compact": w, "q8": to_q8(w)}
            if old:
                layouts["old"] = layouts["q8"]
            copies = {label: [lw] + [lw.map(lambda t: t.clone()) for _ in range(max(1, COLD_BYTES // lw.nbytes) - 1)]
                      for label, lw in layouts.items()}
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, kd).bfloat16()
                best = {label: float("inf") for label in layouts}
                for _ in range(args.repeats):
                    for label, ws in copies.items():   # alternating: the same load on all
                        if label == "old" and rows > GEMV_MAX_ROWS:
                            continue
                        kern = old if label == "old" else k
                        kern.matmul(ws[0], x)
                        t = clock()
                        for cw in ws:
                            kern.matmul(cw, x)
                        best[label] = min(best[label], (clock() - t) / len(ws))
                print(f"{ttype.name:5} {name:8} {rows:>4} {w.nbytes / 1e6:10.1f} {layouts['q8'].nbytes / 1e6:7.1f} "
                      f"{best['compact'] * 1e6:11.0f} {best['q8'] * 1e6:9.0f} {best['q8'] / best['compact']:10.2f}"
                      + (f" {best['old'] * 1e6:14.0f} {best['old'] / best['compact']:11.2f}" if old else ""),
                      flush=True)


if __name__ == "__main__":
    main()
