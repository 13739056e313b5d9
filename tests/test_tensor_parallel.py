"""Tensor parallelism inside a stage (--tensor-parallel-size): the shard plan, the refusals,
float32 greedy output equal to transformers at TP = 2 and TP = 2 x PP = 2 with every
schedule, and a killed TP rank recovered like a killed stage."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from pipeserve import LLM, SamplingParams
from pipeserve.config import EngineConfig
from pipeserve.model.config import ModelConfig
from pipeserve.model.tensor_parallel import (check_tensor_parallel, check_tensor_parallel_config, parameter_slices,
                                             plan_shard)
from tests.test_engine_behaviour import NEW, hf_greedy_batch, random_prompts, token_lists

GREEDY = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)

# SmolLM2-135M's attention: 9 query heads over 3 KV heads of 64 dims.
SMOL = ModelConfig("LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                   num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)


# -- the shard plan ------------------------------------------------------------------
def test_uneven_kv_split_keeps_query_groups_with_their_kv_head():
    """3 KV heads over 2 ranks: 2 + 1 KV heads, each with its 3 query heads (6 + 3)."""
    a, b = plan_shard(SMOL, 0, 2), plan_shard(SMOL, 1, 2)
    assert (a.kv_heads, a.q_heads, b.kv_heads, b.q_heads) == ((0, 2), (0, 6), (2, 3), (6, 9))
    # rank 0 has twice the heads, so fewer MLP rows: about equal weights per rank
    assert a.intermediate == (0, 672) and b.intermediate == (672, 1536)
    weights = [2 * 64 * (s.num_q_heads + s.num_kv_heads) + 3 * (s.intermediate[1] - s.intermediate[0])
               for s in (a, b)]
    assert abs(weights[0] - weights[1]) / max(weights) < 0.05
    assert a.vocab == (0, 24576) and b.vocab == (24576, 49152)
    # the fused q/k/v rows of rank 1: its q heads, then its k and v heads
    dim, ranges = parameter_slices(SMOL, b, "layers.0.self_attn.qkv_proj.weight")
    assert dim == 0 and ranges == ((384, 576), (576 + 128, 576 + 192), (768 + 128, 768 + 192))
    assert parameter_slices(SMOL, b, "layers.0.self_attn.o_proj.weight") == (1, ((384, 576),))
    assert parameter_slices(SMOL, b, "layers.0.input_layernorm.weight") is None


def test_fewer_kv_heads_than_ranks_replicates_them():
    one_kv = replace(SMOL, num_heads=4, num_kv_heads=1)
    shards = [plan_shard(one_kv, r, 2) for r in range(2)]
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1)]
    assert [s.q_heads for s in shards] == [(0, 2), (2, 4)]
    two_kv = replace(SMOL, num_heads=4, num_kv_heads=2)   # T = 3: ranks 0, 1 share KV head 0
    shards = [plan_shard(two_kv, r, 3) for r in range(3)]
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2)]
    assert [s.q_heads for s in shards] == [(0, 1), (1, 2), (2, 4)]
    # every query head is held exactly once
    assert sorted(h for s in shards for h in range(*s.q_heads)) == list(range(4))


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="--tensor-parallel-size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="some rank would hold no attention head"):
        check_tensor_parallel(replace(SMOL, num_heads=2, num_kv_heads=1), 3)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        check_tensor_parallel(replace(SMOL, num_experts=8, num_experts_per_tok=2), 2)
    # Kept-quantized weights: refused only where no cut falls on their blocks
    # (tests/test_tensor_parallel_quant.py); SmolLM2's do at 32 and 256 (MLP only).
    from pipeserve.model.tensor_parallel import SplitAlign
    check_tensor_parallel_config(EngineConfig(tensor_parallel_size=2), SMOL, SplitAlign(32, 32))
    with pytest.raises(ValueError, match="o_proj is quantized in blocks of 256"):
        check_tensor_parallel_config(EngineConfig(tensor_parallel_size=2), SMOL, SplitAlign(256, 256))
    check_tensor_parallel_config(EngineConfig(tensor_parallel_size=2, quantization="none"), SMOL)


@pytest.mark.parametrize("kind,tp", [("qwen2_bias", 2), ("llama_tied_gqa", 3)])
def test_shard_reads_equal_cutting_the_full_tensor(tiny_checkpoints, kind, tp):
    """A rank reads only its rows/columns from safetensors (the fused q/k/v and gate/up parts,
    the vocabulary padding included): the same values as cutting the full tensor."""
    import torch

    from pipeserve.model.llama import LlamaModel
    from pipeserve.model.loader import _read_shard, resolve_model
    from pipeserve.model.tensor_parallel import TensorParallelGroup, take_slices
    source = resolve_model(str(tiny_checkpoints(kind)))
    cfg = source.load_config()
    reader = source.open_weights(cfg)
    for rank in range(tp):
        shard = plan_shard(cfg, rank, tp)
        model = LlamaModel(cfg, 0, cfg.num_layers, True, True, torch.float32, "meta",
                           tp=TensorParallelGroup(shard))
        params = dict(model.named_parameters())
        for ours, names in model.checkpoint_names().items():
            (got,) = _read_shard(reader, source, cfg, shard, ours, names)
            full = torch.cat([reader.read(n) for n in names], dim=0)
            cut = parameter_slices(cfg, shard, ours)
            want = full if cut is None else take_slices(full, *cut)
            assert got.shape == want.shape == params[ours].shape, ours
            assert torch.equal(got, want), ours
    reader.close()


def test_shared_memory_all_reduce_sums_in_rank_order(tmp_path):
    """Three ranks (threads here; processes in a stage) over one mapping, several calls in a
    row (both banks reused): every rank gets the same bits, the sum in rank order."""
    import torch

    from pipeserve.model.tensor_parallel import SharedMemoryAllReduce
    path, size = str(tmp_path / "shm"), 3
    ranks = [SharedMemoryAllReduce(path, r, size, 64, torch.float32, create=(r == 0), timeout_s=30)
             for r in range(size)]
    gen = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(4, 16, generator=gen) for _ in range(size)] for _ in range(5)]
    results = [[None] * size for _ in range(5)]

    def work(r: int) -> None:
        for call, xs in enumerate(inputs):
            results[call][r] = ranks[r].all_reduce(xs[r].clone())

    threads = [threading.Thread(target=work, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for call, xs in enumerate(inputs):
        want = xs[0] + xs[1] + xs[2]
        for r in range(size):
            assert torch.equal(results[call][r], want)
    assert not ranks[0].applies(torch.zeros(65)) and not ranks[0].applies(torch.zeros(8, dtype=torch.bfloat16))


def test_follower_refuses_a_spec_not_signed_with_the_cluster_key():
    """The spec names modules a follower imports: one signed with another key is refused
    before anything is decoded or loaded."""
    from datetime import timedelta

    import torch.distributed as dist

    from pipeserve.pipeline.tensor_group import _spec_mac, run_follower
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    store.set("spec", b"[]")
    store.set("spec_mac", _spec_mac(b"the driver's key", b"[]"))
    assert run_follower(0, 1, store.port, b"another key", 10.0) == 2


# -- equal to transformers -------------------------------------------------------------
def outputs(model: str, prompts, params=GREEDY, **kwargs) -> list:
    """The prompts' RequestOutputs from an engine on the tests' small settings."""
    with LLM(model=model, dtype="float32", kv_cache_memory="16MiB", threads_per_stage=1, **kwargs) as llm:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def run(model: str, prompts, params=GREEDY, **kwargs) -> list[list[int]]:
    return token_lists(outputs(model, prompts, params, **kwargs))


# (checkpoint, KV heads) x (TP, PP, schedule): every schedule, 1 and 2 KV heads, Llama and Qwen2.
TINY_CASES = [
    ("llama_tied_gqa", 2, 1, "async", {}),
    ("llama_1kv", 2, 2, "gpipe", {"pp_micro_batches": 2}),
    ("qwen2_bias", 2, 2, "interleaved", {"pp_virtual_stages": 2}),
    ("qwen2_1kv", 2, 1, "gpipe", {"tp_all_reduce": "gloo"}),
    ("llama_tied_gqa", 3, 1, "async", {}),     # uneven: two ranks share KV head 0
]


@pytest.mark.parametrize("kind,tp,pp,schedule,extra", TINY_CASES,
                         ids=[f"{k}-tp{t}-pp{p}-{s}" for k, t, p, s, _ in TINY_CASES])
def test_tiny_tensor_parallel_matches_transformers(tiny_checkpoints, kind, tp, pp, schedule, extra):
    path = tiny_checkpoints(kind)
    prompts = random_prompts(4, seed=21)
    got = run(str(path), prompts, tensor_parallel_size=tp, pipeline_parallel_size=pp, pp_schedule=schedule,
              **extra)
    assert got == hf_greedy_batch(path, prompts)


SMOL_TOKENS = 6


@pytest.mark.parametrize("pp,schedule,extra", [(1, "async", {}), (2, "interleaved", {"pp_virtual_stages": 2})])
def test_smollm2_tensor_parallel_matches_transformers(smollm2_gguf, hf_smollm2, pp, schedule, extra):
    """SmolLM2's 3 KV heads split 2 + 1 over the two ranks (uneven), GGUF dequantized."""
    from tests.test_model_numerics import hf_greedy
    prompts = random_prompts(3, seed=22, vocab=49152)
    got = run(str(smollm2_gguf), prompts, SamplingParams(temperature=0, max_tokens=SMOL_TOKENS,
                                                         min_tokens=SMOL_TOKENS),
              quantization="none", tensor_parallel_size=2, pipeline_parallel_size=pp, pp_schedule=schedule,
              **extra)
    assert got == [hf_greedy(hf_smollm2, p, SMOL_TOKENS) for p in prompts]


# -- a killed TP rank ---------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    """Child processes of ``pid`` (a stage's TP followers are its children)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    if not path.exists():
        pytest.skip("needs Linux /proc/<pid>/task/<pid>/children to find a stage's TP ranks")
    return [int(c) for c in path.read_text().split()]


def test_killed_tp_rank_is_recovered_like_a_killed_stage(tiny_checkpoints):
    """TP = 2 x PP = 2: SIGKILL stage 1's TP rank 1 mid-generation. Its leader exits with a
    message naming the rank, the driver restarts the pipeline and replays: same tokens."""
    path = str(tiny_checkpoints("llama_tied_gqa"))
    prompts = [{"prompt_token_ids": p} for p in random_prompts(8, seed=23)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(model=path, dtype="float32", kv_cache_memory="16MiB", pipeline_parallel_size=2,
              tensor_parallel_size=2, threads_per_stage=1, stage_timeout=20, max_stage_restarts=2,
              max_num_seqs=2)
    try:
        # --kv-cache-memory is per rank: 2 layers x 1 of the 2 KV heads x 16 dims x 4 bytes x K and V
        assert llm.stats()["num_kv_blocks"] == 16 * 2**20 // (16 * 2 * 2 * 1 * 16 * 4)
        reference = token_lists(llm.generate(prompts, params, use_tqdm=False))
        leader = llm.engine.stage_pids[1]
        (victim,) = _children(leader)

        def kill_when_half_admitted() -> None:
            deadline = time.monotonic() + 60
            while llm.engine.scheduler.num_waiting > len(prompts) // 2 - 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            os.kill(victim, signal.SIGKILL)

        killer = threading.Thread(target=kill_when_half_admitted, daemon=True)
        killer.start()
        outs = llm.generate(prompts, params, use_tqdm=False)
        killer.join()
        recovery = llm.stats()["recovery"]
        new_leader = llm.engine.stage_pids[1]
        new_followers = _children(new_leader)
    finally:
        llm.shutdown()
    assert not any(o.error for o in outs)
    assert token_lists(outs) == reference
    assert recovery["stage_restarts"] == 1, recovery
    assert "stage 1" in recovery["last_error"] and "tensor-parallel" in recovery["last_error"], recovery
    assert new_leader != leader and len(new_followers) == 1 and victim not in new_followers
    for pid in (victim, leader):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _gone(pid: int) -> bool:
    """Exited (a zombie whose new parent has not reaped it yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state or "\nState:\tX" in state


def test_a_stopped_follower_dies_with_its_leader(tiny_checkpoints):
    """A SIGSTOPped follower cannot run its parent watch; the kernel kills it when its leader
    dies (PR_SET_PDEATHSIG), so a pipeline restart leaves no rank behind."""
    llm = LLM(model=str(tiny_checkpoints("llama_tied_gqa")), dtype="float32", kv_cache_memory="16MiB",
              tensor_parallel_size=2, threads_per_stage=1, max_stage_restarts=0)
    try:
        leader = llm.engine.stage_pids[0]
        (follower,) = _children(leader)
        os.kill(follower, signal.SIGSTOP)
        os.kill(leader, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not _gone(follower) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(follower)
    finally:
        llm.shutdown()
