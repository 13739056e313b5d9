"""IQ4 / Q3_K / Q2_K files kept compact (i4 / q3 / q2) against widened to byte-per-code q8, end to
end in one process.

For each ``--model`` two engines are loaded side by side: ``compact`` as the loader keeps the file
(every build takes i4/q2/q3 since AVX-512 ones do too), and ``widened`` with the loader's support
check answering no while it loads (``gguf_widen.keeps``), i.e. the q8 rows AVX-512 builds held
before. Each round runs one request through each in turn (prompt ``--input-len`` random tokens,
``--output-len`` tokens, greedy, ``ignore_eos``): TTFT and TPOT per engine, best of the rounds
and the median ratio widened / compact (the machine is shared: read the ratios). Weight bytes
from ``LLM.stats()``. One stage, ``--threads`` threads.

    PYTHONPATH=$PWD python benchmarks/compact_vs_widened.py --model /tmp/gguf-mixes/llama-Q2_K.gguf \\
        [--model ...] [--threads 2] [--input-len 128] [--output-len 32] [--rounds 3]

Files: ``benchmarks/gguf_mixes.py`` (``--random-blocks`` without llama.cpp).
"""

from __future__ import annotations

import argparse
import json
import statistics

import pipeserve.model.quant.gguf_widen as widen
from pipeserve import LLM
from pipeserve.bench.datasets import random_requests
from pipeserve.bench.hf_source import load_hf_tokenizer
from pipeserve.model.quant.cpu_kernels import cpu_kernels
from pipeserve.sampling_params import SamplingParams


def load(model: str, threads: int, widened: bool) -> LLM:
    """An engine on ``model``; ``widened``: IQ4/Q3_K/Q2_K given to it as q8 rows."""
    keeps = widen.keeps
    if widened:
        widen.keeps = lambda kind: False
    try:
        return LLM(model, quantization="auto", threads_per_stage=threads, max_model_len=1024,
                   enable_prefix_caching=False)   # every round's prompt is prefilled again
    finally:
        widen.keeps = keeps


def one_request(llm: LLM, prompt: list[int], output_len: int) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds of one greedy request."""
    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    m = out.metrics
    ttft = m.first_token_time - m.arrival_time
    return ttft, (m.finished_time - m.first_token_time) / max(1, len(out.outputs[0].token_ids) - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"# quant kernels: {cpu_kernels().isa}, many rows: {cpu_kernels().gemm_isa}")
    for model in args.model:
        engines = {mode: load(model, args.threads, mode == "widened") for mode in ("compact", "widened")}
        tokenizer = load_hf_tokenizer(model)
        prompt = random_requests(tokenizer, num_prompts=1, input_len=args.input_len, output_len=args.output_len,
                                 seed=0)[0].prompt_token_ids
        for llm in engines.values():   # warm-up: allocations, kernel builds
            one_request(llm, prompt[::-1][:32], 4)
        times = {mode: [] for mode in engines}
        for _ in range(args.rounds):
            for mode, llm in engines.items():
                times[mode].append(one_request(llm, prompt, args.output_len))
        row = {"model": model}
        for mode, llm in engines.items():
            row[f"{mode}_weight_bytes"] = llm.stats()["weight_bytes"]
            row[f"{mode}_ttft_ms"] = round(1e3 * min(t[0] for t in times[mode]), 1)
            row[f"{mode}_tpot_ms"] = round(1e3 * min(t[1] for t in times[mode]), 2)
        c, w = times["compact"], times["widened"]
        row["widened_over_compact_ttft"] = round(statistics.median(b[0] / a[0] for a, b in zip(c, w)), 3)
        row["widened_over_compact_tpot"] = round(statistics.median(b[1] / a[1] for a, b in zip(c, w)), 3)
        print(json.dumps(row), flush=True)
        for llm in engines.values():
            llm.shutdown()


if __name__ == "__main__":
    main()
