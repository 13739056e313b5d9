"""When online requests are sent: Poisson or gamma arrival processes.

Gaps between requests are gamma distributed with shape ``burstiness`` and
mean ``1 / rate``. Burstiness 1 is a Poisson process; below 1 requests come in
bursts, above 1 they come more evenly. An infinite rate sends everything at once.
"""

from __future__ import annotations

import math

import numpy as np


def parse_rate(text: str | float) -> float:
    """``"inf"`` or a positive number of requests per second."""
    try:
        rate = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"a request rate must be a number or 'inf', got {text!r}") from None
    if not rate > 0:
        raise ValueError(f"a request rate must be > 0 (or 'inf'), got {text!r}")
    return rate


def parse_rates(text: str) -> list[float]:
    """``"1,2,4,inf"`` -> [1.0, 2.0, 4.0, inf]."""
    rates = [parse_rate(part.strip()) for part in text.split(",") if part.strip()]
    if not rates:
        raise ValueError(f"--sweep-rates {text!r} names no rate; write e.g. 1,2,4")
    return rates


def arrival_gaps(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds to wait before each request (the first waits too, as in a steady stream)."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests).tolist()


def arrival_times(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times relative to the start of the run."""
    return np.cumsum(arrival_gaps(num_requests, rate, burstiness, seed)).tolist()


def rate_label(rate: float) -> str | float:
    """JSON has no infinity: an unbounded rate is written as the string ``"inf"``."""
    return "inf" if math.isinf(rate) else rate
