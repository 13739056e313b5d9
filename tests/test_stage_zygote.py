"""The stage zygote (pipeline/zygote.py): stages forked from a process that imported torch
once; what the driver sees of them (pid, stderr, exit code) is what a new interpreter gave;
an environment the zygote was not made for, or PIPESERVE_STAGE_ZYGOTE=0, starts the old way."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import pytest

from pipeserve.comm.auth import KEY_ENV
from pipeserve.pipeline import launcher, zygote

pytestmark = pytest.mark.skipif(not zygote.enabled() and os.environ.get(zygote.ENABLE_ENV) != "0",
                                reason="this platform has no pidfd_open / send_fds: stages start as new interpreters")


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _env(**extra) -> dict[str, str]:
    return {**os.environ, KEY_ENV: "k" * 32, "PYTHONPATH": launcher.PACKAGE_ROOT, **extra}


@pytest.fixture
def own_zygote(monkeypatch):
    """A zygote of this test's own (the process-wide one is left alone)."""
    made = []

    def make(env):
        z = zygote.StageZygote(env)
        made.append(z)
        return z
    yield make
    for z in made:
        z.close()


def _waiting_port() -> socket.socket:
    """A listening socket that never answers: a stage joining it waits."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_forked_stage_reports_its_stderr_and_exit_code():
    env = _env()
    z = zygote.stage_zygote(env)
    # No --stage and no --nnodes: the worker's own error, exit code 2, on the stderr we passed.
    proc = z.spawn(["worker", "--master-addr", "127.0.0.1"], env, [launcher.PACKAGE_ROOT])
    assert proc.wait(timeout=60) == 2
    assert "give --nnodes and --node-rank" in proc.stderr.read()
    assert proc.poll() == 2
    assert _ppid(z.proc.pid) == os.getpid()


def test_a_killed_stage_reads_as_killed_and_the_zygote_goes_with_the_driver(own_zygote):
    env = _env()
    z = own_zygote(env)
    listener = _waiting_port()
    try:
        args = ["worker", "--stage", "0", "--master-addr", "127.0.0.1", "--master-port",
                str(listener.getsockname()[1]), "--rendezvous-timeout", "120"]
        victim = z.spawn(args, env, [launcher.PACKAGE_ROOT])
        survivor = z.spawn(args, env, [launcher.PACKAGE_ROOT])
        assert _ppid(victim.pid) == z.proc.pid         # forked by the zygote, not by us
        with pytest.raises(subprocess.TimeoutExpired):
            victim.wait(timeout=0.5)
        os.kill(victim.pid, signal.SIGKILL)
        assert victim.wait(timeout=30) == -signal.SIGKILL
        assert survivor.poll() is None
        # The driver's end closes (as when the driver is SIGKILLed): the zygote exits, and the
        # stage it started, watching its parent, follows.
        z._sock.close()
        assert z.proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 30
        while zygote._pid_alive(survivor.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not zygote._pid_alive(survivor.pid)
    finally:
        listener.close()


def test_the_environment_decides_between_the_zygote_and_a_new_interpreter(monkeypatch):
    env = _env()
    first = zygote.stage_zygote(env)
    assert first is not None and first.alive()
    assert zygote.stage_zygote({**env, "PIPESERVE_PARENT_PID": "1", KEY_ENV: "x" * 32}) is first  # per stage
    listener = _waiting_port()
    try:
        busy = first.spawn(["worker", "--stage", "0", "--master-addr", "127.0.0.1", "--master-port",
                            str(listener.getsockname()[1]), "--rendezvous-timeout", "120"],
                           env, [launcher.PACKAGE_ROOT])
        # OMP_NUM_THREADS is read when torch loads: a zygote made without it cannot give it.
        assert zygote.stage_zygote({**env, "OMP_NUM_THREADS": "1"}) is None
        os.kill(busy.pid, signal.SIGKILL)
        busy.wait(timeout=30)
    finally:
        listener.close()
    # No stage of the old zygote runs any more: it makes way for one with the new environment.
    second = zygote.stage_zygote({**env, "OMP_NUM_THREADS": "1"})
    assert second is not None and second is not first and not first.alive()
    monkeypatch.setenv(zygote.ENABLE_ENV, "0")
    assert zygote.stage_zygote(env) is None


def test_with_the_zygote_off_stages_start_as_new_interpreters(monkeypatch):
    monkeypatch.setenv(zygote.ENABLE_ENV, "0")
    listener = _waiting_port()
    try:
        procs = launcher.start_stages([0], "127.0.0.1", listener.getsockname()[1], b"k" * 32, 120.0)
        proc = procs[0]
        assert isinstance(proc.popen, subprocess.Popen) and _ppid(proc.pid) == os.getpid()
        launcher.stop_processes([proc], grace=0.0)
        assert proc.exitcode == -signal.SIGTERM
    finally:
        listener.close()


def test_the_launcher_forks_stages_whose_exit_the_driver_sees():
    listener = _waiting_port()
    try:
        procs = launcher.start_stages([0, 1], "127.0.0.1", listener.getsockname()[1], b"k" * 32, 120.0)
        assert all(isinstance(p.popen, zygote.ForkedProcess) for p in procs.values())
        assert {_ppid(p.pid) for p in procs.values()} == {zygote._zygote.proc.pid}
        assert all(p.is_alive() for p in procs.values())
        launcher.stop_processes(list(procs.values()), grace=0.0)
        assert [p.exitcode for p in procs.values()] == [-signal.SIGTERM] * 2
    finally:
        listener.close()


def test_a_zygote_that_cannot_import_sends_stages_the_old_way(monkeypatch, tmp_path):
    # A torch that fails to import, first on the zygote's path: it exits without saying ready,
    # a request fails with a message, and the launcher starts the stage as a new interpreter.
    (tmp_path / "torch.py").write_text("raise ImportError('no torch on this path')\n")
    env = _env(PYTHONPATH=os.pathsep.join([str(tmp_path), launcher.PACKAGE_ROOT]))
    broken = zygote.StageZygote(env)
    try:
        assert broken.proc.wait(timeout=60) != 0
        with pytest.raises(RuntimeError, match="did not start"):
            broken.spawn(["worker", "--master-addr", "127.0.0.1"], env, [launcher.PACKAGE_ROOT])
        monkeypatch.setattr(zygote, "_zygote", broken)
        listener = _waiting_port()
        try:   # the launcher replaces a dead zygote with a working one
            procs = launcher.start_stages([0], "127.0.0.1", listener.getsockname()[1], b"k" * 32, 120.0)
            assert isinstance(procs[0].popen, zygote.ForkedProcess) and zygote._zygote is not broken
            launcher.stop_processes(list(procs.values()), grace=0.0)
            monkeypatch.setattr(launcher, "stage_zygote", lambda env: broken)
            procs = launcher.start_stages([0], "127.0.0.1", listener.getsockname()[1], b"k" * 32, 120.0)
            assert isinstance(procs[0].popen, subprocess.Popen)
            launcher.stop_processes(list(procs.values()), grace=0.0)
        finally:
            listener.close()
    finally:
        broken.close()
