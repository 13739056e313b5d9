"""From bench flags to requests, and from a run to its JSON file: shared by both bench modes."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

from pipeserve.bench.datasets import (BenchRequest, prefix_requests, random_requests, sharegpt_requests,
                                      summarize_requests)


def build_requests(args: argparse.Namespace, tokenizer) -> list[BenchRequest]:
    if args.dataset == "random":
        return random_requests(tokenizer, num_prompts=args.num_prompts, input_len=args.input_len,
                               output_len=output_len(args), range_ratio=args.range_ratio,
                               seed=args.bench_seed)
    if args.dataset == "prefix":
        return prefix_requests(tokenizer, num_prompts=args.num_prompts, prefix_len=args.prefix_len,
                               num_prefixes=args.num_prefixes, num_turns=args.num_turns,
                               question_len=args.question_len, output_len=output_len(args),
                               seed=args.bench_seed)
    if not args.dataset_path:
        raise ValueError("--dataset sharegpt needs --dataset-path to a local ShareGPT JSON file")
    return sharegpt_requests(args.dataset_path, tokenizer, num_prompts=args.num_prompts,
                             output_len=args.output_len,
                             seed=args.bench_seed)


DEFAULT_OUTPUT_LEN = 128


def output_len(args: argparse.Namespace) -> int:
    """--output-len, or its default where the dataset does not bring its own lengths."""
    return args.output_len if args.output_len is not None else DEFAULT_OUTPUT_LEN


def dataset_json(args: argparse.Namespace, requests: list[BenchRequest]) -> dict:
    """The flags that define the workload, and what it came to in tokens."""
    flags = {"random": ("input_len", "output_len", "range_ratio"),
             "prefix": ("prefix_len", "num_prefixes", "num_turns", "question_len", "output_len"),
             "sharegpt": ("dataset_path",)}[args.dataset]
    return {"name": args.dataset, "seed": args.bench_seed, "num_prompts": args.num_prompts,
            **{f: output_len(args) if f == "output_len" else getattr(args, f) for f in flags},
            **summarize_requests(requests)}


def command_line() -> str:
    """The command as a user would retype it."""
    program = Path(sys.argv[0]).name
    if program in ("pipeserve", "cli.py", "__main__.py"):
        return shlex.join(["pipeserve", *sys.argv[1:]])
    return shlex.join(sys.argv)


def write_json(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(result), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def result_header(kind: str, args: argparse.Namespace) -> dict:
    return {"kind": kind, "label": args.label, "command": command_line(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _jsonable(value):
    """Strict JSON: infinities become "inf", tuples lists, unknown objects their repr."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else None)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)
