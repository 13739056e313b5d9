"""``--profile`` on the driver: wall and CPU time of the engine thread, per phase of a step.

The driver shares the cores with the stages, so its CPU time per step is
work the stages cannot do. ``DriverProfiler.instrument(engine)`` wraps the
engine's own calls (``metrics.profile.Accounts`` with thread CPU time):
scheduling, building the step, submitting it, processing results, and
``step`` itself (its remainder). With PP = 1 the stage's forward runs inside
``submit``; it is accounted apart (``stage_forward``) and is not the driver's.
"""

from __future__ import annotations

import time
from typing import Any

from pipeserve.metrics.profile import DRIVER_CLASSES, Accounts

STAGE_FORWARD = "stage_forward"


class DriverProfiler:
    def __init__(self) -> None:
        self.acc = Accounts({**DRIVER_CLASSES, STAGE_FORWARD: "PP = 1: the stage's forward, inside submit"},
                            cpu=True)
        self.steps = 0          # micro-batches submitted

    def instrument(self, engine: Any) -> None:
        acc = self.acc
        engine.step = acc.timed(engine.step, "driver_other")
        engine.scheduler.schedule = acc.timed(engine.scheduler.schedule, "schedule")
        engine._build_step = acc.timed(engine._build_step, "build_step")
        engine._process = acc.timed(engine._process, "process")
        engine.executor.wait = acc.timed(engine.executor.wait, "wait")
        submit = acc.timed(engine.executor.submit, "submit")

        def counted(step: Any) -> None:
            self.steps += 1
            submit(step)

        engine.executor.submit = counted
        runner = getattr(engine.executor, "runner", None)    # PP = 1: the stage runs in submit
        if runner is not None:
            runner.execute = acc.timed(runner.execute, STAGE_FORWARD)

    def snapshot(self) -> dict:
        return {"steps": self.steps, "ns": dict(self.acc.ns), "cpu_ns": dict(self.acc.cpu_ns),
                "process_cpu_s": time.process_time()}


def driver_breakdown(after: dict, before: dict | None, pipeline: bool) -> dict:
    """The driver's figures between two snapshots: per phase wall / CPU ms, and its CPU
    per step. ``pipeline``: the stages are other processes, so the driver process's
    CPU time (all its threads: transport included) is the driver's too."""
    before = before or {"steps": 0, "ns": {}, "cpu_ns": {}, "process_cpu_s": after["process_cpu_s"]}
    steps = after["steps"] - before["steps"]
    phases = []
    for name in DRIVER_CLASSES:
        wall = after["ns"].get(name, 0) - before["ns"].get(name, 0)
        cpu = after["cpu_ns"].get(name, 0) - before["cpu_ns"].get(name, 0)
        phases.append({"phase": name, "wall_ms": wall / 1e6, "cpu_ms": cpu / 1e6})
    cpu_ms = sum(p["cpu_ms"] for p in phases)
    return {"steps": steps, "phases": phases, "cpu_ms": cpu_ms,
            "wall_ms": sum(p["wall_ms"] for p in phases),
            "cpu_ms_per_step": cpu_ms / steps if steps else 0.0,
            "process_cpu_ms": (after["process_cpu_s"] - before["process_cpu_s"]) * 1e3 if pipeline else None}
