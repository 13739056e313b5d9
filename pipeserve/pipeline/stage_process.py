"""A stage process's life: join the driver, load the layers, serve, and (on another
node) rejoin after losing the driver.

    join: connect + handshake, HELLO -> SPEC, load the runners, READY
    serve: ``StageWorker.run`` until STOP (exit 0), RESET or the driver's connection closes
    then: a stage of the driver's own node exits (the driver restarts it if it wants);
          a stage of another node drops its layers and joins again, retrying for up to
          ``--stage-rejoin-timeout`` seconds, so a restarted or recovering driver finds it.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any

import torch

from pipeserve.comm.auth import AuthError
from pipeserve.comm.messages import Hello, Loading
from pipeserve.comm.rendezvous import join_driver, local_address_for
from pipeserve.comm.tcp import TcpTransport
from pipeserve.comm.transport import Kind
from pipeserve.pipeline.launcher import (EXIT_BAD_KEY, EXIT_CRASHED, EXIT_LOAD_FAILED, EXIT_LOST_DRIVER,
                                         EXIT_NO_DRIVER)
from pipeserve.pipeline.spec import PipelineSpec, node_of_stage, stages_of_node
from pipeserve.pipeline.stage_worker import STOPPED, StageWorker
from pipeserve.worker import thread_governor
from pipeserve.worker.cpu_bind import bind_stage

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_RANKS = 1 << 16     # before the spec arrives, any rank may say HELLO (checked against P after)


# glibc's malloc maps every buffer above its mmap threshold afresh and unmaps it when freed; the
# threshold adapts, but not past 32 MiB, so a step's larger buffers (the head's float32 logits:
# 192 rows x 49152 are 37.7 MB) fault every page in again each step (~10 ms for 37.7 MB in this VM).
# Once a stage has loaded, buffers up to STEP_MMAP_THRESHOLD come from its heap, and up to
# STEP_TRIM_THRESHOLD of free heap is kept for the next step instead of being returned.
STEP_MMAP_THRESHOLD = 256 << 20
STEP_TRIM_THRESHOLD = 512 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3     # mallopt's parameters (malloc.h)


def keep_step_buffers() -> bool:
    """Give the free heap back to the system (``malloc_trim``: what loading left, which after a
    rejoin includes buffers the raised thresholds kept), then raise glibc's mmap and trim
    thresholds (see above); False where the C library is not glibc or refuses. Called after
    each load."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):      # musl and others: their own allocators
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    malloc_trim(0)
    return bool(mallopt(_M_MMAP_THRESHOLD, STEP_MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, STEP_TRIM_THRESHOLD))


def stage_device(spec: PipelineSpec, stage: int, tp_rank: int = 0) -> torch.device:
    """cuda: stage i's TP rank r on GPU i * T + r of its node (stages numbered within the
    node); else the CPU."""
    if spec.config.device != "cuda":
        return torch.device(spec.config.device)
    node = node_of_stage(spec.num_stages, spec.config.nnodes, stage)
    local = stages_of_node(spec.num_stages, spec.config.nnodes, node).index(stage)
    return torch.device("cuda", local * spec.config.tensor_parallel_size + tp_rank)


def build_runners(spec: PipelineSpec, stage: int, device: torch.device, tp_group=None) -> dict[int, Any]:
    """The stage's runners (one per chunk); with --tensor-parallel-size T > 1, the shards of
    ``tp_group``'s rank (a ``TensorParallelGroup``: ``pipeline/tensor_group.py``)."""
    factory = spec.runner_factory
    extra = {} if tp_group is None else {"tp": tp_group}
    if factory is None:
        from pipeserve.worker.model_runner import ModelRunner
        factory = ModelRunner
        extra["replacement"] = spec.replacement
    last = len(spec.partition) - 1
    dtype = DTYPES[spec.config.torch_dtype_name]
    runners = {}
    head = spec.config.pp_lm_head == "shared" and stage == 0     # pipeline/lm_head.py
    if head:
        extra["head"] = True
    for chunk in spec.chunks_of(stage):
        start, end = spec.partition[chunk]
        runners[chunk] = factory(spec.source, spec.model_cfg, start_layer=start, end_layer=end,
                                 is_first=chunk == 0, is_last=chunk == last, dtype=dtype, device=device,
                                 num_blocks=spec.num_blocks, num_host_blocks=spec.num_host_blocks,
                                 block_size=spec.config.block_size,
                                 attention_backend=spec.config.attention_backend,
                                 quantization=spec.config.quantization,
                                 quantization_group_size=spec.config.quantization_group_size,
                                 kv_cache_dtype=spec.config.kv_cache_dtype,
                                 prepack_weights=spec.config.prepack_weights, **extra)
    if head:
        from pipeserve.pipeline.lm_head import HeadRunner
        runners[len(spec.partition)] = HeadRunner(runners[0])
    if spec.config.profile:
        from pipeserve.worker.profiler import StageProfiler
        profiler = StageProfiler(stage)           # one per stage: its chunks add up
        for runner in runners.values():
            if hasattr(runner, "model"):           # a ModelRunner (not a synthetic stand-in)
                profiler.instrument(runner)
                runner.profiler = profiler
        if head:
            profiler.instrument_head(runners[len(spec.partition)])
    return runners


def run_stage(stage: int, master_addr: str, master_port: int, key: bytes, join_timeout: float,
              rejoin_timeout: float | None) -> int:
    """Serve as stage ``stage`` until the driver says STOP; returns the exit code.

    ``rejoin_timeout`` None: exit when the driver's connection is lost."""
    _exit_with_parent()
    rank, timeout = stage + 1, join_timeout
    while True:
        transport = TcpTransport(rank, MAX_RANKS, key)
        leader = None
        try:
            spec, runners, leader = _join(transport, stage, master_addr, master_port, timeout, key)
        except AuthError as exc:
            logger.error("stage %d: %s", stage, exc)
            return EXIT_BAD_KEY
        except ConnectionError as exc:
            logger.error("stage %d: %s", stage, exc)
            return EXIT_NO_DRIVER
        except Exception:
            _report_failure(transport, traceback.format_exc())
            return EXIT_LOAD_FAILED
        gc.freeze()   # the weights and caches live as long as the stage: keep them out of GC scans
        try:
            outcome = StageWorker(spec, stage, runners, transport).run()
        except Exception:        # a bug: its own exit code, which a node worker restarts
            logger.error("stage %d crashed:\n%s", stage, traceback.format_exc())
            return EXIT_CRASHED
        transport.close()
        if leader is not None:
            leader.stop()
        if outcome == STOPPED:
            return 0
        if rejoin_timeout is None:
            logger.error("stage %d: %s; exiting (the driver starts this node's stages)", stage, outcome)
            return EXIT_LOST_DRIVER
        logger.warning("stage %d: %s; joining again for up to %g s (--stage-rejoin-timeout)", stage, outcome,
                       rejoin_timeout)
        del runners, spec, leader
        gc.unfreeze()
        gc.collect()
        timeout = rejoin_timeout


def _join(transport: TcpTransport, stage: int, addr: str, port: int, timeout: float, key: bytes):
    host = local_address_for(addr)
    listen_port = transport.listen(host, 0)
    spec = join_driver(transport, addr, port, Hello(stage + 1, os.getpid(), host, listen_port),
                       timeout).to_spec()
    transport.world_size = spec.num_stages + 1
    transport.device = stage_device(spec, stage)
    with LoadingHeartbeat(transport, min(LoadingHeartbeat.EVERY_S, spec.config.rendezvous_timeout / 4)):
        runners, leader = _load(spec, stage, timeout, key)
    # READY carries the stage's resident weight bytes (LLM.stats()["weight_bytes"]; TP rank 0's).
    transport.send(0, Kind.READY, sum(getattr(r, "weight_bytes", 0) for r in runners.values()))
    return spec, runners, leader


def _load(spec: PipelineSpec, stage: int, timeout: float, key: bytes):
    bind_stage(spec.config.cpu_bind, spec.config.stage_threads * spec.config.tensor_parallel_size)
    thread_governor.start(spec.config.stage_threads, spec.config.adaptive_threads)
    device = stage_device(spec, stage)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    leader = None
    if spec.config.tensor_parallel_size > 1:   # start this stage's other TP ranks (tensor_group.py)
        from pipeserve.pipeline.tensor_group import TensorGroupLeader
        leader = TensorGroupLeader(spec, stage, key, timeout)
    runners = build_runners(spec, stage, device, None if leader is None else leader.group)
    if device.type == "cpu":
        keep_step_buffers()
    if leader is not None:
        leader.ready()
        runners = leader.wrap(runners)
    return runners, leader


class LoadingHeartbeat:
    """While the stage loads (a 70B share can take minutes off a slow disk), tell the driver every
    ``every_s`` seconds how far it has come (``Loading``): the driver's load timeout counts from
    the last heartbeat that showed CPU time or bytes read, not from the start."""

    EVERY_S = 5.0

    def __init__(self, transport: TcpTransport, every_s: float) -> None:
        self.transport, self.every_s = transport, every_s
        self._done = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._beat, name="stage-loading", daemon=True)

    def __enter__(self) -> LoadingHeartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()     # READY (or FAILED) goes after the last heartbeat

    def _beat(self) -> None:
        while not self._done.wait(self.every_s):
            beat = Loading(time.monotonic() - self._start, time.process_time(), bytes_read())
            try:
                self.transport.send(0, Kind.LOADING, beat)
            except ConnectionError:
                return                # the driver is gone: the join fails on its own


def bytes_read() -> int:
    """The bytes this process has had read from storage so far (``read_bytes`` of /proc/self/io:
    its reads and the pages of an mmapped file it faulted in that were not cached; not
    ``rchar``, which reading this file moves), 0 where the kernel does not say."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0


def _report_failure(transport: TcpTransport, trace: str) -> None:
    logger.error("%s", trace)
    try:
        transport.send(0, Kind.FAILED, trace)
    except ConnectionError:
        pass
    transport.close()


def _exit_with_parent() -> None:
    """A stage started by a driver or worker node ends when that process is gone
    (even if it was SIGKILLed and could not stop us)."""
    parent = os.environ.get("PIPESERVE_PARENT_PID")
    if not parent or not parent.isdigit():
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(0.5)
        logger.error("the parent process %s is gone; exiting", parent)
        os._exit(EXIT_LOST_DRIVER)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
