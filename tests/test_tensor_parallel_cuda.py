"""Tensor parallelism on CUDA (--device cuda --tensor-parallel-size T): each rank on its
own GPU, the activations' collectives through NCCL (pipeline/tensor_group.py). float32
greedy output equal to transformers at TP = 2, PP = 2 and TP = 2 x PP = 2.

Each case needs TP x PP GPUs and is skipped, saying so, where the machine has fewer
(the CPU-only development machine has none: these have not run there)."""

from __future__ import annotations

import pytest

from pipeserve import LLM, SamplingParams
from pipeserve.config import EngineConfig
from pipeserve.model.tensor_parallel import check_tensor_parallel_config
from tests.test_engine_behaviour import NEW, hf_greedy_batch, random_prompts, token_lists
from tests.test_tensor_parallel import SMOL


def _gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(count: int):
    return pytest.mark.skipif(_gpus() < count, reason=f"needs {count} CUDA GPUs (torch.cuda.device_count() "
                                                      f"is {_gpus()})")


def test_tensor_parallel_accepts_cuda_but_not_a_pinned_gpu():
    """No GPU needed: the engine's check lets --device cuda through and refuses cuda:N
    (every rank needs its own GPU)."""
    check_tensor_parallel_config(EngineConfig(tensor_parallel_size=2, device="cuda"), SMOL)
    with pytest.raises(ValueError, match="use --device cuda, not --device cuda:1"):
        check_tensor_parallel_config(EngineConfig(tensor_parallel_size=2, device="cuda:1"), SMOL)


def test_cuda_group_uses_nccl_beside_gloo_and_says_when_it_cannot(monkeypatch):
    """No GPU needed: the backend choice, and the two refusals a rank can meet at start."""
    import torch
    import torch.distributed as dist

    import pipeserve.pipeline.stage_process as stage_process
    from pipeserve.pipeline.tensor_group import _backend, _rank_device
    assert _backend(torch.device("cpu")) == "gloo"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert _backend(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a PyTorch build with NCCL"):
        _backend(torch.device("cuda", 0))
    monkeypatch.setattr(stage_process, "stage_device", lambda spec, stage, rank: torch.device("cuda", 3))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match="stage 1 tensor-parallel rank 1 needs GPU 3, but this node has 2"):
        _rank_device(None, 1, 1)


CASES = [(2, 1, "async", {}), (1, 2, "async", {}), (2, 2, "gpipe", {"pp_micro_batches": 2})]


@pytest.mark.parametrize("tp,pp,schedule,extra",
                         [pytest.param(*c, marks=needs_gpus(c[0] * c[1])) for c in CASES],
                         ids=[f"tp{t}-pp{p}" for t, p, _, _ in CASES])
def test_cuda_tensor_parallel_matches_transformers(tiny_checkpoints, tp, pp, schedule, extra):
    path = tiny_checkpoints("llama_tied_gqa")
    prompts = random_prompts(4, seed=31)
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)
    with LLM(model=str(path), dtype="float32", device="cuda", kv_cache_memory="16MiB", threads_per_stage=1,
             tensor_parallel_size=tp, pipeline_parallel_size=pp, pp_schedule=schedule, **extra) as llm:
        got = token_lists(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    assert got == hf_greedy_batch(path, prompts)
