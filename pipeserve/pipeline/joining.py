"""The driver's side of joining: listen, start the local stages, meet every stage, link them.

Protocol (every frame after the HMAC handshake, ``comm/auth.py``):

    stage  -> driver  HELLO {rank, pid, host, port}   (where it listens for its neighbours)
    driver -> stage   SPEC                            (model, partition, config; no secrets)
    stage  -> driver  READY | FAILED (traceback)
    driver -> stages  PEERS [{rank, host, port}]      (once all are ready; again after a replacement)

A ``pipeserve worker`` node first asks NODE (how many stages?) on a short
connection, then starts its stages, which join as above.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pipeserve.comm.auth import cluster_key
from pipeserve.comm.messages import Hello, Loading, NodeInfo, Peer
from pipeserve.comm.tcp import TcpTransport
from pipeserve.comm.transport import Kind
from pipeserve.config import EngineConfig
from pipeserve.pipeline.launcher import StageProcess, start_stages, stop_processes
from pipeserve.pipeline.spec import PipelineSpec, SpecWire, stages_of_node
from pipeserve.pipeline.watchdog import FROZEN_CPU_SHARE
from pipeserve.worker.executor import ExecutorError

logger = logging.getLogger(__name__)

POLL_S = 0.05


def open_stages(config: EngineConfig, spec: PipelineSpec,
                join_timeout: float) -> tuple[TcpTransport, dict[int, StageProcess], int, dict[int, int]]:
    """Listen, start node 0's stages, wait until all P stages joined and loaded, send PEERS.

    Returns (the driver's transport, stage -> local process, the port it listens on,
    rank -> the stage's resident weight bytes).
    Remote stages get ``join_timeout`` seconds to join; loading gets --rendezvous-timeout.
    """
    num_stages, single = config.pipeline_parallel_size, config.nnodes == 1
    key = cluster_key(config.cluster_key, config.nnodes)
    addr = "127.0.0.1" if single else config.master_addr
    transport = TcpTransport(0, num_stages + 1, key, node_info=NodeInfo(config.nnodes, 0, num_stages))
    procs: dict[int, StageProcess] = {}
    weight_bytes: dict[int, int] = {}
    try:
        port = transport.listen(addr, 0 if single else config.master_port)
        procs = start_stages(stages_of_node(num_stages, config.nnodes, 0), addr, port, key,
                             config.rendezvous_timeout)
        hint = (f"on each other node run `PIPESERVE_CLUSTER_KEY=... pipeserve worker --nnodes {config.nnodes} "
                f"--node-rank R --master-addr {config.master_addr} --master-port {port}`")
        hellos = join_stages(transport, SpecWire.of(spec), list(range(1, num_stages + 1)), join_timeout,
                             config.rendezvous_timeout, lambda: check_local_stages(procs), hint, weight_bytes,
                             local={stage + 1 for stage in procs})
        send_peers(transport, hellos)
    except BaseException:
        stop_processes(list(procs.values()), grace=0.0)
        transport.close()
        raise
    return transport, procs, port, weight_bytes


def join_stages(transport: TcpTransport, spec: SpecWire, ranks: list[int], join_timeout: float,
                load_timeout: float, check: Callable[[], None], hint: str = "",
                weight_bytes: dict[int, int] | None = None, local: set[int] = frozenset()) -> dict[int, Hello]:
    """Answer each rank's HELLO with the spec; wait for all READY. ``check`` runs every
    poll and may raise (a local stage process died), ending the wait at once.
    ``weight_bytes`` (if given) gets each rank's resident weight bytes from its READY.
    ``local``: ranks this host started; ``check`` watches them, so a slow start (importing
    torch on a busy machine) gets the loading timeout, and a missing remote host is named
    alone when the join timeout ends."""
    hellos: dict[int, Hello] = {}
    ready: set[int] = set()
    progress = LoadProgress()
    start = time.monotonic()
    deadline = start + join_timeout
    while len(ready) < len(ranks):
        check()
        now = time.monotonic()
        if now > deadline:
            remote_missing = [r for r in ranks if r not in hellos and r not in local]
            if remote_missing or now > start + max(join_timeout, load_timeout):
                _timed_out(remote_missing or ranks, hellos, ready, join_timeout, load_timeout, hint)
        try:
            message = transport.recv(timeout=POLL_S)
        except TimeoutError:
            continue
        rank = message.src
        if rank not in ranks:
            continue
        if message.kind == Kind.HELLO:
            hellos[rank] = message.obj
            ready.discard(rank)
            transport.send(rank, Kind.SPEC, spec)
        elif message.kind == Kind.READY and rank in hellos:
            ready.add(rank)
            if weight_bytes is not None:
                weight_bytes[rank] = message.obj
            if len(hellos) == len(ranks):   # everyone is in: loading gets its own timeout
                deadline = max(deadline, time.monotonic() + load_timeout)
        elif message.kind == Kind.LOADING and rank in hellos:
            if progress.moved(rank, message.obj):   # still coming off the disk: its timeout starts again
                deadline = max(deadline, time.monotonic() + load_timeout)
        elif message.kind == Kind.FAILED:
            raise ExecutorError(f"pipeline stage {rank - 1} failed to start:\n{message.obj}")
        elif message.kind == Kind.LOST:
            hellos.pop(rank, None)
            ready.discard(rank)
        if len(hellos) == len(ranks) and message.kind == Kind.HELLO:
            deadline = max(deadline, time.monotonic() + load_timeout)
    return hellos


class LoadProgress:
    """The stages' loading heartbeats (``Loading``): whether each moved since the last (bytes read,
    or CPU time at the share below which the watchdog calls a step frozen), and a log line now
    and then for a long load."""

    LOG_EVERY_S = 30.0

    def __init__(self) -> None:
        self._last: dict[int, Loading] = {}
        self._logged: dict[int, float] = {}

    def moved(self, rank: int, beat: Loading) -> bool:
        last = self._last.get(rank)
        self._last[rank] = beat
        moved = (last is None or beat.read_bytes > last.read_bytes
                 or beat.cpu_s - last.cpu_s >= FROZEN_CPU_SHARE * (beat.elapsed_s - last.elapsed_s))
        if beat.elapsed_s - self._logged.get(rank, 0.0) >= self.LOG_EVERY_S:
            self._logged[rank] = beat.elapsed_s
            logger.info("pipeline stage %d still loading: %.0f s, %.0f s of CPU, %.2f GB read%s", rank - 1,
                        beat.elapsed_s, beat.cpu_s, beat.read_bytes / 1e9, "" if moved else " (no progress)")
        return moved


def send_peers(transport: TcpTransport, hellos: dict[int, Hello]) -> None:
    peers = [Peer(rank, h.host, h.port) for rank, h in sorted(hellos.items())]
    for rank in hellos:
        transport.send(rank, Kind.PEERS, peers)


def check_local_stages(procs: dict[int, StageProcess]) -> None:
    for stage, proc in procs.items():
        if not proc.is_alive():
            tail = proc.stderr_tail().strip()
            raise ExecutorError(f"pipeline stage {stage} (pid {proc.pid}) exited with code {proc.exitcode} while "
                                f"starting" + (f"; the last lines of its stderr:\n{tail}" if tail else ""))


def _timed_out(ranks: list[int], hellos: dict, ready: set, join_timeout: float, load_timeout: float,
               hint: str) -> None:
    missing = [r - 1 for r in ranks if r not in hellos]
    if missing:
        raise ExecutorError(f"pipeline stage(s) {missing} did not join within {join_timeout:g} s "
                            f"(--rendezvous-timeout, or --stage-rejoin-timeout after a failure); {hint}")
    loading = [r - 1 for r in ranks if r not in ready]
    raise ExecutorError(f"pipeline stage(s) {loading} did not finish loading and showed no progress (CPU time "
                        f"or bytes read) for {load_timeout:g} s (--rendezvous-timeout)")
