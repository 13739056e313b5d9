"""One pipeline stage process: receive a micro-batch, run its layers, pass it on.

The stage makes no decisions. Its main thread receives (any source), computes
and hands the result to a sender thread, then immediately receives the next
micro-batch: sends overlap the next compute. Every interval it spends is
recorded (see ``pipeserve.metrics.timeline``) and piggybacks on the next
message it sends; the last stage's results carry them to the driver.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections import deque
from typing import Any

import torch

from pipeserve.comm.transport import Kind, Message, Transport
from pipeserve.metrics.timeline import Interval
from pipeserve.pipeline.spec import PipelineSpec, StepEnvelope
from pipeserve.worker.step import StepOutput

logger = logging.getLogger(__name__)

STOPPED, LOST_DRIVER, RESET = "stopped", "lost the driver", "reset by the driver"


class IntervalLog:
    """Intervals not yet shipped to the driver (the main and sender threads both add)."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self._pending: list[Interval] = []
        self._lock = threading.Lock()

    def add(self, kind: str, start: float, end: float, step_id: int = -1, chunk: int = 0) -> None:
        if end > start:
            with self._lock:
                self._pending.append(Interval(self.stage, kind, start, end, step_id, chunk))

    def drain(self) -> list[Interval]:
        with self._lock:
            out, self._pending = self._pending, []
            return out


class Sender(threading.Thread):
    """Sends messages in order. A failed send to a stage is reported to the
    driver (LINK_DOWN), which decides; a failed send to the driver shows up as LOST.

    A small message (a decode step's activations, a result) goes out at once from
    the caller's thread when nothing is queued before it: handing it to this
    thread would cost a thread wake-up on every hop, which a lone request pays
    on every token. A large one (a prefill's activations) is queued, so the next
    micro-batch's compute overlaps its transfer.
    """

    DIRECT_MAX_BYTES = 256 * 1024

    def __init__(self, transport: Transport, log: IntervalLog) -> None:
        super().__init__(name="stage-sender", daemon=True)
        self.transport, self.log = transport, log
        self.queue: queue.Queue = queue.Queue()
        self._pending = 0                  # queued and not yet sent: a direct send must not pass them
        self._lock = threading.Lock()

    def put(self, dst: int, kind: Kind, obj: Any = None, tensor: torch.Tensor | None = None,
            step_id: int = -1, chunk: int = 0) -> None:
        item = (dst, kind, obj, tensor, step_id, chunk)
        with self._lock:
            direct = self._pending == 0 and (tensor is None or tensor.nbytes <= self.DIRECT_MAX_BYTES)
            if not direct:
                self._pending += 1
                self.queue.put(item)
        if direct:
            self._send(*item)

    def run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            self._send(*item)
            with self._lock:
                self._pending -= 1

    def _send(self, dst: int, kind: Kind, obj: Any, tensor: torch.Tensor | None, step_id: int,
              chunk: int) -> None:
        start = time.time()
        try:
            self.transport.send(dst, kind, obj, tensor)
        except ConnectionError as exc:
            logger.error("stage %d: send to rank %d failed: %s", self.log.stage, dst, exc)
            if dst != 0:
                self.put(0, Kind.LINK_DOWN, (dst, str(exc)))
            return
        if kind in (Kind.STEP, Kind.RESULT):
            self.log.add("send", start, time.time(), step_id, chunk)

    def close(self) -> None:
        self.queue.put(None)
        self.join()


class StageWorker:
    def __init__(self, spec: PipelineSpec, stage: int, runners: dict[int, Any], transport: Transport) -> None:
        self.spec, self.stage, self.runners = spec, stage, runners
        self.rank = stage + 1
        self.transport = transport
        self.log = IntervalLog(stage)
        self.sender = Sender(transport, self.log)
        self.loopback: deque[Message] = deque()   # chunk handoffs to ourselves (P = 1, V > 1)

    def run(self) -> str:
        """Serve until the driver says STOP or RESET, or its connection is lost; returns which."""
        self.sender.start()
        while True:
            message = self._next_message()
            if message.kind == Kind.STOP:
                outcome = STOPPED
                break
            if message.src == 0 and message.kind in (Kind.LOST, Kind.RESET):
                outcome = LOST_DRIVER if message.kind == Kind.LOST else RESET
                break
            self._handle(message)
        if outcome == STOPPED:
            self.sender.put(0, Kind.BYE, self.log.drain())
        self.sender.close()
        return outcome

    def _next_message(self) -> Message:
        if self.loopback:
            return self.loopback.popleft()
        start = time.time()
        message = self.transport.recv()
        self.log.add("wait", start, message.arrived)
        if message.kind == Kind.STEP:
            env: StepEnvelope = message.obj
            self.log.add("recv", message.arrived, time.time(), env.step.step_id, env.chunk)
        return message

    def _handle(self, message: Message) -> None:
        if message.kind == Kind.STEP:
            self._run_step(message.obj, message.tensor)
        elif message.kind == Kind.PING:
            self.sender.put(0, Kind.PONG, message.arrived)
        elif message.kind == Kind.FLUSH:
            profiler = next((r.profiler for r in self.runners.values() if getattr(r, "profiler", None)), None)
            if profiler is not None:      # --profile: the figures so far, before the TIMELINE that acks
                self.sender.put(0, Kind.PROFILE, profiler.snapshot())
            self.sender.put(0, Kind.TIMELINE, self.log.drain())
        elif message.kind == Kind.PEERS:
            self._link(message.obj)
        elif message.kind == Kind.LOST:
            logger.warning("stage %d: the connection to rank %d closed (%s)", self.stage, message.src, message.obj)
        elif message.kind == Kind.HELLO:
            pass    # a neighbour stage connected
        else:
            logger.warning("stage %d ignores an unexpected %s message", self.stage, message.kind.name)

    def _link(self, peers) -> None:
        """Connect to the stages we exchange activations with (the lower rank dials)."""
        self.transport.set_peers(peers)
        p = self.spec.num_stages
        for stage in {(self.stage + 1) % p, (self.stage - 1) % p} - {self.stage}:
            try:
                self.transport.link(stage + 1)
            except ConnectionError as exc:
                self.sender.put(0, Kind.LINK_DOWN, (stage + 1, str(exc)))

    def _run_step(self, env: StepEnvelope, hidden: torch.Tensor | None) -> None:
        step_id, chunk = env.step.step_id, env.chunk
        start = time.time()
        try:
            out = self.runners[chunk].execute(env.step, hidden)
            if isinstance(out, torch.Tensor) and out.is_cuda:
                torch.cuda.current_stream(out.device).synchronize()  # the sender reads it next
        except Exception:
            self.sender.put(0, Kind.ERROR, (step_id, self.stage, traceback.format_exc()))
            return
        self.log.add("compute", start, time.time(), step_id, chunk)
        intervals = env.intervals + self.log.drain()
        if isinstance(out, StepOutput):
            self.sender.put(0, Kind.RESULT, (out, intervals), step_id=step_id, chunk=chunk)
            return
        nxt = StepEnvelope(env.step, chunk + 1, intervals)
        dst = (chunk + 1) % self.spec.num_stages + 1
        if dst == self.rank:
            self.loopback.append(Message(self.rank, Kind.STEP, nxt, out, time.time()))
        else:
            self.sender.put(dst, Kind.STEP, nxt, out, step_id, chunk)
