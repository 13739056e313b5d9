"""The driver's side of the pipeline: P stage processes behind the ``Executor`` interface.

World: rank 0 is this (driver) process, stage s is rank s + 1. The driver
sends each micro-batch (a ``StepEnvelope``) to stage 0; the metadata then
travels *with* the activations stage to stage, so each stage receives exactly
one message per micro-batch and the driver sends once per step instead of P
times (a broadcast would buy nothing: stage i cannot start before stage i-1's
activations arrive anyway). The last stage sends the ``StepOutput`` back. With
V virtual stages (``interleaved``) the last worker passes a micro-batch back to
worker 0 for its next chunk, V times round.

Schedules are the engine's submission policy; this class serves all three:

- ``async``: keep ``max_inflight`` (default P) micro-batches in flight;
  after each ``wait()`` submit new ones for the finished slots.
- ``gpipe``: submit M micro-batches, then ``wait_all()`` before the next
  step. ``max_inflight`` is at least ``pp_micro_batches`` so all M fit.
- ``interleaved``: as ``async``; the partition has P·V chunks.

The runtime's parts, one job each (docs/ARCHITECTURE.md, "The pipeline runtime"):
``world.StageWorld`` launches and connects one generation of stages,
``links.Links`` carries messages to and from it, ``watchdog.Watchdog`` notices
a dead or silent stage, ``timelines.StageTimelines`` keeps what the stages did.
This class owns the steps in flight and the generations: after a failure
``wait()`` raises ``ExecutorError`` and ``healthy`` is False until
``recover()`` has replaced the generation (the engine then replays the lost
steps) or ``shutdown()`` kills what is left.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

from pipeserve.comm.transport import Kind, Message
from pipeserve.config import EngineConfig
from pipeserve.metrics.timeline import step_shape
from pipeserve.model.config import ModelConfig
from pipeserve.pipeline.links import Links
from pipeserve.pipeline.lm_head import resolve_lm_head
from pipeserve.pipeline.spec import PipelineSpec, StepEnvelope, validate_partition
from pipeserve.pipeline.timelines import StageTimelines
from pipeserve.pipeline.watchdog import Watchdog, dead_stage_message
from pipeserve.pipeline.world import StageWorld
from pipeserve.worker.executor import Executor, ExecutorError
from pipeserve.worker.step import StepInput, StepOutput

logger = logging.getLogger(__name__)


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
        if config.pp_lm_head == "shared":     # the engine resolves auto; a caller may ask for shared
            resolve_lm_head(config, model_cfg, runner_factory)
        self.config = config
        self.num_stages = config.pipeline_parallel_size
        self.max_inflight = default_max_inflight(config)
        # Stage 0 takes a step's ``tokens_from`` tokens from the last stage (async schedule only).
        self.decodes_ahead = config.pp_decode_ahead and config.pp_schedule == "async"
        self.spec = PipelineSpec(config, source, model_cfg, list(partition), num_blocks, num_host_blocks,
                                 runner_factory)
        self.timelines = StageTimelines(self.num_stages, self.spec.virtual_stages, config.pp_schedule)
        self.generation = 0                         # bumped by every recover()
        self._inflight: dict[int, float] = {}      # step id -> submit time
        self._done: queue.Queue[StepOutput | None] = queue.Queue()   # None: a failure's wake-up
        self._flushed: queue.Queue[int] = queue.Queue()
        self._profiles: dict[int, Any] = {}         # stage -> its latest StageProfile (--profile)
        self._failure: str | None = None
        self._failed_step: int | None = None   # the step a stage's runner raised on, if that was the failure
        self._closed = False
        self._last_progress = time.monotonic()
        self._lock = threading.Lock()
        self.world: StageWorld | None = None
        self._start(config.rendezvous_timeout)

    @property
    def timeline(self):
        return self.timelines.timeline

    @property
    def clock_offsets(self) -> list[float]:
        return self.timelines.clock_offsets

    @property
    def procs(self) -> dict[int, Any]:
        """``{stage: process}`` of the local stages of the current generation."""
        return self.world.procs if self.world is not None else {}

    @property
    def stage_pids(self) -> dict[int, int]:
        """``{stage: pid}`` of the stage processes this host runs (the current generation)."""
        return self.world.pids if self.world is not None else {}

    # -- generations -----------------------------------------------------------
    def _start(self, join_timeout: float) -> None:
        """Launch, connect and watch a new generation of stages."""
        gen = self.generation
        self.world = StageWorld.open(self.config, self.spec, join_timeout)
        self.links = Links(self.world.transport, self.num_stages, partial(self._on_message, gen),
                           partial(self._on_broken, gen))
        self.watchdog = Watchdog(self.num_stages, self.world.procs, self.config.stage_timeout,
                                 self._stalled_for, self.links.ping, partial(self._fail, gen))
        try:
            self._sync_clocks()
        except BaseException:
            self._end_generation(kill=True)
            raise
        logger.info("pipeline of %d stages ready (generation %d, partition %s, max %d in flight)",
                    self.num_stages, gen, self.spec.partition, self.max_inflight)

    def _sync_clocks(self) -> None:
        remote = [s for s in range(self.num_stages) if not self.world.local(s)]
        if not remote:
            return
        answers = self.links.ping(remote, self.config.rendezvous_timeout)
        if len(answers) < len(remote):
            raise ExecutorError("pipeline stages did not answer the start-up ping")
        for stage, answer in answers.items():
            self.timelines.set_clock_offset(stage, answer.sent, answer.pong.stage_time, answer.arrived)

    def _end_generation(self, kill: bool, remote: Kind = Kind.STOP) -> None:
        """Stop watching and talking to the current generation; with ``kill``, end its
        local stages now and send ``remote`` (STOP: exit; RESET: join again) to the
        remote ones (best effort: a dead one also rejoins once its host restarts it)."""
        if self.world is None:
            return
        self.watchdog.stop()
        others = [s for s in range(self.num_stages) if not self.world.local(s)]
        self.links.close(stop_stages=others if kill else [], kind=remote)
        self.links.join(timeout=0.5)     # let a STOP / RESET leave first
        if kill:
            self.world.stop(grace=0.0)

    def recover(self) -> None:
        """Replace the failed generation with a new one: every local stage is killed and
        relaunched (remote stages get ``--stage-rejoin-timeout`` to rejoin) and loads its
        layers again. Steps in flight are lost; the engine replays their sequences. The
        stages' KV caches start empty. Raises ``ExecutorError`` if the new one fails too."""
        if self._closed:
            raise ExecutorError("the pipeline executor is shut down")
        with self._lock:
            self.generation += 1      # from here on, the old generation's threads are ignored
            self._inflight.clear()
        self._end_generation(kill=True, remote=Kind.RESET)   # remote stages join the next generation
        self.world = None
        while not self._done.empty():
            self._done.get_nowait()
        self._failure = self._failed_step = None
        join = self.config.rendezvous_timeout if self.config.nnodes == 1 else self.config.stage_rejoin_timeout
        self.spec = dataclasses.replace(self.spec, replacement=True)
        try:
            self._start(join)
        except BaseException as exc:
            self._failure = f"restarting the pipeline failed: {exc}"
            raise ExecutorError(self._failure) from exc

    # -- the Executor interface ---------------------------------------------
    def submit(self, step: StepInput) -> None:
        self._raise_if_failed()
        if self._closed:
            raise ExecutorError("the pipeline executor is shut down")
        # With decode ahead each slot may carry one beside it.
        ahead = self.decodes_ahead
        if len(self._inflight) >= (2 if ahead else 1) * self.max_inflight:
            raise RuntimeError(f"{len(self._inflight)} steps are in flight already (max_inflight "
                               f"{self.max_inflight}{', and a decode ahead beside each' if ahead else ''}); "
                               "wait() for one before submitting")
        now = time.time()
        with self._lock:
            if not self._inflight:
                self._last_progress = time.monotonic()
            self._inflight[step.step_id] = now
        # what the step carries, for the trace's compute slices (a pass over its sequences: only
        # when a trace is written)
        self.timelines.step_submitted(step.step_id, now, step_shape(step) if self.config.trace_file else None)
        self.links.send(0, Kind.STEP, StepEnvelope(step, 0))
        # the other stages get it now, ahead of its activations (stage_worker.py: plans and hops)
        for stage in range(1, self.spec.num_stages):
            self.links.send(stage, Kind.PLAN, step)

    def wait(self, timeout: float | None = None) -> list[StepOutput]:
        deadline = None if timeout is None else time.monotonic() + timeout
        results: list[StepOutput] = []
        while True:
            self._raise_if_failed()
            if self._idle():
                return results
            # Block until a result or a failure (``_fail`` queues a None to wake us):
            # no polling, which cost the driver a wake-up per 50 ms on the stages' cores.
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                results.append(self._done.get(timeout=left))
                while True:
                    results.append(self._done.get_nowait())
            except queue.Empty:
                pass
            results = [r for r in results if r is not None]
            if results or (deadline is not None and time.monotonic() >= deadline):
                return results

    def wait_all(self, timeout: float | None = None) -> list[StepOutput]:
        """GPipe: every submitted step's output (in completion order)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        results: list[StepOutput] = []
        while not self._idle():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if left == 0.0:
                break
            results.extend(self.wait(left))
        return results

    def _idle(self) -> bool:
        """Nothing in flight and nothing done (under the lock a result moves under)."""
        with self._lock:
            return not self._inflight and self._done.empty()

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    @property
    def healthy(self) -> bool:
        return self._failure is None and not self._closed

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise ExecutorError(self._failure, self._failed_step)

    def _fail(self, gen: int, message: str, step_id: int | None = None) -> None:
        """``step_id``: the step a stage's runner raised on (None: a death, a stall, a link)."""
        with self._lock:
            if gen == self.generation and self._failure is None and not self._closed:
                self._failure = message
                self._failed_step = step_id
                logger.error("pipeline failed: %s", message)
                self._done.put(None)     # wakes wait()

    def _stalled_for(self) -> tuple[int, float]:
        with self._lock:
            return len(self._inflight), time.monotonic() - self._last_progress

    # -- messages from the stages -------------------------------------------------
    def _on_broken(self, gen: int, message: str) -> None:
        # A killed stage resets its sockets as it exits: name the dead process when
        # there is one, not just the broken connection.
        if gen == self.generation and self.world is not None:
            message = dead_stage_message(self.world.procs, grace_s=1.0) or message
        self._fail(gen, message)

    def _on_message(self, gen: int, message: Message) -> None:
        if gen != self.generation:
            return                    # a late message of a replaced generation
        kind, obj = message.kind, message.obj
        if kind == Kind.RESULT:
            output, intervals = obj
            self.timelines.add_intervals(intervals)
            self.timelines.step_finished(output.step_id, message.arrived)
            # One move under the lock: wait() (which looks under it) never sees "nothing in
            # flight, nothing done" between the two, and whoever gets the output from _done
            # already sees a free slot (submit would refuse a full pipeline otherwise).
            with self._lock:
                self._inflight.pop(output.step_id, None)
                self._last_progress = time.monotonic()
                self._done.put(output)
        elif kind == Kind.PROFILE:
            self._profiles[message.src - 1] = obj
        elif kind in (Kind.TIMELINE, Kind.BYE):
            self.timelines.add_intervals(obj)
            if kind == Kind.TIMELINE:
                self._flushed.put(message.src - 1)
        elif kind == Kind.ERROR:
            step_id, where, trace = obj
            self._fail(gen, f"pipeline stage {where} raised while running step {step_id}:\n{trace}", step_id)

    # -- figures ---------------------------------------------------------------
    def flush_timeline(self, timeout: float = 2.0) -> None:
        """Ask every stage for its not-yet-shipped intervals (cheap; call when idle)."""
        if not self.healthy:
            return
        for stage in range(self.num_stages):
            self.links.send(stage, Kind.FLUSH)
        deadline = time.monotonic() + timeout
        for _ in range(self.num_stages):
            try:
                self._flushed.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return

    def stats(self, last_seconds: float | None = None) -> dict:
        """The stage timelines' figures (``StageTimelines.stats``), health, the generation
        (how many times the stages were replaced) and the local stages' pids."""
        if not self._inflight:
            self.flush_timeline()
        return {**self.timelines.stats(last_seconds), "healthy": self.healthy,
                "generation": self.generation, "stage_pids": self.stage_pids}

    def profiles(self) -> list:
        """Each stage's cumulative ``StageProfile`` (``--profile``; [] without it), fresh
        when nothing is in flight (the stages send them with their timelines)."""
        if not self._inflight:
            self.flush_timeline()
        return [self._profiles[s] for s in sorted(self._profiles)]

    def weight_bytes(self) -> list[int]:
        """Each stage's resident weight bytes, as it reported when it had loaded."""
        return [self.world.weight_bytes.get(rank, 0) if self.world is not None else 0
                for rank in range(1, self.num_stages + 1)]

    def write_trace(self, path: str | Path) -> tuple[Path, Path]:
        """Chrome trace JSON at ``path`` and a Gantt PNG beside it (same name, .png)."""
        return self.timelines.write_trace(path)

    # -- shutdown --------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        clean = self._failure is None and self.world is not None
        if clean:
            self.flush_timeline()
        self._closed = True
        if clean:
            self.watchdog.stop()
            self.links.close(stop_stages=list(range(self.num_stages)))
            self.links.wait_byes(timeout=5.0)      # their last intervals, before the sockets close
            self.world.stop(grace=5.0)
        self._end_generation(kill=True)
        if self.config.trace_file and self.timelines.has_steps():
            self.write_trace(self.config.trace_file)

    def __del__(self) -> None:
        try:
            if self.world is not None:
                self._closed = True
                self._end_generation(kill=True)
        except Exception:
            pass
