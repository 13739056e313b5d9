"""The watchdog's verdicts on what the stages answer, and a stage's answer to a ping while it
computes (the processes themselves: tests/test_pipeline_runtime.py)."""

from __future__ import annotations

import threading
import time
import types

from pipeserve.comm.messages import Pong
from pipeserve.comm.transport import Kind, Message
from pipeserve.pipeline.links import Answer
from pipeserve.pipeline.stage_worker import StageWorker
from pipeserve.pipeline.watchdog import Watchdog


class FakeEngine:
    """What the watchdog watches: ``inflight`` steps, no result since ``last``."""

    def __init__(self, inflight: int = 1) -> None:
        self.inflight, self.last = inflight, time.monotonic()
        self.pings = 0
        self.failures: list[str] = []
        self.failed = threading.Event()

    def stalled_for(self) -> tuple[int, float]:
        return self.inflight, time.monotonic() - self.last

    def fail(self, message: str) -> None:
        self.failures.append(message)
        self.failed.set()


def _watch(engine: FakeEngine, answer, stages: int = 2, timeout: float = 0.3) -> Watchdog:
    def ping(which, grace):
        engine.pings += 1
        return {s: Answer(0.0, 0.0, p) for s in which if (p := answer(s)) is not None}
    return Watchdog(stages, {}, timeout, engine.stalled_for, ping, engine.fail)


def test_stages_that_answer_but_none_works_lost_a_step() -> None:
    engine = FakeEngine()
    dog = _watch(engine, lambda s: Pong(1.0))
    assert engine.failed.wait(5)
    dog.stop()
    assert engine.pings == 2, "confirmed by a second ping before failing"
    assert "none is working on a step (a step was lost)" in engine.failures[0]


def test_a_stage_at_work_is_waited_for_and_one_that_stops_answering_is_named(caplog) -> None:
    engine = FakeEngine()
    state = {"answering": True}
    answer = lambda s: (Pong(1.0, computing_s=5.0, computing_cpu_s=4.9) if s == 1 else Pong(1.0)) \
        if state["answering"] or s == 0 else None
    with caplog.at_level("WARNING", logger="pipeserve.pipeline.watchdog"):
        dog = _watch(engine, answer)
        time.sleep(1.5)                     # five timeouts: each look finds stage 1 computing
    assert not engine.failures and engine.pings >= 2
    assert "stage 1 has computed a step for 5 s (5 s of CPU)" in caplog.text
    state["answering"] = False
    assert engine.failed.wait(5)
    dog.stop()
    assert "stage(s) [1] did not answer" in engine.failures[0]


def test_a_step_that_runs_without_cpu_is_frozen_and_a_result_ends_a_look() -> None:
    engine = FakeEngine()
    dog = _watch(engine, lambda s: Pong(1.0, computing_s=0.4, computing_cpu_s=0.001 if s else 0.4))
    assert engine.failed.wait(5)
    dog.stop()
    assert "stage(s) [1] frozen: a step has run 0 s there using 0.00 s of CPU" in engine.failures[0]
    # a result between the two pings of "none at work": no failure
    engine = FakeEngine()

    def idle(stage):
        engine.last = time.monotonic()      # the result comes while the watchdog confirms
        return Pong(1.0)
    dog = _watch(engine, idle, timeout=0.3)
    time.sleep(1.0)
    dog.stop()
    assert not engine.failures


class FakeTransport:
    def __init__(self) -> None:
        self.sent: list[tuple[int, Kind, object]] = []

    def send(self, dst, kind, obj=None, tensor=None) -> None:
        self.sent.append((dst, kind, obj))


def test_a_stage_answers_a_ping_at_once_while_it_computes() -> None:
    spec = types.SimpleNamespace(config=types.SimpleNamespace(device="cpu"), num_stages=2)
    transport = FakeTransport()
    stage = StageWorker(spec, 1, {}, transport=transport)
    stage._arrived(Message(0, Kind.PING, None, None, 123.0))
    assert transport.sent == [(0, Kind.PONG, Pong(123.0))] and not stage._backlog
    stage._busy = True
    stage._handling = (time.monotonic() - 7.0, time.process_time() - 6.0)
    stage.sender.sending_since = time.monotonic() - 2.0
    stage._arrived(Message(0, Kind.PING, None, None, 124.0))
    pong = transport.sent[-1][2]
    assert not stage._backlog, "answered on the reader thread, not queued behind the step"
    assert pong.stage_time == 124.0 and 7.0 <= pong.computing_s < 8.0 and 6.0 <= pong.computing_cpu_s < 8.0
    assert 2.0 <= pong.sending_s < 3.0
