"""A stage that dies or freezes mid-generation: the pipeline is restarted, every sequence is
replayed from its token ids, and every request finishes as if nothing had happened.

Stage processes are found through a public accessor only: ``LLMEngine.stage_pids``. The
server's side (16 streams, SIGKILL and SIGSTOP) is in test_recovery_server.py.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

from pipeserve.config import EngineConfig
from pipeserve.engine.recovery import RecoveryLog
from pipeserve.entrypoints.llm import LLM
from pipeserve.sampling_params import SamplingParams
from pipeserve.worker.executor import Executor, ExecutorError
from tests.test_engine_behaviour import random_prompts, token_lists
from tests.test_scheduler import FakeEngine

NEW_TOKENS = 64
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


# -- the scheduler's side: what is dropped, what is replayed ------------------------
def _lose_all_kv(eng: FakeEngine) -> int:
    """What the engine does when a stage dies: the micro-batches in flight are lost, the
    stages come back with empty caches (the fake's KV signatures are wiped), replay."""
    while eng.inflight:
        eng.sched.on_step_failed(eng.inflight.popleft())
    replayed = eng.sched.replay_all()
    eng.dev = [[None] * len(b) for b in eng.dev]
    eng.host = [[None] * len(b) for b in eng.host]
    eng.sched.block_manager.check_integrity()
    return replayed


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_replay_after_lost_kv_never_reads_a_lost_block(seed, mode):
    """Random load with the prefix cache, swaps and n > 1; the KV is lost twice in the middle.
    The fake stages assert that every position a step reads holds the KV of exactly its
    tokens, so a prefix-cache hit on a lost block or a sequence resumed at its old position
    would fail; every request still finishes with all its tokens."""
    eng = FakeEngine(num_blocks=10, num_host_blocks=6, max_inflight=2, seed=seed, preemption_mode=mode,
                     enable_prefix_caching=True, max_num_batched_tokens=12, max_num_seqs=4)
    rng = random.Random(seed)
    replayed, losses = 0, 0
    for step in range(300):
        if rng.random() < 0.3 or step < 4:
            eng.add_random()
        if step >= 40 * (losses + 1) and losses < 2 and eng.sched.num_running:
            replayed += _lose_all_kv(eng)
            losses += 1
            assert eng.sched.block_manager.stats()["num_cached_blocks"] == 0
            assert eng.sched.num_running == eng.sched.num_swapped == 0
        eng.pump()
    eng.drain()
    eng.assert_clean()
    assert losses == 2 and replayed > 0


def test_replay_refuses_while_steps_are_in_flight():
    eng = FakeEngine(num_blocks=8)
    eng.add([1, 2, 3, 4, 5], max_tokens=3)
    eng.submit()
    with pytest.raises(RuntimeError, match="in flight"):
        eng.sched.replay_all()


# -- the engine's side, in process: a fake pipeline that loses its steps --------------
class LosingExecutor(Executor):
    """PP = 1 dressed as a pipeline of ``max_inflight`` slots whose ``wait`` number k in
    ``fail_at`` loses every step in flight, as a dead stage does; ``recover`` works unless
    ``recover_fails``. Each step runs in the wrapped executor at submit, so a lost step's
    KV writes did happen: replay must not depend on them being absent or present."""

    def __init__(self, inner: Executor, fail_at: set[int], recover_fails: bool = False) -> None:
        self.inner, self.fail_at, self.recover_fails = inner, fail_at, recover_fails
        self.max_inflight = 3
        self.waits = 0
        self.recovered = 0
        self._done: list = []

    def submit(self, step) -> None:
        self.inner.submit(step)
        self._done += self.inner.wait()

    def wait(self, timeout=None):
        self.waits += 1
        done, self._done = self._done, []
        if self.waits in self.fail_at:
            raise ExecutorError(f"pipeline stage 1 died (lost {len(done)} steps)")
        return done[:1] + self._hold(done[1:])

    def _hold(self, rest: list) -> list:
        self._done = rest          # hand back one result per wait: the others stay in flight
        return []

    @property
    def num_inflight(self) -> int:
        return len(self._done)

    def recover(self) -> None:
        if self.recover_fails:
            raise ExecutorError("no stage came back")
        self.recovered += 1


def _tiny_llm(tiny_checkpoints, **kwargs) -> LLM:
    return LLM(model=str(tiny_checkpoints("llama_tied_gqa")), dtype="float32", kv_cache_memory="16MiB",
               threads_per_stage=1, max_num_batched_tokens=96, **kwargs)


def test_engine_replays_lost_steps_with_identical_greedy_output(tiny_checkpoints):
    """Steps in flight are lost twice (prompts half prefilled, decodes under way); every
    request still ends by length with the undisturbed run's tokens, seeded sampling too."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, seed=3)]
    params = [GREEDY, SamplingParams(temperature=0.8, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)] * 3
    llm = _tiny_llm(tiny_checkpoints)
    try:
        reference = token_lists(llm.generate(prompts, params))
        llm.engine.executor = LosingExecutor(llm.engine.executor, fail_at={3, 40})
        outs = llm.generate(prompts, params)
        recovery = llm.stats()["recovery"]
    finally:
        llm.shutdown()
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * len(prompts)
    assert token_lists(outs) == reference
    assert recovery["stage_restarts"] == 2 and len(recovery["recovery_seconds"]) == 2
    assert llm.stats()["scheduler"]["num_replayed"] > 0


@pytest.mark.parametrize("recover_fails", [False, True])
def test_spent_restarts_end_every_request_with_a_clear_error(tiny_checkpoints, recover_fails):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, seed=4)]
    llm = _tiny_llm(tiny_checkpoints, max_stage_restarts=1)
    try:
        llm.engine.executor = LosingExecutor(llm.engine.executor, fail_at={3, 9}, recover_fails=recover_fails)
        outs = llm.generate(prompts, GREEDY)
    finally:
        llm.shutdown()
    assert all(o.finished and o.outputs[0].finish_reason == "error" for o in outs)
    why = "no stage came back" if recover_fails else "stage 1 died"
    assert all(why in o.error and "--max-stage-restarts 1" in o.error for o in outs), outs[0].error
    assert not llm.engine.healthy
    with pytest.raises(RuntimeError, match="unhealthy"):
        llm.engine.add_request("late", {"prompt_token_ids": [5, 6, 7]}, GREEDY)


class _Clock:
    """A clock that moves only when told to (the restart window's, ``RecoveryLog.clock``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_restart_window_counts_only_recent_attempts():
    clock = _Clock()
    log = RecoveryLog(clock)
    log.begin("stage 1 died")
    clock.now += 100
    log.begin("stage 1 died")
    assert (log.recent(50), log.recent(150), log.recent(0), log.restarts) == (1, 2, 2, 2)
    clock.now += 100
    assert (log.recent(50), log.recent(150), log.recent(250)) == (0, 1, 2)


class _SteppingExecutor(LosingExecutor):
    """Fails at ``fail_at`` like LosingExecutor; each recovery moves ``clock`` ``gap`` seconds on
    (the next failure comes that much later)."""

    def __init__(self, inner, fail_at: set[int], clock: _Clock, gap: float) -> None:
        super().__init__(inner, fail_at)
        self.clock, self.gap = clock, gap

    def recover(self) -> None:
        super().recover()
        self.clock.now += self.gap


@pytest.mark.parametrize("window", [50.0, 0.0])
def test_failures_further_apart_than_the_window_are_each_recovered(tiny_checkpoints, window):
    """--max-stage-restarts 1: two failures 100 s apart are both recovered with a 50 s window
    (a long-lived server keeps recovering), and end every request with the window off (0: the
    engine's life), the error naming both flags."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, seed=5)]
    llm = _tiny_llm(tiny_checkpoints, max_stage_restarts=1, stage_restart_window=window)
    try:
        reference = token_lists(llm.generate(prompts, GREEDY))
        clock = llm.engine.recovery.clock = _Clock()
        llm.engine.executor = _SteppingExecutor(llm.engine.executor, fail_at={3, 9}, clock=clock, gap=100.0)
        outs = llm.generate(prompts, GREEDY)
        recovery = llm.stats()["recovery"]
    finally:
        llm.shutdown()
    if window:
        assert [o.outputs[0].finish_reason for o in outs] == ["length"] * len(prompts)
        assert token_lists(outs) == reference
        assert recovery["stage_restarts"] == 2 and llm.engine.healthy
    else:
        assert all(o.outputs[0].finish_reason == "error" for o in outs)
        assert all("1 of 1" in o.error and "--max-stage-restarts 1, --stage-restart-window 0" in o.error
                   for o in outs), outs[0].error
        assert recovery["stage_restarts"] == 1 and not llm.engine.healthy


def test_a_negative_restart_window_is_refused():
    with pytest.raises(ValueError, match="stage-restart-window"):
        EngineConfig(stage_restart_window=-1)


# -- offline: LLM.generate at PP = 3, the middle stage killed -------------------------
def _kill_when_half_admitted(llm: LLM, pid: int, total: int) -> threading.Thread:
    """SIGKILL ``pid`` once fewer than ``total / 2`` sequences wait: the first ones are done or
    decoding, later ones wait. Reads only queue lengths (safe from another thread)."""
    def watch() -> None:
        deadline = time.monotonic() + 120
        while llm.engine.scheduler.num_waiting > total // 2 - 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_llm_pp3_survives_killing_the_middle_stage(tiny_checkpoints, capsys):
    path = str(tiny_checkpoints("llama_tied_gqa"))
    prompts = [{"prompt_token_ids": p} for p in random_prompts(16, seed=5)]
    # Two sequences per micro-batch: the 16 requests run in waves, so "half admitted" is mid-run.
    llm = LLM(model=path, dtype="float32", kv_cache_memory="16MiB", pipeline_parallel_size=3,
              threads_per_stage=1, stage_timeout=10, max_stage_restarts=2, max_num_seqs=2)
    try:
        start = time.monotonic()
        reference = token_lists(llm.generate(prompts, GREEDY, use_tqdm=False))
        undisturbed_s = time.monotonic() - start
        victim = llm.engine.stage_pids[1]
        first_spec = llm.engine.executor.spec
        killer = _kill_when_half_admitted(llm, victim, len(prompts))
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        killer.join()
        stats = llm.stats()
        recovery = stats["recovery"]
        new_pids = llm.engine.stage_pids
        replaced_spec = llm.engine.executor.spec
    finally:
        llm.shutdown()
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * len(prompts)
    assert not any(o.error for o in outs)
    assert token_lists(outs) == reference
    assert recovery["stage_restarts"] == 1 and len(recovery["recovery_seconds"]) == 1, recovery
    assert "stage 1" in recovery["last_error"], recovery
    assert stats["scheduler"]["num_replayed"] >= 1       # it died mid-generation
    assert victim not in new_pids.values() and len(new_pids) == 3
    # the new stages map their KV caches in for a shorter time before they serve (ModelRunner)
    assert not first_spec.replacement and replaced_spec.replacement
    with pytest.raises(ProcessLookupError):
        os.kill(victim, 0)
    with capsys.disabled():
        print(f"\nPP=3, stage 1 SIGKILLed: restarted in {recovery['recovery_seconds'][0]:.1f} s "
              f"(undisturbed run {undisturbed_s:.1f} s)")


# -- a step that raises in the model (PP = 1: the runner in the driver's process) ---------
def _raise_in_model(llm: LLM, when) -> list[int]:
    """Make the runner raise on a step for which ``when(step)`` is true; returns the step ids it
    raised on."""
    runner = llm.engine.executor.runner
    execute, raised = runner.execute, []

    def flaky(step, *args, **kwargs):
        if when(step):
            raised.append(step.step_id)
            raise RuntimeError("simulated kernel failure")
        return execute(step, *args, **kwargs)

    runner.execute = flaky
    return raised


def test_pp1_a_step_that_raises_costs_a_replay_not_the_engine(tiny_checkpoints):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, seed=6)]
    llm = _tiny_llm(tiny_checkpoints)
    try:
        reference = token_lists(llm.generate(prompts, GREEDY))
        calls = iter(range(10_000))
        raised = _raise_in_model(llm, lambda step: next(calls) == 5)
        outs = llm.generate(prompts, GREEDY)
        recovery = llm.stats()["recovery"]
        assert llm.engine.healthy
    finally:
        llm.shutdown()
    assert len(raised) == 1 and recovery["stage_restarts"] == 1
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * len(prompts)
    assert token_lists(outs) == reference


def test_pp1_a_model_that_keeps_raising_ends_the_requests_once_restarts_are_spent(tiny_checkpoints):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, seed=7)]
    llm = _tiny_llm(tiny_checkpoints, max_stage_restarts=1)
    try:
        raised = _raise_in_model(llm, lambda step: True)
        outs = llm.generate(prompts, GREEDY)
        assert not llm.engine.healthy
    finally:
        llm.shutdown()
    assert len(raised) == 2          # the first run and the one restart's
    assert all(o.outputs[0].finish_reason == "error" and "simulated kernel failure" in o.error for o in outs)
    # The first of them ran alone after the restart and raised again: it ends as the culprit.
    alone = [o for o in outs if "raised on this request twice" in o.error]
    assert len(alone) == 1
    assert all("--max-stage-restarts 1" in o.error for o in outs if o is not alone[0])


def test_a_request_the_model_raises_on_ends_alone(tiny_checkpoints):
    """The model raises whenever one request's prompt is in the step: the first time, that step's
    requests are isolated and replayed one to a micro-batch; the second time the step holds the
    request alone, so it ends with the error and every other request finishes with its
    undisturbed tokens (2 restarts of the 3 in the window)."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, seed=8)]
    poison = prompts[2]["prompt_token_ids"]
    llm = _tiny_llm(tiny_checkpoints, max_stage_restarts=3, enable_prefix_caching=False)   # prompts from 0
    try:
        reference = token_lists(llm.generate(prompts, GREEDY))
        raised = _raise_in_model(llm, lambda step: any(s.start_pos == 0 and s.token_ids == poison[:len(s.token_ids)]
                                                       for s in step.seqs))
        outs = llm.generate(prompts, GREEDY)
        recovery = llm.stats()["recovery"]
        assert llm.engine.healthy and not llm.engine.scheduler.isolated
        again = token_lists(llm.generate(prompts[:2], GREEDY))     # the engine serves on
    finally:
        llm.shutdown()
    assert len(raised) == 2 and recovery["stage_restarts"] == 2
    assert outs[2].outputs[0].finish_reason == "error"
    assert "raised on this request twice" in outs[2].error and "simulated kernel failure" in outs[2].error
    kept = [i for i in range(5) if i != 2]
    assert all(outs[i].outputs[0].finish_reason == "length" for i in kept)
    assert [token_lists(outs)[i] for i in kept] == [reference[i] for i in kept]
    assert again == reference[:2]


def test_a_stages_exception_names_its_step_to_the_engine():
    """PP > 1: a stage's ERROR message (its runner raised on a step) fails the executor with
    that step's id, which the engine uses to isolate the step's requests; a death names none."""
    import queue as queue_mod

    from pipeserve.comm.transport import Kind, Message
    from pipeserve.pipeline.executor import PipelineExecutor

    def bare() -> PipelineExecutor:
        ex = PipelineExecutor.__new__(PipelineExecutor)      # no stages: only the failure bookkeeping
        ex.generation, ex._lock, ex._closed, ex._done = 1, threading.Lock(), False, queue_mod.Queue()
        ex._failure, ex._failed_step = None, None
        return ex

    ex = bare()
    ex._on_message(1, Message(2, Kind.ERROR, (17, 1, "Traceback ...\nRuntimeError: boom"), None, 0.0))
    with pytest.raises(ExecutorError, match="stage 1 raised while running step 17") as info:
        ex.wait(timeout=0)
    assert info.value.step_id == 17
    ex = bare()
    ex._fail(1, "pipeline stage 1 (pid 5) died")
    with pytest.raises(ExecutorError) as info:
        ex.wait(timeout=0)
    assert info.value.step_id is None
