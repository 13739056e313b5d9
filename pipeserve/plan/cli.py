"""``pipeserve plan``: the performance model and the pipeline simulator as a command."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from pipeserve.plan.analysis import PlanRequest, evaluate
from pipeserve.plan.hardware import load_hardware, parse_quantity
from pipeserve.plan.predict import simulate
from pipeserve.plan.presets import PlanInputError, load_model
from pipeserve.plan.quantization import WEIGHT_FORMATS, weight_format
from pipeserve.plan.recommend import TARGETS, fewest_stages, model_weight_bytes, recommend
from pipeserve.plan.report import (SYMBOLS, explain, format_candidates, format_estimate,
                                   format_fewest_stages, format_hardware, format_simulation)
from pipeserve.plan.simulator import SCHEDULES
from pipeserve.plan.workload import KINDS, Workload


def register(subparsers) -> None:
    """Add the ``plan`` subcommand to an argparse subparsers object."""
    parser = subparsers.add_parser("plan", help="plan a pipeline split: analytic model + simulator",
                                   description=__doc__)
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="SmolLM2-135M", help="preset name or config.json path")
    p.add_argument("--hardware", default="cpu-local", help="preset name or YAML/JSON file")
    p.add_argument("--pp", "--pipeline-parallel-size", "-pp", dest="pp", type=int, default=1)
    p.add_argument("--tp", "--tensor-parallel-size", "-tp", dest="tp", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=None, help="N: in flight (async) / per step")
    p.add_argument("--target", choices=TARGETS, default="throughput")
    p.add_argument("--schedule", choices=SCHEDULES, default="async")
    p.add_argument("--virtual-stages", type=int, default=2, help="V for --schedule interleaved")
    p.add_argument("--partition", default="auto", help="auto (balanced by the planner's times) | balanced (the engine's default split) | uniform | comma list (19,11)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "fp8"), default=None)
    p.add_argument("--quantization", default=None, metavar="FORMAT",
                   help=f"weights' storage format ({', '.join(WEIGHT_FORMATS)}); default: the dtype")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="memory of one device, overriding the hardware's (e.g. 24GiB)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dataset", choices=KINDS, default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON for --dataset sharegpt")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", type=int, default=0, help="shared-prefix: shared tokens")
    p.add_argument("--num-prefixes", type=int, default=1)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson (inf: all at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-simulate", action="store_true", help="analytic model only")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="Gantt chart of the simulation")
    p.add_argument("--calibrate", action="store_true", help="measure this machine, write a hardware file")
    p.add_argument("--output", default="cpu-local.yaml", help="file --calibrate writes")


def run(args: argparse.Namespace) -> int:
    try:
        if args.calibrate:
            return _calibrate(args)
        return _plan(args)
    except PlanInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _calibrate(args: argparse.Namespace) -> int:
    from pipeserve.plan.calibrate import calibrate, write_hardware_file
    hw = calibrate(dtype=args.dtype or "float32")
    write_hardware_file(hw, args.output)
    print(f"wrote {args.output}; use it with --hardware {args.output}")
    return 0


def _check_args(args: argparse.Namespace) -> None:
    for flag in ("pp", "tp", "max_num_seqs", "max_num_batched_tokens", "virtual_stages"):
        if getattr(args, flag) < 1:
            raise PlanInputError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.micro_batches is not None and args.micro_batches < 1:
        raise PlanInputError(f"--micro-batches must be >= 1, got {args.micro_batches}")
    if args.quantization is not None:
        args.quantization = weight_format(args.quantization).name


def _hardware(args: argparse.Namespace):
    hw = load_hardware(args.hardware)
    if args.device_memory is None:
        return hw
    memory = parse_quantity(args.device_memory, "--device-memory")
    return dataclasses.replace(hw, name=f"{hw.name} ({memory / 2**30:.0f} GiB)", mem_bytes=memory)


def _plan(args: argparse.Namespace) -> int:
    _check_args(args)
    name, model = load_model(args.model)
    hw = _hardware(args)
    workload = Workload(kind=args.dataset, num_requests=args.num_prompts, input_len=args.input_len,
                        output_len=args.output_len, range_ratio=args.range_ratio,
                        prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
                        path=args.dataset_path, request_rate=args.request_rate, seed=args.seed)
    req = PlanRequest(pp=args.pp, tp=args.tp, micro_batches=args.micro_batches,
                      schedule=args.schedule,
                      virtual_stages=args.virtual_stages if args.schedule == "interleaved" else 1,
                      partition=args.partition, dtype=args.dtype, quantization=args.quantization,
                      max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      input_len=args.input_len, output_len=args.output_len,
                      request_rate=args.request_rate)
    print(f"Model {name}: {model.num_layers} layers, hidden {model.hidden_size}, "
          f"{model.num_heads} heads / {model.num_kv_heads} KV heads, vocab {model.vocab_size}, "
          f"{model.total_params() / 1e9:.2f} B parameters")
    print(format_hardware(hw))
    print(SYMBOLS)
    est = evaluate(model, hw, req)
    print(format_estimate(est, "Requested"))
    print(format_fewest_stages(fewest_stages(model, hw, req), model_weight_bytes(model, hw, req), hw))
    best, results = recommend(model, hw, req, args.target)
    print(format_candidates(results, best, args.target))
    print(explain(best, results, args.target))
    if args.no_simulate:
        return 0
    if not est.fits:
        # A configuration that cannot hold its weights and one sequence's KV cannot run: its
        # simulation would say nothing, and of a 70B model on one device it takes minutes.
        print(f"Not simulated: PP={req.pp} x TP={req.tp} does not fit in memory (see Stages needed; "
              "pass --pp/--tp/--hardware/--device-memory for a configuration that does)")
        return 0
    _simulate_all(model, hw, req, workload, args)
    return 0


def _simulate_all(model, hw, req: PlanRequest, workload: Workload, args) -> None:
    summaries, plotted = [], None
    for schedule in SCHEDULES:
        v = args.virtual_stages if schedule == "interleaved" else 1
        if req.pp * v > model.num_layers or (schedule == "interleaved" and req.pp == 1):
            continue
        variant = dataclasses.replace(req, schedule=schedule, virtual_stages=v)
        est = evaluate(model, hw, variant)
        result = simulate(model, hw, est, workload, record_intervals=schedule == req.schedule)
        summaries.append(result.summary())
        if schedule == req.schedule:
            plotted = result
    print(f"Workload: {workload.kind}, {workload.num_requests} requests, "
          f"rate {workload.request_rate} req/s, PP={req.pp} x TP={req.tp}")
    print(format_simulation(summaries))
    if args.plot and plotted is not None:
        from pipeserve.plan.gantt import plot_gantt
        plot_gantt(plotted, args.plot, f"{req.schedule}, PP={req.pp}")
        print(f"wrote {args.plot}")
