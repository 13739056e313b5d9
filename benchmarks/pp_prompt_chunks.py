"""TTFT of one long prompt alone, for several engine settings side by side.

Every setting gets its own engine, all started first; then each round times one fresh
prompt (no prefix-cache hit) on each engine in turn, so the settings share the machine's
state round by round. TTFT here is the latency of ``generate`` with ``max_tokens=1``. The
machine may be shared: each round also measures the CPU that other processes used meanwhile
(/proc), and the summary keeps only quiet rounds. Prints one line per setting: median, min,
all rounds (a noisy one in brackets with the other processes' cores).

    python benchmarks/pp_prompt_chunks.py --input-len 2048 --rounds 3 \
        --setting "pp=1" --setting "pp=2,pipeline_prompt_chunks=0" --setting "pp=2" \
        --setting "pp=2,max_num_batched_tokens=1024"
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from pipeserve import LLM, SamplingParams


def parse_setting(text: str) -> dict:
    kwargs: dict = {}
    for part in filter(None, text.split(",")):
        key, value = part.split("=")
        key = {"pp": "pipeline_parallel_size"}.get(key, key)
        kwargs[key] = bool(int(value)) if key == "pipeline_prompt_chunks" else int(value)
    return kwargs


def busy_ticks() -> int:
    """CPU time (clock ticks) every process on the machine used so far."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]          # all but idle and iowait


def process_ticks(pids: list[int]) -> int:
    """CPU time (clock ticks) the processes ``pids`` used so far (user + system)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--input-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads-per-stage", type=int, default=1)
    parser.add_argument("--max-foreign", type=float, default=0.15,
                        help="keep only rounds in which other processes used at most this many cores "
                             "(the machine is shared); the others are shown in brackets")
    parser.add_argument("--setting", action="append", required=True,
                        help="comma-separated key=value engine arguments (pp=P for the pipeline size)")
    args = parser.parse_args()
    rng = random.Random(0)
    engines = []
    for text in args.setting:
        llm = LLM(model=args.model, quantization="auto", kv_cache_memory="256MiB",
                  threads_per_stage=args.threads_per_stage, **parse_setting(text))
        engines.append((text, llm))
    params = SamplingParams(temperature=0, max_tokens=1)

    def prompt() -> dict:
        return {"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(args.input_len)]}

    times: dict[str, list[tuple[float, float]]] = {text: [] for text, _ in engines}   # (TTFT, foreign cores)
    stats: dict[str, dict] = {}
    for _, llm in engines:                       # warm-up: kernels built, caches touched
        llm.generate([prompt()], params, use_tqdm=False)
    tick = os.sysconf("SC_CLK_TCK")
    for _ in range(args.rounds):
        for text, llm in engines:
            mine = [os.getpid(), *llm.engine.stage_pids.values()]
            busy, own = busy_ticks(), process_ticks(mine)
            start = time.perf_counter()
            llm.generate([prompt()], params, use_tqdm=False)
            wall = time.perf_counter() - start
            foreign = (busy_ticks() - busy - (process_ticks(mine) - own)) / tick / wall
            times[text].append((wall, foreign))
    for text, llm in engines:
        stats[text] = llm.stats()["scheduler"]
        llm.shutdown()
    for text, rounds in times.items():
        quiet = [t for t, f in rounds if f <= args.max_foreign]
        summary = (f"median {statistics.median(quiet):6.2f} s  min {min(quiet):6.2f} s  ({len(quiet)} quiet)"
                   if quiet else "no quiet round")
        shown = " ".join(f"{t:.2f}" if f <= args.max_foreign else f"[{t:.2f} @{f:.1f}]" for t, f in rounds)
        print(f"{text:42s} TTFT {summary}  rounds {shown}  pipelined chunks {stats[text]['num_pipelined_chunks']}")


if __name__ == "__main__":
    main()
