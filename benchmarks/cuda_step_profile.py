"""Where a CUDA engine step's time goes: one request's prefill and decode, then a batch under torch.profiler.

Written for the kept-quantized path on a GPU, whose one-request TTFT and 64-request steps the
kernels' own times did not explain (benchmarks/README.md: the first was cuDNN's attention building
a graph per new length; the second, the host's launches). PP = 1 runs in this process, so the
profiler sees the engine, the model and the kernels together.

1. One request: a 32-token prompt (what ``bench --num-warmup`` sends), then three 128-token
   prompts, each for one token (wall time of the prefill), with the Triton kernels' compiled
   variants counted after each (a new variant is a compilation inside that call).
2. One request decoding ``--output-len`` tokens, then ``--num-prompts`` requests: each once to warm
   up (its wall time per engine step), then new prompts of the same lengths (not prefix-cache hits)
   under torch.profiler; the top kernels by GPU time and the top operators by host time.

    python benchmarks/cuda_step_profile.py --model /tmp/mixes/llama-Q4_K_M.gguf [--quantization auto]
"""

from __future__ import annotations

import argparse
import time

import torch

from pipeserve import LLM, SamplingParams
from pipeserve.model.quant import cuda_kernels as ck


def variants() -> str:
    """Compiled variants of each Triton kernel so far (Triton's per-device caches)."""
    if ck.triton is None:
        return "no Triton"
    counts = []
    for name in ("_qgemv", "_dequant"):
        fn = getattr(ck, name)
        counts.append(f"{name} {sum(len(c[0]) for c in getattr(fn, 'device_caches', {}).values())}")
    return ", ".join(counts)


def prompts(n: int, length: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(10, 1000, (length,), generator=g).tolist()} for _ in range(n)]


def timed(llm: LLM, batch: list[dict], max_tokens: int) -> float:
    start = time.perf_counter()
    llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return time.perf_counter() - start


def profiled(llm: LLM, batches: tuple[list[dict], list[dict]], max_tokens: int, label: str, args) -> None:
    """Two batches of the same shape to ``max_tokens``, the first to warm up (its wall time per engine
    step), the second under torch.profiler, whose tables follow."""
    steps = 0
    step = llm.engine.step

    def counted(*a, **kw):
        nonlocal steps
        steps += 1
        return step(*a, **kw)

    llm.engine.step = counted
    wall = timed(llm, batches[0], max_tokens)
    plain, steps = wall / steps, 0
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        wall = timed(llm, batches[1], max_tokens)
    llm.engine.step = step
    print(f"{label} x {max_tokens} tokens: {plain * 1e3:.2f} ms a step; under the profiler {wall * 1e3:.0f} ms, "
          f"{steps} engine steps, {wall / steps * 1e3:.2f} ms a step", flush=True)
    by_device = "self_device_time_total" if args.device == "cuda" else "cpu_time_total"
    for key in (by_device, "self_cpu_time_total"):
        print(prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rows", type=int, default=20, help="rows of each profiler table")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    args = ap.parse_args()
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, quantization=args.quantization)
    print(f"model {args.model}, quantization {args.quantization}, {args.dtype}; Triton variants at start: "
          f"{variants()}", flush=True)
    for i, length in enumerate((32, 128, 128, 128)):
        ms = timed(llm, prompts(1, length, i), 1) * 1e3
        print(f"prefill of {length} tokens, one request: {ms:.1f} ms (variants after: {variants()})", flush=True)
    for label, n, seed in (("one request", 1, 10), (f"{args.num_prompts} requests", args.num_prompts, 20)):
        profiled(llm, (prompts(n, 128, seed), prompts(n, 128, seed + 1)), args.output_len, label, args)
    llm.shutdown()


if __name__ == "__main__":
    main()
