"""The reference throughput workload with kept-quantized weights vs bfloat16, side by side in one process.

Engines for ``--quantization auto`` (the GGUF kept as shipped) and ``none``
(dequantized to bfloat16) are loaded at once; each round runs the same random
requests (the reference workload of benchmarks/run_all.sh: input 320 ± 60 %,
output 160 ± 60 %, seed 0, ``ignore_eos``) through every mode in turn.
``tiled`` is the kept engine with the many-row kernel (quant_gemm.c) switched
off for its round, i.e. the tile path it replaced. Output tok/s per round, and
each mode's ratio to ``none`` in the same round (the machine is shared: read
the ratios, and the median over rounds). Also per CPU second of this process
(``time.process_time``): with ``--threads 1`` that is the work done, which
other processes on the machine do not inflate as they inflate wall time.

    PYTHONPATH=$PWD python benchmarks/quant_throughput.py --num-prompts 64 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from pipeserve import LLM
from pipeserve.bench.datasets import random_requests
from pipeserve.bench.hf_source import load_hf_tokenizer
from pipeserve.bench.offline import run_pipeserve, warm_up
from pipeserve.model.quant.cpu_kernels import cpu_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--modes", default="auto,none,tiled")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=320)
    parser.add_argument("--output-len", type=int, default=160)
    parser.add_argument("--range-ratio", type=float, default=0.6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    modes = args.modes.split(",")
    engines = {q: LLM(model=args.model, dtype="bfloat16", quantization=q, threads_per_stage=args.threads)
               for q in dict.fromkeys("auto" if m == "tiled" else m for m in modes)}
    requests = random_requests(load_hf_tokenizer(args.model, None), num_prompts=args.num_prompts,
                               input_len=args.input_len,
                               output_len=args.output_len, range_ratio=args.range_ratio, seed=0)
    out_tokens = sum(r.output_len for r in requests)
    kernels = cpu_kernels()
    gemm = kernels._gemm if kernels is not None else None
    for llm in engines.values():
        warm_up(llm, requests, 4)
    rates: dict[str, list[float]] = {m: [] for m in modes}
    cpu_rates: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        line = []
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:   # rotate who goes first
            llm = engines["auto" if mode == "tiled" else mode]
            if kernels is not None:
                kernels._gemm = None if mode == "tiled" else gemm
            cpu = time.process_time()
            _, seconds, _ = run_pipeserve(llm, requests, progress=False)
            cpu = time.process_time() - cpu
            rates[mode].append(out_tokens / seconds)
            cpu_rates[mode].append(out_tokens / cpu)
            print(f"  round {r + 1} {mode}: {seconds:.1f} s wall, {cpu:.1f} s CPU", flush=True)
            line.append(f"{mode} {out_tokens / seconds:7.1f}")
        if kernels is not None:
            kernels._gemm = gemm
        ratios = [f"{m}/none {rates[m][-1] / rates['none'][-1]:.3f}" for m in modes if m != "none" and "none" in rates]
        print(f"round {r + 1}: output tok/s " + ", ".join(line) + "; " + ", ".join(ratios), flush=True)
    if "none" in rates:
        for label, table in (("wall", rates), ("CPU-time", cpu_rates)):
            for m in modes:
                if m != "none":
                    per_round = [a / b for a, b in zip(table[m], table["none"])]
                    print(f"{m}/none {label} median ratio {statistics.median(per_round):.3f} "
                          f"(rounds: {', '.join(f'{x:.3f}' for x in per_round)})")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
