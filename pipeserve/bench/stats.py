"""Latency and throughput math shared by the offline and online benchmarks.

Times are seconds inside the code and milliseconds in reports (``*_ms``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """What one request did, measured by the client (online) or the engine (offline)."""

    prompt_len: int
    output_len: int = 0
    success: bool = True
    ttft: float = 0.0                                     # request sent -> first token
    e2el: float = 0.0                                     # request sent -> last token
    itl: list[float] = field(default_factory=list)        # gaps between streamed tokens
    start_time: float = 0.0                               # when it was sent (run clock)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.output_len < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)


def summarize(values_s: list[float]) -> dict:
    """mean, p50, p90, p99, min, max of seconds, reported in ms; empty -> zeros with n = 0."""
    if not values_s:
        return {"n": 0, "mean": 0.0, "min": 0.0, "max": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {"n": int(arr.size), "mean": float(arr.mean()), "min": float(arr.min()), "max": float(arr.max())}
    out.update({f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES})
    return out


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft=500,tpot=50"`` (milliseconds) -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--slo {text!r}: write name=ms pairs with names from {', '.join(SLO_METRICS)}, "
                             "e.g. ttft=500,tpot=50")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--slo {text!r}: {value!r} is not a number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"--slo {text!r}: {name} must be > 0 ms")
        slo[name] = ms / 1000.0
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """A failed request never meets an SLO; a single-token request has no TPOT to miss."""
    if not record.success:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.e2el}
    return all(values[name] is None or values[name] <= limit for name, limit in slo.items())


def latency_metrics(records: list[RequestRecord], duration_s: float,
                    slo: dict[str, float] | None = None) -> dict:
    """Throughput, goodput and latency summaries of one run of ``duration_s`` seconds."""
    if duration_s <= 0:
        raise ValueError(f"a run must last > 0 s, got {duration_s}")
    ok = [r for r in records if r.success]
    in_tokens = sum(r.prompt_len for r in ok)
    out_tokens = sum(r.output_len for r in ok)
    metrics = {
        "num_requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "duration_s": duration_s, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "requests_per_s": len(ok) / duration_s, "input_tokens_per_s": in_tokens / duration_s,
        "output_tokens_per_s": out_tokens / duration_s,
        "total_tokens_per_s": (in_tokens + out_tokens) / duration_s,
        "ttft_ms": summarize([r.ttft for r in ok]),
        "tpot_ms": summarize([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": summarize([gap for r in ok for gap in r.itl]),
        "e2el_ms": summarize([r.e2el for r in ok]),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in records)
        metrics.update({"slo_ms": {k: v * 1000.0 for k, v in slo.items()}, "good_requests": good,
                        "goodput_requests_per_s": good / duration_s,
                        "slo_attainment": good / len(records) if records else 0.0})
    return metrics


def capacity_under_slo(sweep: list[dict], attainment: float) -> float | None:
    """Highest request rate of a sweep whose SLO attainment reaches ``attainment``.

    Rates are walked in increasing order and the walk stops at the first miss:
    a lucky pass above a failing rate is noise, not capacity.
    """
    best = None
    for point in sorted(sweep, key=lambda p: p["request_rate"]):
        if point.get("slo_attainment", 0.0) < attainment:
            break
        best = point["request_rate"]
    return best
