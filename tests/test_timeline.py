"""Timeline figures: busy fraction, bubble ratio, overlap, Chrome trace, Gantt PNG."""

from __future__ import annotations

import json

import pytest

from pipeserve.metrics.timeline import (Interval, Timeline, chrome_trace, intersect, merge,
                                        overlapping_compute, stage_stats, write_chrome_trace,
                                        write_gantt_png)


def gpipe_intervals(p: int, m: int, t: float) -> tuple[list[Interval], list[tuple[float, float]]]:
    """Ideal GPipe: micro-batch j runs on stage s during [(s + j)·t, (s + j + 1)·t]."""
    intervals = [Interval(s, "compute", (s + j) * t, (s + j + 1) * t, j) for s in range(p) for j in range(m)]
    steps = [(0.0, (p + j) * t) for j in range(m)]   # all submitted at 0, j done after the last stage
    return intervals, steps


def test_merge_and_intersect() -> None:
    assert merge([(3, 4), (0, 1), (0.5, 2), (2, 2.5)]) == [(0, 2.5), (3, 4)]
    assert intersect([(0, 2), (3, 5)], [(1, 4)]) == [(1, 2), (3, 4)]


@pytest.mark.parametrize("p,m", [(2, 4), (3, 3), (4, 8), (1, 5)])
def test_ideal_gpipe_bubble_matches_the_formula(p: int, m: int) -> None:
    intervals, steps = gpipe_intervals(p, m, 0.1)
    window = (0.0, (m + p - 1) * 0.1)
    stats = stage_stats(intervals, steps, p, window)
    for s in stats:
        assert s.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))
        assert s.busy_fraction == pytest.approx(m / (m + p - 1))
        assert s.compute_s == pytest.approx(m * 0.1)
        assert s.steps == m


def test_idle_without_work_is_not_a_bubble() -> None:
    # One stage computes [0, 1]; no step is in flight during [1, 3]: not a bubble.
    intervals = [Interval(0, "compute", 0.0, 1.0, 0), Interval(0, "wait", 1.0, 3.0)]
    stats = stage_stats(intervals, [(0.0, 1.0)], 1, (0.0, 3.0))[0]
    assert stats.bubble_ratio == pytest.approx(0.0)
    assert stats.busy_fraction == pytest.approx(1 / 3)
    assert stats.wait_s == pytest.approx(2.0)


def test_send_and_recv_seconds_are_reported() -> None:
    intervals = [Interval(0, "compute", 0.0, 1.0, 0), Interval(0, "send", 1.0, 1.5, 0),
                 Interval(1, "recv", 1.0, 1.5, 0), Interval(1, "compute", 1.5, 2.5, 0)]
    stats = stage_stats(intervals, [(0.0, 2.5)], 2, (0.0, 2.5))
    assert stats[0].send_s == pytest.approx(0.5) and stats[1].recv_s == pytest.approx(0.5)
    assert stats[1].bubble_ratio == pytest.approx(1.5 / 2.5)


def test_overlapping_compute() -> None:
    intervals, _ = gpipe_intervals(2, 4, 1.0)
    assert overlapping_compute(intervals) == pytest.approx(3.0)
    assert overlapping_compute([Interval(0, "compute", 0, 1), Interval(1, "compute", 1, 2)]) == 0.0


def test_timeline_collects_steps_and_window() -> None:
    tl = Timeline(2)
    intervals, _ = gpipe_intervals(2, 2, 0.5)
    tl.add_intervals(intervals)
    for j in range(2):
        tl.step_submitted(j, 0.0)
        tl.step_finished(j, (2 + j) * 0.5)
    tl.step_submitted(99, 5.0)   # still in flight: not in the window
    assert tl.window() == (0.0, 1.5)
    assert [s.bubble_ratio for s in tl.stats()] == pytest.approx([1 / 3, 1 / 3])


def test_step_shapes_are_kept_as_the_intervals_are() -> None:
    tl = Timeline(2, max_intervals=2)
    for j in range(3):
        tl.step_submitted(j, float(j), {"decodes": j})
    tl.step_submitted(3, 3.0)                       # no shape given: none kept
    assert tl.step_shapes() == {1: {"decodes": 1}, 2: {"decodes": 2}}   # the oldest went
    tl.clear()
    assert tl.step_shapes() == {}


def test_chrome_trace_has_one_track_per_stage(tmp_path) -> None:
    intervals, steps = gpipe_intervals(3, 2, 0.01)
    intervals.append(Interval(0, "send", 0.01, 0.012, 0))
    trace = chrome_trace(intervals, steps)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"stage 0 compute", "stage 1 compute", "stage 2 compute"} <= names
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(intervals)
    assert min(e["ts"] for e in slices) == 0.0
    assert all(e["dur"] > 0 for e in slices)
    path = tmp_path / "trace.json"
    write_chrome_trace(path, intervals, steps)
    assert json.loads(path.read_text())["traceEvents"]


def test_gantt_png(tmp_path) -> None:
    intervals, _ = gpipe_intervals(2, 3, 0.01)
    path = tmp_path / "gantt.png"
    write_gantt_png(path, intervals, 2)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 2000
