"""``--plot FILE.png``: the simulated Gantt chart, workers × time (matplotlib, lazily)."""

from __future__ import annotations

from pipeserve.plan.sim_result import SimResult

MAX_BARS = 4000  # beyond this the chart shows only the first bars (a readable window)


def plot_gantt(result: SimResult, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = sorted(result.intervals, key=lambda i: i.start)[:MAX_BARS]
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * result.num_workers))
    colors = plt.get_cmap("tab10")
    for bar in bars:
        ax.broken_barh([(bar.start, bar.end - bar.start)], (bar.worker - 0.4, 0.8),
                       facecolors=colors(bar.micro_batch % 10),
                       edgecolor="black" if bar.prefill else "none", linewidth=0.4)
    ax.set_yticks(range(result.num_workers))
    ax.set_yticklabels([f"stage {w}" for w in range(result.num_workers)])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    shown = "" if len(result.intervals) <= MAX_BARS else f" (first {MAX_BARS} of {len(result.intervals)} bars)"
    ax.set_title(f"{title}{shown}; colour = micro-batch, outlined = carries prefill")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
