"""Starting stage processes: ``python -m pipeserve worker --stage S ...`` subprocesses,
for the driver's node and for ``pipeserve worker`` on another node (one code path),
forked from a zygote that has imported torch once (zygote.py) where it can be.

A stage is its own program: it imports pipeserve, never the user's script,
so a script without ``if __name__ == "__main__":`` works at PP > 1. The
cluster key reaches it through its environment, never its command line. Its
stderr passes through to ours line by line, and the last lines are kept so
that a stage which dies while starting can say why.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pipeserve.comm.auth import KEY_ENV, cluster_key
from pipeserve.comm.messages import NodeInfo
from pipeserve.comm.rendezvous import ask_driver
from pipeserve.comm.tcp import TcpTransport
from pipeserve.pipeline.spec import stages_of_node
from pipeserve.pipeline.watchdog import signal_note
from pipeserve.pipeline.zygote import stage_zygote
from pipeserve.worker.cpu_bind import SLOT_ENV

logger = logging.getLogger(__name__)

# A stage process's exit codes (stage_process.run_stage). A node worker starts a stage again that
# ended any other way (a signal: SIGKILL, the OOM killer, a segfault; a crash while serving),
# not after these: stopped, a load that failed (it would fail again: the driver has its
# traceback), a refused key, a driver gone for good.
EXIT_LOAD_FAILED, EXIT_BAD_KEY, EXIT_CRASHED, EXIT_NO_DRIVER, EXIT_LOST_DRIVER = 1, 2, 3, 4, 5
FINAL_EXITS = {0, EXIT_LOAD_FAILED, EXIT_BAD_KEY, EXIT_NO_DRIVER, EXIT_LOST_DRIVER}
# A node worker restarts its stages at most this many times within this many seconds (a stage
# that dies again as soon as it starts is a crash loop, not a failure to paper over).
NODE_RESTARTS, NODE_RESTART_WINDOW_S = 5, 600.0
NODE_POLL_S = 0.5

TAIL_LINES = 20
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])   # the directory that holds pipeserve/


class StageProcess:
    """One stage subprocess: ``pid``, ``is_alive()``, ``exitcode`` (-N: killed by signal N)."""

    def __init__(self, stage: int, popen) -> None:   # subprocess.Popen or zygote.ForkedProcess
        self.stage, self.popen, self.pid = stage, popen, popen.pid
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._pump = threading.Thread(target=self._pump_stderr, name=f"stage{stage}-stderr", daemon=True)
        self._pump.start()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)
        self._signal(signal.SIGCONT)   # a stopped process only acts on SIGTERM once continued

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def stderr_tail(self) -> str:
        """The last lines the stage wrote to stderr (waits briefly for the pipe to drain)."""
        if not self.is_alive():
            self._pump.join(timeout=1.0)
        return "".join(self._tail)

    def _signal(self, sig: int) -> None:
        if self.is_alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def _pump_stderr(self) -> None:
        for line in self.popen.stderr:
            self._tail.append(line)
            try:
                sys.stderr.write(line)
            except (ValueError, OSError):   # our stderr is closed: keep draining theirs
                pass


def stage_command(stage: int, master_addr: str, master_port: int, timeout: float,
                  rejoin_timeout: float | None) -> list[str]:
    cmd = [sys.executable, "-m", "pipeserve", "worker", "--stage", str(stage), "--master-addr", master_addr,
           "--master-port", str(master_port), "--rendezvous-timeout", str(timeout)]
    if rejoin_timeout is not None:
        cmd += ["--stage-rejoin-timeout", str(rejoin_timeout)]
    return cmd


def start_stages(stages: list[int], master_addr: str, master_port: int, key: bytes, timeout: float,
                 rejoin_timeout: float | None = None, only: list[int] | None = None) -> dict[int, StageProcess]:
    """One subprocess per stage. ``rejoin_timeout`` None: a stage exits when it loses the
    driver (the driver's own node); else it tries to rejoin for that long (other nodes).
    ``only``: start just these of ``stages`` (a node worker's restart), each in its slot."""
    # Our package first, then our import path (a runner factory may live beside the script).
    paths = [PACKAGE_ROOT] + [p for p in sys.path if p and os.path.isdir(p)]
    env = {**os.environ, KEY_ENV: key.decode(), "PIPESERVE_PARENT_PID": str(os.getpid()),
           "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    zygote = stage_zygote(env)
    procs = {}
    for slot, stage in enumerate(stages):
        if only is not None and stage not in only:
            continue
        command = stage_command(stage, master_addr, master_port, timeout, rejoin_timeout)
        env = {**env, SLOT_ENV: f"{slot}/{len(stages)}"}   # where --cpu-bind puts it (worker/cpu_bind.py)
        popen = None
        if zygote is not None:
            try:
                popen = zygote.spawn(command[3:], env, paths)
            except RuntimeError as exc:
                logger.warning("%s; starting stage %d as a new interpreter", exc, stage)
        if popen is None:
            popen = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     errors="replace")
        procs[stage] = StageProcess(stage, popen)
    return procs


def stop_processes(procs: list[StageProcess], grace: float = 5.0) -> None:
    """Wait ``grace`` seconds, then SIGTERM, then SIGKILL: no process is left behind."""
    for proc in procs:
        proc.join(timeout=grace)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2.0)


def run_node(nnodes: int, node_rank: int, master_addr: str, master_port: int, timeout: float,
             rejoin_timeout: float) -> int:
    """Run this node's stages of the pipeline whose driver listens at master_addr:master_port.

    Asks the driver how many stages there are, starts the ones that belong to
    ``node_rank`` and waits for them. Returns 0 when all stages exited cleanly,
    else the first non-zero exit code.
    """
    if not 0 < node_rank < nnodes:
        raise ValueError(f"--node-rank must be in [1, --nnodes {nnodes}): node 0 runs the driver")
    key = cluster_key(None, nnodes)
    info = ask_driver(TcpTransport(-1, 0, key), master_addr, master_port, NodeInfo(nnodes, node_rank), timeout)
    if info.nnodes != nnodes:
        raise ValueError(f"this worker says --nnodes {nnodes}, the driver runs with --nnodes {info.nnodes}")
    stages = stages_of_node(info.num_stages, nnodes, node_rank)
    logger.info("node %d runs stages %s of %d", node_rank, stages, info.num_stages)
    procs = start_stages(stages, master_addr, master_port, key, timeout, rejoin_timeout)
    stopping = threading.Event()

    def stop(*_) -> None:
        stopping.set()
        stop_processes(list(procs.values()), grace=0.0)
    previous = signal.signal(signal.SIGTERM, stop)
    codes: dict[int, int] = {}
    restarts: collections.deque[float] = collections.deque()
    try:
        while len(codes) < len(stages):
            for stage, proc in list(procs.items()):
                if stage in codes or proc.is_alive():
                    continue
                code = proc.exitcode or 0
                if stopping.is_set() or code in FINAL_EXITS:
                    codes[stage] = code
                elif _may_restart(restarts):
                    # The driver pauses its requests for --stage-rejoin-timeout: a new process
                    # for this stage joins it again, as an operator's new worker would.
                    logger.warning("stage %d (pid %d) exited with code %d%s; starting it again (restart %d "
                                   "of %d within %.0f s)", stage, proc.pid, code, signal_note(code),
                                   len(restarts), NODE_RESTARTS, NODE_RESTART_WINDOW_S)
                    procs.update(start_stages(stages, master_addr, master_port, key, timeout, rejoin_timeout,
                                              only=[stage]))
                else:
                    logger.error("stage %d exited with code %d%s and was restarted %d times within %.0f s: "
                                 "not again", stage, code, signal_note(code), NODE_RESTARTS,
                                 NODE_RESTART_WINDOW_S)
                    codes[stage] = code
            stopping.wait(NODE_POLL_S)
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_processes(list(procs.values()), grace=0.0)
    return next((codes[s] for s in stages if codes.get(s)), 0)


def _may_restart(restarts: collections.deque[float]) -> bool:
    """Count one more restart if fewer than NODE_RESTARTS began within the window (the engine's
    restart budget, ``engine.recovery.RecoveryLog.recent``, counts the same way; pipeline/ may not
    import engine/)."""
    now = time.monotonic()
    while restarts and now - restarts[0] > NODE_RESTART_WINDOW_S:
        restarts.popleft()
    if len(restarts) >= NODE_RESTARTS:
        return False
    restarts.append(now)
    return True
