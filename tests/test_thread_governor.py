"""The stage thread governor (pipeserve/worker/thread_governor.py): fewer threads while other
work holds the cores, more again once they are free; driven here by a fake clock, CPU time and
idle time so that each decision is exact."""

import pytest
import torch

from pipeserve.config import EngineConfig
from pipeserve.entrypoints.args import add_engine_args, config_from_args
from pipeserve.worker import thread_governor
from pipeserve.worker.thread_governor import ThreadGovernor, idle_seconds


class FakeHost:
    """Wall clock, this process's CPU time and the CPUs' idle time, advanced by ``run``."""

    def __init__(self) -> None:
        self.t = self.cpu = self.idle = 0.0
        self.sets: list[int] = []

    def run(self, seconds: float, own_cores: float, idle_cores: float) -> None:
        self.t += seconds
        self.cpu += seconds * own_cores
        self.idle += seconds * idle_cores

    def governor(self, threads: int = 2, cpus: int = 2, **kw) -> ThreadGovernor:
        return ThreadGovernor(threads, cpus=list(range(cpus)), clock=lambda: self.t, cpu_time=lambda: self.cpu,
                              idle=lambda: self.idle, set_threads=self.sets.append, **kw)


def test_a_busy_neighbour_lowers_the_threads_at_once_and_a_free_core_raises_them_after_two_intervals():
    host = FakeHost()
    gov = host.governor()
    host.run(0.6, own_cores=1.95, idle_cores=0.05)      # alone: both cores ours
    gov.tick()
    assert host.sets == [] and gov.threads == 2
    host.run(0.6, own_cores=1.33, idle_cores=0.0)       # a busy loop takes a third of each core
    gov.tick()
    assert host.sets == [1] and gov.threads == 1
    host.run(0.6, own_cores=1.0, idle_cores=0.0)        # one thread beside it: nothing idle
    gov.tick()
    assert host.sets == [1]
    host.run(0.6, own_cores=1.0, idle_cores=0.9)        # the neighbour left: one interval is not enough
    gov.tick()
    assert host.sets == [1] and gov.threads == 1
    host.run(0.6, own_cores=1.0, idle_cores=0.9)
    gov.tick()
    assert host.sets == [1, 2] and gov.threads == 2 and gov.changes == 2


def test_a_raise_needs_consecutive_intervals_and_checks_wait_for_the_interval():
    host = FakeHost()
    gov = host.governor(threads=4, cpus=4, interval_s=0.5)
    host.run(0.5, own_cores=1.2, idle_cores=0.0)        # 1.2 cores: one thread
    gov.tick()
    assert host.sets == [1]
    host.run(0.5, own_cores=1.0, idle_cores=2.0)        # 3 free: up once...
    gov.tick()
    host.run(0.5, own_cores=1.0, idle_cores=0.2)        # ...but not twice in a row
    gov.tick()
    host.run(0.5, own_cores=1.0, idle_cores=2.0)
    gov.tick()
    assert host.sets == [1]
    host.run(0.2, own_cores=1.0, idle_cores=2.0)        # within the interval: no decision
    gov.tick()
    host.run(0.4, own_cores=1.0, idle_cores=2.0)
    gov.tick()
    assert host.sets == [1, 3]
    host.run(0.5, own_cores=3.0, idle_cores=2.0)        # capped at the configured threads and the CPUs
    gov.tick()
    host.run(0.5, own_cores=3.0, idle_cores=2.0)
    gov.tick()
    assert host.sets == [1, 3, 4]
    host.run(0.25, own_cores=3.5, idle_cores=0.25)
    assert gov.available() == pytest.approx(3.75)
    host.run(0.25, own_cores=3.5, idle_cores=2.0)      # at most the CPUs it may run on
    assert gov.available() == pytest.approx(4.0)


def test_no_idle_figures_no_change():
    host = FakeHost()
    gov = ThreadGovernor(2, cpus=[0, 1], clock=lambda: host.t, cpu_time=lambda: host.cpu, idle=lambda: None,
                         set_threads=host.sets.append)
    host.run(1.0, own_cores=0.5, idle_cores=0.0)
    gov.tick()
    assert host.sets == [] and gov.available() is None


def test_idle_seconds_reads_the_cpus_lines_of_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 10 900 100 0 0 0 0 0\n"
                    "cpu0 5 0 5 400 50 0 0 0 0 0\n"
                    "cpu1 5 0 5 500 50 0 0 0 0 0\n"
                    "intr 12345\n")
    hz = thread_governor._TICKS
    assert idle_seconds([0], str(stat)) == pytest.approx(450 / hz)
    assert idle_seconds([0, 1], str(stat)) == pytest.approx(1000 / hz)
    assert idle_seconds([0], str(tmp_path / "missing")) is None


def test_start_governs_only_several_adaptive_threads(monkeypatch):
    before = torch.get_num_threads()
    try:
        thread_governor.start(1, True)
        assert thread_governor._governor is None and torch.get_num_threads() == 1
        thread_governor.start(2, False)
        assert thread_governor._governor is None and torch.get_num_threads() == 2
        thread_governor.start(2, True)
        assert thread_governor._governor is not None and thread_governor._governor.max_threads == 2
        thread_governor.tick()   # within its first interval: nothing to do
        assert torch.get_num_threads() == 2
    finally:
        thread_governor._governor = None
        torch.set_num_threads(before)


def test_the_flag():
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).adaptive_threads is EngineConfig().adaptive_threads is True
    assert config_from_args(parser.parse_args(["--no-adaptive-threads"])).adaptive_threads is False


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="threads >= 1"):
        ThreadGovernor(0, cpus=[0])
