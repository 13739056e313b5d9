"""Starting stage processes: the local ones for the driver's node, and the
``pipeserve worker`` side that starts the stages of another node."""

from __future__ import annotations

import logging
import os
import pickle
import signal

import torch.multiprocessing as mp

from pipeserve.comm.rendezvous import client_store
from pipeserve.pipeline.spec import SPEC_KEY, PipelineSpec, stages_of_node
from pipeserve.pipeline.stage_worker import stage_main

logger = logging.getLogger(__name__)


def spawn_stages(stages: list[int], master_addr: str, master_port: int, timeout: float) -> list:
    """One spawned process per stage (spawn: no forked torch or thread state)."""
    ctx = mp.get_context("spawn")
    procs = []
    for stage in stages:
        proc = ctx.Process(target=stage_main, args=(stage + 1, master_addr, master_port, timeout),
                           name=f"pipeserve-stage-{stage}", daemon=True)
        proc.start()
        procs.append(proc)
    return procs


def stop_processes(procs: list, grace: float = 5.0) -> None:
    """Join, then SIGTERM, then SIGKILL: no process is left behind."""
    for proc in procs:
        proc.join(timeout=grace)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            _continue(proc.pid)  # a stopped process only acts on SIGTERM once continued
            proc.join(timeout=2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2.0)


def _continue(pid: int | None) -> None:
    try:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def run_node(nnodes: int, node_rank: int, master_addr: str, master_port: int, timeout: float) -> int:
    """Run this node's stages of the pipeline whose driver listens at master_addr:master_port.

    Reads the pipeline spec from the driver's store, spawns the stages that
    belong to ``node_rank`` and waits for them. Returns 0 when all stages
    exited cleanly, else the first non-zero exit code.
    """
    if node_rank < 1:
        raise ValueError("node 0 runs the driver; start worker nodes with --node-rank 1 .. nnodes-1")
    store = client_store(master_addr, master_port, timeout)
    spec: PipelineSpec = pickle.loads(store.get(SPEC_KEY))
    if spec.config.nnodes != nnodes:
        raise ValueError(f"this worker says --nnodes {nnodes}, the driver runs with --nnodes "
                         f"{spec.config.nnodes}")
    stages = stages_of_node(spec.num_stages, nnodes, node_rank)
    logger.info("node %d runs stages %s of %d", node_rank, stages, spec.num_stages)
    procs = spawn_stages(stages, master_addr, master_port, timeout)
    previous = signal.signal(signal.SIGTERM, lambda *_: stop_processes(procs, grace=0.0))
    try:
        for proc in procs:
            proc.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_processes(procs, grace=0.0)
    codes = [proc.exitcode or 0 for proc in procs]
    return next((c for c in codes if c != 0), 0)
