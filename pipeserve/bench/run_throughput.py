"""``pipeserve bench throughput``: run the workload on pipeserve and/or transformers, report, plot."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from pipeserve.bench.datasets import BenchRequest
from pipeserve.bench.hf_baseline import run_hf
from pipeserve.bench.hf_source import load_hf_model, load_hf_tokenizer
from pipeserve.bench.llamacpp_baseline import import_llama_cpp, load_llama, run_llamacpp
from pipeserve.bench.offline import (pipeline_timeline, preemption_delta, prefix_cache_delta, run_pipeserve,
                                     stage_ratios, warm_up, write_gantt)
from pipeserve.bench.plots import plot_latency_cdfs
from pipeserve.bench.profile_report import measure_roofline, profile_result, roofline_from_file
from pipeserve.bench.stats import RequestRecord, latency_metrics
from pipeserve.bench.workload import build_requests, dataset_json, result_header, write_json
from pipeserve.config import EngineConfig
from pipeserve.entrypoints.args import config_from_args

def run_throughput_command(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    backends = parse_backends(args.backend)
    batch_sizes = parse_batch_sizes(args.hf_batch_size)
    gguf_path = llamacpp_model(config.model) if "llamacpp" in backends else None  # fail before any run
    tokenizer = load_hf_tokenizer(config.model, config.tokenizer)
    requests = build_requests(args, tokenizer)
    result = {**result_header("throughput", args), "dataset": dataset_json(args, requests), "runs": []}
    latencies: dict[str, dict[str, list[float]]] = {}
    plots: list[str] = []
    if "pipeserve" in backends:
        run, records, gantt = pipeserve_run(config, requests, args)
        result["runs"].append(run)
        plots += [gantt] if gantt else []
        latencies["pipeserve"] = latency_series(records)
    if "hf" in backends:
        for run, records in hf_runs(config, requests, batch_sizes, args, tokenizer.pad_token_id):
            result["runs"].append(run)
            latencies[f"transformers b={run['batch_size']}"] = latency_series(records)
    if gguf_path is not None:
        run, records = llamacpp_run(gguf_path, requests, args)
        result["runs"].append(run)
        latencies[f"llama.cpp {run['threads']} threads"] = latency_series(records)
    result["baseline"] = baseline(result["runs"])
    result["llamacpp"] = llamacpp_comparison(result["runs"])
    if args.plot:
        cdf = plot_latency_cdfs(latencies, Path(args.plot) / "latency_cdf.png", "offline latency CDFs")
        result["plots"] = ([str(cdf)] if cdf else []) + plots
    if args.output:
        write_json(result, args.output)
    print(format_summary(result))
    return 0


BACKENDS = ("pipeserve", "hf", "llamacpp")


def parse_backends(text: str) -> list[str]:
    """``--backend``: comma-separated names from BACKENDS; ``both`` is pipeserve,hf."""
    names = [part.strip() for part in str(text).replace("both", "pipeserve,hf").split(",") if part.strip()]
    unknown = [n for n in names if n not in BACKENDS]
    if not names or unknown:
        raise ValueError(f"--backend {text!r}: use comma-separated names from {', '.join(BACKENDS)} "
                         "(or both = pipeserve,hf), e.g. pipeserve,llamacpp")
    return list(dict.fromkeys(names))


def llamacpp_model(model: str) -> str:
    """The GGUF file llama.cpp runs for ``--model``; checks llama-cpp-python is installed."""
    from pipeserve.model.loader import resolve_model
    import_llama_cpp()
    source = resolve_model(model)
    if source.kind != "gguf":
        raise ValueError(f"--backend llamacpp runs GGUF files; --model {model!r} is a Hugging Face "
                         "directory (convert it with llama.cpp's convert_hf_to_gguf.py)")
    return str(source.path)


def llamacpp_run(gguf_path: str, requests: list[BenchRequest],
                 args: argparse.Namespace) -> tuple[dict, list[RequestRecord]]:
    """One timed run of llama.cpp (loading and a short warm-up are not timed)."""
    threads = args.llamacpp_threads or os.cpu_count() or 1
    llm = load_llama(gguf_path, requests, threads)
    warm = [BenchRequest(r.prompt_token_ids[:32], 8) for r in requests[:max(0, args.num_warmup)]]
    run_llamacpp(llm, warm, progress=False)
    records, duration = run_llamacpp(llm, requests, args.temperature, args.progress)
    return {"backend": "llamacpp", "threads": threads, "model": gguf_path,
            **latency_metrics(records, duration)}, records


def llamacpp_comparison(runs: list[dict]) -> dict | None:
    """pipeserve over llama.cpp from this same run: output tokens/s, and decode speed (1 / mean TPOT)."""
    ours = [r for r in runs if r["backend"] == "pipeserve"]
    theirs = [r for r in runs if r["backend"] == "llamacpp"]
    if not ours or not theirs:
        return None
    a, b = ours[0], theirs[0]
    return {"llamacpp_output_tokens_per_s": b["output_tokens_per_s"],
            "pipeserve_output_tokens_per_s": a["output_tokens_per_s"],
            "ratio_output_tokens_per_s": a["output_tokens_per_s"] / b["output_tokens_per_s"],
            "llamacpp_decode_tokens_per_s": _decode_rate(b), "pipeserve_decode_tokens_per_s": _decode_rate(a),
            "ratio_decode_tokens_per_s": _decode_rate(a) / _decode_rate(b) if _decode_rate(b) else None}


def _decode_rate(run: dict) -> float:
    """Tokens/s of one sequence after its first token: 1000 / mean TPOT (ms)."""
    tpot = run.get("tpot_ms", {}).get("mean", 0.0)
    return 1000.0 / tpot if tpot else 0.0


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
    roofline = None
    if config.profile:   # measured before the stages start, so they do not compete with it
        roofline = (roofline_from_file(args.roofline_hardware) if args.roofline_hardware
                    else measure_roofline(config.torch_dtype_name))
    llm = LLM(**dataclasses.asdict(config))
    gantt = None
    try:
        warm_up(llm, requests, args.num_warmup)
        before = llm.stats().get("scheduler", {})
        profile_before = llm.engine.profile()
        records, duration, window = run_pipeserve(llm, requests, args.temperature, args.progress)
        profile_after = llm.engine.profile()
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
           "preemptions": preemption_delta(before, stats.get("scheduler", {})),
           "scheduler": stats.get("scheduler", {})}
    if profile_after is not None:
        run["profile"] = profile_result(profile_before, profile_after, stages, roofline,
                                        pipeline=timeline is not None)
    return run, records, None if gantt is None else str(gantt)


def hf_runs(config: EngineConfig, requests: list[BenchRequest], batch_sizes: list[int],
            args: argparse.Namespace, pad_id: int):
    """One timed run per batch size on one loaded model (loading is not timed)."""
    import torch
    torch.set_num_threads(os.cpu_count() or 1)  # the whole machine, as pipeserve's stages share it
    dtype = args.hf_dtype or config.dtype
    model = load_hf_model(config.model, dtype, config.device)
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


def preemption_line(p: dict, block_size: int) -> str:
    """What running out of KV blocks cost the timed run (``preemption_delta``)."""
    parts = ([f"{p['recompute']} preemptions by recompute (KV of {p['dropped_tokens']} tokens dropped)"]
             if p["recompute"] else []) + ([f"{p['swap']} by swap"] if p["swap"] else [])
    return (f"  KV cache of {p['kv_blocks']} blocks ({p['kv_blocks'] * block_size} tokens) ran out: "
            f"{', '.join(parts)}; a larger --kv-cache-memory avoids them")


def format_summary(result: dict) -> str:
    lines = [f"{'backend':<22}{'req/s':>9}{'in tok/s':>11}{'out tok/s':>11}{'mean TTFT ms':>14}"
             f"{'mean TPOT ms':>14}"]
    for run in result["runs"]:
        name = {"hf": f"transformers b={run.get('batch_size')}",
                "llamacpp": f"llama.cpp {run.get('threads')} thr"}.get(run["backend"], run["backend"])
        lines.append(f"{name:<22}{run['requests_per_s']:>9.2f}{run['input_tokens_per_s']:>11.1f}"
                     f"{run['output_tokens_per_s']:>11.1f}{run['ttft_ms']['mean']:>14.1f}"
                     f"{run.get('tpot_ms', {}).get('mean', float('nan')):>14.2f}")
        for stage in run.get("stages", []):
            lines.append(f"  stage {stage['stage']}: busy {stage.get('busy_ratio', float('nan')):.2f}"
                         f"  bubble {stage.get('bubble_ratio', float('nan')):.2f}"
                         f"  (steady state: busy {stage.get('steady_busy_ratio', float('nan')):.2f}"
                         f"  bubble {stage.get('steady_bubble_ratio', float('nan')):.2f})")
        preempted = run.get("preemptions", {})
        if preempted.get("recompute") or preempted.get("swap"):
            lines.append(preemption_line(preempted, run["engine"]["block_size"]))
        if run.get("profile"):
            lines.append(run["profile"]["table"])
    if result.get("baseline"):
        b = result["baseline"]
        lines.append(f"pipeserve / transformers (b={b['hf_best_batch_size']}) output tokens/s: "
                     f"{b['speedup_output_tokens_per_s']:.2f}x")
    if result.get("llamacpp"):
        c = result["llamacpp"]
        decode = "-" if c["ratio_decode_tokens_per_s"] is None else f"{c['ratio_decode_tokens_per_s']:.2f}x"
        lines.append(f"pipeserve / llama.cpp output tokens/s: {c['ratio_output_tokens_per_s']:.2f}x; "
                     f"decode tokens/s (1/TPOT): {c['pipeserve_decode_tokens_per_s']:.1f} / "
                     f"{c['llamacpp_decode_tokens_per_s']:.1f} = {decode}")
    return "\n".join(lines)
