"""Where one request's time per token goes at PP = P: the stages' computes and the gaps
between them, from the stage timelines (driver clock), median over the decode steps.

One request alone runs its stages one after the other, so a token's time (from stage 0's start
of one step to its start of the next) is the stages' computes plus the gaps: stage s -> stage
s + 1 (encode, send, wake-up, receive) and the last stage -> stage 0's next step. With decode
ahead (``--pp-decode-ahead``, on by default) the driver submits the next step before this one's
result and the last stage sends the tokens to stage 0 itself, so that last gap is one hop; without
it the gap holds the result's trip to the driver, the driver's own time and its next step's trip
to stage 0. Also shown: the result's trip to the driver, and how long before stage 0 started
each step the driver had submitted it (with decode ahead about a token's time; without, the
driver -> stage 0 trip). PP = 1 runs in the driver's process and has none of them.

    PYTHONPATH=$PWD python benchmarks/pp_token_timeline.py [--pp 2] [--tokens 256] [--model M]
        [--no-decode-ahead]
"""

from __future__ import annotations

import argparse
import statistics

from pipeserve import LLM, SamplingParams


def gaps(timeline, stages: int) -> dict[str, list[float]]:
    computes: dict[int, dict[int, tuple[float, float]]] = {}
    for iv in timeline.intervals():
        if iv.kind == "compute" and iv.step_id >= 0:
            computes.setdefault(iv.step_id, {}).setdefault(iv.stage, (iv.start, iv.end))
    steps = sorted(timeline.finished_steps())                      # in step order
    rows: dict[str, list[float]] = {}
    for (step, _, done), (nxt, next_submit, _) in zip(steps[5:-6], steps[6:-5]):   # decode steps
        c, n = computes.get(step, {}), computes.get(nxt, {})
        if len(c) < stages or 0 not in n:
            continue
        add = lambda name, v: rows.setdefault(name, []).append(v * 1e3)   # noqa: E731
        add("token (stage 0 start to start)", n[0][0] - c[0][0])
        for s in range(stages):
            add(f"stage {s} compute", c[s][1] - c[s][0])
            if s + 1 < stages:
                add(f"stage {s} -> stage {s + 1}", c[s + 1][0] - c[s][1])
        add(f"stage {stages - 1} -> stage 0's next step", n[0][0] - c[stages - 1][1])
        add(f"stage {stages - 1} -> driver (result)", done - c[stages - 1][1])
        add("next step submitted before stage 0 starts it", n[0][0] - next_submit)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads-per-stage", type=int, default=1)
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2 GGUF")
    parser.add_argument("--no-decode-ahead", action="store_true", help="--no-pp-decode-ahead")
    args = parser.parse_args()
    if args.pp < 2:
        parser.error("--pp must be at least 2 (PP = 1 runs in the driver's process: no timelines)")
    extra = {"model": args.model} if args.model else {}
    if args.no_decode_ahead:
        extra["pp_decode_ahead"] = False
    llm = LLM(pipeline_parallel_size=args.pp, threads_per_stage=args.threads_per_stage, **extra)
    prompt = "The history of the city " * 20
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    llm.generate([prompt], params)                      # warm-up
    executor = llm.engine.executor
    executor.flush_timeline()
    executor.timeline.clear()
    llm.generate([prompt], params)
    executor.flush_timeline()
    print(f"PP={args.pp}, {args.threads_per_stage} thread(s) a stage, decode ahead "
          f"{'off' if args.no_decode_ahead else 'on'}, one request, ms per token (median / p90 over the decode steps)")
    for name, values in gaps(executor.timeline, args.pp).items():
        values.sort()
        print(f"  {name:46s} {statistics.median(values):7.3f} {values[int(0.9 * len(values))]:7.3f}")
    llm.shutdown()


if __name__ == "__main__":
    main()
