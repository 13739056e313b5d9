"""``pipeserve bench throughput``: run the workload on pipeserve and/or transformers, report, plot."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from pipeserve.bench.datasets import BenchRequest
from pipeserve.bench.hf_baseline import run_hf
from pipeserve.bench.hf_source import load_hf_model, load_hf_tokenizer
from pipeserve.bench.offline import (pipeline_timeline, prefix_cache_delta, run_pipeserve, stage_ratios,
                                     warm_up, write_gantt)
from pipeserve.bench.plots import plot_latency_cdfs
from pipeserve.bench.stats import RequestRecord, latency_metrics
from pipeserve.bench.workload import build_requests, dataset_json, result_header, write_json
from pipeserve.config import EngineConfig
from pipeserve.entrypoints.args import config_from_args

def run_throughput_command(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    batch_sizes = parse_batch_sizes(args.hf_batch_size)
    tokenizer = load_hf_tokenizer(config.model, config.tokenizer)
    requests = build_requests(args, tokenizer)
    result = {**result_header("throughput", args), "dataset": dataset_json(args, requests), "runs": []}
    latencies: dict[str, dict[str, list[float]]] = {}
    plots: list[str] = []
    if args.backend in ("pipeserve", "both"):
        run, records, gantt = pipeserve_run(config, requests, args)
        result["runs"].append(run)
        plots += [gantt] if gantt else []
        latencies["pipeserve"] = latency_series(records)
    if args.backend in ("hf", "both"):
        for run, records in hf_runs(config, requests, batch_sizes, args, tokenizer.pad_token_id):
            result["runs"].append(run)
            latencies[f"transformers b={run['batch_size']}"] = latency_series(records)
    result["baseline"] = baseline(result["runs"])
    if args.plot:
        cdf = plot_latency_cdfs(latencies, Path(args.plot) / "latency_cdf.png", "offline latency CDFs")
        result["plots"] = ([str(cdf)] if cdf else []) + plots
    if args.output:
        write_json(result, args.output)
    print(format_summary(result))
    return 0


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--hf-batch-size {text!r}: write integers, e.g. 8 or 8,16,32") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--hf-batch-size {text!r}: each batch size must be >= 1")
    return sizes


def pipeserve_run(config: EngineConfig, requests: list[BenchRequest],
                  args: argparse.Namespace) -> tuple[dict, list[RequestRecord], str | None]:
    """The timed run, its figures, and the path of its Gantt chart (with --plot, PP > 1)."""
    from pipeserve.entrypoints.llm import LLM
    llm = LLM(**dataclasses.asdict(config))
    gantt = None
    try:
        warm_up(llm, requests, args.num_warmup)
        before = llm.stats().get("scheduler", {})
        records, duration, window = run_pipeserve(llm, requests, args.temperature, args.progress)
        stats = llm.stats()
        timeline = pipeline_timeline(llm)
        stages = stage_ratios(timeline, window)
        if args.plot:
            title = f"{config.pipeline_parallel_size} stages, {config.pp_schedule} schedule, middle of the run"
            gantt = write_gantt(Path(args.plot) / "pipeline_gantt.png", timeline, window, args.gantt_window, title)
    finally:
        llm.shutdown()
    run = {"backend": "pipeserve", "engine": dataclasses.asdict(config),
           **latency_metrics(records, duration),
           "stages": stages, "partition": stats.get("partition"),
           "prefix_cache": prefix_cache_delta(before, stats.get("scheduler", {})),
           "scheduler": stats.get("scheduler", {})}
    return run, records, None if gantt is None else str(gantt)


def hf_runs(config: EngineConfig, requests: list[BenchRequest], batch_sizes: list[int],
            args: argparse.Namespace, pad_id: int):
    """One timed run per batch size on one loaded model (loading is not timed)."""
    import torch
    torch.set_num_threads(os.cpu_count() or 1)  # the whole machine, as pipeserve's stages share it
    dtype = args.hf_dtype or config.dtype
    model = load_hf_model(config.model, dtype)
    for size in batch_sizes:
        warm = [BenchRequest(r.prompt_token_ids[:32], 8) for r in requests[:max(0, args.num_warmup)]]
        if warm:
            run_hf(model, warm, size, pad_id, progress=False)
        records, duration = run_hf(model, requests, size, pad_id, args.temperature, args.progress)
        yield {"backend": "hf", "batch_size": size, "dtype": config.replace(dtype=dtype).torch_dtype_name,
               **latency_metrics(records, duration)}, records


def baseline(runs: list[dict]) -> dict | None:
    """pipeserve output tokens/s over the best transformers batch size's, from this same run."""
    ours = [r for r in runs if r["backend"] == "pipeserve"]
    theirs = [r for r in runs if r["backend"] == "hf"]
    if not ours or not theirs:
        return None
    best = max(theirs, key=lambda r: r["output_tokens_per_s"])
    return {"hf_best_batch_size": best["batch_size"],
            "hf_output_tokens_per_s": best["output_tokens_per_s"],
            "pipeserve_output_tokens_per_s": ours[0]["output_tokens_per_s"],
            "speedup_output_tokens_per_s": ours[0]["output_tokens_per_s"] / best["output_tokens_per_s"]}


def latency_series(records: list[RequestRecord]) -> dict[str, list[float]]:
    ok = [r for r in records if r.success]
    return {"ttft": [r.ttft * 1000 for r in ok], "e2el": [r.e2el * 1000 for r in ok],
            "tpot": [r.tpot * 1000 for r in ok if r.tpot is not None]}


def format_summary(result: dict) -> str:
    lines = [f"{'backend':<22}{'req/s':>9}{'in tok/s':>11}{'out tok/s':>11}{'mean TTFT ms':>14}"]
    for run in result["runs"]:
        name = run["backend"] if run["backend"] != "hf" else f"transformers b={run['batch_size']}"
        lines.append(f"{name:<22}{run['requests_per_s']:>9.2f}{run['input_tokens_per_s']:>11.1f}"
                     f"{run['output_tokens_per_s']:>11.1f}{run['ttft_ms']['mean']:>14.1f}")
        for stage in run.get("stages", []):
            lines.append(f"  stage {stage['stage']}: busy {stage.get('busy_ratio', float('nan')):.2f}"
                         f"  bubble {stage.get('bubble_ratio', float('nan')):.2f}"
                         f"  (steady state: busy {stage.get('steady_busy_ratio', float('nan')):.2f}"
                         f"  bubble {stage.get('steady_bubble_ratio', float('nan')):.2f})")
    if result.get("baseline"):
        b = result["baseline"]
        lines.append(f"pipeserve / transformers (b={b['hf_best_batch_size']}) output tokens/s: "
                     f"{b['speedup_output_tokens_per_s']:.2f}x")
    return "\n".join(lines)
