"""PNG plots of benchmark results: latency CDFs and rate curves.

The pipeline Gantt chart is the engine's own (``metrics.timeline.write_gantt_png``)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: benchmarks run on headless machines
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

LATENCY_PANELS = (("ttft", "time to first token"), ("tpot", "time per output token"),
                  ("itl", "inter-token latency"), ("e2el", "end-to-end latency"))


def plot_latency_cdfs(series: dict[str, dict[str, list[float]]], path: Path, title: str = "") -> Path | None:
    """``series[label][metric]`` are latencies in ms; one panel per metric that has data."""
    panels = [(key, name) for key, name in LATENCY_PANELS
              if any(values.get(key) for values in series.values())]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (key, name) in zip(axes[0], panels):
        for label, values in series.items():
            data = np.sort(np.asarray(values.get(key) or [], dtype=float))
            if data.size:
                ax.step(data, np.arange(1, data.size + 1) / data.size, where="post", label=label)
        ax.set(xlabel=f"{name} (ms)", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return _save(fig, path, title or "latency CDFs")


def plot_rate_curves(points: list[dict], path: Path, title: str = "") -> Path | None:
    """Output tokens/s and p99 TPOT against the offered request rate of a sweep."""
    if not points:
        return None
    rates = [_rate(p["request_rate"]) for p in points]
    xs, labels = _rate_positions(rates)
    order = np.argsort(xs)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    series = ((left, [p["output_tokens_per_s"] for p in points], "output tokens/s"),
              (right, [p["tpot_ms"]["p99"] for p in points], "p99 TPOT (ms)"))
    for ax, ys, name in series:
        ax.plot(np.asarray(xs)[order], np.asarray(ys)[order], marker="o")
        ax.set(xlabel="request rate (req/s)", ylabel=name)
        ax.set_xticks(xs, labels)
        ax.grid(alpha=0.3)
    slo = points[0].get("slo_ms", {}).get("tpot")
    if slo:
        right.axhline(slo, color="red", linestyle="--", label=f"SLO {slo:g} ms")
        right.legend(fontsize=8)
    return _save(fig, path, title or "throughput and p99 TPOT against request rate")


def _rate(value) -> float:
    return math.inf if value == "inf" else float(value)


def _rate_positions(rates: list[float]) -> tuple[list[float], list[str]]:
    """Infinite rate drawn just right of the highest finite one, labelled 'inf'."""
    finite = [r for r in rates if math.isfinite(r)]
    edge = (max(finite) * 1.5) if finite else 1.0
    return [r if math.isfinite(r) else edge for r in rates], \
        [f"{r:g}" if math.isfinite(r) else "inf" for r in rates]


def _save(fig, path: Path, title: str) -> Path:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
