"""Single-stream decode speed with quantized weights, side by side in one run.

One engine per ``--quantization`` mode (all loaded at once), then rounds that
time each mode in turn on the same request: a prompt of 128 random token ids,
256 new tokens, greedy, end-of-sequence ignored. Decode tok/s is
255 / (time for 256 tokens - time for 1 token), the best of the rounds (the
machine is shared: the least disturbed round is the closest to its speed).

    PYTHONPATH=$PWD python benchmarks/quant_decode.py --modes auto,none,int8,int4 --rounds 2

``--cpu-time`` (with ``--threads 1``) times with the process's CPU clock, which other
processes on a shared machine do not inflate.
"""

from __future__ import annotations

import argparse
import random
import time

from pipeserve import LLM, SamplingParams


CLOCK = time.perf_counter


def timed(llm: LLM, prompt: list[int], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = CLOCK()
    out = llm.generate([prompt], params, use_tqdm=False)
    if len(out[0].outputs[0].token_ids) != tokens:
        raise RuntimeError("the engine stopped early")
    return CLOCK() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--modes", default="auto,none,int8,int4")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true", help="time with the CPU clock (one thread)")
    args = parser.parse_args()
    if args.cpu_time:
        if args.threads != 1:
            parser.error("--cpu-time measures one thread: use it with --threads 1")
        global CLOCK
        CLOCK = time.process_time
    prompt = [random.Random(0).randrange(100, 20000) for _ in range(args.prompt_len)]
    engines = {mode: LLM(model=args.model, dtype=args.dtype, quantization=mode, threads_per_stage=args.threads)
               for mode in args.modes.split(",")}
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for mode, llm in engines.items():
            timed(llm, prompt, 8)   # warm-up (kernel build, allocator)
            first = timed(llm, prompt, 1)
            decode = args.output_len - 1
            rate = decode / (timed(llm, prompt, args.output_len) - first)
            best[mode] = max(best.get(mode, 0.0), rate)
    for mode, llm in engines.items():
        weights = llm.stats()["weight_bytes"][0]
        print(f"--quantization {mode:5}  decode {best[mode]:6.1f} tok/s  weights {weights / 2**20:6.1f} MiB")


if __name__ == "__main__":
    main()
