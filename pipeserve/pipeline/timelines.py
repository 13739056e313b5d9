"""The driver's record of what every stage did: intervals on the driver's clock.

Stages timestamp their own compute / send / recv / wait intervals (see
``pipeserve.metrics.timeline``) and ship them with their messages; this part
shifts them onto the driver's clock, keeps them, and turns them into figures
(busy fraction, bubble ratio) and a Chrome trace + PNG Gantt chart.
"""

from __future__ import annotations

from pathlib import Path

from pipeserve.metrics.timeline import Interval, Timeline, write_chrome_trace, write_gantt_png


class StageTimelines:
    def __init__(self, num_stages: int, virtual_stages: int, schedule: str) -> None:
        self.num_stages = num_stages
        self.virtual_stages = virtual_stages
        self.schedule = schedule
        self.timeline = Timeline(num_stages)
        # Stage clock minus driver clock, per stage. Stages on the driver's host
        # share its clock: 0 (a measured offset would only add the round trip's noise).
        self.clock_offsets = [0.0] * num_stages

    def set_clock_offset(self, stage: int, sent: float, stage_time: float, received: float) -> None:
        """From one ping: the stage's time at receipt minus the round trip's midpoint."""
        self.clock_offsets[stage] = stage_time - (sent + received) / 2

    def step_submitted(self, step_id: int, t: float, shape: dict | None = None) -> None:
        self.timeline.step_submitted(step_id, t, shape)

    def step_finished(self, step_id: int, t: float) -> None:
        self.timeline.step_finished(step_id, t)

    def add_intervals(self, intervals: list[Interval]) -> None:
        """Stage clocks -> driver clock."""
        off = self.clock_offsets
        self.timeline.add_intervals([
            Interval(iv.stage, iv.kind, iv.start - off[iv.stage], iv.end - off[iv.stage], iv.step_id, iv.chunk)
            for iv in intervals])

    def stats(self, last_seconds: float | None = None) -> dict:
        """Per-stage busy fraction, bubble ratio, compute/send/recv/wait seconds and step
        counts (see metrics.timeline), over the window from the first submit to the last
        result, or over its last ``last_seconds``; plus their means over stages."""
        window = self.timeline.window()
        if window and last_seconds:
            window = (max(window[0], window[1] - last_seconds), window[1])
        stages = self.timeline.stats(window)
        return {"num_stages": self.num_stages, "virtual_stages": self.virtual_stages,
                "window_s": (window[1] - window[0]) if window else 0.0,
                "steps_completed": len(self.timeline.step_spans()),
                "busy_fraction": _mean([s.busy_fraction for s in stages]),
                "bubble_ratio": _mean([s.bubble_ratio for s in stages]),
                "stages": [s.as_dict() for s in stages], "clock_offsets_s": list(self.clock_offsets)}

    def has_steps(self) -> bool:
        return bool(self.timeline.step_spans())

    def write_trace(self, path: str | Path) -> tuple[Path, Path]:
        """Chrome trace JSON at ``path`` and a Gantt PNG beside it (same name, .png)."""
        path = Path(path)
        intervals = self.timeline.intervals()
        write_chrome_trace(path, intervals, self.timeline.step_spans(), self.timeline.step_shapes())
        png = path.with_suffix(".png")
        write_gantt_png(png, intervals, self.num_stages, title=f"{self.num_stages} stages, {self.schedule} schedule")
        return path, png


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
