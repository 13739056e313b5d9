"""One request alone: per-token decode latency at TP = 2 (shared-memory or gloo all-reduce) vs
PP = 2 vs PP = 1, and the all-reduce share.

    PYTHONPATH=<tree> python benchmarks/tp_latency.py [--prompt 128] [--tokens 256] [--rounds 2]

SmolLM2-135M (the built-in GGUF, dequantized: tensor parallelism runs dense
weights), 2 threads in all: PP = 1 with 2 threads, PP = 2 and TP = 2 with one
thread per process. The configurations run alternately, ``--rounds`` times each,
each in its own child process (so one's stage processes never overlap
another's run). Per-token latency = (last token - first token) / (tokens - 1);
TTFT is first token - arrival. For TP the stage's TP rank 0 logs where its step
time went (``tp-stats``: step time, all-reduces, step broadcasts), parsed from
the child's stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

CONFIGS = {
    "PP=1 (2 threads)": dict(threads_per_stage=2),
    "PP=1 (1 thread)": dict(threads_per_stage=1),
    "PP=2 (1 thread each)": dict(pipeline_parallel_size=2, threads_per_stage=1),
    "TP=2 shm (1 thread each)": dict(tensor_parallel_size=2, threads_per_stage=1, tp_all_reduce="shm"),
    "TP=2 gloo (1 thread each)": dict(tensor_parallel_size=2, threads_per_stage=1, tp_all_reduce="gloo"),
}


def child(name: str, prompt: int, tokens: int, dtype: str) -> None:
    from pipeserve import LLM, SamplingParams
    ids = [random.Random(0).randrange(3, 49000) for _ in range(prompt)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    with LLM(dtype=dtype, quantization="none", kv_cache_memory="256MiB", **CONFIGS[name]) as llm:
        llm.generate([{"prompt_token_ids": ids[:16]}], SamplingParams(temperature=0, max_tokens=4),
                     use_tqdm=False)   # warm-up
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    m = out.metrics
    print("RESULT " + json.dumps({"ttft_s": m.first_token_time - m.arrival_time,
                                  "tpot_ms": (m.last_token_time - m.first_token_time) / (tokens - 1) * 1e3,
                                  "tokens": out.outputs[0].token_ids[:8]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--child", default=None)
    ap.add_argument("--only", default=None, help="comma-separated configuration names (substrings)")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.prompt, args.tokens, args.dtype)
        return
    names = [n for n in CONFIGS if not args.only or any(o in n for o in args.only.split(","))]
    results: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            proc = subprocess.run([sys.executable, __file__, "--child", name, "--prompt", str(args.prompt),
                                   "--tokens", str(args.tokens), "--dtype", args.dtype],
                                  capture_output=True, text=True, env=os.environ)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if proc.returncode or not lines:
                sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
            row = json.loads(lines[-1][7:])
            stats = [json.loads(l.split("tp-stats ", 1)[1]) for l in proc.stderr.splitlines() if "tp-stats " in l]
            if stats:
                s = stats[-1]
                row["all_reduce_share"] = s["all_reduce_s"] / s["step_s"]
                row["broadcast_share"] = s["broadcast_s"] / s["step_s"]
                row["tp_stats"] = s
            results[name].append(row)
            print(name, json.dumps(row), flush=True)
    print("\n| configuration | per-token latency (ms, median of rounds) | TTFT (s) | all-reduce share of TP "
          "rank 0's step time | step broadcast share |")
    print("|---|---|---|---|---|")
    base = statistics.median(r["tpot_ms"] for r in next(iter(results.values())))
    for name, rows in results.items():
        tpot = statistics.median(r["tpot_ms"] for r in rows)
        ttft = statistics.median(r["ttft_s"] for r in rows)
        share = (f"{statistics.median(r['all_reduce_share'] for r in rows):.0%}" if "all_reduce_share" in rows[0]
                 else "-")
        bshare = (f"{statistics.median(r['broadcast_share'] for r in rows):.0%}" if "broadcast_share" in rows[0]
                  else "-")
        print(f"| {name} | {tpot:.1f} ({tpot / base:.2f}x first row) | {ttft:.2f} | {share} | {bshare} |")
    same = len({json.dumps(r["tokens"]) for rows in results.values() for r in rows}) == 1
    print(f"\nfirst 8 tokens identical across configurations: {same}")


if __name__ == "__main__":
    main()
