"""``pipeserve bench throughput`` and ``pipeserve bench serve``: flags and wiring."""

from __future__ import annotations

import argparse
import math

from pipeserve.bench.arrivals import parse_rate, parse_rates
from pipeserve.entrypoints.args import add_engine_args

DATASETS = ("random", "sharegpt", "prefix")


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: offline throughput, online serving")
    kinds = bench.add_subparsers(dest="bench_command")
    _add_throughput(kinds)
    _add_serve(kinds)
    bench.set_defaults(func=lambda args: _usage(bench))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (--dataset sharegpt)")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--input-len", type=int, default=256, help="random: mean prompt tokens")
    g.add_argument("--output-len", type=int, default=None,
                   help="random/prefix: output tokens (default 128); sharegpt: overrides the answers' lengths")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--prefix-len", type=int, default=512, help="prefix: tokens of each shared prefix")
    g.add_argument("--num-prefixes", type=int, default=4, help="prefix: distinct shared prefixes")
    g.add_argument("--num-turns", type=int, default=4, help="prefix: turns per conversation")
    g.add_argument("--question-len", type=int, default=32, help="prefix: new tokens per turn")
    g.add_argument("--seed", dest="bench_seed", metavar="SEED", type=int, default=0, help="workload seed")
    g.add_argument("--temperature", type=float, default=0.0)
    out = p.add_argument_group("results")
    out.add_argument("--output", default=None, help="write the results as JSON here")
    out.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots into DIR")
    out.add_argument("--label", default=None, help="name of this run in the results table")
    out.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def _add_throughput(kinds) -> None:
    p = kinds.add_parser("throughput", help="offline throughput through LLM.generate (and transformers)")
    _add_dataset_args(p)
    g = p.add_argument_group("backends")
    g.add_argument("--backend", default="pipeserve",
                   help="comma-separated: pipeserve, hf (transformers generate in static batches), "
                        "llamacpp (llama-cpp-python, one sequence at a time; optional extra "
                        "pipeserve[llamacpp]); both = pipeserve,hf. Several: one run each, and ratios")
    g.add_argument("--hf-batch-size", default="8",
                   help="transformers batch size(s), comma-separated; the best one is the baseline")
    g.add_argument("--hf-dtype", choices=("auto", "float32", "bfloat16", "float16"), default=None,
                   help="dtype of the transformers baseline (default: the engine's --dtype)")
    g.add_argument("--llamacpp-threads", type=int, default=None,
                   help="llama.cpp threads (default: all cores, as pipeserve's stages share them)")
    g.add_argument("--num-warmup", type=int, default=2, help="short untimed requests before the run")
    g.add_argument("--gantt-window", type=float, default=2.0,
                   help="seconds of the pipeline timeline, from the middle of the run, in the Gantt chart")
    g.add_argument("--roofline-hardware", default=None, metavar="FILE",
                   help="with --profile: the peaks of the roofline from this hardware file (`pipeserve plan "
                        "--calibrate` writes one); default: a short GEMM and copy measurement at start")
    add_engine_args(p, skip=frozenset({"seed"}))
    p.set_defaults(func=_run_throughput)


def _add_serve(kinds) -> None:
    p = kinds.add_parser("serve", help="online load against an OpenAI-compatible server")
    _add_dataset_args(p)
    g = p.add_argument_group("load")
    g.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    g.add_argument("--model", default="smollm2-135m-instruct",
                   help="model whose tokenizer sizes the workload (HF dir, .gguf, built-in name)")
    g.add_argument("--tokenizer", default=None, help="tokenizer source, if not --model's")
    g.add_argument("--served-model-name", default=None, help="the 'model' field (default: first of /v1/models)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--request-rate", type=parse_rate, default=math.inf, help="requests/s, or inf")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, <1 burstier")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--sweep-rates", type=parse_rates, default=None, help="e.g. 1,2,4,8: one run per rate")
    g.add_argument("--slo", default=None, help="e.g. ttft=500,tpot=50,e2el=10000 (ms) for goodput")
    g.add_argument("--slo-attainment", type=float, default=0.9,
                   help="fraction of requests that must meet the SLO for a rate to count as sustained")
    g.add_argument("--prompt-format", choices=("text", "ids"), default="text",
                   help="send prompts as text or as token-id lists")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.set_defaults(func=_run_serve)


def _run_throughput(args: argparse.Namespace) -> int:
    from pipeserve.bench.run_throughput import run_throughput_command
    return run_throughput_command(args)


def _run_serve(args: argparse.Namespace) -> int:
    from pipeserve.bench.run_serve import run_serve_command
    return run_serve_command(args)
