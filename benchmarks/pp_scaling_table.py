"""One row of run_pp_scaling.sh's table: PP=2 over PP=1 for one mix and round.

Usage: python benchmarks/pp_scaling_table.py RESULTS_DIR MIX ROUND
Throughput mixes compare output tokens/s; the single request compares its mean time
per output token (TPOT), where PP=2's extra is the hop latency and driver round trip.
On a shared CPU the PP=2 processes compete with others differently from the PP=1
one, so the row also gives the ratio the stages' steady-state busy fractions imply
(the sum over stages: the speed-up if a stage's compute is as fast as PP=1's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run(results: Path, mix: str, pp: int, rnd: str) -> dict:
    return json.loads((results / f"{mix}_pp{pp}_r{rnd}.json").read_text())["runs"][0]


def main() -> None:
    results, mix, rnd = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    one, two = run(results, mix, 1, rnd), run(results, mix, 2, rnd)
    stages = two.get("stages", [])
    bubbles = " ".join(f"s{i}:{s.get('steady_bubble_ratio', float('nan')):.3f}" for i, s in enumerate(stages))
    busy = sum(s.get("steady_busy_ratio", float("nan")) for s in stages)
    if mix == "single":
        t1, t2 = one["tpot_ms"]["mean"], two["tpot_ms"]["mean"]
        print(f"{mix:14s} r{rnd}  TPOT PP=1 {t1:7.2f} ms  PP=2 {t2:7.2f} ms  PP=2 extra {t2 / t1 - 1:+.1%}")
        return
    o1, o2 = one["output_tokens_per_s"], two["output_tokens_per_s"]
    print(f"{mix:14s} r{rnd}  out tok/s PP=1 {o1:7.1f}  PP=2 {o2:7.1f}  ratio {o2 / o1:.2f}x  "
          f"busy-implied {busy:.2f}x  partition {two.get('partition')}  steady bubble {bubbles}")


if __name__ == "__main__":
    main()
