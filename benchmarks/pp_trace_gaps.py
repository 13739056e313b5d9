"""Where a pipeline's bubbles are, from a Chrome trace (``--trace-file``) of a run.

Over the middle of the run (``--window``, default the 10 %-90 % of the span between the first and
the last compute slice), per stage:

- its busy share and its gaps (between two of its compute slices), split by what the other
  stages did meanwhile: some other stage computing (this one waited on the pipeline: an
  imbalance of stages or of micro-batches, or a slow step elsewhere), or no stage computing (the
  round trip through the driver and the links), by the gaps' sizes, and the largest ones;
- its compute time fitted by least squares on what each step carried (the trace's compute slices
  have their step's ``decodes``, ``decode_context`` (the positions those decodes attend to),
  ``prompt_tokens``, ``swap_in`` and ``swap_out`` blocks, ``metrics.timeline.step_shape``): the
  coefficients, R² and the residuals' spread, i.e. how much the same work's time varies from
  step to step (the host's noise, which a fixed two-micro-batch round turns into waits);
- with ``--phases N``, the whole run in N equal spans of time: each stage's busy share and mean
  compute a step, and what the steps carried (decodes, prompt tokens): which stage limited the
  pipeline when (a burst of requests runs its prompts first, then their decodes, and the two
  load the stages differently: the LM head weighs on the last stage only for the tokens sampled).

    python -m pipeserve bench throughput ... -pp 2 --trace-file /tmp/run.json
    python benchmarks/pp_trace_gaps.py /tmp/run.json [--window 0.1 0.9] [--phases 10]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from pipeserve.metrics.timeline import clip, intersect, merge, total

SHAPE = ("decodes", "decode_context", "prompt_tokens", "swap_in", "swap_out")
BUCKETS_MS = (0.5, 2, 10, 50)


def load(path: str) -> dict[int, list[tuple[float, float, int, dict]]]:
    """Compute slices per stage: (start, end) in ms, step id, the slice's args."""
    data = json.load(open(path))
    events = data["traceEvents"] if isinstance(data, dict) else data
    stages: dict[int, list] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "compute":
            stages[e["tid"] // 2].append((e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3, e["args"]["step_id"], e["args"]))
    for slices in stages.values():
        slices.sort()
    return dict(stages)


def split_heads(stages: dict) -> dict[int, list]:
    """--pp-lm-head shared: the slices in which stage 0 ran a step's head (chunk = the partition's
    chunk count, one more than the last stage's largest chunk), taken out of ``stages`` (they
    stay in the busy shares, which ``load``'s own lists give): a step is then one slice a stage."""
    last = max(stages)
    count = 1 + max((args.get("chunk", 0) for *_, args in stages[last]), default=0)
    heads = {}
    for stage, slices in stages.items():
        heads[stage] = [sl for sl in slices if sl[3].get("chunk", 0) == count]
        if heads[stage]:
            stages[stage] = [sl for sl in slices if sl[3].get("chunk", 0) != count]
    return heads


def gaps(stages: dict, lo: float, hi: float) -> None:
    for stage, slices in sorted(stages.items()):
        others = merge([(a, b) for s, sl in stages.items() if s != stage for a, b, *_ in sl])
        busy = total(clip(merge([(a, b) for a, b, *_ in slices]), (lo, hi)))
        found = []
        for (_, end, step, _), (start, _, nxt, _) in zip(slices, slices[1:]):
            if end < lo or start > hi or start <= end:
                continue
            found.append((start - end, total(intersect(others, [(end, start)])), step, nxt))
        idle = sum(g for g, *_ in found)
        elsewhere = sum(o for _, o, *_ in found)
        span = hi - lo
        print(f"stage {stage}: busy {busy / span:.3f}; gaps {idle:.0f} ms ({idle / span:.3f}): another stage "
              f"computing {elsewhere:.0f} ms ({elsewhere / span:.3f}), none {idle - elsewhere:.0f} ms "
              f"({(idle - elsewhere) / span:.3f}); {len(found)} gaps")
        edges = (0.0,) + BUCKETS_MS + (float("inf"),)
        for low, high in zip(edges, edges[1:]):
            some = [(g, o) for g, o, *_ in found if low <= g < high]
            if some:
                print(f"    gaps {low:g}-{high:g} ms: {len(some):5d}, {sum(g for g, _ in some):8.1f} ms, of it none "
                      f"computing {sum(g - o for g, o in some):7.1f} ms")
        largest = sorted(found, reverse=True)[:6]
        print("    largest (ms, of it another computing, between steps):",
              ", ".join(f"{g:.1f} ({o:.1f}) {a}->{b}" for g, o, a, b in largest))


def fit(stages: dict, lo: float, hi: float) -> None:
    try:
        import numpy as np
    except ImportError:
        print("(numpy missing: no fit)")
        return
    for stage, slices in sorted(stages.items()):
        rows = [(b - a, [args.get(k, 0) for k in SHAPE]) for a, b, _, args in slices
                if a >= lo and b <= hi and all(k in args for k in SHAPE)]
        if len(rows) < 2 * (len(SHAPE) + 1):
            print(f"stage {stage}: too few compute slices with their step's shape to fit "
                  "(a trace from before the shapes?)")
            continue
        y = np.array([t for t, _ in rows])
        x = np.array([v + [1.0] for _, v in rows], dtype=float)
        x[:, 1] /= 1e3                                     # per 1,000 positions attended to
        used = x.any(axis=0)                               # a column of zeros (no swaps) leaves the fit
        coef = np.zeros(x.shape[1])
        coef[used] = np.linalg.lstsq(x[:, used], y, rcond=None)[0]
        resid = y - x @ coef
        r2 = 1 - (resid ** 2).sum() / ((y - y.mean()) ** 2).sum()
        print(f"stage {stage}: compute ms = {coef[0]:.3f} a decode + {coef[1]:.3f} per 1k positions attended + "
              f"{coef[2]:.4f} a prompt token + {coef[3]:.3f} / {coef[4]:.3f} a block swapped in / out + "
              f"{coef[5]:.2f} a step; R2 {r2:.3f} over {len(rows)} steps (mean {y.mean():.1f} ms); residuals "
              f"{resid.std():.1f} ms = {resid.std() / y.mean():.1%} of a step")


def phases(stages: dict, t0: float, t1: float, count: int, busy_slices: dict) -> None:
    span = (t1 - t0) / count
    names = sorted(stages)
    print(f"the run in {count} spans of {span / 1e3:.1f} s: busy share and mean compute (ms) a step of each stage; "
          "per step of stage 0, decodes and prompt tokens")
    print("  span " + "".join(f"   s{s} busy  s{s} ms" for s in names) + "  decodes  prompt tokens")
    for i in range(count):
        lo, hi = t0 + i * span, t0 + (i + 1) * span
        row = []
        for stage in names:
            slices = stages[stage]
            busy = total(clip(merge([(a, b) for a, b, *_ in busy_slices[stage]]), (lo, hi)))
            started = [b - a for a, b, *_ in slices if lo <= a < hi]
            row.append(f"  {busy / span:8.3f} {sum(started) / max(1, len(started)):7.1f}")
        first = [args for a, _, _, args in stages[names[0]] if lo <= a < hi]
        decodes = sum(args.get("decodes", 0) for args in first) / max(1, len(first))
        prompts = sum(args.get("prompt_tokens", 0) for args in first) / max(1, len(first))
        print(f"  {i:4d}" + "".join(row) + f"  {decodes:7.1f}  {prompts:13.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--window", nargs=2, type=float, default=(0.1, 0.9), metavar=("FROM", "TO"),
                    help="the part of the run looked at, as fractions of its span")
    ap.add_argument("--phases", type=int, default=0, metavar="N",
                    help="also the whole run in N spans: which stage was busy when")
    args = ap.parse_args()
    stages = load(args.trace)
    if not stages:
        raise SystemExit(f"{args.trace}: no compute slices")
    t0 = min(sl[0][0] for sl in stages.values())
    t1 = max(sl[-1][1] for sl in stages.values())
    lo, hi = t0 + args.window[0] * (t1 - t0), t0 + args.window[1] * (t1 - t0)
    print(f"{len(stages)} stages; window {lo - t0:.0f}-{hi - t0:.0f} ms of {t1 - t0:.0f}")
    gaps(stages, lo, hi)
    every = {stage: list(slices) for stage, slices in stages.items()}
    heads = split_heads(stages)
    for stage, slices in sorted(heads.items()):
        if slices:
            ms = [b - a for a, b, *_ in slices]
            print(f"stage {stage} ran {len(slices)} steps' LM heads (--pp-lm-head shared), {sum(ms):.0f} ms, "
                  f"{sum(ms) / len(ms):.2f} ms each: left out of the fit and the spans' ms a step")
    fit(stages, lo, hi)
    if args.phases > 0:
        phases(stages, t0, t1, args.phases, every)


if __name__ == "__main__":
    main()
