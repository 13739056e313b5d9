"""One request alone: time per output token at PP = 1 against PP = P, side by side.

Every engine is started once, up front (an idle engine's stages sleep), then the same
request (greedy, ``--tokens`` tokens) goes through each in turn, round after round, the
order rotating each round: a slow spell of a noisy host then hits every engine alike. The
figure is the median over rounds of each engine's TPOT (first token to last) and of the
per-round ratio to PP = 1.

    PYTHONPATH=$PWD python benchmarks/pp_lone_request.py [--pp 2] [--rounds 8] [--tokens 256]
        [--threads-per-stage 1] [--model M] [--against cpu-bind|decode-ahead]

The third engine is PP = P without what ``--against`` names: ``--cpu-bind none`` (default) or
``--no-pp-decode-ahead``.
"""

from __future__ import annotations

import argparse
import statistics

from pipeserve import LLM, SamplingParams


def tpot_ms(output) -> float:
    m, n = output.metrics, len(output.outputs[0].token_ids)
    return (m.last_token_time - m.first_token_time) / (n - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads-per-stage", type=int, default=1)
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2 GGUF")
    parser.add_argument("--against", choices=("cpu-bind", "decode-ahead"), default="cpu-bind",
                        help="the third engine: PP = P with --cpu-bind none, or without decode ahead")
    args = parser.parse_args()
    extra = {"model": args.model} if args.model else {}
    common = dict(threads_per_stage=args.threads_per_stage, **extra)
    engines = {
        "PP=1": LLM(pipeline_parallel_size=1, **common),
        f"PP={args.pp}": LLM(pipeline_parallel_size=args.pp, **common),
        (f"PP={args.pp} --cpu-bind none" if args.against == "cpu-bind" else f"PP={args.pp} no decode ahead"):
            LLM(pipeline_parallel_size=args.pp, **common,
                **({"cpu_bind": "none"} if args.against == "cpu-bind" else {"pp_decode_ahead": False})),
    }
    prompt = "The history of the city " * 20      # ~128 tokens
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    names = list(engines)
    for llm in engines.values():
        llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))     # warm-up
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            times[name].append(tpot_ms(engines[name].generate([prompt], params)[0]))
        print(f"round {r}: " + ", ".join(f"{n} {times[n][-1]:.2f} ms" for n in names), flush=True)
    base = times["PP=1"]
    print(f"\nmedian TPOT over {args.rounds} rounds, {args.tokens} tokens, {args.threads_per_stage} thread(s) a stage")
    for name in names:
        ratios = [t / b for t, b in zip(times[name], base)]
        print(f"  {name:24s} {statistics.median(times[name]):6.2f} ms   x PP=1: median {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f})")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
