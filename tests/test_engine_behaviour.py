"""The engine on tiny random checkpoints: equal to transformers, and the same
greedy tokens whatever the batching, caching or preemption."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from pipeserve import LLM, SamplingParams
from pipeserve.engine.llm_engine import LLMEngine
from pipeserve.config import EngineConfig

NEW = 32


def random_prompts(count: int, seed: int = 0, vocab: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 60))] for _ in range(count)]


def greedy(max_tokens: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)


def token_lists(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def hf_greedy_batch(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                          do_sample=False, pad_token_id=0)
    return out[:, width:].tolist()


@pytest.mark.parametrize("kind", ["llama_tied_gqa", "mistral", "qwen2_bias"])
def test_greedy_batch_matches_transformers(tiny_checkpoints, kind):
    path = tiny_checkpoints(kind)
    prompts = random_prompts(8, seed=1)
    with LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB") as llm:
        ours = token_lists(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy()))
    assert ours == hf_greedy_batch(path, prompts)


@pytest.fixture(scope="module")
def llama_dir(tiny_checkpoints):
    return tiny_checkpoints("llama_tied_gqa")


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(model=str(llama_dir), dtype="float32", kv_cache_memory="16MiB", block_size=4) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(llm):
    """Each prompt run alone."""
    prompts = random_prompts(6, seed=2)
    alone = [token_lists(llm.generate([{"prompt_token_ids": p}], greedy()))[0] for p in prompts]
    return prompts, alone


def test_batched_equals_alone(llm, reference):
    prompts, alone = reference
    assert token_lists(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy())) == alone


def test_prefix_cache_hit_gives_same_tokens(llm, reference):
    prompts, alone = reference
    before = llm.stats()["scheduler"]["prefix_cache_hit_tokens"]
    again = token_lists(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy()))
    assert llm.stats()["scheduler"]["prefix_cache_hit_tokens"] > before
    assert again == alone


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_preemption_gives_same_tokens(llama_dir, reference, mode):
    prompts, alone = reference
    # 24 blocks of 4 tokens: far less than 6 sequences of up to 60 + 32 tokens need.
    with LLM(model=str(llama_dir), dtype="float32", block_size=4, num_gpu_blocks_override=24,
             preemption_mode=mode, swap_space="4MiB", enable_prefix_caching=False) as small:
        outs = token_lists(small.generate([{"prompt_token_ids": p} for p in prompts], greedy()))
        stats = small.stats()["scheduler"]
        resolved = small.engine.config.preemption_mode
    assert resolved == ("swap" if mode == "auto" else mode)   # CPU, one host, 4 MiB of pool fits
    assert stats[f"num_preemptions_{resolved}"] > 0, stats
    assert outs == alone
    assert stats["num_free_blocks"] == 24


def test_chunked_prefill_gives_same_tokens(llama_dir, reference):
    prompts, alone = reference
    with LLM(model=str(llama_dir), dtype="float32", block_size=4, max_num_batched_tokens=8,
             kv_cache_memory="16MiB") as chunked:
        assert token_lists(chunked.generate([{"prompt_token_ids": p} for p in prompts], greedy())) == alone


def test_seeded_sampling_reproducible_and_seed_dependent(llm, reference):
    prompts, _ = reference
    p = {"prompt_token_ids": prompts[0]}
    s7 = SamplingParams(temperature=1.0, seed=7, max_tokens=24, min_tokens=24)
    first = token_lists(llm.generate([p], s7))[0]
    # Same seed, now among batch mates with other seeds and unseeded neighbours.
    mates = [{"prompt_token_ids": q} for q in prompts[1:4]]
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=8) for i in range(3)]
    batched = llm.generate(mates + [p], params + [s7])
    assert batched[-1].outputs[0].token_ids == first
    other = token_lists(llm.generate([p], SamplingParams(temperature=1.0, seed=8, max_tokens=24,
                                                          min_tokens=24)))[0]
    assert other != first


def test_top_k_1_equals_greedy(llm, reference):
    prompts, alone = reference
    params = SamplingParams(temperature=0.8, top_k=1, max_tokens=NEW, min_tokens=NEW)
    assert token_lists(llm.generate([{"prompt_token_ids": p} for p in prompts], params)) == alone


def test_n_completions(llm, reference):
    prompts, alone = reference
    out = llm.generate([{"prompt_token_ids": prompts[0]}],
                       SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=16, min_tokens=16))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    greedy_n = llm.generate([{"prompt_token_ids": prompts[0]}],
                            SamplingParams(n=2, temperature=0, max_tokens=NEW, min_tokens=NEW))[0]
    assert [c.token_ids for c in greedy_n.outputs] == [alone[0], alone[0]]


def test_stop_string_cuts_before_it(llm):
    prompt = "the quick brown fox"
    full = llm.generate([prompt], greedy(24))[0].outputs[0]
    text = full.text
    assert len(text) > 12, text
    stop = text[8:11]
    cut = text.index(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_logprobs_top_n(llm, reference):
    prompts, alone = reference
    out = llm.generate([{"prompt_token_ids": prompts[0]}],
                       SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and len(entry) >= 3
        best = max(entry.values(), key=lambda lp: lp.logprob)
        assert entry[tok].logprob == best.logprob  # greedy picks the most likely token


def test_bad_prompts_fail_alone(llm, reference):
    prompts, alone = reference
    too_long = list(range(3, 3 + 600))  # the tiny model's context is 512
    outs = llm.generate([{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": too_long},
                         {"prompt_token_ids": [999999]}], greedy())
    assert outs[0].outputs[0].token_ids == alone[0]
    assert outs[1].outputs[0].finish_reason == "error" and "512" in outs[1].error and "600" in outs[1].error
    assert outs[2].outputs[0].finish_reason == "error" and "999999" in outs[2].error


def test_prompt_that_never_fits_the_cache_is_refused(llama_dir):
    with LLM(model=str(llama_dir), dtype="float32", block_size=4, num_gpu_blocks_override=4) as small:
        outs = small.generate([{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": [5, 6, 7]}],
                              greedy(4))
    assert outs[0].outputs[0].finish_reason == "error" and "KV cache" in outs[0].error
    assert len(outs[1].outputs[0].token_ids) == 4


def test_invalid_sampling_params_name_the_parameter():
    for kwargs, name in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                         ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
                         ({"n": 0}, "n"), ({"top_k": -5}, "top_k")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)


def test_abort_frees_blocks_and_others_finish(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", block_size=4,
                                    kv_cache_memory="16MiB"))
    try:
        prompts = random_prompts(3, seed=5)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, greedy(40))
        for _ in range(3):
            engine.step()
        aborted = engine.abort_request("1")
        assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert set(finished) == {"0", "2"}
        assert all(len(o.outputs[0].token_ids) == 40 for o in finished.values())
        stats = engine.stats()["scheduler"]
        assert stats["num_free_blocks"] == engine.num_blocks
    finally:
        engine.shutdown()


def test_cli_generate_prints_completion(llama_dir):
    cmd = [sys.executable, "-m", "pipeserve.entrypoints.cli", "generate", "--model", str(llama_dir),
           "--prompt", "hello world", "--max-tokens", "6", "--dtype", "float32", "--kv-cache-memory", "8MiB"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()
    bad = subprocess.run(cmd + ["--dtype", "int3"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "dtype" in bad.stderr and "Traceback" not in bad.stderr


def test_kv_integrity_is_checked_whenever_the_engine_goes_idle(llama_dir, monkeypatch):
    from pipeserve.kv_cache.block_manager import BlockManager, KVCacheIntegrityError
    checks = []
    real = BlockManager.check_integrity
    monkeypatch.setattr(BlockManager, "check_integrity", lambda self: (checks.append(1), real(self)))
    with LLM(model=str(llama_dir), dtype="float32", block_size=4, kv_cache_memory="16MiB") as llm:
        llm.generate(random_prompts(3), greedy(4))
        assert len(checks) == 1                     # once, when the last request finished
        llm.generate(random_prompts(2, seed=1), greedy(4))
        assert len(checks) == 2
        # A leaked block (held by nobody, not free) is caught at the next idle point.
        manager = llm.engine.scheduler.block_manager
        manager._free.popleft()
        with pytest.raises(KVCacheIntegrityError):
            llm.generate(random_prompts(1, seed=2), greedy(2))


def test_start_up_says_how_many_sequences_the_kv_cache_holds():
    from pipeserve.engine.llm_engine import kv_concurrency
    small = kv_concurrency(num_blocks=5461, block_size=16, max_model_len=8192, max_num_seqs=256)
    assert small.startswith("KV cache of 87376 tokens: maximum concurrency 10.67 at max_model_len (8192 tokens), "
                            "42.7 at 2048 tokens; fewer than max_num_seqs (256)")
    assert "--kv-cache-memory" in small
    roomy = kv_concurrency(num_blocks=100000, block_size=16, max_model_len=2048, max_num_seqs=8)
    assert roomy == ("KV cache of 1600000 tokens: maximum concurrency 781.25 at max_model_len (2048 tokens), "
                     "3125.0 at 512 tokens")


def test_auto_preemption_swaps_only_where_the_pool_is_local_memory_that_fits():
    from pipeserve.engine.llm_engine import resolve_preemption_mode
    gib = 1 << 30
    one_host = EngineConfig(pipeline_parallel_size=2)
    assert resolve_preemption_mode(one_host, gib, gib, 16 * gib) == "swap"
    assert resolve_preemption_mode(one_host, gib, gib, None) == "swap"          # unknown: assumed to fit
    assert resolve_preemption_mode(one_host, gib, gib, 3 * gib) == "recompute"  # two stages need 4 GiB
    assert resolve_preemption_mode(one_host, gib, gib, 5 * gib, weight_bytes=gib) == "swap"
    assert resolve_preemption_mode(one_host, gib, gib, 5 * gib, weight_bytes=2 * gib) == "recompute"
    assert resolve_preemption_mode(one_host, gib, 0, 16 * gib) == "recompute"   # --swap-space 0
    two_hosts = EngineConfig(nnodes=2, pipeline_parallel_size=2)
    assert resolve_preemption_mode(two_hosts, gib, gib, 16 * gib) == "recompute"
    assert resolve_preemption_mode(EngineConfig(device="cuda"), gib, gib, 16 * gib) == "recompute"


def test_logit_bias_crosses_the_pipeline_and_stays_with_its_request(llama_dir):
    """PP = 2 (the bias travels in each step's plan to the last stage): +100 on one token makes
    greedy decoding emit only it; -100 on the unbiased run's first token moves the first token;
    a batch mate without a bias keeps its own tokens; an id outside the vocabulary is refused."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, seed=11)]
    with LLM(model=str(llama_dir), dtype="float32", kv_cache_memory="16MiB", pipeline_parallel_size=2,
             threads_per_stage=1) as llm:
        plain = token_lists(llm.generate(prompts, greedy()))
        forced = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logit_bias={7: 100.0})
        banned = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True,
                                logit_bias={plain[0][0]: -100.0})
        outs = token_lists(llm.generate(prompts, [forced, greedy()]))
        assert outs[0] == [7] * NEW and outs[1] == plain[1]
        moved = token_lists(llm.generate(prompts[:1], banned))[0]
        assert moved[0] != plain[0][0]
        refused = llm.generate(prompts[:1], SamplingParams(max_tokens=2, logit_bias={100000: 1.0}))[0]
        assert refused.outputs[0].finish_reason == "error" and "logit_bias names token id 100000" in refused.error
