"""GGUF files of Phi-3 (``phi3``) and Gemma 2 / 3 (``gemma2``, ``gemma3``) against transformers.

Each tiny random checkpoint is written to GGUF the way llama.cpp's converter
writes it (Phi3MiniModel, Gemma2Model, Gemma3Model in convert_hf_to_gguf.py):
the gguf package's own tensor-name map, Phi-3's qkv and gate_up left fused
(attn_qkv, ffn_up) with longrope's factors as rope_factors_long/short, Gemma's
norm weights stored as 1 + w and no query_pre_attn_scalar (llama.cpp derives
the attention scale from the head size, so these checkpoints use the value it
derives). With ``--quantization none`` in float32 the greedy tokens equal
transformers' on the checkpoint the file was written from, at PP = 1 and 2
through both attention backends; Q8_0 files stay quantized (``auto``) and
keep >= 95 % of the top-1 tokens.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pipeserve import LLM, SamplingParams
from pipeserve.model.loader import resolve_model
from pipeserve.model.loader.gguf import read_gguf_config
from tests.checkpoints import _add_tensor, finish_gguf, lazy_conversions, write_shape_metadata
from tests.test_families import _BASE, NEW, WINDOW, hf_greedy, prompts_for, save_random_checkpoint
from tests.test_loaders import hf_logits, run_stages

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KINDS = ("phi3", "phi3_longrope", "gemma2", "gemma3")
_ARCH = {"phi3": "phi3", "phi3_longrope": "phi3", "gemma2": "gemma2", "gemma3": "gemma3"}


def _config(kind: str):
    from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config
    if kind == "phi3":      # every layer slides (Phi-3-mini: 2047), which transformers applies
        return Phi3Config(**_BASE, tie_word_embeddings=False, sliding_window=WINDOW), "Phi3ForCausalLM"
    if kind == "phi3_longrope":
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 24,
                "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.5 * i for i in range(8)]}
        return Phi3Config(**{**_BASE, "max_position_embeddings": 96}, original_max_position_embeddings=24,
                          rope_parameters=rope, tie_word_embeddings=False), "Phi3ForCausalLM"
    # Gemma: query_pre_attn_scalar = head_dim, what llama.cpp uses for every size but 27B.
    if kind == "gemma2":
        return Gemma2Config(**_BASE, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                            attn_logit_softcapping=5.0, final_logit_softcapping=3.0), "Gemma2ForCausalLM"
    # Six layers with Gemma 3's pattern (five sliding, one global), which the converter does not
    # write: llama.cpp assumes it. The global layer has linear scaling, the sliding ones their own base.
    return Gemma3TextConfig(**{**_BASE, "num_hidden_layers": 6}, head_dim=16, query_pre_attn_scalar=16,
                            sliding_window=WINDOW, sliding_window_pattern=6, final_logit_softcapping=4.0,
                            rope_parameters={
                                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}), \
        "Gemma3ForCausalLM"


def build_hf(kind: str, directory: Path) -> Path:
    config, arch = _config(kind)
    config.architectures = [arch]
    return save_random_checkpoint(config, directory)


def write_family_gguf(hf_dir: Path, path: Path, qtype: str = "F32") -> Path:
    """``hf_dir`` as llama.cpp's converter writes a phi3 / gemma2 / gemma3 GGUF; matrices in ``qtype``."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(hf_dir)
    arch = {"phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3"}[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    {"phi3": _phi3_metadata, "gemma2": _gemma2_metadata, "gemma3": _gemma3_metadata}[arch](writer, cfg)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for hf_name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        array = tensor.float().numpy()
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            array = array + np.float32(1.0)      # Gemma2Model / Gemma3Model.modify_tensors
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            assert hf_name == "lm_head.weight" and arch == "gemma2", hf_name   # Gemma2Model drops it
            continue
        _add_tensor(writer, name, array, qtype)
    finish_gguf(writer)
    return path


def _phi3_metadata(w, cfg) -> None:
    rope = cfg.rope_parameters
    write_shape_metadata(w, cfg)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(cfg.sliding_window or 0)
    if rope.get("rope_type") == "longrope":   # Phi3MiniModel.generate_extra_tensors
        orig = rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        scale = cfg.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))


def _gemma2_metadata(w, cfg) -> None:
    write_shape_metadata(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)


def _gemma3_metadata(w, cfg) -> None:
    full, local = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
    write_shape_metadata(w, cfg)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(full["factor"])
    w.add_rope_freq_base(full["rope_theta"])
    w.add_rope_freq_base_swa(local["rope_theta"])
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(kind, qtype) -> (HF directory, GGUF file written from it)."""
    return lazy_conversions(tmp_path_factory.mktemp("gguf_families"), build_hf, write_family_gguf)


# -- metadata -------------------------------------------------------------------
_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
           "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "hidden_act",
           "qk_norm", "norm_unit_offset", "sandwich_norms", "scale_embeddings", "query_pre_attn_scalar",
           "attn_logit_softcapping", "final_logit_softcapping", "rope_local_theta", "fused_checkpoint",
           "rope_switch_len")


def configs_agree(converted, kind: str, fields) -> tuple:
    """(GGUF's config, the safetensors checkpoint's) of ``kind``, asserted equal in ``fields``."""
    hf_dir, path = converted(kind)
    ours, ref = read_gguf_config(path), resolve_model(str(hf_dir)).load_config()
    for field in fields:
        assert getattr(ours, field) == pytest.approx(getattr(ref, field)), field
    return ours, ref


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_config_equals_the_safetensors_config(converted, kind):
    ours, ref = configs_agree(converted, kind, _FIELDS)
    assert [ours.layer_sliding_window(i) for i in range(ours.num_layers)] == \
        [ref.layer_sliding_window(i) for i in range(ref.num_layers)]
    if ref.rope_scaling is not None:
        for key in ("rope_type", "factor", "original_max_position_embeddings", "attention_factor",
                    "short_factor", "long_factor"):
            assert ours.rope_scaling.get(key) == pytest.approx(ref.rope_scaling.get(key)), key


def _gemma_file(tmp_path: Path, arch: str, layers: int, **keys) -> Path:
    w = gguf.GGUFWriter(str(tmp_path / f"{arch}-{layers}.gguf"), arch)
    for add, value in [(w.add_block_count, layers), (w.add_embedding_length, 4608), (w.add_feed_forward_length, 64),
                       (w.add_head_count, 32), (w.add_head_count_kv, 16), (w.add_key_length, 128),
                       (w.add_value_length, 128), (w.add_vocab_size, 32)]:
        add(value)
    for name, value in keys.items():
        getattr(w, f"add_{name}")(value)
    finish_gguf(w)
    return tmp_path / f"{arch}-{layers}.gguf"


def test_gemma_attention_scale_and_windows_follow_llama_cpp(tmp_path):
    """query_pre_attn_scalar is not in the file: llama.cpp scales by hidden / heads for the
    27B models (Gemma 2: 46 layers, Gemma 3: 62; 4608 / 32 = 144 as Gemma-2-27B's config
    says) and by head_dim otherwise; the windows follow its defaults and pattern key."""
    assert read_gguf_config(_gemma_file(tmp_path, "gemma2", 46)).query_pre_attn_scalar == 144
    small = read_gguf_config(_gemma_file(tmp_path, "gemma2", 42))
    assert small.query_pre_attn_scalar == 128
    # Gemma 2 without the keys: llama.cpp's window 4096, caps 50 / 30, every other layer sliding.
    assert (small.sliding_window, small.attn_logit_softcapping, small.final_logit_softcapping) == (4096, 50.0, 30.0)
    assert [small.layer_sliding_window(i) for i in range(4)] == [4096, None, 4096, None]
    assert read_gguf_config(_gemma_file(tmp_path, "gemma3", 62)).query_pre_attn_scalar == 144
    g3 = read_gguf_config(_gemma_file(tmp_path, "gemma3", 12, sliding_window=512))
    assert [g3.layer_sliding_window(i) is None for i in range(12)] == [i % 6 == 5 for i in range(12)]
    assert (g3.attn_logit_softcapping, g3.final_logit_softcapping, g3.rope_local_theta) == (None, None, 10000.0)
    assert read_gguf_config(_gemma_file(tmp_path, "gemma3", 12)).sliding_window is None  # no window key
    listed = read_gguf_config(_gemma_file(tmp_path, "gemma3", 4, sliding_window=64,
                                          sliding_window_pattern=[True, False, False, True]))
    assert [listed.layer_sliding_window(i) for i in range(4)] == [64, None, None, 64]


# -- numerics -------------------------------------------------------------------
def engine_greedy(path: Path, hf_dir: Path, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)
    with LLM(model=str(path), tokenizer=str(hf_dir), dtype="float32", kv_cache_memory="16MiB",
             threads_per_stage=1, **kwargs) as llm:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_greedy_matches_transformers_pp1_and_pp2_both_backends(converted, kind):
    """Prompts longer than the window (8); for longrope, prompts that cross the original
    length (24) while decoding and that start past it, in chunks of 8 tokens."""
    hf_dir, path = converted(kind)
    prompts = prompts_for("phi3_longrope" if kind == "phi3_longrope" else "gemma2")
    expected = hf_greedy(hf_dir, prompts)
    extra = {"max_num_batched_tokens": 8} if kind == "phi3_longrope" else {}
    assert engine_greedy(path, hf_dir, prompts, quantization="none", attention_backend="torch", **extra) == expected
    assert engine_greedy(path, hf_dir, prompts, quantization="none", attention_backend="cpu",
                         pipeline_parallel_size=2, **extra) == expected


@pytest.mark.parametrize("kind", ["phi3_longrope", "gemma3"])
def test_q8_0_gguf_stays_quantized_and_computes_what_it_stores(converted, kind):
    """Phi-3's fused attn_qkv / ffn_up and Gemma 3's tied embedding and two rotaries kept in
    Q8_0 (``--quantization auto``): the logits through two stages equal those of the same
    file dequantized at load (``none``), and the engine end to end (PP = 2) keeps the
    weights quantized and gives the dequantized engine's greedy tokens."""
    hf_dir, path = converted(kind, "Q8_0")
    source = resolve_model(str(path))
    cfg = source.load_config()
    ids, bounds = prompts_for(kind)[2][:24], [0, cfg.num_layers // 2, cfg.num_layers]   # run_stages holds 24
    kept = run_stages(source, bounds, ids)
    dense = run_stages(source, bounds, ids, quantization="none")
    # up to the decode kernel's integer activations, which rows of up to
    # GEMV_PASSES_MAX_ROWS (these 24) take: each moves by at most half its block's step
    torch.testing.assert_close(kept, dense, rtol=0, atol=5e-4)
    # the quantization itself is Q8_0's: close to transformers on the checkpoint it came from
    assert (dense.argmax(-1) == hf_logits(hf_dir, ids).argmax(-1)).float().mean().item() >= 0.85
    prompts = prompts_for(kind)
    expected = engine_greedy(path, hf_dir, prompts, quantization="none")
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)
    with LLM(model=str(path), tokenizer=str(hf_dir), dtype="float32", kv_cache_memory="16MiB",
             threads_per_stage=1, quantization="auto", pipeline_parallel_size=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        weight_bytes = sum(llm.stats()["weight_bytes"])     # per stage
    assert weight_bytes < 0.5 * 4 * cfg.total_params()      # Q8_0: ~1.06 bytes a weight, not float32's 4
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_longrope_gguf_without_short_factors_is_refused(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "p.gguf"), "phi3")
    for add, value in [(w.add_block_count, 1), (w.add_embedding_length, 64), (w.add_feed_forward_length, 64),
                       (w.add_head_count, 4), (w.add_vocab_size, 32), (w.add_rope_scaling_orig_ctx_len, 24),
                       (w.add_rope_scaling_attn_factors, 1.1)]:
        add(value)
    w.add_tensor("rope_factors_long.weight", np.ones(8, np.float32))
    finish_gguf(w)
    with pytest.raises(ValueError, match="rope_factors_short"):
        read_gguf_config(tmp_path / "p.gguf")
