"""The pipeline runtime with real stage processes: outputs equal PP = 1, stages
overlap, GPipe bubbles match (P-1)/(M+P-1), and failures end cleanly."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time

import pytest
import torch

from pipeserve.config import EngineConfig
from pipeserve.metrics.timeline import overlapping_compute
from pipeserve.model.loader import resolve_model
from pipeserve.pipeline.executor import PipelineExecutor
from pipeserve.pipeline.partition import uniform_partition
from pipeserve.pipeline.synthetic import SleepRunner, SyntheticSource, failing_runner
from pipeserve.worker.executor import Executor, ExecutorError
from pipeserve.worker.local_executor import LocalExecutor
from pipeserve.worker.model_runner import ModelRunner
from pipeserve.worker.step import SeqSampling, SeqStep, StepInput
from tests.procs import descendants, stage_processes

# -- a minimal driver loop: greedy decoding, each sequence with its own KV blocks --
BLOCKS_PER_SEQ = 4


def greedy() -> SeqSampling:
    return SeqSampling(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, step_index=0)


def generate(executor: Executor, prompts: list[list[int]], new_tokens: int, micro_batches: int,
             timeout: float = 30.0) -> list[list[int]]:
    """Not the engine: just enough to push real steps through any ``Executor``.
    Prefill then ``new_tokens - 1`` decode rounds; every round submits all
    micro-batches (GPipe style) and waits for them. Returns generated ids per prompt."""
    tokens = [list(p) for p in prompts]
    produced: list[list[int]] = [[] for _ in prompts]
    groups = [list(range(len(prompts)))[g::micro_batches] for g in range(micro_batches)]
    step_id = 0
    for _ in range(new_tokens):
        for group in groups:
            seqs = [_seq_step(i, tokens[i], len(produced[i])) for i in group]
            executor.submit(StepInput(step_id, seqs))
            step_id += 1
        results = _wait_all(executor, timeout)
        for out in results:
            for tok in out.sampled:
                tokens[tok.seq_id].append(tok.token_id)
                produced[tok.seq_id].append(tok.token_id)
    return produced


def _seq_step(i: int, tokens: list[int], num_new: int) -> SeqStep:
    table = list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ))
    if num_new == 0:   # prefill the whole prompt
        return SeqStep(i, list(tokens), 0, table, greedy())
    return SeqStep(i, [tokens[-1]], len(tokens) - 1, table, greedy())


def _wait_all(executor: Executor, timeout: float) -> list:
    results = []
    while executor.num_inflight:
        got = executor.wait(timeout)
        if not got:
            raise TimeoutError(f"no step finished within {timeout} s")
        results.extend(got)
    return results


PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], [1, 2, 3, 4, 5, 6], [300, 12, 77, 8, 9, 10, 64],
           [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]
NEW_TOKENS = 5
NUM_BLOCKS = BLOCKS_PER_SEQ * len(PROMPTS)


def config(pp: int, **kw) -> EngineConfig:
    base = dict(pipeline_parallel_size=pp, dtype="float32", block_size=16, threads_per_stage=1,
                stage_timeout=20.0, rendezvous_timeout=60.0)
    return EngineConfig(**{**base, **kw})


def assert_no_process_left(pids: list[int]) -> None:
    assert not descendants(os.getpid()) & set(pids)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    source = resolve_model(str(tiny_checkpoints("llama_tied_gqa")))
    return source, source.load_config()


@pytest.fixture(scope="module")
def reference(tiny) -> list[list[int]]:
    """PP = 1: one in-process runner over all layers."""
    source, cfg = tiny
    runner = ModelRunner(source, cfg, start_layer=0, end_layer=cfg.num_layers, is_first=True, is_last=True,
                         dtype=torch.float32, device=torch.device("cpu"), num_blocks=NUM_BLOCKS,
                         num_host_blocks=0, block_size=16)
    return generate(LocalExecutor(runner), PROMPTS, NEW_TOKENS, micro_batches=1)


@pytest.mark.parametrize("pp,virtual", [(2, 1), (3, 1), (2, 2)])
def test_pipeline_matches_single_stage(tiny, reference, pp: int, virtual: int) -> None:
    source, cfg = tiny
    schedule = "interleaved" if virtual > 1 else "async"
    conf = config(pp, pp_schedule=schedule, pp_virtual_stages=virtual, pp_max_inflight=len(PROMPTS))
    ex = PipelineExecutor(conf, source, cfg, uniform_partition(cfg.num_layers, pp * virtual),
                          NUM_BLOCKS, 0)
    pids = [p.pid for p in ex.procs.values()]
    try:
        out = generate(ex, PROMPTS, NEW_TOKENS, micro_batches=len(PROMPTS))
        stats = ex.stats()
    finally:
        ex.shutdown()
    assert out == reference
    assert [p.exitcode for p in ex.procs.values()] == [0] * pp   # clean stop, no abort at exit
    assert stats["steps_completed"] == NEW_TOKENS * len(PROMPTS)
    assert [s["steps"] for s in stats["stages"]] == [NEW_TOKENS * len(PROMPTS) * virtual] * pp
    # The tiny model computes in well under a millisecond, so whether two of
    # its stages happen to compute at once is luck: the overlap is asserted
    # with a fixed compute time in test_async_micro_batches_overlap.
    overlap = overlapping_compute(ex.timeline.intervals())
    print(f"PP={pp} V={virtual}: overlapping compute {overlap * 1e3:.2f} ms, stats {stats}")
    assert_no_process_left(pids)


@pytest.fixture(scope="module")
def sleepers():
    """Stage processes with a fixed 0.2 s compute per micro-batch, started once per P
    and shared by the schedule tests (the kill test uses P = 2 last: it ends it)."""
    made: dict[int, PipelineExecutor] = {}

    def get(pp: int) -> PipelineExecutor:
        if pp not in made or not made[pp].healthy:
            cfg = _synthetic_cfg()
            conf = config(pp, pp_schedule="gpipe", pp_micro_batches=2 * pp, stage_timeout=30.0)
            made[pp] = PipelineExecutor(conf, SyntheticSource(step_seconds=0.2), cfg,
                                        uniform_partition(cfg.num_layers, pp), 8, 0, runner_factory=SleepRunner)
        made[pp].timeline.clear()
        return made[pp]
    yield get
    for ex in made.values():
        ex.shutdown()


@pytest.mark.parametrize("pp,m", [(2, 4), (3, 6)])
def test_gpipe_bubble_matches_the_formula(sleepers, pp: int, m: int, tmp_path) -> None:
    ex = sleepers(pp)
    cfg = _synthetic_cfg()
    assert ex.max_inflight == m
    for j in range(m):
        ex.submit(StepInput(j, [SeqStep(j, [10 * j], 0, [0], greedy())]))
    outs = ex.wait_all(timeout=30)
    stats = ex.stats()
    assert sorted((o.step_id, o.sampled[0].token_id) for o in outs) == \
        [(j, 10 * j + cfg.num_layers) for j in range(m)]
    expected = (pp - 1) / (m + pp - 1)
    print(f"GPipe P={pp} M={m}: bubble {stats['bubble_ratio']:.3f} (formula {expected:.3f}), "
          f"per stage {[round(s['bubble_ratio'], 3) for s in stats['stages']]}, window {stats['window_s']:.3f} s")
    assert abs(stats["bubble_ratio"] - expected) < 0.05
    json_path, png_path = ex.write_trace(tmp_path / "trace.json")
    assert json_path.stat().st_size > 0 and png_path.read_bytes()[:4] == b"\x89PNG"


def test_async_micro_batches_overlap(sleepers) -> None:
    """Keep P micro-batches in flight (the async schedule): all stages compute at once."""
    ex = sleepers(3)
    submitted, finished = 0, []
    while len(finished) < 9:
        while submitted < 9 and ex.num_inflight < 3:
            ex.submit(StepInput(submitted, [SeqStep(submitted, [submitted], 0, [0], greedy())]))
            submitted += 1
        finished += ex.wait(timeout=10)
    stats = ex.stats()
    assert sorted(o.step_id for o in finished) == list(range(9))
    overlap = overlapping_compute(ex.timeline.intervals())
    print(f"async P=3, 9 micro-batches of 0.2 s per stage: >=2 stages computing for {overlap:.3f} s "
          f"of {stats['window_s']:.3f} s; bubble {stats['bubble_ratio']:.3f}")
    assert overlap > 1.2          # ideal: 1.8 s of the 2.2 s window
    assert stats["bubble_ratio"] < 0.3   # ideal (P-1)/(N+P-1) = 2/11


def test_trace_file_is_written_at_shutdown(tmp_path) -> None:
    cfg = _synthetic_cfg()
    trace = tmp_path / "pp.json"
    ex = PipelineExecutor(config(2, trace_file=str(trace)), SyntheticSource(step_seconds=0.01), cfg,
                          uniform_partition(cfg.num_layers, 2), 8, 0, runner_factory=SleepRunner)
    try:
        ex.submit(StepInput(0, [SeqStep(0, [1], 4, [0], greedy()), SeqStep(1, [5, 6, 7], 0, [1], greedy())]))
        assert len(ex.wait_all(timeout=10)) == 1
    finally:
        ex.shutdown()
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"stage 0 compute", "stage 1 compute"} <= tracks
    assert trace.with_suffix(".png").exists()
    # each compute slice says what its step carried (benchmarks/pp_trace_gaps.py fits on it)
    computes = [e["args"] for e in events if e.get("cat") == "compute"]
    assert [a.pop("chunk") for a in computes] == [0, 1] and all(
        a == {"step_id": 0, "decodes": 1, "decode_context": 5, "prompt_tokens": 3, "prompts": 1, "swap_in": 0,
              "swap_out": 0} for a in computes)


def test_streaming_sleep_runner_samples_as_the_sleeping_one() -> None:
    """``stream_mib`` (benchmarks/pp_hop_latency.py --compute-ms) changes how the time is
    spent, not what the stand-in computes."""
    kw = dict(start_layer=0, end_layer=6, is_first=True, is_last=True, dtype=torch.float32,
              device=torch.device("cpu"), num_blocks=8, num_host_blocks=0, block_size=16)
    step = StepInput(0, [SeqStep(0, [5, 6], 0, [0], greedy())])
    outs = [SleepRunner(SyntheticSource(step_seconds=0.001, stream_mib=mib), _synthetic_cfg(), **kw).execute(step)
            for mib in (0, 1)]
    assert outs[0] == outs[1] and outs[0].sampled


def _synthetic_cfg():
    from pipeserve.model.config import ModelConfig
    return ModelConfig("LlamaForCausalLM", vocab_size=1000, hidden_size=32, intermediate_size=64,
                       num_layers=6, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512)


def _sleep_executor(pp: int, **kw) -> PipelineExecutor:
    cfg = _synthetic_cfg()
    return PipelineExecutor(config(pp, **kw), SyntheticSource(step_seconds=0.3), cfg,
                            uniform_partition(cfg.num_layers, pp), 8, 0, runner_factory=SleepRunner)


def _submit_some(ex: PipelineExecutor, n: int) -> None:
    for j in range(n):
        ex.submit(StepInput(j, [SeqStep(j, [j], 0, [0], greedy())]))


def test_killed_stage_raises_and_leaves_no_process(sleepers) -> None:
    ex = sleepers(2)
    pids = [p.pid for p in ex.procs.values()]
    try:
        _submit_some(ex, 2)
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ExecutorError, match=r"stage 1 .*SIGKILL"):
            while True:
                ex.wait(timeout=5.0)
        assert time.monotonic() - start < 5.0
        assert not ex.healthy
        with pytest.raises(ExecutorError):
            ex.submit(StepInput(9, []))
    finally:
        t = time.monotonic()
        ex.shutdown()
        assert time.monotonic() - t < 10.0
    assert_no_process_left(pids)


def test_silent_stage_times_out_and_is_named() -> None:
    ex = _sleep_executor(2, stage_timeout=1.5)
    pids = [p.pid for p in ex.procs.values()]
    try:
        os.kill(pids[0], signal.SIGSTOP)   # alive but silent
        _submit_some(ex, 1)
        start = time.monotonic()
        with pytest.raises(ExecutorError, match=r"stage\(s\) \[0\] did not answer"):
            while True:
                ex.wait(timeout=5.0)
        assert time.monotonic() - start < 1.5 + 2.0 + 1.0   # timeout + ping grace + slack
    finally:
        ex.shutdown()
    assert_no_process_left(pids)


def _slow_executor(source: SyntheticSource, stage_timeout: float) -> PipelineExecutor:
    cfg = _synthetic_cfg()
    return PipelineExecutor(config(2, stage_timeout=stage_timeout), source, cfg,
                            uniform_partition(cfg.num_layers, 2), 8, 0, runner_factory=SleepRunner)


def _prompt_step() -> StepInput:
    """A prompt chunk: stage 0 runs it on its main thread (a decode's step runs on the thread
    that read it, which also reads the driver's pings)."""
    return StepInput(0, [SeqStep(0, [3] * 100, 0, list(range(7)), greedy())])


def test_a_step_longer_than_the_stage_timeout_is_waited_for(caplog) -> None:
    """--stage-timeout counts silence, not slowness: a step that computes (and uses the CPU) for
    longer than it, as a 70B prompt chunk on an old CPU does, is waited for; the stages answer
    the watchdog's pings while they compute."""
    ex = _slow_executor(SyntheticSource(step_seconds=2.0, stream_mib=64), stage_timeout=0.6)
    pids = [p.pid for p in ex.procs.values()]
    try:
        with caplog.at_level("WARNING", logger="pipeserve.pipeline.watchdog"):
            ex.submit(_prompt_step())
            outputs = _wait_all(ex, 30.0)
        assert [o.step_id for o in outputs] == [0] and ex.healthy
        assert "has computed a step for" in caplog.text
    finally:
        ex.shutdown()
    assert_no_process_left(pids)


def test_a_step_that_uses_no_cpu_past_the_stage_timeout_is_frozen() -> None:
    """A stage that answers pings but whose step has run for --stage-timeout without using the
    CPU (a deadlock; here a runner that sleeps) is named as frozen."""
    ex = _slow_executor(SyntheticSource(step_seconds=60.0), stage_timeout=1.0)
    pids = [p.pid for p in ex.procs.values()]
    try:
        ex.submit(_prompt_step())
        start = time.monotonic()
        with pytest.raises(ExecutorError, match=r"stage\(s\) \[0\] frozen: a step has run \d+ s there"):
            while True:
                ex.wait(timeout=5.0)
        assert time.monotonic() - start < 3 * 1.0 + 2 * 2.0 + 2.0   # two looks, their pings, slack
    finally:
        ex.shutdown()
    assert_no_process_left(pids)


def test_a_load_longer_than_the_rendezvous_timeout_is_waited_for_while_it_progresses(caplog) -> None:
    """--rendezvous-timeout counts a load's silence: a stage that loads for longer (a 70B share off
    a slow disk) but sends heartbeats that show its CPU time or bytes read moving is waited for;
    one whose heartbeats show nothing moving is named."""
    cfg = _synthetic_cfg()
    conf = config(2, rendezvous_timeout=0.8)
    ex = PipelineExecutor(conf, SyntheticSource(step_seconds=0.0, load_seconds=3.0), cfg,
                          uniform_partition(cfg.num_layers, 2), 8, 0, runner_factory=SleepRunner)
    try:
        ex.submit(StepInput(0, [SeqStep(0, [3], 0, [0], greedy())]))
        assert [o.step_id for o in _wait_all(ex, 30.0)] == [0]
    finally:
        ex.shutdown()
    start = time.monotonic()
    with pytest.raises(ExecutorError, match=r"stage\(s\) \[0, 1\] did not finish loading and showed no "
                                            r"progress \(CPU time or bytes read\) for 0.8 s"):
        PipelineExecutor(conf, SyntheticSource(load_seconds=60.0, load_idle=True), cfg,
                         uniform_partition(cfg.num_layers, 2), 8, 0, runner_factory=SleepRunner)
    assert time.monotonic() - start < 20.0


def test_stage_that_fails_to_load_is_reported() -> None:
    cfg = _synthetic_cfg()
    before = stage_processes(os.getpid())
    with pytest.raises(ExecutorError, match=r"(?s)failed to start:.*no such weights"):
        PipelineExecutor(config(2), SyntheticSource(), cfg, uniform_partition(cfg.num_layers, 2), 8, 0,
                         runner_factory=failing_runner)
    assert stage_processes(os.getpid()) <= before


def test_bad_partition_is_refused_before_spawning() -> None:
    cfg = _synthetic_cfg()
    with pytest.raises(ValueError, match="covers 5 layers"):
        PipelineExecutor(config(2), SyntheticSource(), cfg, [(0, 2), (2, 5)], 8, 0, runner_factory=SleepRunner)


def test_llm_with_two_stages_matches_one(tiny_checkpoints) -> None:
    """Through the engine: pipeserve.LLM(..., pipeline_parallel_size=2) == PP = 1, greedy."""
    from pipeserve import LLM, SamplingParams
    path = str(tiny_checkpoints("llama_tied_gqa"))
    prompts = ["hello world", "the quick brown fox", "tokens flow", "a stage holds its layers"]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    outputs = {}
    for pp in (1, 2):
        with LLM(model=path, pipeline_parallel_size=pp, dtype="float32", kv_cache_memory="8MiB",
                 threads_per_stage=1) as llm:
            outputs[pp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            if pp == 2:
                stats = llm.stats()["pipeline"]
    assert outputs[2] == outputs[1]
    assert stats["steps_completed"] > 0 and len(stats["stages"]) == 2


_STEP_BUFFERS_PROBE = """
import resource, sys, torch
from pipeserve.pipeline.stage_process import keep_step_buffers
if sys.argv[1] == "tuned":
    assert keep_step_buffers()
def faults_of_a_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(48 << 18, dtype=torch.float32)   # 48 MiB: above glibc's 32 MiB mmap cap
    x.fill_(1.0)
    del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_a_step()
print(min(faults_of_a_step() for _ in range(3)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="keep_step_buffers tunes glibc's malloc; this C library has its own allocator")
def test_a_loaded_stage_reuses_its_large_step_buffers():
    """After keep_step_buffers a 48 MiB buffer freed and taken again faults (almost) no pages in;
    with glibc's defaults every page of it faults in again. In a child process each: the
    thresholds are process-wide."""
    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _STEP_BUFFERS_PROBE, mode], capture_output=True, text=True,
                             check=True, timeout=120)
        return int(out.stdout.split()[-1])
    default, tuned = faults("default"), faults("tuned")
    assert default >= 20 and tuned * 4 < default, (default, tuned)   # 12288 4 KiB pages, or 24 huge ones
