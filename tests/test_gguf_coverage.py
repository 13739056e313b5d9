"""GGUF families beyond plain Llama: Llama 3.x files with ``rope_freqs`` and
``qwen2`` files, written from tiny random checkpoints the way llama.cpp's
converter writes them (F32 tensors), give transformers' greedy tokens."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from pipeserve import LLM
from pipeserve.config import EngineConfig
from pipeserve.model.loader import ModelSource, resolve_model
from pipeserve.model.loader.gguf import GGUF_ARCHITECTURES, read_gguf_config
from tests.checkpoints import finish_gguf, write_llama_gguf
from tests.test_engine_behaviour import greedy, hf_greedy_batch, random_prompts, token_lists
from tests.test_loaders import IDS, hf_logits, run_stages, write_gguf

# After the quantized-weights work lands, a GGUF stays in its own types by
# default; "none" is the dequantized path these tests pin to transformers.
DEQUANTIZED = ({"quantization": "none"}
               if "quantization" in {f.name for f in dataclasses.fields(EngineConfig)} else {})


@pytest.fixture(scope="module")
def converted(tiny_checkpoints, tmp_path_factory):
    """kind -> (HF directory, GGUF file written from it)."""
    root = tmp_path_factory.mktemp("converted")
    built: dict = {}

    def get(kind: str):
        if kind not in built:
            hf = tiny_checkpoints(kind)
            built[kind] = hf, write_llama_gguf(hf, root / f"{kind}.gguf")
        return built[kind]
    return get


def engine_greedy(gguf_path, hf_dir, prompts, pp: int) -> list[list[int]]:
    with LLM(model=str(gguf_path), tokenizer=str(hf_dir), dtype="float32", kv_cache_memory="16MiB",
             pipeline_parallel_size=pp, threads_per_stage=1, **DEQUANTIZED) as llm:
        return token_lists(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy()))


# -- metadata -------------------------------------------------------------------
def test_llama3_gguf_carries_frequency_factors(converted):
    _, path = converted("llama3_rope")
    cfg = read_gguf_config(path)
    assert cfg.architecture == "LlamaForCausalLM" and not cfg.tie_word_embeddings
    assert cfg.rope_freq_factors is not None and len(cfg.rope_freq_factors) == cfg.head_dim // 2
    # the tiny config scales every band: 1 (short), the blend, and 8 (long wavelengths)
    assert cfg.rope_freq_factors[0] == 1.0 and cfg.rope_freq_factors[-1] == 8.0


def test_qwen2_gguf_becomes_qwen2_config(converted):
    hf_dir, path = converted("qwen2_bias")
    ours, ref = read_gguf_config(path), resolve_model(str(hf_dir)).load_config()
    assert ours.architecture == "Qwen2ForCausalLM" and ours.attention_bias
    assert not GGUF_ARCHITECTURES["qwen2"].qk_rows_permuted and GGUF_ARCHITECTURES["llama"].qk_rows_permuted
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(ours, field) == pytest.approx(getattr(ref, field)), field


def test_unknown_gguf_architecture_names_it_and_the_supported_ones(tmp_path):
    path = write_gguf(tmp_path / "p.gguf", {"x": (np.ones(4, np.float32), None)}, arch="falcon")
    with pytest.raises(ValueError, match=r"'falcon'.*llama, qwen2, qwen3, phi3, gemma2, gemma3, qwen2moe, qwen3moe"):
        read_gguf_config(path)


def test_yarn_scaled_gguf_is_refused(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "y.gguf"), "qwen2")
    for add, value in [(w.add_block_count, 1), (w.add_embedding_length, 64), (w.add_feed_forward_length, 64),
                       (w.add_head_count, 4), (w.add_vocab_size, 32), (w.add_rope_scaling_factor, 4.0)]:
        add(value)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_tensor("blk.0.attn_q.bias", np.zeros(64, np.float32))
    finish_gguf(w)
    with pytest.raises(ValueError, match="'yarn' RoPE scaling"):
        read_gguf_config(tmp_path / "y.gguf")


# -- numerics -------------------------------------------------------------------
def test_rope_freqs_are_applied(converted, monkeypatch):
    hf_dir, path = converted("llama3_rope")
    source = resolve_model(str(path))
    reference = hf_logits(hf_dir, IDS)
    assert (run_stages(source, [0, 4], IDS) - reference).abs().max().item() < 1e-3
    # Without the factors the same file is a different model: the check above can fail.
    plain = dataclasses.replace(source.load_config(), rope_freq_factors=None)
    monkeypatch.setattr(ModelSource, "load_config", lambda self: plain)
    assert (run_stages(source, [0, 4], IDS) - reference).abs().max().item() > 1e-2


CASES = [("llama3_rope", 1), ("llama3_rope", 2), ("qwen2_bias", 1), ("qwen2_bias", 2), ("llama_tied_gqa", 1)]


@pytest.mark.parametrize("kind,pp", CASES, ids=[f"{k}-pp{p}" for k, p in CASES])
def test_gguf_greedy_tokens_match_transformers(converted, kind, pp):
    # llama3_rope: rope_freqs and an untied head; qwen2_bias: unpermuted q/k with
    # biases; llama_tied_gqa: the head tied to the embedding.
    hf_dir, path = converted(kind)
    prompts = random_prompts(3, seed=5)
    assert engine_greedy(path, hf_dir, prompts, pp) == hf_greedy_batch(hf_dir, prompts)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def qwen3_converted(tmp_path_factory):
    """A tiny Qwen3 (per-head q/k norms, head_dim 24 != hidden / heads, untied head) and its GGUF."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from tests.checkpoints import _randomize, save_tiny_tokenizer
    root = tmp_path_factory.mktemp("qwen3")
    config = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
                         rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=False)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, 0)
    model.save_pretrained(root / "hf")
    save_tiny_tokenizer(root / "hf")
    return root / "hf", write_llama_gguf(root / "hf", root / "qwen3.gguf")


@pytest.mark.parametrize("pp", [1, 2])
def test_qwen3_gguf_greedy_tokens_match_transformers(qwen3_converted, pp):
    hf_dir, path = qwen3_converted
    cfg = read_gguf_config(path)
    assert (cfg.architecture, cfg.qk_norm, cfg.head_dim) == ("Qwen3ForCausalLM", True, 24)
    prompts = random_prompts(3, seed=7)
    assert engine_greedy(path, hf_dir, prompts, pp) == hf_greedy_batch(hf_dir, prompts)
