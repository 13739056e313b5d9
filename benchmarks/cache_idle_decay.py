"""How fast a buffer streams again after its core has left it alone for a while.

    python benchmarks/cache_idle_decay.py [--mb 35 8] [--gaps 0 0.1 0.3 1 3] [--sleep] [--cpu 0]

One thread on one CPU sums a bfloat16 buffer of ``--mb`` MB (35: about a SmolLM2 stage's
kept-quantized weights at PP = 2) over and over; between two sums it waits ``gap`` ms, spinning
(``--sleep``: sleeping, so that the vCPU may halt). Prints the median time of a sum and its
GB/s for each gap.

Why: one request through a pipeline leaves each stage's core idle while the other stages
compute, and a stage's weights are read again only after that gap. Where the last-level cache
is shared with other tenants (a cloud guest), what it held of them is gone within a few
milliseconds, whoever the core ran meanwhile; at PP = 1 the same weights are read back to back
with the rest of the model in between. benchmarks/README.md, fortieth session.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def median_sum_s(x: torch.Tensor, gap_s: float, sleep: bool, reps: int) -> float:
    times = []
    for _ in range(reps):
        if sleep:
            time.sleep(gap_s)
        else:
            end = time.perf_counter() + gap_s
            while time.perf_counter() < end:
                pass
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, nargs="+", default=[35, 8])
    ap.add_argument("--gaps", type=float, nargs="+", default=[0, 0.1, 0.3, 1, 3], help="ms between sums")
    ap.add_argument("--sleep", action="store_true", help="sleep between sums instead of spinning")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--cpu", type=int, default=0)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    for mb in args.mb:
        x = torch.randn(mb * 1_000_000 // 2, dtype=torch.bfloat16)
        for _ in range(5):
            x.sum()
        for gap in args.gaps:
            t = median_sum_s(x, gap / 1e3, args.sleep, args.reps)
            print(f"{mb} MB, {'sleep' if args.sleep else 'spin'} gap {gap:g} ms: median {t * 1e3:.2f} ms a sum, "
                  f"{mb / t / 1e3:.1f} GB/s")


if __name__ == "__main__":
    main()
