"""Single-stream decode speed with quantized weights, side by side in one run.

One engine per ``--quantization`` mode (all loaded at once), then rounds that
time each mode in turn on the same request: a prompt of 128 random token ids,
256 new tokens, greedy, end-of-sequence ignored. Decode tok/s is
255 / (time for 256 tokens - time for 1 token), the best of the rounds (the
machine is shared: the least disturbed round is the closest to its speed).

    PYTHONPATH=$PWD python benchmarks/quant_decode.py --modes auto,none,int8,int4 --rounds 2

``--cpu-time`` (with ``--threads 1``) times with the process's CPU clock, which other
processes on a shared machine do not inflate.

``--bandwidth`` also measures, after each mode's timing in every round, what the same
number of threads read from memory (``torch.sum`` over 256 MiB, best of 5), and reports
issue 11's share of the bandwidth limit: the limit's time per token (the stage's resident
weight bytes, every one of which a token reads, over that round's bandwidth) over the
round's decode time per token, the median over the rounds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

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
    parser.add_argument("--bandwidth", action="store_true",
                        help="measure the read bandwidth each round and report the share of the limit")
    args = parser.parse_args()
    if args.cpu_time:
        if args.threads != 1:
            parser.error("--cpu-time measures one thread: use it with --threads 1")
        global CLOCK
        CLOCK = time.process_time
    prompt = [random.Random(0).randrange(100, 20000) for _ in range(args.prompt_len)]
    engines = {mode: LLM(model=args.model, dtype=args.dtype, quantization=mode, threads_per_stage=args.threads)
               for mode in args.modes.split(",")}
    weights = {mode: llm.stats()["weight_bytes"][0] for mode, llm in engines.items()}
    probe = torch.ones(64 << 20) if args.bandwidth else None   # 256 MiB of float32
    best: dict[str, float] = {}
    shares: dict[str, list[float]] = {mode: [] for mode in engines}
    for r in range(args.rounds):
        for mode, llm in engines.items():
            timed(llm, prompt, 8)   # warm-up (kernel build, allocator)
            first = timed(llm, prompt, 1)
            decode = args.output_len - 1
            rate = decode / (timed(llm, prompt, args.output_len) - first)
            best[mode] = max(best.get(mode, 0.0), rate)
            if probe is not None:
                bandwidth = read_bandwidth(probe, args.threads)
                limit = weights[mode] / bandwidth            # seconds a token at the memory's pace
                shares[mode].append(limit * rate)
                print(f"round {r + 1} --quantization {mode:5}  TPOT {1e3 / rate:5.2f} ms  read "
                      f"{bandwidth / 1e9:5.1f} GB/s  limit {limit * 1e3:5.2f} ms  {limit * rate:6.1%} of it")
    for mode, llm in engines.items():
        line = f"--quantization {mode:5}  decode {best[mode]:6.1f} tok/s  weights {weights[mode] / 2**20:6.1f} MiB"
        if shares[mode]:
            line += f"  median {statistics.median(shares[mode]):.1%} of the bandwidth limit"
        print(line)


def read_bandwidth(probe: torch.Tensor, threads: int) -> float:
    """Bytes a second that ``threads`` threads read summing ``probe``, best of 5."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        probe.sum()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            probe.sum()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return probe.numel() * probe.element_size() / best


if __name__ == "__main__":
    main()
