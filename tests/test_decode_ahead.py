"""Decode ahead (``EngineConfig.pp_decode_ahead``): with a micro-batch slot free, the next
decode of a sequence is sent before its input token is sampled, and the last stage hands
that token to stage 0 directly. The scheduler's side with test_scheduler's fake engine
(whose KV signatures catch a read of a position no earlier step wrote), stage 0's order
of waiting steps, and the engine end to end against PP = 1."""

from __future__ import annotations

import threading
import types

import pytest

from pipeserve.comm.transport import Kind, Message
from pipeserve.pipeline.spec import Hop, StepEnvelope
from pipeserve.pipeline.stage_worker import StageWorker
from pipeserve.scheduler.scheduler import Scheduler
from pipeserve.worker.step import SeqStep, StepInput
from tests.test_scheduler import BS, FakeEngine


def _items(out) -> list[tuple[int, int, bool]]:
    return [(i.start, i.num_new_tokens, i.sample) for i in out.scheduled]


def _ahead(eng: FakeEngine, seqs) -> object:
    out = eng.sched.schedule_ahead(seqs)
    if not out.is_empty:
        eng.inflight.append(out)
    return out


def test_a_decode_ahead_takes_the_slot_after_the_token_in_flight() -> None:
    eng = FakeEngine(num_blocks=8, max_inflight=2)
    seq = eng.add(list(range(2 * BS)), max_tokens=4).seqs[0]
    assert _items(eng.submit()) == [(0, 2 * BS, True)]
    # The prompt's sampled token sits at position 2 BS: a third block, allocated now.
    assert _items(_ahead(eng, [seq])) == [(2 * BS, 1, True)]
    assert len(seq.block_table) == 3 and seq.num_tokens == 2 * BS
    assert _ahead(eng, [seq]).is_empty, "one decode ahead at a time"
    assert eng.submit().is_empty, "nothing else to schedule while both are in flight"
    eng.complete_oldest()
    assert seq.num_computed_tokens == 2 * BS and seq.num_output_tokens == 1
    eng.complete_oldest()          # the fake engine checks it read the prompt's and the token's KV
    assert seq.num_computed_tokens == 2 * BS + 1 and seq.num_output_tokens == 2
    assert eng.sched.stats()["num_decodes_ahead"] == 1
    assert eng.sched.stats()["num_pipelined_chunks"] == 0, "a decode ahead is not a prompt's chunk"
    eng.drain()
    eng.assert_clean()


def test_a_sequence_that_stops_keeps_its_blocks_until_the_decode_ahead_is_back() -> None:
    eng = FakeEngine(num_blocks=8, max_inflight=2)
    seq = eng.add(list(range(5)), max_tokens=8).seqs[0]
    eng.submit()
    _ahead(eng, [seq])
    eng.complete_oldest()
    eng.sched.finish_seq(seq, "stop")       # its token was EOS: the decode ahead is for nothing
    assert seq.block_table, "the stages may still be writing its blocks"
    eng.complete_oldest()
    assert seq.block_table == [] and seq.num_output_tokens == 1
    eng.assert_clean()


def test_no_decode_ahead_without_a_free_block_or_with_longrope() -> None:
    eng = FakeEngine(num_blocks=3, max_inflight=2)
    seq = eng.add(list(range(2 * BS)), max_tokens=2).seqs[0]
    other = eng.add([1, 2], max_tokens=1).seqs[0]
    assert len(eng.submit().scheduled) == 2
    assert _ahead(eng, [seq]).is_empty, "the slot needs a third block: left out, nobody preempted"
    assert len(seq.block_table) == 2 and len(other.block_table) == 1
    eng.drain()
    eng.assert_clean()
    longrope = Scheduler(eng.config, 8, 0, eng.requests, rope_switch_len=4)
    assert longrope.schedule_ahead([seq]).is_empty


# -- stage 0: a step waits for its tokens, and only first-chunk steps wait behind it --
def _step_message(step_id: int, chunk: int = 0, tokens_from: int = -1, seq: int = 7) -> Message:
    step = StepInput(step_id, [SeqStep(seq, [0], 3, [0])], tokens_from=tokens_from)
    return Message(0, Kind.STEP, StepEnvelope(step, chunk), None, 0.0)


def _stage() -> StageWorker:
    spec = types.SimpleNamespace(config=types.SimpleNamespace(device="cpu"), num_stages=2)
    return StageWorker(spec, 0, {}, transport=None)


def test_stage_zero_holds_a_step_until_its_tokens_arrive() -> None:
    stage = _stage()
    waiting, later, other_chunk, flush = (_step_message(2, tokens_from=1), _step_message(3),
                                         _step_message(0, chunk=2), Message(0, Kind.FLUSH, None, None, 0.0))
    stage._backlog.extend([waiting, later, other_chunk, flush])
    assert stage._pick() == 2, "a later step of the same sequence may not pass the waiting one; another chunk may"
    stage._backlog.remove(other_chunk)
    assert stage._pick() == 2                   # the flush
    stage._backlog.remove(flush)
    assert stage._pick() is None
    # Another micro-batch's decode ahead whose tokens are here passes (its source came back first),
    # unless it shares a sequence with a step that stays.
    ready_other = _step_message(4, tokens_from=0, seq=8)
    stage._tokens[0] = {8: 5}
    stage._backlog.append(ready_other)
    assert stage._pick() == 2
    stage._backlog[0].obj.step.seqs.append(SeqStep(8, [0], 9, [1]))
    assert stage._pick() is None
    stage._backlog[0].obj.step.seqs.pop()
    stage._backlog.remove(ready_other)
    stage._tokens.clear()
    stage._busy = True                          # the tokens arrive while the stage computes: kept
    stage._tokens_arrived(1, [(7, 42)])
    assert stage._pick() == 0 and waiting.arrived > 0
    stage._fill_tokens(waiting.obj.step)
    assert waiting.obj.step.seqs[0].token_ids == [42] and not stage._tokens
    with pytest.raises(RuntimeError, match="before the tokens of step 5"):
        stage._fill_tokens(StepInput(6, [SeqStep(7, [0], 4, [0])], tokens_from=5))
    stage._tokens_arrived(5, [(8, 1)])
    with pytest.raises(RuntimeError, match="no token for sequence 7"):
        stage._fill_tokens(StepInput(6, [SeqStep(7, [0], 4, [0])], tokens_from=5))


def test_stage_zero_keeps_a_bounded_number_of_unclaimed_tokens() -> None:
    stage = _stage()
    stage._busy = True
    for step_id in range(StageWorker.MAX_KEPT_TOKENS + 10):
        stage._tokens_arrived(step_id, [(1, step_id)])
    assert len(stage._tokens) == StageWorker.MAX_KEPT_TOKENS and min(stage._tokens) == 10


def test_the_main_thread_is_woken_only_for_a_message_it_can_handle_now() -> None:
    """A message that arrives while the stage computes, or a step still waiting for its tokens,
    does not wake the main thread (on a one-core stage each wake-up preempted the compute); the
    busy thread's going idle, or the tokens' arrival, wakes it when a message can run."""
    class CountingCondition:
        def __init__(self):
            self.notified, self._cv = 0, threading.Condition()

        def __enter__(self):
            return self._cv.__enter__()

        def __exit__(self, *exc):
            return self._cv.__exit__(*exc)

        def notify(self):
            self.notified += 1
            self._cv.notify()

    stage = _stage()
    stage._direct = False            # every message to the main thread (a CUDA stage's rule)
    stage._cv = cv = CountingCondition()
    stage._busy = True
    stage._arrived(_step_message(2))
    assert cv.notified == 0, "the busy thread looks at the backlog when it is done"
    stage._idle()
    assert cv.notified == 1 and not stage._busy
    stage._backlog.clear()
    stage._arrived(_step_message(4, tokens_from=3))
    assert cv.notified == 1, "a step waiting for its decode-ahead tokens cannot run yet"
    stage._busy = True
    stage._tokens_arrived(3, [(7, 11)])
    assert cv.notified == 1, "tokens that arrive while the stage computes wait for its going idle"
    stage._idle()
    assert cv.notified == 2
    stage._backlog.clear()
    stage._arrived(_step_message(6, tokens_from=5))
    stage._tokens_arrived(5, [(7, 12)])
    assert cv.notified == 3, "an idle stage's main thread runs the step its tokens released"
    stage._backlog.clear()
    stage._arrived(Message(0, Kind.FLUSH, None, None, 0.0))
    assert cv.notified == 4


def test_stage_zero_prepares_a_waiting_step_before_it_goes_idle() -> None:
    """Only first-chunk steps that wait for their tokens, on stage 0; a failing prepare is left
    to fail when the step runs (the worker goes on)."""
    class Runner:
        def __init__(self, fail=False):
            self.prepared, self.fail = [], fail

        def prepare_ahead(self, step):
            if self.fail:
                raise ValueError("invalid sequence shape")
            self.prepared.append(step.step_id)

    stage = _stage()
    stage.runners = {0: Runner()}
    stage._tokens[1] = {7: 5}
    stage._backlog.extend([_step_message(2, tokens_from=0), _step_message(3, tokens_from=1, seq=8),
                           _step_message(4), _step_message(5, chunk=1, tokens_from=0),
                           Message(0, Kind.FLUSH, None, None, 0.0)])
    stage._prepare_waiting()
    assert stage.runners[0].prepared == [2], "steps whose tokens are here, other chunks and plain steps run now"
    stage.runners = {0: Runner(fail=True)}
    stage._prepare_waiting()
    later = _stage()
    later.stage, later.runners = 1, {1: Runner()}
    later._backlog.append(_step_message(2, tokens_from=0))
    later._prepare_waiting()
    assert later.runners[1].prepared == [], "waiting for tokens is stage 0's; the others prepare plans"


def test_a_step_prepared_ahead_runs_as_one_prepared_when_it_runs(tiny_checkpoints) -> None:
    import torch

    from pipeserve.worker.step import SeqSampling
    from tests.test_model_numerics import make_runner
    runner = make_runner(tiny_checkpoints("llama_tied_gqa"))
    calls = []
    prepare = runner._prepare
    runner._prepare = lambda step: calls.append(step.step_id) or prepare(step)
    greedy = SeqSampling(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, step_index=0)
    prompt = StepInput(0, [SeqStep(1, [5, 9, 11, 4], 0, [0, 1], greedy)])
    first = runner.execute(prompt).sampled[0].token_id
    plain, ahead = (StepInput(i, [SeqStep(1, [first], 4, [0, 1], greedy)], tokens_from=0) for i in (1, 2))
    runner.prepare_ahead(ahead)
    runner.prepare_ahead(ahead)                    # once
    assert calls == [0, 2]
    out_ahead = runner.forward_logits(ahead)
    assert calls == [0, 2], "the forward used what was prepared"
    out_plain = runner.forward_logits(plain)       # the same position again: the same KV written
    assert calls == [0, 2, 1] and torch.equal(out_ahead, out_plain)
    assert "_prepared" not in ahead.__dict__


# -- plans: the other stages get each step ahead of its activations (HOP = its id) --
def _hop(step_id: int, chunk: int = 1) -> Message:
    return Message(1, Kind.HOP, Hop(step_id, chunk, []), None, 0.0)


def _worker(stage: int, chunks: tuple[int, ...], num_stages: int = 2) -> StageWorker:
    spec = types.SimpleNamespace(config=types.SimpleNamespace(device="cpu"), num_stages=num_stages,
                                 partition=[(0, 1)] * (num_stages * len(chunks)))
    return StageWorker(spec, stage, {c: None for c in chunks}, transport=None)


def test_a_hop_waits_for_its_plan_and_runs_the_planned_step() -> None:
    stage = _worker(1, (1,))
    stage._busy = True                 # nothing is handled here: the picks and the bookkeeping
    hop = _hop(4)
    stage._arrived(hop)
    assert stage._pick() is None, "its plan is still on its way (another connection)"
    stage._arrived(Message(0, Kind.FLUSH, None, None, 0.0))
    assert stage._pick() == 1, "other messages pass it"
    stage._backlog.pop()
    step = StepInput(4, [SeqStep(7, [0], 3, [0])])
    stage._arrived(Message(0, Kind.PLAN, step, None, 0.0))
    assert stage._pick() == 0 and stage._plans[4] is step
    env = stage._envelope(hop)
    assert env.step is step and env.chunk == 1 and not stage._plans, "this stage's last chunk of it: dropped"
    for step_id in range(StageWorker.MAX_PLANS + 5):   # plans whose steps failed upstream: bounded
        stage._plan_arrived(StepInput(step_id, []))
    assert len(stage._plans) == StageWorker.MAX_PLANS and min(stage._plans) == 5

    idle = _worker(1, (1,))               # idle: the plan's arrival runs the hop that waited for it
    handled = []
    idle._handle = handled.append
    idle._arrived(hop)
    assert handled == [] and list(idle._backlog) == [hop]
    idle._plan_arrived(step)
    assert handled == [hop] and not idle._backlog and not idle._busy


def test_a_step_stays_planned_while_a_later_chunk_of_it_runs_on_the_stage() -> None:
    """Interleaved (V = 2 at P = 2): stage 0 runs chunks 0 and 2, the driver's STEP and then a hop
    back round the ring; P = 1 hands its chunks to itself in memory, so it keeps nothing."""
    step = StepInput(9, [SeqStep(7, [0], 3, [0])])
    first = _worker(0, (0, 2))
    assert first._envelope(Message(0, Kind.STEP, StepEnvelope(step, 0), None, 0.0)).step is step
    assert first._plans[9] is step
    assert first._envelope(_hop(9, chunk=2)).step is step and not first._plans
    later = _worker(1, (1, 3))
    later._plans[9] = step                  # the driver's plan
    assert later._envelope(_hop(9, chunk=1)).step is step and later._plans[9] is step
    assert later._envelope(_hop(9, chunk=3)).step is step and not later._plans
    alone = _worker(0, (0, 1), num_stages=1)
    alone._envelope(Message(1, Kind.STEP, StepEnvelope(step, 0), None, 0.0))
    assert not alone._plans


def test_an_idle_stage_prepares_a_plan_as_it_comes() -> None:
    class Runner:
        def __init__(self):
            self.prepared = []

        def prepare_ahead(self, step):
            self.prepared.append(step.step_id)

    stage = _worker(1, (1,))
    stage.runners = {1: Runner()}
    stage._plan_arrived(StepInput(3, [SeqStep(7, [0], 3, [0])]))
    assert stage.runners[1].prepared == [3] and not stage._busy
    stage._busy = True                    # computing: kept, prepared before it goes idle
    stage._plan_arrived(StepInput(4, [SeqStep(7, [0], 4, [0])]))
    assert stage.runners[1].prepared == [3]


# -- the engine, end to end ----------------------------------------------------
REQUESTS = [   # one at a time: one live sequence, two micro-batch slots at PP = 2
    dict(temperature=0.0, max_tokens=20),
    dict(temperature=0.9, seed=7, max_tokens=20),           # the generator follows the step index
    dict(temperature=0.9, seed=3, top_k=20, min_tokens=6, max_tokens=12, stop_token_ids=None),
    dict(temperature=0.0, max_tokens=2),
]


def _run(llm, prompt: str, stop_at: int | None = None) -> list[list[int]]:
    from pipeserve import SamplingParams
    out = []
    for kw in REQUESTS:
        out.append(llm.generate([prompt], SamplingParams(**kw))[0].outputs[0].token_ids)
    # A stop token met half-way: the decode ahead of the next position computes for nothing.
    stop = out[0][stop_at if stop_at is not None else 5]
    out.append(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20,
                                                     stop_token_ids=[stop]))[0].outputs[0].token_ids)
    # min_tokens bans that stop token for the first 8 outputs, counting the ones in flight.
    out.append(llm.generate([prompt], SamplingParams(temperature=0.9, seed=11, max_tokens=14, min_tokens=8,
                                                     stop_token_ids=[stop]))[0].outputs[0].token_ids)
    out.append(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0].token_ids)
    # Many sequences: every micro-batch's next decode goes ahead while nothing waits; sequences
    # stop at different points (length, the stop token) and the chains go on without them.
    prompts = [prompt[:n] for n in (12, 20, 28, 36, 44, 52)]
    batch = [SamplingParams(temperature=0.0, max_tokens=m, stop_token_ids=[stop] if m % 2 else None)
             for m in (9, 14, 17, 22, 25, 30)]
    out += [o.outputs[0].token_ids for o in llm.generate(prompts, batch)]
    return out


def test_decode_ahead_gives_the_tokens_of_pp1(tiny_checkpoints) -> None:
    from pipeserve import LLM
    path = str(tiny_checkpoints("llama_tied_gqa"))
    prompt = "a stage holds its layers and passes them on"
    outputs, ahead = {}, {}
    for pp, on in ((1, True), (2, True), (2, False)):
        with LLM(model=path, pipeline_parallel_size=pp, dtype="float32", kv_cache_memory="8MiB",
                 threads_per_stage=1, pp_decode_ahead=on) as llm:
            outputs[pp, on] = _run(llm, prompt)
            ahead[pp, on] = llm.stats()["scheduler"]["num_decodes_ahead"]
            engine = llm.engine
            assert not engine._inflight and not engine._forwarding
            engine.scheduler.block_manager.check_integrity()
    assert outputs[2, True] == outputs[1, True] == outputs[2, False]
    stop = outputs[1, True][0][5]
    assert outputs[1, True][4][-1] == stop and len(outputs[1, True][4]) <= 6
    assert stop not in outputs[1, True][5][:8]
    assert ahead[1, True] == 0 and ahead[2, False] == 0
    # Every decode ran ahead: the prompt's step already hands its token to stage 0.
    assert ahead[2, True] >= sum(len(o) - 1 for o in outputs[2, True][:7])


def test_decodes_ahead_only_while_every_live_sequence_is_in_flight() -> None:
    """The engine chains decodes ahead only then: otherwise the chains would keep every slot
    and a waiting request, or a prompt between its chunks, would never get one."""
    eng = FakeEngine(num_blocks=16, max_inflight=2, max_num_batched_tokens=8, pipeline_prompt_chunks=False)
    seq = eng.add(list(range(12)), max_tokens=3).seqs[0]
    assert not eng.sched.all_in_flight(), "a request waits"
    eng.submit()
    assert eng.sched.all_in_flight()
    eng.complete_oldest()
    assert seq.num_computed_tokens == 8 and not eng.sched.all_in_flight(), "between its prompt's chunks"
    eng.submit()
    assert eng.sched.all_in_flight()
    eng.drain()
    eng.assert_clean()


def test_a_stage_killed_with_a_decode_ahead_waiting_costs_a_pause(tiny_checkpoints) -> None:
    """Stage 1 dies while stage 0 holds a decode ahead for its tokens: both steps are lost,
    the pipeline is restarted and the request replayed; its tokens are the undisturbed run's."""
    import os
    import signal
    import threading
    import time

    from pipeserve import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(5, 40))}
    with LLM(model=str(tiny_checkpoints("llama_tied_gqa")), pipeline_parallel_size=2, dtype="float32",
             kv_cache_memory="8MiB", threads_per_stage=1, stage_timeout=20.0) as llm:
        reference = llm.generate([prompt], params)[0].outputs[0].token_ids
        engine = llm.engine
        counters = engine.scheduler._counters      # read from another thread: a plain int, not stats()
        base = counters["decodes_ahead"]
        victim = engine.stage_pids[1]

        def kill_mid_run() -> None:
            deadline = time.monotonic() + 60
            while counters["decodes_ahead"] < base + 40 and time.monotonic() < deadline:
                time.sleep(0.0005)
            os.kill(victim, signal.SIGKILL)

        killer = threading.Thread(target=kill_mid_run)
        killer.start()
        out = llm.generate([prompt], params)[0]
        killer.join()
        recovery = llm.stats()["recovery"]
    assert recovery["stage_restarts"] == 1, "the kill came after the request had finished: make it longer"
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == reference
