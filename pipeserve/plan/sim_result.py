"""What a simulation produced: per-request times, stage busy intervals, and the summary."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Interval:
    """One chunk's forward of one micro-batch on one worker (a Gantt bar)."""
    worker: int
    start: float
    end: float
    micro_batch: int
    chunk: int
    prefill: bool          # the micro-batch carried prefill tokens


@dataclass(frozen=True)
class RequestTimes:
    arrival: float
    first_token: float
    finish: float
    prompt_len: int
    output_len: int


@dataclass
class SimResult:
    schedule: str
    num_workers: int
    requests: list[RequestTimes] = field(default_factory=list)
    intervals: list[Interval] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)     # s of compute per worker
    first_start: float = 0.0                            # first forward begins
    last_end: float = 0.0                               # last micro-batch returns
    micro_batches: int = 0                              # micro-batches launched
    driver_busy: float = 0.0                            # s the driver spent forming them
    preemptions: int = 0                                # engine batcher: preemptions (recompute or swap)
    swaps: int = 0                                      # of them, by swap into the host pool
    # The hardware file's held-out predicted / measured band (low, high, runs); None: not validated.
    validated_ratio: tuple[float, float, int] | None = None

    @property
    def span(self) -> float:
        return max(self.last_end - self.first_start, 1e-12)

    def bubble_ratios(self) -> list[float]:
        """Share of the busy span each worker sat idle."""
        return [1.0 - b / self.span for b in self.busy]

    def summary(self) -> dict:
        reqs = self.requests
        out_tokens = sum(r.output_len for r in reqs)
        in_tokens = sum(r.prompt_len for r in reqs)
        first_arrival = min((r.arrival for r in reqs), default=0.0)
        duration = max((r.finish for r in reqs), default=0.0) - first_arrival
        ttft = [r.first_token - r.arrival for r in reqs]
        tpot = [(r.finish - r.first_token) / (r.output_len - 1) for r in reqs if r.output_len > 1]
        e2e = [r.finish - r.arrival for r in reqs]
        duration = max(duration, 1e-12)
        return {
            "schedule": self.schedule, "requests": len(reqs), "duration_s": duration,
            "output_tokens_per_s": out_tokens / duration,
            "total_tokens_per_s": (out_tokens + in_tokens) / duration,
            "requests_per_s": len(reqs) / duration,
            "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot), "e2e_s": percentiles(e2e),
            "bubble_ratio": self.bubble_ratios(), "micro_batches": self.micro_batches,
            "driver_busy_ratio": self.driver_busy / self.span, "preemptions": self.preemptions,
            "swaps": self.swaps, "validated_ratio": self.validated_ratio,
        }


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99))}
