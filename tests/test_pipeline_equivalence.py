"""Greedy float32 output of the pipeline equals PP = 1 for every schedule and
partition, through the public ``LLM`` API; a killed stage fails every request
cleanly."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pipeserve import LLM, SamplingParams
from tests.procs import descendants, stage_processes
from tests.test_engine_behaviour import random_prompts, token_lists

GREEDY = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
SCHEDULE_FLAGS = {"async": {}, "gpipe": {"pp_micro_batches": 3}, "interleaved": {"pp_virtual_stages": 2}}


def manual_split(pp: int, layers: int, virtual: int = 1) -> str:
    """An uneven split: the first chunk gets the remainder, and one more layer
    from the last chunk that can spare one."""
    parts = pp * virtual
    counts = [layers // parts] * parts
    counts[0] += layers - sum(counts)
    spare = [j for j in range(1, parts) if counts[j] > 1]
    if spare:
        counts[spare[-1]] -= 1
        counts[0] += 1
    return ",".join(str(c) for c in counts)


def run(model: str, prompts, **kwargs) -> list[list[int]]:
    with LLM(model=model, dtype="float32", kv_cache_memory="64MiB", threads_per_stage=1, **kwargs) as llm:
        return token_lists(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY))


@pytest.fixture(scope="module")
def qwen2(tiny_checkpoints):
    path = str(tiny_checkpoints("qwen2_bias"))
    prompts = random_prompts(6, seed=11)
    return path, prompts, run(path, prompts)


# The tiny model has 4 layers, so interleaving (2 chunks a stage) runs at PP = 2 only. Every
# PP and schedule with two partitions, every schedule with every partition (uniform with
# interleaved in the SmolLM2 cases below): each case is an engine start.
TINY_CASES = [(2, "async", "uniform"), (2, "async", "auto"), (2, "gpipe", "uniform"), (2, "gpipe", "manual"),
              (2, "interleaved", "auto"), (2, "interleaved", "manual"), (3, "async", "manual"),
              (3, "gpipe", "auto")]


@pytest.mark.parametrize("pp,schedule,partition", TINY_CASES, ids=[f"{p}-pp{n}-{s}" for n, s, p in TINY_CASES])
def test_tiny_qwen2_pipeline_equals_single_stage(qwen2, pp, schedule, partition):
    assert_matches_single_stage(qwen2, 4, pp, schedule, SCHEDULE_FLAGS[schedule], partition)


def assert_matches_single_stage(case, num_layers: int, pp: int, schedule: str, extra: dict,
                                partition: str) -> None:
    """``case`` is (model path, prompts, PP = 1 tokens); "manual" becomes an uneven split."""
    path, prompts, reference = case
    virtual = extra.get("pp_virtual_stages", 1)
    split = manual_split(pp, num_layers, virtual) if partition == "manual" else partition
    got = run(path, prompts, pipeline_parallel_size=pp, pp_schedule=schedule, pp_partition=split, **extra)
    assert got == reference


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, smollm2_kept_reference):
    prompts, tokens, _ = smollm2_kept_reference
    return str(smollm2_gguf), prompts, tokens


# Each schedule and each partition once, at PP = 2 and 3: an engine start costs SmolLM2 far
# more than its tokens, and the tiny model above runs every combination.
@pytest.mark.parametrize("pp,schedule,extra,partition", [
    (2, "gpipe", {"pp_micro_batches": 2}, "auto"),
    (3, "async", {}, "manual"),
    (3, "interleaved", {"pp_virtual_stages": 2}, "uniform"),
])
def test_smollm2_pipeline_equals_single_stage(smollm2, pp, schedule, extra, partition):
    assert_matches_single_stage(smollm2, 30, pp, schedule, extra, partition)


def test_killed_stage_fails_every_request_and_leaves_no_process(qwen2):
    """--max-stage-restarts 0: a dead stage ends every request with a clear error (no recovery)."""
    path, prompts, _ = qwen2
    llm = LLM(model=path, dtype="float32", kv_cache_memory="64MiB", pipeline_parallel_size=2,
              threads_per_stage=1, stage_timeout=10, max_stage_restarts=0)
    pids = [p.pid for p in llm.engine.executor.procs.values()]
    victim = llm.engine.executor.procs[1]
    engine_step, steps = llm.engine.step, []

    def step(*args, **kwargs):   # the kill at the 20th engine step: mid-generation on any host (a
        steps.append(1)          # timer of 1 s lost the race once the 400 tokens took 0.99 s)
        if len(steps) == 20:
            victim.kill()
        return engine_step(*args, **kwargs)

    llm.engine.step = step
    start = time.monotonic()
    try:
        long = SamplingParams(temperature=0, max_tokens=400, min_tokens=400)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], long)
    finally:
        llm.shutdown()
    assert time.monotonic() - start < 10 + 5
    assert all(o.finished and o.outputs[0].finish_reason == "error" for o in outs)
    # The victim's neighbour may notice first (its send fails): either is named.
    assert all("pipeline stage" in o.error and "died" in o.error for o in outs), outs[0].error
    assert not llm.engine.healthy
    assert not descendants(os.getpid()) & set(pids)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_tokenizer_that_fails_to_load_stops_the_stages_it_overlapped(qwen2, tmp_path):
    """The tokenizer loads while the stages start: when it fails, the stages are stopped
    and its error is the one raised."""
    path, _, _ = qwen2
    for name in ("config.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((Path(path) / name).read_bytes())
    (tmp_path / "tokenizer.json").write_text("{not json")
    before = stage_processes(os.getpid())
    with pytest.raises(Exception) as raised:
        LLM(model=path, tokenizer=str(tmp_path), dtype="float32", kv_cache_memory="16MiB",
            pipeline_parallel_size=2, threads_per_stage=1)
    assert "pipeline stage" not in str(raised.value)
    assert stage_processes(os.getpid()) <= before
