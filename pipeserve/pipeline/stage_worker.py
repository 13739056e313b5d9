"""One pipeline stage process: receive a micro-batch, run its layers, pass it on.

The stage makes no decisions. Its main thread receives (any source), computes
and hands the result to a sender thread, then immediately receives the next
micro-batch: sends overlap the next compute. Every interval it spends is
recorded (see ``pipeserve.metrics.timeline``) and piggybacks on the next
message it sends; the last stage's results carry them to the driver.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import queue
import sys
import threading
import time
import traceback
from collections import deque
from typing import Any

import torch

from pipeserve.comm.rendezvous import client_store, local_address_for
from pipeserve.comm.transport import Kind, Message, TorchTransport, Transport
from pipeserve.metrics.timeline import Interval
from pipeserve.pipeline.spec import (SPEC_KEY, PipelineSpec, StepEnvelope, failed_key, joined_key,
                                     node_of_stage, ready_key, stages_of_node)
from pipeserve.worker.step import StepOutput

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SEND_FAILED_EXIT = 3


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
    """Sends queued messages in order; a failed send means the pipeline is broken: exit."""

    def __init__(self, transport: Transport, log: IntervalLog) -> None:
        super().__init__(name="stage-sender", daemon=True)
        self.transport, self.log = transport, log
        self.queue: queue.Queue = queue.Queue()

    def put(self, dst: int, kind: Kind, obj: Any = None, tensor: torch.Tensor | None = None,
            step_id: int = -1, chunk: int = 0) -> None:
        self.queue.put((dst, kind, obj, tensor, step_id, chunk))

    def run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            dst, kind, obj, tensor, step_id, chunk = item
            start = time.time()
            try:
                self.transport.send(dst, kind, obj, tensor)
            except Exception as exc:  # the peer is gone: nothing useful is left to do
                logger.error("stage %d: send to rank %d failed: %s", self.log.stage, dst, exc)
                os._exit(SEND_FAILED_EXIT)
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

    def run(self) -> None:
        self.sender.start()
        while True:
            message = self._next_message()
            if message.kind == Kind.STOP:
                break
            self._handle(message)
        self.sender.put(0, Kind.BYE, self.log.drain())
        self.sender.close()

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
            self.sender.put(0, Kind.TIMELINE, self.log.drain())
        else:
            logger.warning("stage %d ignores an unexpected %s message", self.stage, message.kind.name)

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


# -- process entry -----------------------------------------------------------
def stage_device(spec: PipelineSpec, stage: int) -> torch.device:
    """cuda: stage i on GPU i of its node (numbered within the node); else the CPU."""
    if spec.config.device != "cuda":
        return torch.device(spec.config.device)
    node = node_of_stage(spec.num_stages, spec.config.nnodes, stage)
    return torch.device("cuda", stages_of_node(spec.num_stages, spec.config.nnodes, node).index(stage))


def build_runners(spec: PipelineSpec, stage: int, device: torch.device) -> dict[int, Any]:
    factory = spec.runner_factory
    if factory is None:
        from pipeserve.worker.model_runner import ModelRunner
        factory = ModelRunner
    last = len(spec.partition) - 1
    dtype = DTYPES[spec.config.torch_dtype_name]
    runners = {}
    for chunk in spec.chunks_of(stage):
        start, end = spec.partition[chunk]
        runners[chunk] = factory(spec.source, spec.model_cfg, start_layer=start, end_layer=end,
                                 is_first=chunk == 0, is_last=chunk == last, dtype=dtype, device=device,
                                 num_blocks=spec.num_blocks, num_host_blocks=spec.num_host_blocks,
                                 block_size=spec.config.block_size,
                                 attention_backend=spec.config.attention_backend,
                                 quantization=spec.config.quantization,
                                 quantization_group_size=spec.config.quantization_group_size)
    return runners


def stage_main(rank: int, master_addr: str, master_port: int, timeout: float) -> None:
    """Entry point of a stage process (spawned locally or by a worker node)."""
    logging.basicConfig(level=logging.INFO, format=f"[stage {rank - 1}] %(levelname)s %(message)s")
    store = client_store(master_addr, master_port, timeout)
    store.set(joined_key(rank), str(os.getpid()))
    try:
        spec: PipelineSpec = pickle.loads(store.get(SPEC_KEY))
        stage = rank - 1
        torch.set_num_threads(spec.config.stage_threads)
        device = stage_device(spec, stage)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        runners = build_runners(spec, stage, device)
    except Exception:
        store.set(failed_key(rank), traceback.format_exc())
        raise
    # The ready value is the stage's resident weight bytes (LLM.stats()["weight_bytes"]).
    store.set(ready_key(rank), str(sum(getattr(r, "weight_bytes", 0) for r in runners.values())))
    gc.freeze()  # the weights and caches live as long as the stage: keep them out of GC scans
    transport = TorchTransport(store, rank, spec.num_stages + 1, local_address_for(master_addr), device)
    StageWorker(spec, stage, runners, transport).run()
    # Every message has left (the sender joined). Skip interpreter teardown:
    # destroying gloo's threads there can abort the process after a clean run.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
