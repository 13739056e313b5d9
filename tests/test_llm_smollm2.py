"""The real model end to end through ``LLM``: equal to transformers in float32,
and close to float32 in bfloat16."""

from __future__ import annotations

import pytest
import torch

from pipeserve import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "To make a cup of tea, first",
    "Pipeline parallelism splits a model into stages, and",
    "Q: What is 12 times 12?\nA:",
    "The quick brown fox",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm32():
    # quantization="none": the GGUF dequantized to float32, the token-identity reference.
    llm = LLM(dtype="float32", kv_cache_memory="128MiB", threads_per_stage=2, quantization="none")
    yield llm
    llm.shutdown()


def hf_generate(hf, tok, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' batched greedy generate (left padding), EOS banned like min_tokens does."""
    width = max(len(p) for p in prompts)
    pad = tok.eos_token_ids[0]
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, output_logits=True, return_dict_in_generate=True,
                          pad_token_id=pad)
    tokens = out.sequences[:, width:].tolist()
    logprobs = [torch.log_softmax(step.float(), dim=-1) for step in out.logits]  # NEW_TOKENS x [B, V]
    return tokens, logprobs


def test_greedy_batch_is_token_identical_to_transformers(llm32, hf_smollm2):
    tok = llm32.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0)
    outs = llm32.generate([{"prompt_token_ids": p} for p in prompts], params)
    ref_tokens, ref_logprobs = hf_generate(hf_smollm2, tok, prompts)
    for i, out in enumerate(outs):
        ours = out.outputs[0].token_ids
        assert ours == ref_tokens[i], f"prompt {i} ({PROMPTS[i]!r}) differs from transformers"
        # The logprob of each chosen token agrees with transformers' raw logits.
        for t, entry in enumerate(out.outputs[0].logprobs):
            ref = ref_logprobs[t][i, ours[t]].item()
            assert abs(entry[ours[t]].logprob - ref) < 1e-3, (i, t)


def test_chat_template_and_text(llm32):
    out = llm32.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_bfloat16_teacher_forced_top1_agreement(llm32):
    """bfloat16 predicts, at each position of the float32 greedy continuation,
    the same top-1 token at >= 95% of positions."""
    tok = llm32.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    conts = [o.outputs[0].token_ids for o in llm32.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    bf16 = LLM(dtype="bfloat16", kv_cache_memory="128MiB", threads_per_stage=2)
    try:
        # One request per position: prompt + the float32 continuation so far; the
        # prefix cache makes this cheap.
        forced = [{"prompt_token_ids": p + c[:k]} for p, c in zip(prompts, conts) for k in range(NEW_TOKENS)]
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        picks = [o.outputs[0].token_ids[0] for o in bf16.generate(forced, one)]
    finally:
        bf16.shutdown()
    targets = [c[k] for c in conts for k in range(NEW_TOKENS)]
    agreement = sum(a == b for a, b in zip(picks, targets)) / len(targets)
    print(f"bfloat16 teacher-forced top-1 agreement: {agreement:.4f} over {len(targets)} positions")
    assert agreement >= 0.95
