"""The pipeserve side of ``bench throughput``: the requests through ``LLM.generate``.

Requests run turn by turn (one ``generate`` per turn, so a multi-turn
workload's turn t meets the KV its turn t-1 left in the prefix cache);
single-turn workloads are one ``generate``. Latencies come from the engine's
per-request metrics; busy and bubble ratios from its pipeline stats.
"""

from __future__ import annotations

import time

from pipeserve.bench.datasets import BenchRequest
from pipeserve.bench.stats import RequestRecord


def sampling_params_for(requests: list[BenchRequest], temperature: float):
    from pipeserve.sampling_params import SamplingParams
    # ignore_eos: every request produces exactly the tokens the workload asked for.
    return [SamplingParams(max_tokens=r.output_len, temperature=temperature, top_p=1.0,
                           ignore_eos=True, seed=None) for r in requests]


def warm_up(llm, requests: list[BenchRequest], count: int) -> None:
    """A few short requests first, so one-time costs (allocations, kernel choice) stay out of the timing.

    Their prompts are reversed snippets of the workload's, so they leave nothing
    in the prefix cache that the timed requests could hit.
    """
    if count <= 0:
        return
    from pipeserve.sampling_params import SamplingParams
    prompts = [{"prompt_token_ids": r.prompt_token_ids[:32][::-1]} for r in requests[:count]]
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))


def record_of(output) -> RequestRecord:
    """Engine timestamps (wall clock) -> one latency record."""
    m = output.metrics
    tokens = len(output.outputs[0].token_ids) if output.outputs else 0
    first = m.first_token_time or m.finished_time or m.arrival_time
    finished = m.finished_time or first
    return RequestRecord(prompt_len=len(output.prompt_token_ids), output_len=tokens,
                         success=output.error is None, ttft=first - m.arrival_time,
                         e2el=finished - m.arrival_time, error=output.error)


def run_pipeserve(llm, requests: list[BenchRequest], temperature: float = 0.0,
                  progress: bool = True) -> tuple[list[RequestRecord], float, float]:
    """Returns (records in request order, wall seconds, wall-clock start time of the timed run)."""
    records: list[RequestRecord] = []
    wall_start = time.time()
    start = time.perf_counter()
    for turn in sorted({r.turn for r in requests}):
        wave = [r for r in requests if r.turn == turn]
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in wave]
        outputs = llm.generate(prompts, sampling_params_for(wave, temperature), use_tqdm=progress)
        records += [record_of(o) for o in outputs]
    return records, time.perf_counter() - start, wall_start


def stage_ratios(pipeline_stats: dict) -> list[dict]:
    """Per-stage busy and bubble ratios from ``LLM.stats()["pipeline"]``.

    Accepts a list of per-stage dicts under ``"stages"`` or, for a single
    stage with no pipeline figures, reports nothing rather than guessing.
    """
    stages = pipeline_stats.get("stages") if isinstance(pipeline_stats, dict) else None
    if not isinstance(stages, list):
        return []
    rows = []
    for i, stage in enumerate(stages):
        if not isinstance(stage, dict):
            continue
        row = {"stage": stage.get("stage", i)}
        for key in ("busy_ratio", "bubble_ratio", "comm_ratio", "layers"):
            if key in stage:
                row[key] = stage[key]
        rows.append(row)
    return rows


def timeline_events(pipeline_stats: dict, since: float | None = None) -> list[dict]:
    """The engine's per-stage work intervals as plot events (``stage``, ``start``, ``end``, ...).

    Events that began before ``since`` (the warm-up) are dropped.
    """
    events = pipeline_stats.get("timeline") if isinstance(pipeline_stats, dict) else None
    if not isinstance(events, list):
        return []
    out = []
    for e in events:
        if not isinstance(e, dict) or not {"stage", "start", "end"} <= e.keys():
            continue
        if since is not None and e["start"] < since:
            continue
        out.append({"stage": e["stage"], "start": e["start"], "end": e["end"],
                    "micro_batch": e.get("micro_batch", e.get("step_id")), "kind": e.get("kind", "compute")})
    return out


def prefix_cache_delta(before: dict, after: dict) -> dict:
    """Prefix-cache counters of the timed run alone (the scheduler's counters are cumulative)."""
    keys = ("prefix_cache_query_tokens", "prefix_cache_hit_tokens")
    if not all(k in before and k in after for k in keys):
        return {}
    query, hit = (after[k] - before[k] for k in keys)
    return {"query_tokens": query, "hit_tokens": hit, "hit_rate": hit / query if query else 0.0}
