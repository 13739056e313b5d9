"""Q3_K / Q2_K in the q3 / q2 layouts with their files' integer sub-scales (this tree) against the
layout before (a float16 scale, and for Q2_K a minimum, per 16 weights; quant_matmul.c as of git
revision ``--compare``), one process, alternating call by call.

Random valid blocks of Llama-3-8B-like shapes (a 70B's rows are the same, wider) are repacked as
the loader does; the old layout is built from the same codes (``to_q8``'s float16 scale and
minimum per 16, q3's hmask alone in ``qh``), so both compute the same weights up to that rounding.
Each call reads its matrix from DRAM: enough distinct copies that they do not fit in the last-level
cache. Prints the median time per call over ``--repeats`` rounds and old / new (> 1: the new
layout is faster), at each of ``--threads``.

    PYTHONPATH=$PWD python benchmarks/k2_layouts.py --compare f7ea9a7 [--threads 1,2] [--rows 1,4]
        [--shapes o,gate,down] [--types Q3_K,Q2_K] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import gguf
import torch

from pipeserve.model.quant.cpu_kernels import cpu_kernels
from pipeserve.model.quant.packed import PackedWeight, to_q8

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_compact import COLD_BYTES, SHAPES, kquant_weight  # noqa: E402
from quant_gemv_bw import kernels_at  # noqa: E402

T = gguf.GGMLQuantizationType


def old_layout(w: PackedWeight) -> PackedWeight:
    """The same codes with a float16 scale (and minimum) per 16 and q3's hmask alone: the layout before."""
    wide = to_q8(w)
    qh = None if w.kind == "q2" else w.qh.view(w.out_features, -1, 48)[..., :32].reshape(w.out_features, -1)
    return PackedWeight(w.kind, 16, w.qs, wide.scale, wide.minv, w.source, qh.contiguous() if qh is not None else None,
                        w.zero)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", required=True, metavar="REV", help="the revision whose layout to time against")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--shapes", default="o,gate,down")
    parser.add_argument("--types", default="Q3_K,Q2_K")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    new, old = cpu_kernels(), kernels_at(args.compare)
    print(f"isa={new.isa} old={args.compare}: median us per call, old / new")
    print(f"{'type':5} {'shape':6} {'thr':>3} {'rows':>4} {'new MB':>7} {'old MB':>7} {'new us':>8} {'old us':>8} "
          f"{'old/new':>7}")
    for ttype in (T[name] for name in args.types.split(",")):
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            w = kquant_weight(ttype, n, k, seed=n + k)
            layouts = {"new": (new, w), "old": (old, old_layout(w))}
            copies = {label: (kern, [lw] + [lw.map(lambda t: t.clone()) for _ in range(max(1, COLD_BYTES // lw.nbytes))])
                      for label, (kern, lw) in layouts.items()}
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                for rows in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(rows, k)
                    times = {label: [] for label in copies}
                    for _ in range(args.repeats):
                        for label, (kern, ws) in copies.items():   # alternating: the same load on both
                            kern.matmul(ws[0], x)
                            t = time.perf_counter()
                            for cw in ws:
                                kern.matmul(cw, x)
                            times[label].append((time.perf_counter() - t) / len(ws))
                    med = {label: statistics.median(v) for label, v in times.items()}
                    print(f"{ttype.name:5} {name:6} {threads:>3} {rows:>4} {w.nbytes / 1e6:7.1f} "
                          f"{layouts['old'][1].nbytes / 1e6:7.1f} {med['new'] * 1e6:8.0f} {med['old'] * 1e6:8.0f} "
                          f"{med['old'] / med['new']:7.2f}", flush=True)


if __name__ == "__main__":
    main()
