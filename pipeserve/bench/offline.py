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
                  progress: bool = True) -> tuple[list[RequestRecord], float, tuple[float, float]]:
    """Returns (records in request order, seconds, (start, end) of the timed run on the wall clock)."""
    records: list[RequestRecord] = []
    wall_start = time.time()
    start = time.perf_counter()
    for turn in sorted({r.turn for r in requests}):
        wave = [r for r in requests if r.turn == turn]
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in wave]
        outputs = llm.generate(prompts, sampling_params_for(wave, temperature), use_tqdm=progress)
        records += [record_of(o) for o in outputs]
    return records, time.perf_counter() - start, (wall_start, time.time())


def pipeline_timeline(llm):
    """The executor's ``metrics.timeline.Timeline`` (PP > 1), with every stage's intervals
    shipped to the driver; None for a single in-process stage, which records none."""
    timeline = getattr(llm.engine.executor, "timeline", None)
    if timeline is not None:
        llm.stats()  # an idle pipeline executor flushes the stages' intervals here
    return timeline


# The steady state leaves out this fraction of the run at each end: the fill of
# the pipeline and its drain once the last requests finish.
STEADY_TRIM = 0.1


def stage_ratios(timeline, window: tuple[float, float]) -> list[dict]:
    """Per-stage busy and bubble ratios over the timed run alone (the warm-up
    left out), and over its steady state (``steady_*``: the middle 80%)."""
    if timeline is None:
        return []
    trim = (window[1] - window[0]) * STEADY_TRIM
    steady = timeline.stats((window[0] + trim, window[1] - trim))
    rows = []
    for s, st in zip(timeline.stats(window), steady):
        row = s.as_dict()
        row["busy_ratio"] = row.pop("busy_fraction")
        row["steady_busy_ratio"] = st.busy_fraction
        row["steady_bubble_ratio"] = st.bubble_ratio
        rows.append(row)
    return rows


def gantt_window(run: tuple[float, float], width_s: float) -> tuple[float, float]:
    """``width_s`` seconds from the middle of the run, where the pipeline is in steady state."""
    middle = (run[0] + run[1]) / 2
    half = min(width_s, run[1] - run[0]) / 2
    return middle - half, middle + half


def write_gantt(path, timeline, run: tuple[float, float], width_s: float, title: str):
    """The engine's Gantt chart of a window of the run; None when nothing was recorded there."""
    if timeline is None:
        return None
    from pathlib import Path

    from pipeserve.metrics.timeline import write_gantt_png
    lo, hi = gantt_window(run, width_s)
    intervals = [iv for iv in timeline.intervals() if iv.end > lo and iv.start < hi and iv.kind != "wait"]
    if not intervals:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_gantt_png(path, intervals, timeline.num_stages, title=title)
    return path


def prefix_cache_delta(before: dict, after: dict) -> dict:
    """Prefix-cache counters of the timed run alone (the scheduler's counters are cumulative)."""
    keys = ("prefix_cache_query_tokens", "prefix_cache_hit_tokens")
    if not all(k in before and k in after for k in keys):
        return {}
    query, hit = (after[k] - before[k] for k in keys)
    return {"query_tokens": query, "hit_tokens": hit, "hit_rate": hit / query if query else 0.0}


def preemption_delta(before: dict, after: dict) -> dict:
    """Preemptions of the timed run alone, and the KV cache they ran out of: by recompute (with
    the tokens whose KV it dropped) and by swap."""
    keys = ("num_preemptions_recompute", "num_preemptions_swap", "num_preempted_tokens")
    if not all(k in before and k in after for k in keys):
        return {}
    recompute, swap, tokens = (after[k] - before[k] for k in keys)
    return {"recompute": recompute, "swap": swap, "dropped_tokens": tokens,
            "kv_blocks": after.get("num_blocks", 0)}
