"""TTFT of one long prompt alone, for several engine settings side by side.

Every setting gets its own engine, all started first; then each round times one fresh
prompt (no prefix-cache hit) on each engine in turn, so the settings share the machine's
state (another process's load included) round by round. TTFT here is the latency of
``generate`` with ``max_tokens=1``. Prints one line per setting: median, min, all rounds.

    python benchmarks/pp_prompt_chunks.py --input-len 2048 --rounds 3 \
        --setting "pp=1" --setting "pp=2,pipeline_prompt_chunks=0" --setting "pp=2" \
        --setting "pp=2,max_num_batched_tokens=1024"
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--input-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads-per-stage", type=int, default=1)
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

    times: dict[str, list[float]] = {text: [] for text, _ in engines}
    stats: dict[str, dict] = {}
    for _, llm in engines:                       # warm-up: kernels built, caches touched
        llm.generate([prompt()], params, use_tqdm=False)
    for _ in range(args.rounds):
        for text, llm in engines:
            start = time.perf_counter()
            llm.generate([prompt()], params, use_tqdm=False)
            times[text].append(time.perf_counter() - start)
    for text, llm in engines:
        stats[text] = llm.stats()["scheduler"]
        llm.shutdown()
    for text, t in times.items():
        print(f"{text:45s} TTFT median {statistics.median(t):7.2f} s  min {min(t):7.2f} s  "
              f"rounds {' '.join(f'{x:.2f}' for x in t)}  pipelined chunks {stats[text]['num_pipelined_chunks']}")


if __name__ == "__main__":
    main()
