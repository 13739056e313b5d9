"""``pipeserve bench serve``: online load against an OpenAI-compatible server.

Requests leave on a Poisson or gamma schedule (or all at once), at most
``max_concurrency`` in flight; each streams its tokens back so TTFT, TPOT and
inter-token latency are measured where a user would see them.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import httpx

from pipeserve.bench.arrivals import arrival_times, rate_label
from pipeserve.bench.client import CompletionRequest, first_model_id, send_completion
from pipeserve.bench.datasets import BenchRequest
from pipeserve.bench.stats import RequestRecord, capacity_under_slo, latency_metrics


@dataclass(frozen=True)
class LoadOptions:
    base_url: str
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    api_key: str | None = None
    request_timeout_s: float = 600.0
    progress: bool = True


def to_completion_requests(requests: list[BenchRequest], model: str, tokenizer, prompt_format: str,
                           temperature: float = 0.0) -> list[CompletionRequest]:
    """Text prompts (decoded, re-measured in tokens) or raw token-id prompts."""
    if prompt_format not in ("text", "ids"):
        raise ValueError(f"--prompt-format must be text or ids, got {prompt_format!r}")
    out = []
    for r in requests:
        if prompt_format == "ids":
            prompt, length = r.prompt_token_ids, r.prompt_len
        else:
            prompt = r.prompt if r.prompt is not None else tokenizer.decode(r.prompt_token_ids)
            # Decoding random ids and encoding again need not give the same ids back.
            length = len(tokenizer.encode(prompt, add_special_tokens=False))
        out.append(CompletionRequest(model, prompt, length, r.output_len, temperature))
    return out


async def resolve_model_name(options: LoadOptions, name: str | None) -> str:
    if name:
        return name
    async with httpx.AsyncClient(timeout=30.0) as client:
        return await first_model_id(client, options.base_url, options.api_key)


async def run_load(requests: list[CompletionRequest], rate: float,
                   options: LoadOptions) -> tuple[list[RequestRecord], float]:
    """Send every request on the arrival schedule; returns (records in send order, seconds)."""
    schedule = arrival_times(len(requests), rate, options.burstiness, options.seed)
    limit = options.max_concurrency or len(requests)
    gate = asyncio.Semaphore(limit)
    bar = _progress(len(requests), rate) if options.progress else None
    connections = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=options.request_timeout_s, limits=connections) as client:
        start = time.perf_counter()

        async def one(req: CompletionRequest, at: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with gate:
                record = await send_completion(client, options.base_url, req, options.api_key, start)
            if bar is not None:
                bar.update(1)
            return record

        records = await asyncio.gather(*(one(r, t) for r, t in zip(requests, schedule)))
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return list(records), duration


async def check_server(requests: list[CompletionRequest], options: LoadOptions) -> None:
    """One short request before timing: a wrong URL or model fails here with the server's words."""
    probe = requests[0]
    probe = CompletionRequest(probe.model, probe.prompt, probe.prompt_len, min(4, probe.max_tokens),
                              probe.temperature)
    async with httpx.AsyncClient(timeout=options.request_timeout_s) as client:
        record = await send_completion(client, options.base_url, probe, options.api_key)
    if not record.success:
        raise ValueError(f"the test request to {options.base_url} failed: {record.error}")


def benchmark_rate(requests: list[CompletionRequest], rate: float, options: LoadOptions,
                   slo: dict[str, float]) -> tuple[dict, list[RequestRecord]]:
    records, duration = asyncio.run(run_load(requests, rate, options))
    metrics = latency_metrics(records, duration, slo)
    metrics.update({"request_rate": rate_label(rate), "burstiness": options.burstiness,
                    "max_concurrency": options.max_concurrency,
                    "errors": sorted({r.error for r in records if r.error})[:5]})
    return metrics, records


def sweep(requests: list[CompletionRequest], rates: list[float], options: LoadOptions,
          slo: dict[str, float], attainment: float) -> tuple[dict, dict[str, list[RequestRecord]]]:
    """Every rate in turn on the same requests; capacity = highest rate that keeps the SLO."""
    points, records = [], {}
    for rate in sorted(rates):
        metrics, recs = benchmark_rate(requests, rate, options, slo)
        points.append(metrics)
        records[str(rate_label(rate))] = recs
    result = {"sweep": points}
    if slo:
        numeric = [{**p, "request_rate": _as_float(p["request_rate"])} for p in points]
        capacity = capacity_under_slo(numeric, attainment)
        result.update({"slo_attainment_target": attainment,
                       "capacity_requests_per_s": None if capacity is None else rate_label(capacity)})
    return result, records


def records_json(records: list[RequestRecord]) -> list[dict]:
    """Per-request rows for the result JSON (and for re-plotting later)."""
    return [{"prompt_len": r.prompt_len, "output_len": r.output_len, "success": r.success,
             "start_s": r.start_time, "ttft_s": r.ttft, "tpot_s": r.tpot, "e2el_s": r.e2el,
             "itl_s": r.itl, "error": r.error} for r in records]


def _as_float(rate) -> float:
    return math.inf if rate == "inf" else float(rate)


def _progress(total: int, rate: float):
    from tqdm import tqdm
    return tqdm(total=total, desc=f"rate {rate_label(rate)} req/s", unit="req")
