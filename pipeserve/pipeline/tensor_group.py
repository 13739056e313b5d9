"""A pipeline stage as a group of T tensor-parallel ranks (``--tensor-parallel-size T``).

World layout, stage-major: stage s's TP rank r is global rank ``s * T + r``.
TP rank 0 is the stage process the driver knows (it joins, talks to the
driver and its neighbour stages over ``comm/``, exactly as at T = 1). It starts
its T - 1 *followers* itself, as children on its own host
(``python -m pipeserve worker --stage S --tp-rank R --tp-store-port Q``), so a
remote node's stages bring their followers with them and nothing else in the
runtime changes:

    leader:   TCPStore(127.0.0.1, port 0) -> start followers -> put the spec (+ HMAC)
              -> gloo process group of T ranks -> load its shards -> barrier -> READY
    follower: read + verify the spec -> gloo group -> load its shards -> barrier
              -> loop: receive a step by broadcast, run it (its collectives with the others)

Each micro-batch reaches the leader once (the driver and the previous stage
send to rank 0 only); the leader broadcasts the step (its JSON wire form) and
the incoming activations to the followers, then every rank runs the step's
layers, whose all-reduces keep the activations replicated. So only rank 0
sends activations on and only rank 0 of the last stage samples (the full
logits are gathered there). This costs one broadcast of [tokens, hidden] per
stage per micro-batch, the same size as one all-reduce of a layer.

Failures: a follower that exits (killed, or failing to load) makes its leader
exit with ``EXIT_TP_RANK_DIED`` after logging which rank died; to the driver
that is a dead stage, recovered like any other (``PipelineExecutor.recover``).
A follower exits when its leader is gone (parent watch) or says STOP.

Trust: the spec (which names modules to import) is authenticated with the
cluster key (HMAC) before a follower uses it; the store and the gloo group
listen on 127.0.0.1 only: one host's processes, as in torch.distributed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch

logger = logging.getLogger(__name__)

EXIT_TP_RANK_DIED = 6
_STEP, _STOP = 1, 2
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_HEADER = 6   # kind, chunk, payload bytes, hidden rows (-1: none), hidden cols, dtype index


def _spec_mac(key: bytes, text: bytes) -> str:
    return hmac.new(key, b"pipeserve-tp-spec\0" + text, hashlib.sha256).hexdigest()


def _backend(device: torch.device) -> str:
    """gloo on CPU; on CUDA NCCL for CUDA tensors (the activations' collectives) beside
    gloo for CPU ones (the step headers and payloads): one group, dispatched by device."""
    if device.type != "cuda":
        return "gloo"
    import torch.distributed as dist
    if not dist.is_nccl_available():
        raise RuntimeError("--device cuda with --tensor-parallel-size > 1 needs a PyTorch build with NCCL "
                           "(torch.distributed.is_nccl_available() is False)")
    return "cpu:gloo,cuda:nccl"


def _init_group(store, rank: int, size: int, timeout_s: float, device: torch.device):
    import torch.distributed as dist
    dist.init_process_group(_backend(device), store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))


def _rank_device(spec, stage: int, rank: int) -> torch.device:
    """Where TP rank ``rank`` of ``stage`` computes: the CPU, or its own GPU (``stage_device``),
    made the current one before NCCL starts (NCCL uses the current device)."""
    from pipeserve.pipeline.stage_process import stage_device
    device = stage_device(spec, stage, rank)
    if device.type == "cuda":
        if device.index >= torch.cuda.device_count():
            raise RuntimeError(f"stage {stage} tensor-parallel rank {rank} needs GPU {device.index}, but this "
                               f"node has {torch.cuda.device_count()} (each stage's T ranks take T GPUs)")
        torch.cuda.set_device(device)
    return device


def _group_for(spec, stage: int, rank: int, shm_path: str | None = None, create: bool = False):
    """This rank's ``TensorParallelGroup``; with ``shm_path`` its all-reduces go through
    shared memory (``--tp-all-reduce shm``, CPU only), sized for the largest step's activations."""
    from pipeserve.model.tensor_parallel import SharedMemoryAllReduce, TensorParallelGroup, plan_shard
    from pipeserve.model.loader import split_alignment
    size = spec.config.tensor_parallel_size
    align = split_alignment(spec.source, spec.model_cfg, spec.config.quantization,
                            spec.config.quantization_group_size)   # the driver's split (llm_engine)
    group = TensorParallelGroup(plan_shard(spec.model_cfg, rank, size, align), device=_rank_device(spec, stage, rank))
    if shm_path is not None:
        from pipeserve.pipeline.stage_process import DTYPES
        elems = min(spec.config.max_num_batched_tokens * spec.model_cfg.hidden_size, 1 << 24)
        group.shm = SharedMemoryAllReduce(shm_path, rank, size, elems, DTYPES[spec.config.torch_dtype_name],
                                          create, spec.config.stage_timeout)
    return group


def _shm_path(stage: int) -> str:
    import tempfile
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(directory, f"pipeserve-tp-{os.getpid()}-{stage}")


class TensorGroupLeader:
    """TP rank 0's side: the followers' processes, the group, the step broadcasts."""

    def __init__(self, spec, stage: int, key: bytes, timeout_s: float) -> None:
        import torch.distributed as dist

        from pipeserve.pipeline.launcher import PACKAGE_ROOT
        from pipeserve.pipeline.spec import SpecWire
        from pipeserve.worker.step_wire import dumps
        self.stage, self.size = stage, spec.config.tensor_parallel_size
        self._closing = False
        store = dist.TCPStore("127.0.0.1", 0, self.size, True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        text = dumps(SpecWire.of(spec)).encode()
        on_cpu = spec.config.device == "cpu"   # on CUDA the activations' collectives are NCCL's
        self.shm_path = _shm_path(stage) if spec.config.tp_all_reduce == "shm" and on_cpu else None
        store.set("shm", self.shm_path or "")
        self.group = _group_for(spec, stage, 0, self.shm_path, create=True)
        store.set("spec", text)
        store.set("spec_mac", _spec_mac(key, text))
        paths = [PACKAGE_ROOT] + [p for p in sys.path if p and os.path.isdir(p)]
        env = {**os.environ, "PIPESERVE_PARENT_PID": str(os.getpid()),
               "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
        self.followers = {
            rank: subprocess.Popen([sys.executable, "-m", "pipeserve", "worker", "--stage", str(stage),
                                    "--tp-rank", str(rank), "--tp-store-port", str(store.port),
                                    "--master-addr", "127.0.0.1", "--rendezvous-timeout", str(timeout_s)],
                                   env=env, stdin=subprocess.DEVNULL)
            for rank in range(1, self.size)}
        threading.Thread(target=self._watch, name="tp-followers", daemon=True).start()
        _init_group(store, 0, self.size, timeout_s, self.group.device)
        if self.shm_path:   # every follower mapped it before joining the group: the name can go
            os.unlink(self.shm_path)
        self.store = store
        self.steps, self.step_seconds, self.broadcast_seconds = 0, 0.0, 0.0

    @property
    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self.followers.items()}

    def ready(self) -> None:
        """Every rank has loaded its shards (a follower that failed has exited: see _watch)."""
        import torch.distributed as dist
        dist.barrier()

    def wrap(self, runners: dict[int, Any]) -> dict[int, Any]:
        return {chunk: LeaderRunner(runner, chunk, self) for chunk, runner in runners.items()}

    def send_step(self, chunk: int, step, hidden: torch.Tensor | None) -> None:
        from pipeserve.worker.step_wire import dumps
        start = time.perf_counter()
        payload = dumps(step).encode()
        rows, cols, dtype = -1, 0, 0
        if hidden is not None:
            rows, cols, dtype = hidden.shape[0], hidden.shape[1], _DTYPES.index(hidden.dtype)
        self.group.broadcast(torch.tensor([_STEP, chunk, len(payload), rows, cols, dtype], dtype=torch.int64))
        self.group.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        if hidden is not None:   # on CUDA from this rank's GPU (NCCL), as the followers receive it
            self.group.broadcast(hidden.to(self.group.device).contiguous())
        self.broadcast_seconds += time.perf_counter() - start

    def stats(self) -> dict:
        """Where TP rank 0's step time went: every step (broadcast + its layers), the all-reduces
        inside (their time includes waiting for the slowest rank), the step broadcasts."""
        return {"stage": self.stage, "tp": self.size, "steps": self.steps,
                "step_s": round(self.step_seconds, 4), "all_reduce_s": round(self.group.reduce_seconds, 4),
                "all_reduces": self.group.reduce_calls, "broadcast_s": round(self.broadcast_seconds, 4)}

    def stop(self) -> None:
        """Tell the followers to exit and wait for them (they also exit when we do)."""
        logger.info("tp-stats %s", json.dumps(self.stats()))
        self._closing = True
        try:
            self.group.broadcast(torch.tensor([_STOP, 0, 0, -1, 0, 0], dtype=torch.int64))
        except Exception as exc:   # a follower already gone
            logger.warning("stage %d: stopping the tensor-parallel ranks: %s", self.stage, exc)
        for proc in self.followers.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()

    def dead_followers(self, wait_s: float = 0.0) -> str:
        """'tensor-parallel rank R (pid P) exited with code C' for each follower gone, waiting
        up to ``wait_s`` for a dying one's exit to show; '' when all live."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.poll()}"
                    for rank, proc in self.followers.items() if proc.poll() is not None]
            if dead or time.monotonic() >= deadline:
                return "; ".join(dead)
            time.sleep(0.05)

    def _watch(self) -> None:
        while not self._closing:
            for rank, proc in self.followers.items():
                code = proc.poll()
                if code is not None and not self._closing:
                    logger.error("stage %d: tensor-parallel rank %d (pid %d) exited with code %s; the stage "
                                 "cannot compute without it and exits (code %d)", self.stage, rank, proc.pid,
                                 code, EXIT_TP_RANK_DIED)
                    logging.shutdown()
                    os._exit(EXIT_TP_RANK_DIED)
            time.sleep(0.1)


class LeaderRunner:
    """A runner of TP rank 0: broadcasts each step to the followers, then runs its own share."""

    def __init__(self, runner, chunk: int, leader: TensorGroupLeader) -> None:
        self.runner, self.chunk, self.leader = runner, chunk, leader
        self.weight_bytes = getattr(runner, "weight_bytes", 0)
        self.profiler = getattr(runner, "profiler", None)   # --profile: rank 0's figures stand for the stage

    def execute(self, step, hidden_states: torch.Tensor | None = None):
        start = time.perf_counter()
        try:
            self.leader.send_step(self.chunk, step, hidden_states)
            out = self.runner.execute(step, hidden_states)
            self.leader.steps += 1
            self.leader.step_seconds += time.perf_counter() - start
            return out
        except RuntimeError as exc:   # a collective failed: name the rank that is gone, if one is
            dead = self.leader.dead_followers(wait_s=1.0)
            if dead:
                raise RuntimeError(f"stage {self.leader.stage}: {dead}; the step cannot complete "
                                   f"({str(exc).splitlines()[0][:200]})") from None
            raise

    def __getattr__(self, name: str):
        return getattr(self.runner, name)


def _die_with_parent() -> None:
    """Linux: the kernel SIGKILLs us when the leader dies, even if we are stopped (SIGSTOP)
    and our parent-watch thread cannot run; elsewhere the watch thread alone."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_follower(stage: int, tp_rank: int, store_port: int, key: bytes, timeout_s: float) -> int:
    """A follower's life (``pipeserve worker --stage S --tp-rank R``); returns the exit code."""
    import torch.distributed as dist

    from pipeserve.pipeline.spec import SpecWire
    from pipeserve.pipeline.stage_process import _exit_with_parent, build_runners
    from pipeserve.worker import thread_governor
    from pipeserve.worker.step import StepInput
    from pipeserve.worker.step_wire import from_wire
    _exit_with_parent()
    _die_with_parent()
    store = dist.TCPStore("127.0.0.1", store_port, None, False, timeout=timedelta(seconds=timeout_s))
    text = store.get("spec")
    if not hmac.compare_digest(store.get("spec_mac").decode(), _spec_mac(key, text)):
        logger.error("stage %d tp rank %d: the pipeline spec is not signed with the cluster key", stage, tp_rank)
        return 2
    spec = from_wire(SpecWire, json.loads(text), "spec").to_spec()
    size = spec.config.tensor_parallel_size
    thread_governor.start(spec.config.stage_threads, spec.config.adaptive_threads)
    try:
        group = _group_for(spec, stage, tp_rank, store.get("shm").decode() or None)   # map it before joining
    except Exception:
        logger.error("stage %d tp rank %d cannot start:\n%s", stage, tp_rank, traceback.format_exc())
        return 1
    _init_group(store, tp_rank, size, timeout_s, group.device)
    try:
        runners = build_runners(spec, stage, group.device, group)
    except Exception:
        logger.error("stage %d tp rank %d failed to load:\n%s", stage, tp_rank, traceback.format_exc())
        return 1
    dist.barrier()
    while True:
        try:
            header = group.broadcast(torch.empty(_HEADER, dtype=torch.int64)).tolist()
        except RuntimeError:
            logger.error("stage %d tp rank %d: lost the stage's TP rank 0; exiting", stage, tp_rank)
            return 1
        kind, chunk, nbytes, rows, cols, dtype = header
        if kind == _STOP:
            return 0
        payload = group.broadcast(torch.empty(nbytes, dtype=torch.uint8))
        step = from_wire(StepInput, json.loads(payload.numpy().tobytes()), "tensor-parallel step")
        hidden = None
        if rows >= 0:
            hidden = group.broadcast(torch.empty(rows, cols, dtype=_DTYPES[dtype], device=group.device))
        try:
            runners[chunk].execute(step, hidden)
        except Exception:
            logger.error("stage %d tp rank %d: step %d failed:\n%s", stage, tp_rank, step.step_id,
                         traceback.format_exc())
            return 1
