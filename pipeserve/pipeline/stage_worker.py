"""One pipeline stage process: receive a micro-batch, run its layers, pass it on.

The stage makes no decisions. It handles one message at a time, in arrival
order, and hands large results to a sender thread, so their transfer overlaps
the next compute. Who handles a message: the transport's reader thread that
read it, when it is a small step (a decode's activations) and the stage is idle;
otherwise the main thread, which takes the backlog in order. Waking the main
thread would cost a thread hand-off on every hop, which one request alone pays
on every token; a large step (a prefill) goes to the main thread so that the
reader keeps reading the next one from the socket while this one computes.
Every interval the stage spends is recorded (see ``pipeserve.metrics.timeline``)
and piggybacks on the next message it sends; the last stage's results carry
them to the driver.

Decode ahead (``EngineConfig.pp_decode_ahead``): the driver may send stage 0 a
decode step before the tokens it takes in are sampled (``StepInput.tokens_from``).
The last stage sends the tokens of such a source step (``forward_tokens``) to
stage 0 as well as the result to the driver, and stage 0 runs the waiting step
as soon as they arrive, on the reader thread that read them when it is idle:
one request's token goes from the last stage to stage 0 in one hop, without
the driver. Until then that step waits, with any later first-chunk step that
shares a sequence with it; every other message is handled.

A shared LM head (``--pp-lm-head shared``, ``pipeline/lm_head.py``): for a step marked
``head_first`` the last stage sends the sampling rows' hidden states to stage 0 (a hop to chunk
``len(partition)``), whose ``HeadRunner`` samples; stage 0 then sends the result to the driver and
keeps the tokens itself for the decode ahead that waits for them.

Steps ahead of their activations: the driver sends every other stage each step (a PLAN)
when it sends stage 0 the step, and the stages pass each other only the step's id with the
activations (a HOP). A stage that is idle when a plan comes builds the step's metadata then
(as stage 0 does for a step that waits for its tokens), so neither the step's encoding and
decoding nor its metadata lie between one stage's compute and the next. A hop that comes
before its plan (they travel on different connections) waits for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections import OrderedDict, deque
from typing import Any

import torch

from pipeserve.comm.messages import Pong
from pipeserve.comm.tcp import TcpTransport
from pipeserve.comm.transport import Kind, Message, Transport
from pipeserve.metrics.timeline import Interval
from pipeserve.pipeline.spec import Hop, PipelineSpec, StepEnvelope
from pipeserve.worker.step import StepInput, StepOutput

logger = logging.getLogger(__name__)

STOPPED, LOST_DRIVER, RESET = "stopped", "lost the driver", "reset by the driver"


class IntervalLog:
    """Intervals not yet shipped to the driver (the handling and sender threads both add):
    this stage's own and those an earlier stage's step carried in.

    They ride on the steps and results that go towards the driver, but at most every
    ``SHIP_EVERY_S`` seconds: encoding and decoding four intervals a hop would add
    ~60 us to each hop of every token. The driver's FLUSH takes the rest at once."""

    SHIP_EVERY_S = 0.25

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self._pending: list[Interval] = []
        self._lock = threading.Lock()
        self._shipped = time.monotonic()

    def add(self, kind: str, start: float, end: float, step_id: int = -1, chunk: int = 0) -> None:
        if end > start:
            with self._lock:
                self._pending.append(Interval(self.stage, kind, start, end, step_id, chunk))

    def carry(self, intervals: list[Interval]) -> None:
        if intervals:
            with self._lock:
                self._pending.extend(intervals)

    def drain(self) -> list[Interval]:
        with self._lock:
            out, self._pending = self._pending, []
            self._shipped = time.monotonic()
            return out

    def due(self) -> list[Interval]:
        """What to attach to the message going out now: everything, if the last shipment is
        ``SHIP_EVERY_S`` old; else nothing."""
        if time.monotonic() - self._shipped < self.SHIP_EVERY_S:
            return []
        return self.drain()


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
        self.sending_since: float | None = None   # monotonic start of the queued transfer on the wire

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
            self.sending_since = time.monotonic()
            try:
                self._send(*item)
            finally:
                self.sending_since = None
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
        if kind in (Kind.STEP, Kind.HOP, Kind.RESULT):
            self.log.add("send", start, time.time(), step_id, chunk)

    def close(self) -> None:
        self.queue.put(None)
        self.join()


class StageWorker:
    # Decode ahead: the source steps' tokens kept for a step that has not arrived yet. A source
    # step whose follower was never scheduled (its sequence stopped, new work took the slot)
    # leaves its tokens behind: at most this many are kept, the oldest dropped first.
    MAX_KEPT_TOKENS = 64
    # Plans (the driver's steps, sent ahead of their activations) kept for hops yet to come: a few
    # a micro-batch in flight; a plan whose step failed on an earlier stage is dropped, oldest first.
    MAX_PLANS = 256
    # Stage 0's steps of up to this many tokens run on the reader thread (``_small_step``).
    DIRECT_MAX_TOKENS = 64

    def __init__(self, spec: PipelineSpec, stage: int, runners: dict[int, Any], transport: TcpTransport) -> None:
        self.spec, self.stage, self.runners = spec, stage, runners
        self.rank = stage + 1
        self.transport = transport
        self.log = IntervalLog(stage)
        self.sender = Sender(transport, self.log)
        # The messages not yet handled (chunk hand-offs to ourselves, P = 1 and V > 1, go
        # first), whether one is being handled, and since when none is.
        self._cv = threading.Condition()
        self._backlog: deque[Message] = deque()
        self._busy = False
        self._idle_since = time.time()
        self._crash: BaseException | None = None   # raised on a reader thread; re-raised by run()
        # the message being handled: since when (monotonic) and the process's CPU time then (a PONG's)
        self._handling: tuple[float, float] | None = None
        self._tokens: OrderedDict[int, dict[int, int]] = OrderedDict()  # source step id -> {seq id: token}
        self._plans: OrderedDict[int, StepInput] = OrderedDict()          # step id -> the step, for its hops
        # A CUDA stage computes on its main thread only: the current device and stream are per thread.
        self._direct = not spec.config.device.startswith("cuda")

    def run(self) -> str:
        """Serve until the driver says STOP or RESET, or its connection is lost; returns which."""
        self.sender.start()
        self.transport.set_receiver(self._arrived)
        while True:
            message = self._next_message()
            if message.kind == Kind.STOP:
                outcome = STOPPED
                break
            if message.src == 0 and message.kind in (Kind.LOST, Kind.RESET):
                outcome = LOST_DRIVER if message.kind == Kind.LOST else RESET
                break
            try:
                self._handle(message)
                self._prepare_waiting()
            finally:
                self._idle()
        # still busy: a step arriving from now on waits in the backlog, unhandled
        if outcome == STOPPED:
            self.sender.put(0, Kind.BYE, self.log.drain())
        self.sender.close()
        return outcome

    def _arrived(self, message: Message) -> None:
        """On a transport reader thread: handle a small step here if the stage is idle, else
        queue the message for the main thread."""
        if message.kind == Kind.TOKENS:
            self._tokens_arrived(*message.obj)
            return
        if message.kind == Kind.PLAN:
            self._plan_arrived(message.obj)
            return
        if message.kind == Kind.PING:
            self._answer_ping(message)
            return
        with self._cv:
            direct = (self._direct and not self._busy and not self._backlog and self._small_step(message)
                      and self._has_tokens(message) and self._has_plan(message))
            if not direct:
                self._backlog.append(message)
                self._wake_main()
                return
            self._busy = True
        self._handle_here(message)

    def _answer_ping(self, message: Message) -> None:
        """Answer the driver's PING here, on the reader thread, whatever the stage is doing: a
        step may compute for minutes (a 70B prompt chunk on an old CPU) and the driver's
        watchdog tells such a stage, at work, from a silent or frozen one by this answer. It
        goes straight to the driver's connection, not behind a large transfer to the next stage
        queued in the sender."""
        now, handling, sending = time.monotonic(), self._handling, self.sender.sending_since
        pong = Pong(message.arrived)
        if handling is not None:
            pong.computing_s = max(0.0, now - handling[0])
            pong.computing_cpu_s = max(0.0, time.process_time() - handling[1])
        if sending is not None:
            pong.sending_s = max(0.0, now - sending)
        try:
            self.transport.send(0, Kind.PONG, pong)
        except ConnectionError as exc:      # the driver's link is gone: its LOST ends this stage
            logger.info("stage %d: could not answer a ping: %s", self.stage, exc)

    @staticmethod
    def _small_step(message: Message) -> bool:
        """A step the reader thread that read it may run: a decode's (activations up to
        ``Sender.DIRECT_MAX_BYTES``; stage 0's steps carry token ids, up to ``DIRECT_MAX_TOKENS``).
        A prompt chunk goes to the main thread: the reader keeps reading, and the driver's
        connection, which brings stage 0 its steps, still brings the watchdog's pings while the
        chunk computes (for minutes, a 70B share on an old CPU)."""
        if message.kind == Kind.STEP and message.tensor is None:
            return message.obj.step.num_tokens <= StageWorker.DIRECT_MAX_TOKENS
        return message.kind in (Kind.STEP, Kind.HOP) and (message.tensor is None
                                                          or message.tensor.nbytes <= Sender.DIRECT_MAX_BYTES)

    def _has_plan(self, message: Message) -> bool:
        """False for a hop whose step (the driver's plan) has not arrived."""
        return message.kind != Kind.HOP or message.obj.step_id in self._plans

    def _plan_arrived(self, step: StepInput) -> None:
        """A step this stage will run, from the driver (on its link's reader thread). A hop that
        waited for it may run now; an idle stage with nothing to run builds its metadata."""
        with self._cv:
            self._plans[step.step_id] = step
            while len(self._plans) > self.MAX_PLANS:
                self._plans.popitem(last=False)
            if self._busy or not self._direct:
                self._wake_main()
                return
            index = self._pick()
            if index is not None and not self._small_step(self._backlog[index]):
                self._wake_main()
                return
            message = None if index is None else self._backlog[index]
            if message is not None:
                del self._backlog[index]
            self._busy = True
        if message is not None:
            self._handle_here(message)
            return
        try:
            self._prepare_waiting()
        finally:
            self._idle()

    def _has_tokens(self, message: Message) -> bool:
        """False for a first-chunk step whose input tokens (decode ahead) have not arrived."""
        if message.kind != Kind.STEP:
            return True
        step = message.obj.step
        return message.obj.chunk != 0 or step.tokens_from < 0 or step.tokens_from in self._tokens

    def _tokens_arrived(self, step_id: int, pairs: list[tuple[int, int]]) -> None:
        """Decode ahead: the tokens a step sampled, from the last stage (on its link's reader
        thread, or this stage's own at P = 1). The step waiting for them runs now: here, when
        the stage is idle and it is next."""
        with self._cv:
            self._tokens[step_id] = dict(pairs)
            while len(self._tokens) > self.MAX_KEPT_TOKENS:
                self._tokens.popitem(last=False)
            now = time.time()
            for waiting in self._backlog:     # its wait ends now, not when it arrived
                if waiting.kind == Kind.STEP and waiting.obj.chunk == 0 and waiting.obj.step.tokens_from == step_id:
                    waiting.arrived = max(waiting.arrived, now)
            index = None if self._busy or not self._direct else self._pick()
            if index is None or not self._small_step(self._backlog[index]):
                self._wake_main()
                return
            message = self._backlog[index]
            del self._backlog[index]
            self._busy = True
        self._handle_here(message)

    def _handle_here(self, message: Message) -> None:
        """Handle ``message`` on this (reader) thread; the caller has set ``_busy``."""
        try:
            self._handle(message)
            self._prepare_waiting()
        except BaseException as exc:      # the main thread's death, as if it had run the step
            with self._cv:
                self._crash = exc
                self._cv.notify()
            return
        self._idle()

    def _prepare_waiting(self) -> None:
        """Before the stage goes idle: the metadata (ModelRunner.prepare_ahead) of the steps it
        will run next: on stage 0 those that wait for their decode-ahead tokens, on the others
        the plans not built yet (whose activations may have come: then it is the forward's work,
        done first; one chunk a stage: with more, each chunk's runner builds its own). Built
        when the token or the activations arrive, it took ~0.12 ms a step, cold after the wait
        (~0.03 warm), on the path from one stage's compute to the next. A step whose metadata
        fails here is left to fail, and be reported, when it runs."""
        if not self._direct or (self.stage > 0 and len(self.runners) != 1):
            return
        with self._cv:
            if self.stage == 0:
                waiting = [m.obj.step for m in self._backlog if m.kind == Kind.STEP and m.obj.chunk == 0
                           and not self._has_tokens(m)]
            else:
                waiting = [step for step in self._plans.values() if "_prepared" not in step.__dict__]
        runner = self.runners.get(0) if self.stage == 0 else next(iter(self.runners.values()))
        prepare = getattr(runner, "prepare_ahead", None)
        for step in waiting if prepare is not None else ():
            try:
                prepare(step)
            except Exception:
                pass

    def _next_message(self) -> Message:
        with self._cv:
            while self._crash is None and (self._busy or (index := self._pick()) is None):
                self._cv.wait()
            if self._crash is not None:
                raise self._crash
            self._busy = True
            message = self._backlog[index]
            del self._backlog[index]
            return message

    def _pick(self) -> int | None:
        """Where in the backlog the next message to handle is: the oldest, except that a
        first-chunk step still waiting for its tokens stays, and so does every later
        first-chunk step that shares a sequence with one that stays (a sequence's steps run
        in submission order on every chunk; micro-batches of other sequences need not:
        decodes ahead wait for their sources' tokens, which come back in another order
        than they were sent). Other chunks and messages go on."""
        waiting: set[int] = set()      # sequences of the first-chunk steps that stay
        for index, message in enumerate(self._backlog):
            if message.kind == Kind.HOP and message.obj.step_id not in self._plans:
                continue   # its plan is on its way from the driver (every later hop's is behind it)
            if message.kind == Kind.STEP and message.obj.chunk == 0:
                seqs = {s.seq_id for s in message.obj.step.seqs}
                if not self._has_tokens(message) or (waiting and not waiting.isdisjoint(seqs)):
                    waiting |= seqs
                    continue
            return index
        return None

    def _idle(self) -> None:
        with self._cv:
            self._busy = False
            self._idle_since = time.time()
            self._wake_main()

    def _wake_main(self) -> None:
        """Under ``_cv``: wake the main thread only when it has something to handle now. While the
        stage is busy, the thread that is busy looks again when it is done (``_idle``); a step
        waiting for its decode-ahead tokens runs when they arrive. Every other wake-up of a
        one-core stage preempted its compute thread (one request at PP = 2: stage 0's main
        thread had woken ~5 times a token)."""
        if not self._busy and self._pick() is not None:
            self._cv.notify()

    def _handle(self, message: Message) -> None:
        self._handling = (time.monotonic(), time.process_time())
        try:
            self._handle_one(message)
        finally:
            self._handling = None

    def _handle_one(self, message: Message) -> None:
        self.log.add("wait", self._idle_since, message.arrived)
        if message.kind in (Kind.STEP, Kind.HOP):
            env = self._envelope(message)
            self.log.add("recv", max(message.arrived, self._idle_since), time.time(), env.step.step_id, env.chunk)
            self._run_step(env, message.tensor)
        elif message.kind == Kind.FLUSH:
            profiler = next((r.profiler for r in self.runners.values() if getattr(r, "profiler", None)), None)
            if profiler is not None:      # --profile: the figures so far, before the TIMELINE that acks
                self.sender.put(0, Kind.PROFILE, profiler.snapshot())
            self.sender.put(0, Kind.TIMELINE, self.log.drain())
        elif message.kind == Kind.PEERS:
            self._link(message.obj)
        elif message.kind == Kind.LOST:
            # a neighbour stage's link: it closes at every shutdown (that stage may take its STOP
            # first), and when a stage dies the driver sees its own link go and recovers; no warning
            logger.info("stage %d: the connection to rank %d closed (%s)", self.stage, message.src, message.obj)
        elif message.kind == Kind.HELLO:
            pass    # a neighbour stage connected
        else:
            logger.warning("stage %d ignores an unexpected %s message", self.stage, message.kind.name)

    def _envelope(self, message: Message) -> StepEnvelope:
        """The step a STEP or HOP runs. A hop's step is its plan, kept while a later chunk of it
        runs here (P = 1 hands chunks to itself in memory); so is the driver's step on stage 0."""
        later = len(self.runners) > 1 and self.spec.num_stages > 1   # hops bring it back here
        if message.kind == Kind.STEP:
            env = message.obj
            if (later and env.chunk + self.spec.num_stages < len(self.spec.partition)) or env.step.head_first:
                # its later chunks, or its head (--pp-lm-head shared), come back here
                with self._cv:
                    self._plans[env.step.step_id] = env.step
            return env
        hop: Hop = message.obj
        with self._cv:
            step = self._plans[hop.step_id]
            if not later or hop.chunk + self.spec.num_stages >= len(self.spec.partition):
                del self._plans[hop.step_id]
        return StepEnvelope(step, hop.chunk, hop.intervals)

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
            if chunk == 0 and env.step.tokens_from >= 0:
                self._fill_tokens(env.step)
            out = self.runners[chunk].execute(env.step, hidden)
            if isinstance(out, torch.Tensor) and out.is_cuda:
                torch.cuda.current_stream(out.device).synchronize()  # the sender reads it next
        except Exception:
            self.sender.put(0, Kind.ERROR, (step_id, self.stage, traceback.format_exc()))
            return
        self.log.add("compute", start, time.time(), step_id, chunk)
        self.log.carry(env.intervals)
        intervals = self.log.due()
        if isinstance(out, StepOutput):
            if env.step.forward_tokens:       # stage 0 first: its next step waits for them, the driver does not
                pairs = [(t.seq_id, t.token_id) for t in out.sampled]
                if self.stage == 0:
                    self._tokens_arrived(step_id, pairs)
                else:
                    self.sender.put(1, Kind.TOKENS, (step_id, pairs))
            self.sender.put(0, Kind.RESULT, (out, intervals), step_id=step_id, chunk=chunk)
            return
        dst = (chunk + 1) % self.spec.num_stages + 1
        if dst == self.rank:
            with self._cv:              # the next thing this stage handles
                self._backlog.appendleft(Message(self.rank, Kind.STEP, StepEnvelope(env.step, chunk + 1, intervals),
                                                 out, time.time()))
        else:
            self.sender.put(dst, Kind.HOP, Hop(step_id, chunk + 1, intervals), out, step_id, chunk)

    def _fill_tokens(self, step) -> None:
        """Decode ahead: each sequence's input token is the one step ``tokens_from`` sampled for it."""
        with self._cv:
            tokens = self._tokens.pop(step.tokens_from, None)
        if tokens is None:
            raise RuntimeError(f"step {step.step_id} runs before the tokens of step {step.tokens_from}, "
                               "which it takes in, arrived")
        for seq in step.seqs:
            if seq.seq_id not in tokens:
                raise RuntimeError(f"step {step.tokens_from} sampled no token for sequence {seq.seq_id}, "
                                   f"which step {step.step_id} takes in")
            seq.token_ids = [tokens[seq.seq_id]]
