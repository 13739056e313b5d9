"""--pp-lm-head: the first and last stage share the LM head, step by step (pipeline/lm_head.py).

Which configurations share it, how the driver places each step's head, the partition it
implies, and, through the public ``LLM`` API, float32 greedy tokens identical to PP = 1 with the
head shared (tied and untied heads, decode ahead, GPipe, three stages) and no extra resident
bytes on stage 0 when the head is the embedding."""

from __future__ import annotations

import pytest
import torch

from pipeserve import LLM, SamplingParams
from pipeserve.config import EngineConfig
from pipeserve.model.config import ModelConfig
from pipeserve.pipeline.lm_head import HeadBalance, resolve_lm_head
from pipeserve.pipeline.partition import choose_partition, shape_costs, stage_times
from pipeserve.sampling.inputs import SeqSampling
from pipeserve.worker.step import SeqStep, StepInput
from tests.test_engine_behaviour import random_prompts, token_lists

SMOL = dict(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
            num_kv_heads=3, head_dim=64, max_position_embeddings=8192)


def smol_cfg(tied: bool = True) -> ModelConfig:
    return ModelConfig(**SMOL, tie_word_embeddings=tied)


def config(**kw) -> EngineConfig:
    return EngineConfig(**{"pipeline_parallel_size": 2, **kw})


@pytest.mark.parametrize("kw,tied,expected", [
    ({}, True, "shared"),                                              # auto, head tied: no memory cost
    ({}, False, "last"),                                               # auto, untied: would copy the head
    ({"pp_lm_head": "shared"}, False, "shared"),                       # asked for: stage 0 loads a copy
    ({"pp_lm_head": "last"}, True, "last"),
    ({"pipeline_parallel_size": 1}, True, "last"),
    ({"pp_schedule": "interleaved", "pp_virtual_stages": 2}, True, "last"),
    ({"tensor_parallel_size": 2}, True, "last"),
    ({"pp_schedule": "gpipe"}, True, "shared"),
    ({"pipeline_parallel_size": 3}, True, "shared"),
])
def test_resolve_lm_head(kw, tied, expected):
    assert resolve_lm_head(config(**kw), smol_cfg(tied)) == expected


@pytest.mark.parametrize("kw,why", [
    ({"pipeline_parallel_size": 1}, "PP = 1"),
    ({"pp_schedule": "interleaved", "pp_virtual_stages": 2}, "interleaved"),
    ({"tensor_parallel_size": 2}, "tensor-parallel"),
])
def test_shared_is_refused_where_it_cannot_apply(kw, why):
    with pytest.raises(ValueError, match=f"--pp-lm-head shared does not apply: .*{why}"):
        resolve_lm_head(config(pp_lm_head="shared", **kw), smol_cfg())
    with pytest.raises(ValueError, match="custom runner"):
        resolve_lm_head(config(pp_lm_head="shared"), smol_cfg(), runner_factory=object)
    with pytest.raises(ValueError, match="--pp-lm-head must be auto, last or shared"):
        config(pp_lm_head="first")


def step(step_id: int, prompt_lens: list[int], decodes: int, sample_prompts: bool = True) -> StepInput:
    sampling = SeqSampling(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, step_index=0)
    seqs = [SeqStep(i, [5] * n, 0, [0], sampling if sample_prompts else None) for i, n in enumerate(prompt_lens)]
    seqs += [SeqStep(100 + i, [7], 40, [1], sampling) for i in range(decodes)]
    return StepInput(step_id, seqs)


def test_equal_layer_counts_alternate_the_heads():
    balance = HeadBalance(smol_cfg(), [(0, 15), (15, 30)])
    placed = []
    for i in range(8):
        s = step(i, [], 16)
        balance.place(s)
        placed.append(s.head_first)
    assert placed == [False, True] * 4
    assert (balance.heads, balance.first_heads) == (8, 4)


def test_the_stage_with_fewer_layers_takes_more_heads():
    """16 / 14 layers: the first stage's two extra layers a token are worth some heads."""
    cfg = smol_cfg()
    for split in ([(0, 16), (16, 30)], [(0, 14), (14, 30)]):
        balance = HeadBalance(cfg, split)
        for i in range(400):
            balance.place(step(i, [], 64))
            assert abs(balance.lead) <= cfg.head_params() * 64     # the carry-over stays bounded
        share = balance.first_heads / balance.heads
        assert 0.2 < share < 0.5 if split[0][1] == 16 else 0.5 < share < 0.8, share


def test_the_heads_move_when_prompts_give_way_to_decodes():
    """16 / 14: while prompts fill the steps stage 0 has the more work and runs no head; once
    only decodes are left the heads come to it at once, not after the prompts' surplus drains."""
    balance = HeadBalance(smol_cfg(), [(0, 16), (16, 30)])
    prompts = [step(i, [900], 60) for i in range(200)]
    for s in prompts:
        balance.place(s)
    assert not any(s.head_first for s in prompts)
    decodes = [step(i, [], 100) for i in range(200, 210)]
    for s in decodes:
        balance.place(s)
    assert sum(s.head_first for s in decodes[:4]) >= 1


def test_a_step_that_samples_nothing_keeps_its_head_off_stage_0():
    balance = HeadBalance(smol_cfg(), [(0, 14), (14, 30)])     # stage 0 would take every head
    s = step(0, [512], 0, sample_prompts=False)                 # a non-final prompt chunk
    balance.place(s)
    assert not s.head_first and balance.heads == 0


def test_partition_with_a_shared_head_balances_the_layers():
    """balanced's shape costs put ~2.7 layers of head on the last stage (16 / 14); shared, each
    end carries half of it (15 / 15), and at PP = 3 the middle stage takes the most layers."""
    import dataclasses
    costs = shape_costs(smol_cfg(), 2)
    assert choose_partition("balanced", 30, 2, costs=costs) == [(0, 16), (16, 30)]
    shared = dataclasses.replace(costs, head_share=0.5)
    assert choose_partition("balanced", 30, 2, costs=shared) == [(0, 15), (15, 30)]
    three = [end - start for start, end in choose_partition("balanced", 30, 3, costs=shared)]
    assert three[1] == max(three) and sum(three) == 30
    # one stage runs the whole head whatever the share
    assert stage_times([(0, 30)], shared) == stage_times([(0, 30)], costs)


def test_an_untied_shared_head_counts_its_copy_on_stage_0():
    import dataclasses

    from pipeserve.pipeline.partition import chunk_bytes
    costs = dataclasses.replace(shape_costs(smol_cfg(tied=False), 2), head_share=0.5, first_head_bytes=1000)
    assert chunk_bytes(costs, 0, 15, True, False) - chunk_bytes(costs, 0, 15, True, False) == 0
    assert chunk_bytes(costs, 0, 15, True, False) == costs.span_bytes(0, 15) + costs.embed_bytes + 1000
    assert chunk_bytes(costs, 0, 30, True, True) == costs.span_bytes(0, 30) + costs.embed_bytes + costs.head_bytes


GREEDY = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)


def run(path: str, prompts, **kw) -> tuple[list[list[int]], dict]:
    with LLM(model=path, dtype="float32", kv_cache_memory="64MiB", threads_per_stage=1, **kw) as llm:
        tokens = token_lists(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY))
        return tokens, llm.stats()


@pytest.fixture(scope="module")
def tied(tiny_checkpoints):
    path = str(tiny_checkpoints("llama_tied_gqa"))
    prompts = random_prompts(6, seed=5)
    return path, prompts, run(path, prompts)[0]


@pytest.fixture(scope="module")
def untied(tiny_checkpoints):
    path = str(tiny_checkpoints("qwen2_bias"))
    prompts = random_prompts(6, seed=7)
    return path, prompts, run(path, prompts)[0]


@pytest.mark.parametrize("kw", [
    {"pipeline_parallel_size": 2},                                     # auto: shared, the head tied
    {"pipeline_parallel_size": 2, "pp_partition": "1,3"},              # stage 0 takes most heads
    {"pipeline_parallel_size": 2, "pp_schedule": "gpipe", "pp_micro_batches": 3},
    {"pipeline_parallel_size": 3, "pp_partition": "1,2,1"},
], ids=["pp2", "pp2-1,3", "pp2-gpipe", "pp3"])
def test_a_shared_tied_head_gives_the_single_stage_tokens(tied, kw):
    path, prompts, reference = tied
    tokens, stats = run(path, prompts, **kw)
    assert tokens == reference
    head = stats["lm_head"]
    assert head["mode"] == "shared"
    assert 0 < head["first_stage"] <= head["steps_sampled"], head
    if "pp_partition" not in kw:     # 2 / 2 layers: the heads alternate; 1 / 3: stage 0 takes them all
        assert head["first_stage"] < head["steps_sampled"], head


def test_an_untied_head_is_shared_when_asked(untied):
    path, prompts, reference = untied
    tokens, stats = run(path, prompts, pipeline_parallel_size=2)
    assert tokens == reference and stats["lm_head"]["mode"] == "last"
    tokens, stats = run(path, prompts, pipeline_parallel_size=2, pp_lm_head="shared")
    assert tokens == reference and stats["lm_head"]["first_stage"] > 0
    last = run(path, prompts, pipeline_parallel_size=2, pp_lm_head="last")[1]
    # stage 0 holds a copy of the head (and the final norm) now: the vocabulary x hidden floats
    grown = stats["weight_bytes"][0] - last["weight_bytes"][0]
    assert grown >= 320 * 64 * 4, (stats["weight_bytes"], last["weight_bytes"])


def test_one_request_keeps_the_head_on_the_last_stage(tied):
    """One sequence: the stages run one after the other, nothing to balance: every head on the
    last stage, whose tokens reach stage 0's decode ahead directly."""
    path, prompts, reference = tied
    tokens, stats = run(path, prompts[:1], pipeline_parallel_size=2)
    assert tokens == reference[:1]
    assert stats["lm_head"] == {"mode": "shared", "steps_sampled": 0, "first_stage": 0}


def test_decodes_ahead_take_their_tokens_from_stage_0s_head(tied):
    """Two sequences at PP = 2 (no more than the micro-batches, so decodes go ahead): the heads
    alternate and the decodes ahead of those stage 0 ran take its tokens."""
    path, prompts, reference = tied
    tokens, stats = run(path, prompts[:2], pipeline_parallel_size=2)
    assert tokens == reference[:2]
    assert stats["lm_head"]["first_stage"] >= 4


def test_a_tied_head_costs_stage_0_no_bytes(smollm2_gguf):
    """The built-in GGUF kept quantized: stage 0's head is its embedding's blocks."""
    sizes = {}
    for mode in ("last", "shared"):
        with LLM(model=str(smollm2_gguf), pipeline_parallel_size=2, pp_partition="15,15", pp_lm_head=mode,
                 kv_cache_memory="32MiB", threads_per_stage=1) as llm:
            sizes[mode] = llm.stats()["weight_bytes"]
    assert sizes["shared"][1] == sizes["last"][1]
    assert 0 <= sizes["shared"][0] - sizes["last"][0] <= 4 * 576 * 2, sizes   # the final norm's weight


def test_sampling_on_stage_0_is_the_last_stages(tied):
    """Seeded random sampling with penalties, logit bias and logprobs gives what PP = 1 gives when
    stage 0 samples half the steps: everything the sampler reads travels in the step."""
    path, prompts, _ = tied
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=10, min_tokens=10, logprobs=2,
                            presence_penalty=0.4, logit_bias={5: 3.0})

    def sample(**kw):
        with LLM(model=path, dtype="float32", kv_cache_memory="64MiB", threads_per_stage=1, **kw) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            return [o.outputs[0] for o in outs], llm.stats()["lm_head"]

    reference, _ = sample()
    shared, head = sample(pipeline_parallel_size=2)
    assert head["first_stage"] > 0
    assert [o.token_ids for o in shared] == [o.token_ids for o in reference]
    for got, want in zip(shared, reference):
        for g, w in zip(got.logprobs, want.logprobs):
            assert g.keys() == w.keys()
            assert all(abs(g[t].logprob - w[t].logprob) < 1e-4 for t in g)


def test_a_dense_tied_head_is_the_embeddings_tensor(tied):
    """float32 safetensors: stage 0 sharing the head adds only the final norm's weight, and a
    stage that holds both (PP = 1) keeps one tensor for the two."""
    from pipeserve.model.loader import load_model, resolve_model
    path, prompts, _ = tied
    sizes = {mode: run(path, prompts[:2], pipeline_parallel_size=2, pp_lm_head=mode)[1]["weight_bytes"]
             for mode in ("last", "shared")}
    assert sizes["shared"][1] == sizes["last"][1]
    assert 0 <= sizes["shared"][0] - sizes["last"][0] <= 64 * 4, sizes
    source = resolve_model(path)
    cfg = source.load_config()
    model = load_model(source, cfg, 0, cfg.num_layers, True, True, torch.float32, "cpu", quantization="none")
    assert model.lm_head.weight is model.embed_tokens.weight


class _Reversing:
    """The pipeline's executor, whose ``wait`` hands back what is done youngest first, holding a
    lone result until another comes: as a step whose head ran on stage 0 may come back after a
    later one's, whatever the timing."""

    def __init__(self, inner) -> None:
        self.inner, self.held = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def wait(self, timeout=None):
        done = self.held + self.inner.wait(timeout)
        self.held = []
        if len(done) == 1 and self.inner.num_inflight:
            self.held = done
            return []
        return sorted(done, key=lambda r: -r.step_id)


def test_results_back_out_of_order_are_taken_in_order(tied):
    """Prompts in pipelined chunks and decodes ahead at PP = 2 with the head shared, their results
    handed back youngest first: the engine takes each sequence's steps in order, same tokens."""
    path, prompts, reference = tied
    with LLM(model=path, dtype="float32", kv_cache_memory="64MiB", threads_per_stage=1, pipeline_parallel_size=2,
             max_num_batched_tokens=32) as llm:
        llm.engine.executor = _Reversing(llm.engine.executor)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert llm.engine.executor.held == [] and not llm.engine._early
    assert token_lists(outs) == reference
