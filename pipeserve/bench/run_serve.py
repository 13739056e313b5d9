"""``pipeserve bench serve``: one rate or a sweep against a running server; JSON and plots."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from pipeserve.bench.hf_source import load_hf_tokenizer
from pipeserve.bench.plots import plot_latency_cdfs, plot_rate_curves
from pipeserve.bench.serve import (LoadOptions, benchmark_rate, check_server, records_json,
                                   resolve_model_name, sweep, to_completion_requests)
from pipeserve.bench.stats import RequestRecord, parse_slo
from pipeserve.bench.workload import build_requests, dataset_json, result_header, write_json


def run_serve_command(args: argparse.Namespace) -> int:
    slo = parse_slo(args.slo)
    if not 0.0 < args.slo_attainment <= 1.0:
        raise ValueError(f"--slo-attainment must be in (0, 1], got {args.slo_attainment}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    options = LoadOptions(base_url=args.base_url, burstiness=args.burstiness,
                          max_concurrency=args.max_concurrency, seed=args.bench_seed, api_key=args.api_key,
                          request_timeout_s=args.request_timeout, progress=args.progress)
    tokenizer = load_hf_tokenizer(args.model, args.tokenizer)
    requests = build_requests(args, tokenizer)
    model = asyncio.run(resolve_model_name(options, args.served_model_name))
    completions = to_completion_requests(requests, model, tokenizer, args.prompt_format, args.temperature)
    asyncio.run(check_server(completions, options))
    result = {**result_header("serve", args), "base_url": args.base_url, "served_model": model,
              "dataset": dataset_json(args, requests), "prompt_format": args.prompt_format}
    if args.sweep_rates:
        summary, by_rate = sweep(completions, args.sweep_rates, options, slo, args.slo_attainment)
        result.update(summary)
    else:
        metrics, records = benchmark_rate(completions, args.request_rate, options, slo)
        result.update(metrics)
        result["requests"] = records_json(records)
        by_rate = {str(metrics["request_rate"]): records}
    if args.plot:
        result["plots"] = serve_plots(Path(args.plot), by_rate, result.get("sweep"))
    if args.output:
        write_json(result, args.output)
    print(format_summary(result))
    return 0


def serve_plots(directory: Path, by_rate: dict[str, list[RequestRecord]], points: list[dict] | None) -> list[str]:
    series = {f"rate {rate}": _latencies_ms(records) for rate, records in by_rate.items()}
    made = [plot_latency_cdfs(series, directory / "latency_cdf.png", "online latency CDFs")]
    if points:
        made.append(plot_rate_curves(points, directory / "rate_curves.png"))
    return [str(p) for p in made if p is not None]


def _latencies_ms(records: list[RequestRecord]) -> dict[str, list[float]]:
    ok = [r for r in records if r.success]
    return {"ttft": [r.ttft * 1000 for r in ok], "tpot": [r.tpot * 1000 for r in ok if r.tpot is not None],
            "itl": [g * 1000 for r in ok for g in r.itl], "e2el": [r.e2el * 1000 for r in ok]}


def format_summary(result: dict) -> str:
    points = result.get("sweep") or [result]
    lines = [f"{'rate':>8}{'req/s':>9}{'out tok/s':>11}{'TTFT p50/p99 ms':>19}{'TPOT p50/p99 ms':>19}"
             f"{'E2E p99 ms':>12}{'goodput':>9}"]
    for p in points:
        good = f"{p['goodput_requests_per_s']:.2f}" if "goodput_requests_per_s" in p else "-"
        lines.append(f"{p['request_rate']!s:>8}{p['requests_per_s']:>9.2f}{p['output_tokens_per_s']:>11.1f}"
                     f"{p['ttft_ms']['p50']:>10.1f}/{p['ttft_ms']['p99']:<8.1f}"
                     f"{p['tpot_ms']['p50']:>10.1f}/{p['tpot_ms']['p99']:<8.1f}"
                     f"{p['e2el_ms']['p99']:>12.1f}{good:>9}")
        if p.get("failed"):
            lines.append(f"  {p['failed']} request(s) failed: {'; '.join(p.get('errors', []))}")
    if "capacity_requests_per_s" in result:
        lines.append(f"capacity under the SLO ({result['slo_attainment_target']:.0%} of requests): "
                     f"{result['capacity_requests_per_s']} req/s")
    return "\n".join(lines)
