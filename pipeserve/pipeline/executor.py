"""The driver's side of the pipeline: P stage processes behind the ``Executor`` interface.

World: rank 0 is this (driver) process, stage s is rank s + 1. The driver
sends each micro-batch (a pickled ``StepEnvelope``) to stage 0; the metadata
then travels *with* the activations stage to stage, so each stage receives
exactly one message per micro-batch and the driver sends once per step
instead of P times (a broadcast would buy nothing: stage i cannot start
before stage i-1's activations arrive anyway). The last stage sends the
``StepOutput`` back. With V virtual stages (``interleaved``) the last worker
passes a micro-batch back to worker 0 for its next chunk, V times round.

Schedules are the engine's submission policy; this class serves all three:

- ``async``: keep ``max_inflight`` (default P) micro-batches in flight;
  after each ``wait()`` submit new ones for the finished slots.
- ``gpipe``: submit M micro-batches, then ``wait_all()`` before the next
  step. ``max_inflight`` is at least ``pp_micro_batches`` so all M fit.
- ``interleaved``: as ``async``; the partition has P·V chunks.

Liveness: a watchdog thread checks every stage process and a per-result
deadline (``stage_timeout``) while work is in flight; after a failure
``wait()`` raises ``ExecutorError``, ``healthy`` is False, and
``shutdown()`` kills what is left.
"""

from __future__ import annotations

import logging
import pickle
import queue
import threading
import time
from pathlib import Path
from typing import Any

from pipeserve.comm.rendezvous import local_address_for, master_store, wait_for_keys
from pipeserve.comm.transport import Kind, TorchTransport
from pipeserve.config import EngineConfig
from pipeserve.metrics.timeline import Interval, Timeline, write_chrome_trace, write_gantt_png
from pipeserve.model.config import ModelConfig
from pipeserve.pipeline.launcher import spawn_stages, stop_processes
from pipeserve.pipeline.spec import (SPEC_KEY, PipelineSpec, StepEnvelope, failed_key, joined_key,
                                     ready_key, stages_of_node, validate_partition)
from pipeserve.worker.executor import Executor, ExecutorError
from pipeserve.worker.step import StepInput, StepOutput

logger = logging.getLogger(__name__)

POLL_S = 0.05


def default_max_inflight(config: EngineConfig) -> int:
    if config.pp_max_inflight:
        return config.pp_max_inflight
    p = config.pipeline_parallel_size
    if config.pp_schedule == "gpipe":
        return max(p, config.pp_micro_batches or p)
    return p


class PipelineExecutor(Executor):
    def __init__(self, config: EngineConfig, source: Any, model_cfg: ModelConfig,
                 partition: list[tuple[int, int]], num_blocks: int, num_host_blocks: int,
                 runner_factory=None) -> None:
        validate_partition(partition, model_cfg.num_layers, config.pipeline_parallel_size)
        self.config = config
        self.num_stages = config.pipeline_parallel_size
        self.max_inflight = default_max_inflight(config)
        self.spec = PipelineSpec(config, source, model_cfg, list(partition), num_blocks, num_host_blocks,
                                 runner_factory)
        self.timeline = Timeline(self.num_stages)
        self.clock_offsets = [0.0] * self.num_stages
        self._inflight: dict[int, float] = {}      # step id -> submit time
        self._done: queue.Queue[StepOutput] = queue.Queue()
        self._failure: str | None = None
        self._closed = False
        self._last_progress = time.monotonic()
        self._pongs: queue.Queue[tuple[int, float, float]] = queue.Queue()
        self._flushed: queue.Queue[int] = queue.Queue()
        self._byes: set[int] = set()
        self._lock = threading.Lock()
        self.procs: dict[int, Any] = {}
        try:
            self._start()
        except BaseException:
            self._kill_all()
            raise

    # -- start-up ------------------------------------------------------------
    def _start(self) -> None:
        cfg = self.config
        single = cfg.nnodes == 1
        addr = "127.0.0.1" if single else cfg.master_addr
        self.store = master_store(addr, 0 if single else cfg.master_port, self.num_stages + 1,
                                  cfg.rendezvous_timeout)
        self.port = self.store.port
        self.store.set(SPEC_KEY, pickle.dumps(self.spec))
        local = stages_of_node(self.num_stages, cfg.nnodes, 0)
        for stage, proc in zip(local, spawn_stages(local, addr, self.port, cfg.rendezvous_timeout)):
            self.procs[stage] = proc
        self._rendezvous()
        self.transport = TorchTransport(self.store, 0, self.num_stages + 1, local_address_for(addr))
        # One sender per stage: a stage that stops reading blocks only its own queue,
        # so the others still answer the pings that name the silent one.
        self._sendqs: dict[int, queue.Queue] = {rank: queue.Queue() for rank in range(1, self.num_stages + 1)}
        senders = [threading.Thread(target=self._send_loop, args=(q,), name=f"pp-send-{r}", daemon=True)
                   for r, q in self._sendqs.items()]
        self._receiver = threading.Thread(target=self._recv_loop, name="pp-driver-recv", daemon=True)
        self._threads = senders + [self._receiver,
                                   threading.Thread(target=self._watch_loop, name="pp-watchdog", daemon=True)]
        for t in self._threads:
            t.start()
        self._sync_clocks()
        logger.info("pipeline of %d stages ready (partition %s, max %d in flight)", self.num_stages,
                    self.spec.partition, self.max_inflight)

    def _rendezvous(self) -> None:
        cfg = self.config
        ranks = range(1, self.num_stages + 1)
        missing = wait_for_keys(self.store, [joined_key(r) for r in ranks], cfg.rendezvous_timeout,
                                self._check_startup)
        if missing:
            stages = sorted(int(k.rsplit("/", 1)[1]) - 1 for k in missing)
            raise ExecutorError(
                f"pipeline stage(s) {stages} did not join within --rendezvous-timeout "
                f"{cfg.rendezvous_timeout:g} s; on each other node run `pipeserve worker --nnodes {cfg.nnodes} "
                f"--node-rank R --master-addr {cfg.master_addr} --master-port {self.port}`")
        # Loading weights may take a while; it gets its own rendezvous-timeout.
        missing = wait_for_keys(self.store, [ready_key(r) for r in ranks], cfg.rendezvous_timeout,
                                self._check_startup)
        if missing:
            raise ExecutorError(f"pipeline stages did not finish loading within {cfg.rendezvous_timeout:g} s: "
                                f"{missing}")
        self.stage_weight_bytes = [int(self.store.get(ready_key(r))) for r in ranks]

    def _check_startup(self) -> None:
        for rank in range(1, self.num_stages + 1):
            if self.store.check([failed_key(rank)]):
                trace = self.store.get(failed_key(rank)).decode()
                raise ExecutorError(f"pipeline stage {rank - 1} failed to start:\n{trace}")
        for stage, proc in self.procs.items():
            if not proc.is_alive():
                raise ExecutorError(f"pipeline stage {stage} (pid {proc.pid}) exited with code "
                                    f"{proc.exitcode} while starting")

    def _sync_clocks(self) -> None:
        """Clock offset of each remote stage: its time at receipt minus the driver's
        round-trip midpoint. Stages on this host share its clock: offset 0 (a
        measured one would only add the round trip's noise)."""
        remote = [s for s in range(self.num_stages) if s not in self.procs]
        if not remote:
            return
        sent = time.time()
        for stage in remote:
            self._send(stage + 1, Kind.PING, None)
        for _ in remote:
            try:
                stage, stage_time, received = self._pongs.get(timeout=self.config.rendezvous_timeout)
            except queue.Empty:
                raise ExecutorError("pipeline stages did not answer the start-up ping") from None
            self.clock_offsets[stage] = stage_time - (sent + received) / 2

    # -- the Executor interface ---------------------------------------------
    def submit(self, step: StepInput) -> None:
        self._raise_if_failed()
        if self._closed:
            raise ExecutorError("the pipeline executor is shut down")
        if len(self._inflight) >= self.max_inflight:
            raise RuntimeError(f"{len(self._inflight)} steps are in flight already (max_inflight "
                               f"{self.max_inflight}); wait() for one before submitting")
        now = time.time()
        with self._lock:
            if not self._inflight:
                self._last_progress = time.monotonic()
            self._inflight[step.step_id] = now
        self.timeline.step_submitted(step.step_id, now)
        self._send(1, Kind.STEP, StepEnvelope(step, 0))

    def wait(self, timeout: float | None = None) -> list[StepOutput]:
        deadline = None if timeout is None else time.monotonic() + timeout
        results: list[StepOutput] = []
        while True:
            self._raise_if_failed()
            if not self._inflight and self._done.empty():
                return results
            try:
                results.append(self._done.get(timeout=POLL_S))
                while True:
                    results.append(self._done.get_nowait())
            except queue.Empty:
                pass
            if results or (deadline is not None and time.monotonic() >= deadline):
                return results

    def wait_all(self, timeout: float | None = None) -> list[StepOutput]:
        """GPipe: every submitted step's output (in completion order)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        results: list[StepOutput] = []
        while self._inflight or not self._done.empty():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if left == 0.0:
                break
            results.extend(self.wait(left))
        return results

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    @property
    def healthy(self) -> bool:
        return self._failure is None and not self._closed

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise ExecutorError(self._failure)

    def _fail(self, message: str) -> None:
        with self._lock:
            if self._failure is None and not self._closed:
                self._failure = message
                logger.error("pipeline failed: %s", message)

    # -- driver threads --------------------------------------------------------
    def _send(self, rank: int, kind: Kind, obj: Any = None) -> None:
        self._sendqs[rank].put((rank, kind, obj, None))

    def _send_loop(self, sendq: queue.Queue) -> None:
        while True:
            item = sendq.get()
            if item is None:
                return
            dst, kind, obj, tensor = item
            try:
                self.transport.send(dst, kind, obj, tensor)
            except Exception as exc:
                self._fail(f"sending to pipeline stage {dst - 1} failed: {exc}")
                return

    def _recv_loop(self) -> None:
        while len(self._byes) < self.num_stages:
            try:
                message = self.transport.recv()
            except Exception as exc:
                # A killed stage resets its sockets as it exits: name the dead
                # process when there is one, not just the broken connection.
                self._fail(self._dead_stage_message() or f"lost the connection to the pipeline stages: {exc}")
                return
            self._on_message(message.src - 1, message.kind, message.obj, message.arrived)

    def _on_message(self, stage: int, kind: Kind, obj: Any, arrived: float) -> None:
        if kind == Kind.RESULT:
            output, intervals = obj
            self._add_intervals(intervals)
            self.timeline.step_finished(output.step_id, arrived)
            # Queue the output before it stops counting as in flight: wait() must
            # never see "nothing in flight, nothing done" while it is between the two.
            self._done.put(output)
            with self._lock:
                self._inflight.pop(output.step_id, None)
                self._last_progress = time.monotonic()
        elif kind == Kind.PONG:
            self._pongs.put((stage, obj, arrived))
        elif kind in (Kind.TIMELINE, Kind.BYE):
            self._add_intervals(obj)
            if kind == Kind.BYE:
                self._byes.add(stage)
            else:
                self._flushed.put(stage)
        elif kind == Kind.ERROR:
            step_id, where, trace = obj
            self._fail(f"pipeline stage {where} raised while running step {step_id}:\n{trace}")

    def _add_intervals(self, intervals: list[Interval]) -> None:
        # Stage clocks -> driver clock.
        self.timeline.add_intervals([
            Interval(iv.stage, iv.kind, iv.start - self.clock_offsets[iv.stage],
                     iv.end - self.clock_offsets[iv.stage], iv.step_id, iv.chunk) for iv in intervals])

    def _dead_stage_message(self, grace_s: float = 1.0) -> str | None:
        """Which local stage process died, waiting up to ``grace_s`` for its exit to show."""
        deadline = time.monotonic() + grace_s
        while True:
            for stage, proc in self.procs.items():
                if not proc.is_alive():
                    return (f"pipeline stage {stage} (pid {proc.pid}) died with exit code {proc.exitcode}"
                            f"{_signal_note(proc.exitcode)}")
            if time.monotonic() >= deadline or self._closed:
                return None
            time.sleep(POLL_S)

    def _watch_loop(self) -> None:
        while not self._closed and self._failure is None:
            time.sleep(POLL_S)
            message = self._dead_stage_message(grace_s=0.0)
            if message is not None and not self._closed:
                self._fail(message)
                return
            with self._lock:
                silent = bool(self._inflight) and \
                    time.monotonic() - self._last_progress > self.config.stage_timeout
            if silent:
                self._fail(self._silence_message())
                return

    def _silence_message(self) -> str:
        """Which stages are silent: ping everyone, name those that do not answer."""
        self._pongs = queue.Queue()
        for stage in range(self.num_stages):
            self._send(stage + 1, Kind.PING, None)
        answered: set[int] = set()
        deadline = time.monotonic() + min(2.0, self.config.stage_timeout)
        while len(answered) < self.num_stages and time.monotonic() < deadline:
            try:
                answered.add(self._pongs.get(timeout=POLL_S)[0])
            except queue.Empty:
                pass
        silent = [s for s in range(self.num_stages) if s not in answered]
        who = f"stage(s) {silent} did not answer" if silent else "all stages answer pings but no result came"
        return (f"pipeline stalled: no result for {self.config.stage_timeout:g} s (--stage-timeout) with "
                f"{len(self._inflight)} step(s) in flight; {who}")

    # -- figures ---------------------------------------------------------------
    def flush_timeline(self, timeout: float = 2.0) -> None:
        """Ask every stage for its not-yet-shipped intervals (cheap; call when idle)."""
        if not self.healthy:
            return
        for stage in range(self.num_stages):
            self._send(stage + 1, Kind.FLUSH, None)
        deadline = time.monotonic() + timeout
        for _ in range(self.num_stages):
            try:
                self._flushed.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return

    def stats(self, last_seconds: float | None = None) -> dict:
        """Per-stage busy fraction, bubble ratio, compute/send/recv/wait seconds and step
        counts (see metrics.timeline), over the window from the first submit to the last
        result, or over its last ``last_seconds``; plus their means over stages."""
        if not self._inflight:
            self.flush_timeline()
        window = self.timeline.window()
        if window and last_seconds:
            window = (max(window[0], window[1] - last_seconds), window[1])
        stages = self.timeline.stats(window)
        return {"num_stages": self.num_stages, "virtual_stages": self.spec.virtual_stages,
                "window_s": (window[1] - window[0]) if window else 0.0,
                "steps_completed": len(self.timeline.step_spans()),
                "busy_fraction": _mean([s.busy_fraction for s in stages]),
                "bubble_ratio": _mean([s.bubble_ratio for s in stages]),
                "stages": [s.as_dict() for s in stages], "clock_offsets_s": list(self.clock_offsets),
                "healthy": self.healthy}

    def weight_bytes(self) -> list[int]:
        return list(self.stage_weight_bytes)

    def write_trace(self, path: str | Path) -> tuple[Path, Path]:
        """Chrome trace JSON at ``path`` and a Gantt PNG beside it (same name, .png)."""
        path = Path(path)
        intervals = self.timeline.intervals()
        write_chrome_trace(path, intervals, self.timeline.step_spans())
        png = path.with_suffix(".png")
        write_gantt_png(png, intervals, self.num_stages,
                        title=f"{self.num_stages} stages, {self.config.pp_schedule} schedule")
        return path, png

    # -- shutdown --------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        clean = self._failure is None and hasattr(self, "transport")
        if clean:
            self.flush_timeline()
        self._closed = True
        if clean:
            for stage in range(self.num_stages):
                self._send(stage + 1, Kind.STOP, None)
            stop_processes(list(self.procs.values()), grace=5.0)
            self._receiver.join(timeout=2.0)
        self._kill_all(stop_remote=not clean)
        for thread in getattr(self, "_threads", []):
            thread.join(timeout=0.5)  # threads left in gloo at interpreter exit may abort it
        if self.config.trace_file and self.timeline.step_spans():
            self.write_trace(self.config.trace_file)

    def _kill_all(self, stop_remote: bool = True) -> None:
        self._closed = True
        stop_processes(list(self.procs.values()), grace=0.0)
        for rank, sendq in getattr(self, "_sendqs", {}).items():
            if stop_remote and rank - 1 not in self.procs:
                sendq.put((rank, Kind.STOP, None, None))  # best effort: remote stages we cannot kill
            sendq.put(None)

    def __del__(self) -> None:
        try:
            self._kill_all()
        except Exception:
            pass


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _signal_note(code: int | None) -> str:
    if code is not None and code < 0:
        import signal
        return f" (killed by {signal.Signals(-code).name})"
    return ""
