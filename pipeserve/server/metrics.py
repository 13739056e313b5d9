"""Prometheus metrics of the server, in a registry of its own (not the global one).

Two sources feed it:
  - ``observe(output, now)``, called by the async engine on its thread for
    every output: token counters, finish reasons and the latency histograms;
  - ``update(stats, ...)``, called before each scrape with the engine's
    ``stats()``: queue gauges, KV usage, prefix cache, per-stage ratios.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from pipeserve.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_RECOVERY_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 300.0)


@dataclass
class _Progress:
    """What one request has shown so far (engine thread only)."""

    arrival: float
    tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        label = {"model_name": model_name}
        self._model = model_name
        self.finished = Counter("pipeserve_request_success", "Requests finished, by finish reason",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter("pipeserve_prompt_tokens", "Prompt tokens of admitted requests",
                                     ["model_name"], registry=self.registry).labels(**label)
        self.generation_tokens = Counter("pipeserve_generation_tokens", "Generated tokens",
                                         ["model_name"], registry=self.registry).labels(**label)
        self.errors = Counter("pipeserve_http_errors", "Requests refused or failed, by HTTP status",
                              ["model_name", "status"], registry=self.registry)
        self.ttft = self._histogram("pipeserve_time_to_first_token_seconds",
                                    "Time from arrival to the first generated token", _LATENCY_BUCKETS)
        self.tpot = self._histogram("pipeserve_time_per_output_token_seconds",
                                    "Mean time per output token after the first, per request",
                                    _LATENCY_BUCKETS)
        self.itl = self._histogram("pipeserve_inter_token_latency_seconds",
                                   "Time between two successive outputs of one request", _LATENCY_BUCKETS)
        self.e2e = self._histogram("pipeserve_e2e_request_latency_seconds",
                                   "Time from arrival to the end of the request", _E2E_BUCKETS)
        self.engine = _EngineCollector(model_name)
        self.registry.register(self.engine)
        self._progress: dict[str, _Progress] = {}

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]):
        return Histogram(name, doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(model_name=self._model)

    # -- fed by the engine thread -----------------------------------------
    def observe(self, out: RequestOutput, now: float) -> None:
        progress = self._progress.get(out.request_id)
        if progress is None:
            progress = self._progress[out.request_id] = _Progress(arrival=out.metrics.arrival_time)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
        tokens = sum(len(c.token_ids) for c in out.outputs)
        if tokens > progress.tokens:
            self._on_new_tokens(progress, tokens, now)
        if out.finished:
            self._on_finished(out, progress, now)

    def _on_new_tokens(self, progress: _Progress, tokens: int, now: float) -> None:
        self.generation_tokens.inc(tokens - progress.tokens)
        if progress.first_token is None:
            self.ttft.observe(max(0.0, now - progress.arrival))
            progress.first_token = now
        else:
            self.itl.observe(now - progress.last_token)
        progress.last_token = now
        progress.tokens = tokens

    def _on_finished(self, out: RequestOutput, progress: _Progress, now: float) -> None:
        del self._progress[out.request_id]
        self.finished.labels(model_name=self._model, finished_reason=finish_reason_of(out)).inc()
        self.e2e.observe(max(0.0, now - progress.arrival))
        longest = max((len(c.token_ids) for c in out.outputs), default=0)
        if longest > 1 and progress.first_token is not None:
            self.tpot.observe((progress.last_token - progress.first_token) / (longest - 1))

    # -- fed by the HTTP side -----------------------------------------------
    def count_error(self, status: int) -> None:
        self.errors.labels(model_name=self._model, status=str(status)).inc()

    def update(self, stats: dict, *, num_server_requests: int, healthy: bool) -> None:
        self.engine.snapshot = stats
        self.engine.num_server_requests = num_server_requests
        self.engine.healthy = healthy

    def render(self) -> bytes:
        return generate_latest(self.registry)


def finish_reason_of(out: RequestOutput) -> str:
    """One reason per request: an error wins, then the first completion's reason."""
    if out.error:
        return "error"
    reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
    return reasons[0] if reasons else "abort"


class _EngineCollector:
    """Gauges and counters read from the last ``LLMEngine.stats()`` snapshot."""

    def __init__(self, model_name: str) -> None:
        self.model = model_name
        self.snapshot: dict = {}
        self.num_server_requests = 0
        self.healthy = True

    def describe(self) -> list[Metric]:
        return []  # the families depend on the snapshot (a stage count); nothing to pre-describe

    def collect(self) -> Iterator[Metric]:
        sched = self.snapshot.get("scheduler", {})
        yield self._gauge("pipeserve_num_requests_running", "Sequences running in the engine",
                          sched.get("num_running", 0))
        yield self._gauge("pipeserve_num_requests_waiting", "Sequences waiting to be scheduled",
                          sched.get("num_waiting", 0))
        yield self._gauge("pipeserve_num_requests_swapped", "Sequences preempted to the host pool",
                          sched.get("num_swapped", 0))
        yield self._gauge("pipeserve_num_requests_in_server", "Requests admitted by the server, not finished",
                          self.num_server_requests)
        yield self._gauge("pipeserve_kv_cache_usage_ratio", "Fraction of KV blocks held by sequences",
                          sched.get("kv_usage", 0.0))
        yield self._gauge("pipeserve_healthy", "1 while every stage is alive", 1.0 if self.healthy else 0.0)
        yield from self._prefix_cache(sched)
        yield self._counter("pipeserve_num_preemptions", "Sequences preempted",
                            sched.get("num_preemptions", 0))
        yield from self._stages(self.snapshot.get("pipeline") or {})
        yield from self._stage_pids(self.snapshot.get("pipeline") or {})
        yield from self._recovery(self.snapshot.get("recovery") or {})

    def _stage_pids(self, pipeline: dict) -> Iterator[Metric]:
        pids = pipeline.get("stage_pids") or {}
        family = GaugeMetricFamily("pipeserve_stage_pid", "Process id of each stage process on the "
                                   "server's host (changes when a stage is restarted)",
                                   labels=["model_name", "stage"])
        for stage, pid in sorted(pids.items()):
            family.add_metric([self.model, str(stage)], float(pid))
        yield family

    def _recovery(self, recovery: dict) -> Iterator[Metric]:
        yield self._counter("pipeserve_stage_restarts", "Pipeline restarts after a stage died or stalled",
                            recovery.get("stage_restarts", 0))
        seconds = [float(x) for x in recovery.get("recovery_seconds", [])]
        family = HistogramMetricFamily("pipeserve_stage_recovery_seconds", "Time from a stage failure being "
                                       "detected to the restarted pipeline serving again",
                                       labels=["model_name"])
        buckets = [(str(le), sum(1 for x in seconds if x <= le)) for le in _RECOVERY_BUCKETS]
        family.add_metric([self.model], buckets + [("+Inf", len(seconds))], sum(seconds))
        yield family

    def _prefix_cache(self, sched: dict) -> Iterator[Metric]:
        queries = sched.get("prefix_cache_query_tokens", 0)
        hits = sched.get("prefix_cache_hit_tokens", 0)
        yield self._counter("pipeserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                            queries)
        yield self._counter("pipeserve_prefix_cache_hits", "Prompt tokens served by the prefix cache", hits)
        yield self._gauge("pipeserve_prefix_cache_hit_rate", "Prefix cache hits / queries, in tokens",
                          hits / queries if queries else 0.0)

    def _stages(self, pipeline: dict) -> Iterator[Metric]:
        rows = stage_rows(pipeline)
        if not rows:
            return  # PP=1 runs no pipeline timeline: no per-stage figures to report
        busy = GaugeMetricFamily("pipeserve_stage_busy_ratio", "Fraction of time each stage computes",
                                 labels=["model_name", "stage"])
        bubble = GaugeMetricFamily("pipeserve_stage_bubble_ratio", "Fraction of time each stage idles "
                                   "while work is in flight", labels=["model_name", "stage"])
        for stage, busy_ratio, bubble_ratio in rows:
            if busy_ratio is not None:
                busy.add_metric([self.model, str(stage)], busy_ratio)
            if bubble_ratio is not None:
                bubble.add_metric([self.model, str(stage)], bubble_ratio)
        yield busy
        yield bubble

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model], float(value))
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model], float(value))
        return family


def stage_rows(pipeline: dict) -> list[tuple[int, float | None, float | None]]:
    """``(stage, busy, bubble)`` per stage from the executor's stats:
    ``{"stages": [{"stage", "busy_fraction", "bubble_ratio", ...}, ...]}``."""
    stages = pipeline.get("stages")
    if not isinstance(stages, list):
        return []
    return [(int(s.get("stage", i)), _num(s.get("busy_fraction")), _num(s.get("bubble_ratio")))
            for i, s in enumerate(stages)]


def _num(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None
