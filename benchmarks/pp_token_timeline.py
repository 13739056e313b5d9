"""Where one request's time per token goes at PP = P: the stages' computes and the gaps
between them, from the stage timelines (driver clock), median over the decode steps.

One request alone runs its stages one after the other, so a token's time is the stages'
computes plus the gaps: driver -> stage 0 (the driver's send, the stage's receive and
decode), stage s -> stage s + 1 (encode, send, wake-up, receive), the last stage -> the
driver (its result), and the driver's own time between a result and the next step.
PP = 1 runs in the driver's process and has none of them.

    PYTHONPATH=$PWD python benchmarks/pp_token_timeline.py [--pp 2] [--tokens 256] [--model M]
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
    steps = timeline.finished_steps()
    rows: dict[str, list[float]] = {}
    for (step, submit, done), (_, next_submit, _) in zip(steps[5:-6], steps[6:-5]):   # decode steps
        c = computes.get(step, {})
        if len(c) < stages:
            continue
        add = lambda name, v: rows.setdefault(name, []).append(v * 1e3)   # noqa: E731
        add("token (submit to result)", done - submit)
        add("driver -> stage 0", c[0][0] - submit)
        for s in range(stages):
            add(f"stage {s} compute", c[s][1] - c[s][0])
            if s + 1 < stages:
                add(f"stage {s} -> stage {s + 1}", c[s + 1][0] - c[s][1])
        add(f"stage {stages - 1} -> driver", done - c[stages - 1][1])
        add("driver: result to next step", next_submit - done)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads-per-stage", type=int, default=1)
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2 GGUF")
    args = parser.parse_args()
    if args.pp < 2:
        parser.error("--pp must be at least 2 (PP = 1 runs in the driver's process: no timelines)")
    extra = {"model": args.model} if args.model else {}
    llm = LLM(pipeline_parallel_size=args.pp, threads_per_stage=args.threads_per_stage, **extra)
    prompt = "The history of the city " * 20
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    llm.generate([prompt], params)                      # warm-up
    executor = llm.engine.executor
    executor.flush_timeline()
    executor.timeline.clear()
    llm.generate([prompt], params)
    executor.flush_timeline()
    print(f"PP={args.pp}, {args.threads_per_stage} thread(s) a stage, one request, ms per token "
          "(median / p90 over the decode steps)")
    for name, values in gaps(executor.timeline, args.pp).items():
        values.sort()
        print(f"  {name:30s} {statistics.median(values):7.3f} {values[int(0.9 * len(values))]:7.3f}")
    llm.shutdown()


if __name__ == "__main__":
    main()
