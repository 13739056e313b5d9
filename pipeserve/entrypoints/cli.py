"""The ``pipeserve`` command: generate, serve, bench, plan, worker."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from pipeserve.entrypoints.args import add_engine_args, config_from_args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    logging.basicConfig(level=getattr(args, "log_level", "WARNING").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "node_rank", 0) and args.command != "worker":
        # The same command on another node runs that node's stages for the driver on node 0.
        return _run_worker_node(args)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pipeserve: error: {exc}", file=sys.stderr)
        return 2


def _run_worker_node(args: argparse.Namespace) -> int:
    from pipeserve.pipeline.cli import run as run_worker
    if not 0 < args.node_rank < args.nnodes:
        print(f"pipeserve: error: --node-rank must be in [0, {args.nnodes}), got {args.node_rank}",
              file=sys.stderr)
        return 2
    return run_worker(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipeserve", description="Pipeline-parallel LLM inference")
    sub = parser.add_subparsers(dest="command")
    _add_generate(sub)
    for module in ("pipeserve.server.cli", "pipeserve.bench.cli", "pipeserve.plan.cli",
                   "pipeserve.pipeline.cli"):
        _register(sub, module)
    return parser


def _register(sub, module: str) -> None:
    import importlib
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("pipeserve"):
            return  # that part of pipeserve is not built yet
        raise
    mod.register(sub)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate one completion and print it")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", dest="sampling_seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--log-level", default="WARNING")
    add_engine_args(p, skip=frozenset({"seed"}))
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from pipeserve.entrypoints.llm import LLM
    from pipeserve.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    config = config_from_args(args)
    llm = LLM(**dataclasses.asdict(config))
    try:
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            out = llm.generate([args.prompt], params)[0]
    finally:
        llm.shutdown()
    if out.error:
        print(f"pipeserve: error: {out.error}", file=sys.stderr)
        return 1
    print(out.outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
