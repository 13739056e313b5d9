"""What each pipeline stage did when: intervals, and the figures drawn from them.

Every stage records intervals of four kinds, on the driver's clock (stages
report ``time.time()`` and the driver subtracts each stage's measured clock
offset):

- ``compute``: the stage's model forward for one micro-batch (chunk);
- ``send``:    its sender thread pushing one message to the next rank (this
               overlaps the stage's next compute: sends are asynchronous);
- ``recv``:    receiving a message's payload and activations after its header
               arrived (the transfer time on a slow link);
- ``wait``:    blocked waiting for the next message header (idle).

The driver records, per step, when it was submitted and when its result came
back. Over a window ``[t0, t1]`` (default: first submit to last result):

- ``busy fraction`` of a stage = its compute time inside the window / window length;
- ``work time`` = the part of the window where at least one step was in flight
  (submitted, result not yet back): the pipeline had work;
- ``bubble ratio`` of a stage = (work time during which that stage was not
  computing) / window length. With GPipe-style submission of M equal
  micro-batches over P equal stages it is (P − 1)/(M + P − 1).

This module is plain Python; ``write_gantt_png`` imports matplotlib lazily.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

KINDS = ("compute", "send", "recv", "wait")

Span = tuple[float, float]


@dataclass(frozen=True)
class Interval:
    stage: int
    kind: str           # one of KINDS
    start: float        # seconds, driver clock
    end: float
    step_id: int = -1   # -1: not tied to a step (idle wait)
    chunk: int = 0      # virtual-stage chunk (interleaved schedule)


@dataclass(frozen=True)
class StageStats:
    stage: int
    busy_fraction: float
    bubble_ratio: float
    compute_s: float
    send_s: float
    recv_s: float
    wait_s: float
    steps: int          # chunk forwards computed inside the window

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class Timeline:
    """Thread-safe, bounded store of stage intervals and step submit/finish times."""

    def __init__(self, num_stages: int, max_intervals: int = 200_000) -> None:
        self.num_stages = num_stages
        self._intervals: deque[Interval] = deque(maxlen=max_intervals)
        self._steps: dict[int, list[float | None]] = {}
        self._finished: deque[tuple[int, float, float]] = deque(maxlen=max_intervals)
        # What each step carried (``step_shape``), kept for the trace's compute slices when given;
        # as many as the finished steps
        self._shapes: dict[int, dict] = {}
        self._lock = threading.Lock()

    def add_intervals(self, intervals: list[Interval]) -> None:
        with self._lock:
            self._intervals.extend(intervals)

    def step_submitted(self, step_id: int, t: float, shape: dict | None = None) -> None:
        with self._lock:
            self._steps[step_id] = [t, None]
            if shape is not None:
                if len(self._shapes) >= self._finished.maxlen:   # the oldest goes, as the finished steps' do
                    del self._shapes[next(iter(self._shapes))]
                self._shapes[step_id] = shape

    def step_shapes(self) -> dict[int, dict]:
        """``step_shape`` of the steps submitted with one, by step id."""
        with self._lock:
            return dict(self._shapes)

    def step_finished(self, step_id: int, t: float) -> None:
        with self._lock:
            span = self._steps.pop(step_id, None)
            if span is not None:
                self._finished.append((step_id, span[0], t))

    def intervals(self) -> list[Interval]:
        with self._lock:
            return sorted(self._intervals, key=lambda iv: (iv.start, iv.stage))

    def step_spans(self) -> list[Span]:
        """(submit, done) of finished steps; in-flight steps end now-unknown and are left out."""
        with self._lock:
            return [(start, end) for _, start, end in self._finished]

    def finished_steps(self) -> list[tuple[int, float, float]]:
        """(step id, submit, done) of finished steps, in finishing order."""
        with self._lock:
            return list(self._finished)

    def window(self) -> Span | None:
        spans = self.step_spans()
        if not spans:
            return None
        return min(s for s, _ in spans), max(e for _, e in spans)

    def stats(self, window: Span | None = None) -> list[StageStats]:
        window = window or self.window()
        if window is None:
            return []
        return stage_stats(self.intervals(), self.step_spans(), self.num_stages, window)

    def clear(self) -> None:
        with self._lock:
            self._intervals.clear()
            self._finished.clear()
            self._shapes.clear()


# -- interval arithmetic ---------------------------------------------------
def merge(spans: list[Span]) -> list[Span]:
    """Union of spans as sorted, disjoint spans."""
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def clip(spans: list[Span], window: Span) -> list[Span]:
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in spans if min(e, hi) > max(s, lo)]


def total(spans: list[Span]) -> float:
    return sum(e - s for s, e in spans)


def intersect(a: list[Span], b: list[Span]) -> list[Span]:
    """Intersection of two sorted disjoint span lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def stage_stats(intervals: list[Interval], step_spans: list[Span], num_stages: int,
                window: Span) -> list[StageStats]:
    """Per-stage figures over ``window`` (definitions in the module docstring)."""
    length = max(window[1] - window[0], 1e-12)
    work = clip(merge(step_spans), window)
    result = []
    for stage in range(num_stages):
        mine = [iv for iv in intervals if iv.stage == stage]
        by_kind = {k: clip(merge([(iv.start, iv.end) for iv in mine if iv.kind == k]), window) for k in KINDS}
        compute = by_kind["compute"]
        idle_with_work = total(work) - total(intersect(work, compute))
        steps = sum(1 for iv in mine if iv.kind == "compute" and window[0] <= iv.start < window[1])
        result.append(StageStats(stage=stage, busy_fraction=total(compute) / length,
                                 bubble_ratio=idle_with_work / length, compute_s=total(compute),
                                 send_s=total(by_kind["send"]), recv_s=total(by_kind["recv"]),
                                 wait_s=total(by_kind["wait"]), steps=steps))
    return result


def overlapping_compute(intervals: list[Interval]) -> float:
    """Seconds during which two or more stages computed at the same time."""
    stages = sorted({iv.stage for iv in intervals})
    per_stage = {s: merge([(iv.start, iv.end) for iv in intervals if iv.stage == s and iv.kind == "compute"])
                 for s in stages}
    pairs = [intersect(per_stage[a], per_stage[b]) for i, a in enumerate(stages) for b in stages[i + 1:]]
    return total(merge([span for spans in pairs for span in spans]))


def step_shape(step) -> dict:
    """What a ``StepInput`` carries, as the trace's compute slices show it (and
    benchmarks/pp_trace_gaps.py fits each stage's compute time on): its decodes (one new token
    each) and the positions they attend to, its prompt tokens (chunks of more than one) and
    their count, and the KV blocks it swaps in and out."""
    decodes = context = prompt_tokens = prompts = 0
    for seq in step.seqs:
        n = len(seq.token_ids)
        if n == 1:
            decodes += 1
            context += seq.start_pos + 1
        else:
            prompts += 1
            prompt_tokens += n
    return {"decodes": decodes, "decode_context": context, "prompt_tokens": prompt_tokens, "prompts": prompts,
            "swap_in": len(step.swap_in), "swap_out": len(step.swap_out)}


# -- exports ---------------------------------------------------------------
def chrome_trace(intervals: list[Interval], step_spans: list[Span] = (), shapes: dict[int, dict] | None = None) -> dict:
    """Chrome trace event JSON (open in Perfetto / chrome://tracing): one track per stage.
    ``shapes``: ``step_shape`` by step id, added to the args of that step's compute slices."""
    origin = min([iv.start for iv in intervals] + [s for s, _ in step_spans], default=0.0)
    shapes = shapes or {}
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "pipeline"}}]
    stages = sorted({iv.stage for iv in intervals})
    for stage in stages:
        for tid, lane in ((2 * stage, "compute"), (2 * stage + 1, "comm")):
            events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid,
                           "args": {"name": f"stage {stage} {lane}"}})
    for iv in intervals:
        if iv.kind == "wait":
            continue  # idle is the gap between slices; drawing it would hide nothing new
        tid = 2 * iv.stage + (0 if iv.kind == "compute" else 1)
        events.append({"ph": "X", "pid": 0, "tid": tid, "name": f"{iv.kind} step {iv.step_id}",
                       "cat": iv.kind, "ts": (iv.start - origin) * 1e6,
                       "dur": max(iv.end - iv.start, 0.0) * 1e6,
                       "args": {"step_id": iv.step_id, "chunk": iv.chunk,
                                **(shapes.get(iv.step_id, {}) if iv.kind == "compute" else {})}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, intervals: list[Interval], step_spans: list[Span] = (),
                       shapes: dict[int, dict] | None = None) -> None:
    Path(path).write_text(json.dumps(chrome_trace(intervals, step_spans, shapes)))


_COLORS = {"compute": "tab:blue", "send": "tab:orange", "recv": "tab:red"}


def write_gantt_png(path: str | Path, intervals: list[Interval], num_stages: int,
                    title: str = "pipeline timeline") -> None:
    """Stages (rows) against time: compute in the upper half of a row, communication below."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min((iv.start for iv in intervals), default=0.0)
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.8 * num_stages))
    for kind, color in _COLORS.items():
        for stage in range(num_stages):
            spans = [((iv.start - origin) * 1e3, (iv.end - iv.start) * 1e3) for iv in intervals
                     if iv.stage == stage and iv.kind == kind]
            y = (stage + 0.05, 0.5) if kind == "compute" else (stage + 0.55, 0.4)
            ax.broken_barh(spans, y, facecolors=color, label=kind if stage == 0 else None)
    ax.set_yticks([s + 0.5 for s in range(num_stages)], [f"stage {s}" for s in range(num_stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
