"""What ``--profile`` costs: the same requests with it off and on, alternating, in one run.

    python benchmarks/profile_overhead.py --num-prompts 24 --rounds 2 [-pp 2]

Requests have the reference workload's shape (random ids, input 128-512,
output 64-256, seed 0), fewer of them. Each round loads one engine with
profiling off and one with it on (order alternating) and times
``generate``; the ratio of the medians is the overhead. On a loaded machine
only this same-run ratio means anything.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def requests(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, 40000) for _ in range(rng.randint(128, 512))], rng.randint(64, 256))
            for _ in range(n)]


def timed_run(profile: bool, reqs, pp: int) -> float:
    from pipeserve import LLM, SamplingParams
    with LLM(model="smollm2-135m-instruct", dtype="bfloat16", pipeline_parallel_size=pp, profile=profile) as llm:
        llm.generate([{"prompt_token_ids": reqs[0][0][:32]}], SamplingParams(max_tokens=4, ignore_eos=True))
        prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
        params = [SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0) for _, out in reqs]
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("-pp", type=int, default=1)
    args = p.parse_args()
    reqs = requests(args.num_prompts)
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        for profile in ((False, True) if r % 2 == 0 else (True, False)):
            times[profile].append(timed_run(profile, reqs, args.pp))
            print(f"round {r} profile={'on ' if profile else 'off'}: {times[profile][-1]:.2f} s", flush=True)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"median generate time: off {off:.2f} s, on {on:.2f} s; on/off = {on / off:.3f}")


if __name__ == "__main__":
    main()
