"""The stage zygote: a process that imports torch and the stage's modules once, then forks
each local stage from that state instead of starting a new interpreter.

A stage started with ``python -m pipeserve worker --stage S`` spends about 2 s of CPU
importing torch and pipeserve before it does anything of its own, every time: every engine
start, every restart of a stage that died. The zygote pays that once per driver process.
The driver asks it over a Unix socket (``SOCK_SEQPACKET``: one message, one request) for a
stage with that command line, environment, working directory and import path, passing the
write end of a pipe that becomes the stage's stderr; the zygote forks, answers with the pid,
and reports the exit code when the stage ends (a pidfd per child in one ``select`` loop: the
zygote never runs a thread, so a fork finds no lock held). The forked child becomes the
stage at the zygote's top level, as ``python -m pipeserve worker ...`` would have been:
same program, same arguments, the environment it was given.

The stage watches its parent (stage_process._exit_with_parent): here the zygote, which exits
as soon as the driver's end of the socket closes, so a driver killed by SIGKILL still takes
its stages with it. Import-time settings (``OMP_*``, ``TORCH_*``, ...) are fixed when the
zygote imports torch, so a stage whose environment differs from the zygote's in anything
but the per-stage variables starts the old way (``launcher.start_stages``), as does every
stage when ``PIPESERVE_STAGE_ZYGOTE=0`` or the platform has no pidfd. Other nodes' workers
(``pipeserve worker --nnodes``) use the same launcher, so their stages fork as well.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading

from pipeserve.comm.auth import KEY_ENV

logger = logging.getLogger(__name__)

ENABLE_ENV = "PIPESERVE_STAGE_ZYGOTE"
# Set per stage by the launcher; any other difference from the zygote's environment means
# "start a fresh interpreter". The zygote itself never holds the first two (its PYTHONPATH
# finds the package).
PARENT_ENV = "PIPESERVE_PARENT_PID"   # read by stage_process._exit_with_parent
PER_STAGE_ENV = (KEY_ENV, PARENT_ENV, "PYTHONPATH")
PRELOAD = ("torch", "pipeserve.pipeline.cli", "pipeserve.pipeline.stage_process",
           "pipeserve.pipeline.stage_worker", "pipeserve.worker.model_runner")
MAX_MESSAGE = 1 << 20
READY_TIMEOUT_S = 300.0     # the zygote's own imports, on a machine busy loading a model


class ForkedProcess:
    """A stage forked by the zygote, with what StageProcess uses of ``subprocess.Popen``:
    ``pid``, ``stderr`` (text lines), ``poll()``, ``wait(timeout)``."""

    def __init__(self, pid: int, stderr_fd: int, zygote: StageZygote, args: list[str]) -> None:
        self.pid, self.args, self._zygote = pid, args, zygote
        self.stderr = os.fdopen(stderr_fd, "r", errors="replace")

    def poll(self) -> int | None:
        return self._zygote.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        code = self._zygote.exit_code(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code


class StageZygote:
    """The driver's handle on its zygote process (one per driver process, made on first use),
    started with the stages' environment ``env`` less the cluster key and parent pid."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env_key = _env_key(env)
        env = {k: v for k, v in env.items() if k not in (KEY_ENV, PARENT_ENV)}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeserve.pipeline.zygote", str(theirs.fileno())],
                                     env=env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        theirs.close()
        self._lock = threading.Lock()          # one request at a time
        self._cond = threading.Condition()
        self._ready = False
        self._closed = False
        self._replies: list[dict] = []
        self._codes: dict[int, int] = {}
        self._spawned: set[int] = set()
        threading.Thread(target=self._read, name="stage-zygote", daemon=True).start()

    def spawn(self, argv: list[str], env: dict[str, str], path: list[str]) -> ForkedProcess:
        """Fork one stage running ``python -m pipeserve <argv>``; RuntimeError if the zygote is gone."""
        read_fd, write_fd = os.pipe()
        request = json.dumps({"argv": argv, "env": {**env, PARENT_ENV: str(self.proc.pid)},
                              "cwd": os.getcwd(), "path": path}).encode()
        try:
            with self._lock:
                with self._cond:
                    if not self._cond.wait_for(lambda: self._ready or self._closed, READY_TIMEOUT_S) or self._closed:
                        raise RuntimeError("the stage zygote did not start")
                try:
                    socket.send_fds(self._sock, [request], [write_fd])
                except OSError as exc:
                    raise RuntimeError(f"the stage zygote is gone ({exc})") from None
                with self._cond:
                    if not self._cond.wait_for(lambda: self._replies or self._closed, 30.0) or not self._replies:
                        raise RuntimeError("the stage zygote did not answer")
                    reply = self._replies.pop(0)
                    self._spawned.add(reply["pid"])
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        return ForkedProcess(reply["pid"], read_fd, self, [sys.executable, "-m", "pipeserve", *argv])

    def exit_code(self, pid: int, timeout: float | None = 0.0) -> int | None:
        """The stage's exit code (-N: killed by signal N), None while it runs (after ``timeout`` s)."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._codes or self._closed, timeout)
            if pid in self._codes:
                return self._codes[pid]
        if self._closed and not _pid_alive(pid):   # the zygote died before reporting: the code is lost
            return -signal.SIGKILL
        return None

    def alive(self) -> bool:
        return not self._closed and self.proc.poll() is None

    def idle(self) -> bool:
        """No stage of ours is running."""
        with self._cond:
            return self._spawned <= self._codes.keys()

    def close(self) -> None:
        """Close our end: the zygote exits (its stages, watching it, follow)."""
        try:
            self._sock.close()
        finally:
            try:
                self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _read(self) -> None:
        try:
            while True:
                data = self._sock.recv(MAX_MESSAGE)
                if not data:
                    break
                message = json.loads(data)
                with self._cond:
                    if "ready" in message:
                        self._ready = True
                    elif "exited" in message:
                        self._codes[message["exited"]] = message["code"]
                    else:
                        self._replies.append(message)
                    self._cond.notify_all()
        except OSError:
            pass
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()


_zygote: StageZygote | None = None
_zygote_lock = threading.Lock()


@atexit.register
def _close_zygote() -> None:
    if _zygote is not None:
        _zygote.close()


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0" and hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")


def stage_zygote(env: dict[str, str]) -> StageZygote | None:
    """This process's zygote for stages started with ``env`` (made on first use); None when
    stages must start as new interpreters (disabled, or an environment the zygote was not
    started with)."""
    global _zygote
    if not enabled():
        return None
    with _zygote_lock:
        if _zygote is not None and (not _zygote.alive() or _zygote.env_key != _env_key(env) and _zygote.idle()):
            _zygote.close()   # gone, or made for an environment no running stage still needs
            _zygote = None
        if _zygote is None:
            _zygote = StageZygote(env)
        return _zygote if _zygote.env_key == _env_key(env) else None


def _env_key(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k not in PER_STAGE_ENV and k != ENABLE_ENV))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------------------------
# The zygote process.

def _serve(sock: socket.socket) -> tuple[dict, int] | None:
    """Answer requests until the driver closes its end (None). Returns (request, stderr fd)
    in a forked child: the child leaves the loop and becomes the stage."""
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ, None)
    sock.send(json.dumps({"ready": True}).encode())
    while True:
        for key, _ in selector.select():
            if key.data is not None:   # a stage's pidfd: it exited
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(key.data, 0)
                sock.send(json.dumps({"exited": key.data, "code": os.waitstatus_to_exitcode(status)}).encode())
                continue
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
            if not data:
                return None
            request = json.loads(data)
            sys.stderr.flush()
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                for child_key in list(selector.get_map().values()):
                    if child_key.data is not None:
                        os.close(child_key.fd)
                selector.close()
                sock.close()
                return request, fds[0]
            os.close(fds[0])
            selector.register(os.pidfd_open(pid), selectors.EVENT_READ, pid)
            sock.send(json.dumps({"pid": pid}).encode())


def _become_stage(request: dict, stderr_fd: int) -> int:
    os.dup2(stderr_fd, 2)
    os.close(stderr_fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[:0] = [p for p in request["path"] if p not in sys.path]
    sys.argv = [sys.argv[0], *request["argv"]]
    if request["argv"][:1] != ["worker"]:
        raise ValueError(f"the stage zygote runs `pipeserve worker ...`, not {request['argv']}")
    from pipeserve.pipeline.cli import main as worker_main
    return worker_main(request["argv"][1:])


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the driver's to handle
    sock = socket.socket(fileno=int(argv[0]))
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    try:
        child = _serve(sock)
    except OSError:   # the driver is gone
        child = None
    if child is None:   # no interpreter teardown: torch's takes seconds
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return _become_stage(*child)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
