"""The driver's links to one generation of stages: a sender thread per stage, and a
receiver that runs on the transport's reader threads.

One sender per stage: a stage that stops reading blocks only its own queue, so
the others still answer the pings that name the silent one. A message whose
stage has nothing queued goes out at once from the caller's thread (the
engine's, for a step): a hand-off to the sender thread would cost a thread
wake-up per step, which a lone request pays on every token. For the same reason
messages are received on the thread that read them from the socket (one per
stage, serialised here), not handed to a receiving thread: the receiver hands
every message to ``on_message`` except PONGs, which it keeps for ``ping``.
A broken link (a stage that died resets its sockets) is reported once through
``on_broken``; what it means is the owner's business.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from pipeserve.comm.messages import Pong
from pipeserve.comm.transport import Kind, Message, Transport

POLL_S = 0.05


class Answer(NamedTuple):
    """A stage's PONG: when the PING left and its answer came (the driver's ``time.time()``),
    and what the stage said (its clock, and whether it is at work: ``Pong``)."""
    sent: float
    arrived: float
    pong: Pong


class Links:
    def __init__(self, transport: Transport, num_stages: int, on_message: Callable[[Message], None],
                 on_broken: Callable[[str], None]) -> None:
        self.transport = transport
        self.num_stages = num_stages
        self._on_message = on_message
        self._on_broken = on_broken
        self._pongs: queue.Queue[tuple[int, Pong, float]] = queue.Queue()   # (stage, its answer, arrived)
        self._byes: set[int] = set()
        self._sendqs: dict[int, queue.Queue] = {stage: queue.Queue() for stage in range(num_stages)}
        self._pending = [0] * num_stages          # queued, not yet sent: a direct send must not pass them
        self._direct = [True] * num_stages       # False once its link broke or the links closed
        self._lock = threading.Lock()
        self._receive_lock = threading.Lock()     # one message at a time, whichever stage it is from
        self._ended = False                       # broken, or every stage said BYE: ignore the rest
        self._all_bye = threading.Event()
        self.threads = [threading.Thread(target=self._send_loop, args=(stage, q), name=f"pp-send-{stage}",
                                         daemon=True) for stage, q in self._sendqs.items()]
        for t in self.threads:
            t.start()
        transport.set_receiver(self._receive)

    def send(self, stage: int, kind: Kind, obj: Any = None) -> None:
        with self._lock:
            direct = self._pending[stage] == 0 and self._direct[stage]
            if not direct:
                self._pending[stage] += 1
                self._sendqs[stage].put((kind, obj))
        if direct:
            self._send_now(stage, kind, obj)

    def ping(self, stages: list[int], timeout: float) -> dict[int, Answer]:
        """Ping ``stages``; an ``Answer`` for each that answers within ``timeout``."""
        while not self._pongs.empty():
            self._pongs.get_nowait()                 # answers to an earlier round
        sent = time.time()
        for stage in stages:
            self.send(stage, Kind.PING)
        answers: dict[int, Answer] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < len(stages) and time.monotonic() < deadline:
            try:
                stage, pong, arrived = self._pongs.get(timeout=POLL_S)
            except queue.Empty:
                continue
            answers[stage] = Answer(sent, arrived, pong)
        return answers

    def close(self, stop_stages: list[int] = (), kind: Kind = Kind.STOP) -> None:
        """Send ``kind`` (STOP, or RESET) to ``stop_stages`` after what is queued for them,
        then end the senders."""
        with self._lock:
            self._direct = [False] * self.num_stages
        for stage, sendq in self._sendqs.items():
            if stage in stop_stages:
                sendq.put((kind, None))
            sendq.put(None)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for each sender to end."""
        for thread in self.threads:
            thread.join(timeout=timeout)

    def wait_byes(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every stage's BYE (their last intervals)."""
        return self._all_bye.wait(timeout)

    # -- threads -------------------------------------------------------------
    def _send_loop(self, stage: int, sendq: queue.Queue) -> None:
        while True:
            item = sendq.get()
            if item is None:
                return
            kind, obj = item
            sent = self._send_now(stage, kind, obj)
            with self._lock:
                self._pending[stage] -= 1
            if not sent:
                return

    def _send_now(self, stage: int, kind: Kind, obj: Any) -> bool:
        try:
            self.transport.send(stage + 1, kind, obj)
        except Exception as exc:
            with self._lock:
                self._direct[stage] = False     # what follows queues up behind the ended sender
            self._on_broken(f"sending to pipeline stage {stage} failed: {exc}")
            return False
        return True

    def _receive(self, message: Message) -> None:
        with self._receive_lock:
            if self._ended:
                return
            if message.kind == Kind.PONG:
                self._pongs.put((message.src - 1, message.obj, message.arrived))
                return
            if message.kind == Kind.BYE:
                self._byes.add(message.src - 1)
            if message.kind == Kind.LOST and message.src - 1 not in self._byes:
                self._ended = True
                self._on_broken(f"lost the connection to pipeline stage {message.src - 1}: {message.obj}")
                return
            if message.kind == Kind.LINK_DOWN:
                self._ended = True
                self._on_broken(f"pipeline stage {message.src - 1} cannot reach stage {message.obj[0] - 1}: "
                                f"{message.obj[1]}")
                return
            self._on_message(message)
            if len(self._byes) == self.num_stages:
                self._ended = True
                self._all_bye.set()
