"""--cpu-bind: each stage process of a host on its own CPUs (pipeserve/worker/cpu_bind.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipeserve.config import EngineConfig, parse_cpu_list
from pipeserve.pipeline.executor import PipelineExecutor
from pipeserve.pipeline.partition import uniform_partition
from pipeserve.pipeline.synthetic import SleepRunner, SyntheticSource
from pipeserve.worker.cpu_bind import DriverCpus, stage_cpus
from tests.test_pipeline_runtime import _synthetic_cfg


def test_auto_splits_the_cpus_into_equal_disjoint_runs_in_stage_order():
    allowed = [0, 1, 2, 3, 4, 5, 6]
    assert [stage_cpus("auto", s, 3, allowed, 2) for s in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [stage_cpus("auto", s, 2, [5, 1], 1) for s in range(2)] == [[1], [5]]


def test_auto_binds_nothing_when_a_stage_would_get_fewer_cpus_than_its_threads_or_is_alone():
    assert stage_cpus("auto", 0, 2, [0, 1, 2], 2) is None   # 1 CPU each, 2 threads each
    assert stage_cpus("auto", 0, 3, [0, 1], 1) is None      # more stages than CPUs
    assert stage_cpus("auto", 0, 1, [0, 1], 1) is None      # one stage: the whole host is its
    assert stage_cpus("none", 1, 2, [0, 1, 2, 3], 1) is None


def test_explicit_lists_one_per_stage():
    assert stage_cpus("0-1,4|2,3", 0, 2, list(range(8)), 1) == [0, 1, 4]
    assert stage_cpus("0-1,4|2,3", 1, 2, list(range(8)), 1) == [2, 3]
    with pytest.raises(ValueError, match="lists 2 CPU sets for the 3 stages"):
        stage_cpus("0|1", 0, 3, [0, 1, 2], 1)
    with pytest.raises(ValueError, match=r"CPUs \[9\] that this process may not run on"):
        stage_cpus("0|9", 1, 2, [0, 1], 1)


@pytest.mark.parametrize("text,error", [("a", "not a CPU number"), ("3-1", "not a CPU range"), ("1,,2", "not a CPU")])
def test_bad_cpu_lists_are_named(text, error):
    with pytest.raises(ValueError, match=error):
        parse_cpu_list(text)


def test_config_checks_the_flag():
    EngineConfig(cpu_bind="0|1", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="cpu_bind"):
        EngineConfig(cpu_bind="fast")
    with pytest.raises(ValueError, match="lists 3 CPU sets for 2 stages"):
        EngineConfig(cpu_bind="0|1|2", pipeline_parallel_size=2)


def _allowed(pid: int) -> list[int]:
    """The CPUs every thread of a process may run on (/proc), the same for all of them."""
    seen = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                line = next(line for line in f if line.startswith("Cpus_allowed_list:"))
        except FileNotFoundError:   # a thread that ended meanwhile
            continue
        seen.append(parse_cpu_list(line.split(":", 1)[1].strip()))
    assert seen and all(cpus == seen[0] for cpus in seen), f"threads of {pid} on different CPUs: {seen}"
    return seen[0]


def _stage_affinities(**kw) -> list[list[int]]:
    cfg = _synthetic_cfg()
    conf = EngineConfig(pipeline_parallel_size=2, threads_per_stage=1, stage_timeout=30.0, **kw)
    ex = PipelineExecutor(conf, SyntheticSource(step_seconds=0.01), cfg, uniform_partition(cfg.num_layers, 2), 8, 0,
                          runner_factory=SleepRunner)
    try:
        return [_allowed(ex.procs[s].pid) for s in sorted(ex.procs)]
    finally:
        ex.shutdown()


needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                    reason="this process may run on one CPU: nothing to split between two stages")


@needs_two_cpus
def test_stage_processes_run_on_disjoint_cpus_by_default():
    allowed = sorted(os.sched_getaffinity(0))
    got = _stage_affinities()
    assert got == [stage_cpus("auto", s, 2, allowed, 1) for s in range(2)]
    assert not set(got[0]) & set(got[1])


@needs_two_cpus
def test_stage_processes_follow_explicit_lists_and_none():
    allowed = sorted(os.sched_getaffinity(0))
    assert _stage_affinities(cpu_bind=f"{allowed[1]}|{allowed[0]}") == [[allowed[1]], [allowed[0]]]
    assert _stage_affinities(cpu_bind="none") == [allowed, allowed]


@pytest.fixture
def home_cpus():
    """This process's CPUs, given back to every thread after the test, whatever it left."""
    home = sorted(os.sched_getaffinity(0))
    yield home
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), home)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.fixture
def bound_child(home_cpus):
    """A process bound to this process's last CPU, as a last stage is: (pid, its CPUs)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.sched_setaffinity(child.pid, home_cpus[-1:])
        yield child.pid, home_cpus[-1:]
    finally:
        child.kill()
        child.wait()


@needs_two_cpus
def test_the_driver_follows_the_last_stage_only_while_alone(home_cpus, bound_child):
    pid, cpus = bound_child
    follower = DriverCpus(lambda: pid)
    follower.follow(True)
    assert _allowed(os.getpid()) == cpus and follower.bound == frozenset(cpus)
    follower.follow(True)                           # no change: nothing to do
    assert _allowed(os.getpid()) == cpus
    follower.follow(False)
    assert _allowed(os.getpid()) == home_cpus and follower.bound is None


@needs_two_cpus
def test_the_driver_stays_put_where_the_last_stage_is_not_bound_or_not_here(home_cpus, bound_child):
    pid, _ = bound_child
    os.sched_setaffinity(pid, home_cpus)            # a stage on every CPU (--cpu-bind none)
    for last_stage_pid in (lambda: pid, lambda: None):
        DriverCpus(last_stage_pid).follow(True)
        assert _allowed(os.getpid()) == home_cpus
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    DriverCpus(lambda: gone.pid).follow(True)       # the stage has exited: no error, no binding
    assert _allowed(os.getpid()) == home_cpus


@needs_two_cpus
def test_an_engine_with_one_request_runs_its_driver_beside_the_last_stage(home_cpus, tiny_checkpoints):
    """PP = 2, one request: after a step the driver's threads are on the last stage's CPUs; a
    second request, or the last request's end (the caller stops stepping), gives them back every CPU."""
    from pipeserve import LLM, SamplingParams
    path = str(tiny_checkpoints("llama_tied_gqa"))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(model=path, dtype="float32", kv_cache_memory="64MiB", threads_per_stage=1,
             pipeline_parallel_size=2) as llm:
        engine = llm.engine
        last = _allowed(engine.executor.procs[1].pid)
        assert last != home_cpus
        engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, params)
        engine.step()
        assert _allowed(os.getpid()) == last
        engine.add_request("b", {"prompt_token_ids": [8, 9]}, params)
        engine.step()
        assert _allowed(os.getpid()) == home_cpus
        engine.abort_request("b")
        engine.step()
        assert _allowed(os.getpid()) == last                   # "a" alone again
        engine.abort_request("a")                             # the caller may stop stepping now
        assert _allowed(os.getpid()) == home_cpus
        engine.add_request("c", {"prompt_token_ids": [5, 6, 7]}, params)
        while engine.has_unfinished_requests():
            engine.step()
        assert _allowed(os.getpid()) == home_cpus             # finished: no step after the last one
