"""Sliding-window attention end to end: tiny random Mistral (every layer
slides) and Qwen2 (``use_sliding_window``: layers >= ``max_window_layers``
slide) checkpoints whose window (12) is much shorter than their prompts
(40-80 tokens) give transformers' greedy tokens (float32) at PP = 1 and
PP = 2, through both attention backends, with chunked prefill and with
prefix-cache hits; in bfloat16 (where the C prefill kernel runs the window)
their teacher-forced top-1 tokens agree with float32.
Kernel-level checks of windows and soft caps live in test_cpu_attention.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pipeserve import LLM, SamplingParams
from pipeserve.model.loader import load_model, resolve_model
from tests.checkpoints import _randomize, save_tiny_tokenizer
from tests.kernels import kernel_missing

WINDOW, NEW = 12, 32


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _config(kind: str):
    from transformers import MistralConfig, Qwen2Config
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, sliding_window=WINDOW, tie_word_embeddings=False)
    if kind == "mistral":   # every layer slides
        return MistralConfig(**common)
    # Qwen2: layers >= max_window_layers slide, the others attend fully, so one step mixes windows.
    return Qwen2Config(**common, use_sliding_window=True, max_window_layers=2)


KINDS = ("mistral", "qwen2")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (directory, transformers' greedy tokens for make_prompts()), built once."""
    from transformers import AutoModelForCausalLM
    built: dict[str, tuple[Path, list[list[int]]]] = {}

    def get(kind: str) -> tuple[Path, list[list[int]]]:
        if kind not in built:
            directory = tmp_path_factory.mktemp(kind + "_window")
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32)
            _randomize(model, 0)
            model.save_pretrained(directory)
            save_tiny_tokenizer(directory)
            built[kind] = directory, hf_greedy(directory)
        return built[kind]
    return get


def hf_greedy(directory: Path) -> list[list[int]]:
    """transformers' greedy continuation, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    assert hf.config.sliding_window == WINDOW
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in make_prompts()]


def make_prompts() -> list[list[int]]:
    """Four prompts of 40-80 tokens; the last two share a 48-token prefix (a
    prefix-cache hit for whichever runs second)."""
    rng = random.Random(15)
    prefix = [rng.randrange(3, 300) for _ in range(48)]
    return [[rng.randrange(3, 300) for _ in range(n)] for n in (40, 80)] + \
        [prefix + [rng.randrange(3, 300) for _ in range(n)] for n in (9, 21)]


def generate(path: Path, one_at_a_time: bool = False, **kwargs) -> tuple[list[list[int]], int]:
    """Our greedy tokens and the prefix-cache hit tokens of the run."""
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)
    requests = [{"prompt_token_ids": p} for p in make_prompts()]
    with LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", block_size=4, threads_per_stage=1,
             **kwargs) as llm:
        if one_at_a_time:
            outs = [llm.generate([r], params)[0] for r in requests]
        else:
            outs = llm.generate(requests, params)
        hits = llm.stats()["scheduler"]["prefix_cache_hit_tokens"]
    return [o.outputs[0].token_ids for o in outs], hits


@pytest.mark.parametrize("kind", KINDS)
def test_window_is_shorter_than_the_prompts_and_changes_the_output(checkpoints, kind):
    """transformers with full attention on the same weights picks other tokens
    along the expected continuations: a runtime that ignored the window would
    fail the tests below."""
    from transformers import AutoConfig, AutoModelForCausalLM
    path, expected = checkpoints(kind)
    config = AutoConfig.from_pretrained(str(path))
    config.sliding_window = None
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    hf = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=torch.float32).eval()
    prompts = make_prompts()
    assert min(len(p) for p in prompts) > 3 * WINDOW
    differing = 0
    with torch.no_grad():
        for prompt, continuation in zip(prompts, expected):
            logits = hf(torch.tensor([prompt + continuation])).logits[0, len(prompt) - 1:-1]
            differing += int((logits.argmax(-1) != torch.tensor(continuation)).sum())
    assert differing >= NEW


# PP = 2 on the cpu backend only: each stage process costs seconds to start, and
# the window is per layer, the same on whichever stage a layer lives (for Qwen2
# the two stages hold the full and the sliding layers).
CASES = [("mistral", "torch", 1), ("mistral", "cpu", 1), ("mistral", "cpu", 2), ("qwen2", "torch", 1),
         ("qwen2", "cpu", 2)]


@pytest.mark.parametrize("kind,backend,pp", CASES)
def test_greedy_matches_transformers(checkpoints, kind, backend, pp):
    if backend == "cpu" and kernel_missing("paged_attention"):
        pytest.skip(kernel_missing("paged_attention"))
    path, expected = checkpoints(kind)
    ours, _ = generate(path, attention_backend=backend, pipeline_parallel_size=pp)
    assert ours == expected


@pytest.mark.parametrize("kind,backend", [("mistral", "torch"), ("mistral", "cpu"), ("qwen2", "cpu")])
def test_chunked_prefill_and_prefix_hits_match_transformers(checkpoints, kind, backend):
    """Prompts cut into 16-token chunks (each attends to cached keys through the
    window), run one after the other so the fourth reuses the third's 48-token
    prefix from the cache."""
    if backend == "cpu" and kernel_missing("paged_attention"):
        pytest.skip(kernel_missing("paged_attention"))
    path, expected = checkpoints(kind)
    ours, hits = generate(path, one_at_a_time=True, attention_backend=backend, max_num_batched_tokens=16)
    assert hits >= 44   # the shared prefix, in whole 4-token blocks
    assert ours == expected


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_top1_agrees_with_float32(checkpoints, kind):
    """Teacher-forced over a 120-token sequence in 16-token chunks, with the cpu
    backend: in bfloat16 the C prefill kernel (on AVX512_BF16) applies the window
    to each chunk's cached keys; >= 95 % equal top-1 tokens."""
    if kernel_missing("paged_attention"):
        pytest.skip(kernel_missing("paged_attention"))
    rng = random.Random(4)
    tokens = [rng.randrange(3, 300) for _ in range(120)]
    path, _ = checkpoints(kind)
    top = {dtype: chunked_logits(path, tokens, dtype).argmax(-1) for dtype in (torch.float32, torch.bfloat16)}
    agreement = (top[torch.float32] == top[torch.bfloat16]).float().mean().item()
    assert agreement >= 0.95, f"bf16 top-1 agrees with f32 on {agreement:.1%}"


def chunked_logits(path: Path, tokens: list[int], dtype: torch.dtype, chunk: int = 16) -> torch.Tensor:
    """Logits [len(tokens), vocab], the prompt prefilled ``chunk`` tokens at a time."""
    source = resolve_model(str(path))
    cfg = source.load_config()
    model = load_model(source, cfg, 0, cfg.num_layers, True, True, dtype, "cpu", attention_backend="cpu")
    block, n = 16, len(tokens)
    table = list(range(-(-n // block)))[::-1]   # blocks in reverse order: the table is followed
    shape = (len(table), block, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_layers)]
    logits = []
    with torch.inference_mode():
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            meta = model.backend.build_metadata([end - start], [end], [table], block, torch.device("cpu"))
            hidden = model(torch.tensor(tokens[start:end]), torch.arange(start, end), meta, caches)
            logits.append(model.compute_logits(hidden))
    return torch.cat(logits)
