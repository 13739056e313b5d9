"""Tiny random-weight checkpoints for tests, built with transformers and saved
as safetensors (plus a tiny byte-level BPE tokenizer) in a directory.

Weights are drawn with a larger spread than transformers' init so logits are
far from uniform: a wrong weight or a wrong mask then shows as a large error.

    from tests.checkpoints import build_checkpoint, CHECKPOINT_KINDS
    path = build_checkpoint("llama_tied_gqa", tmp_path)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

TINY_VOCAB = 320          # the model's vocabulary; the tokenizer uses the first ~300 ids
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello pipeline",
           "a stage holds its layers and its kv cache", "tokens flow from stage to stage"] * 4

_COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def _configs() -> dict:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    return {
        "llama_tied_gqa": lambda: LlamaConfig(**_COMMON, tie_word_embeddings=True, rope_theta=10000.0),
        "mistral": lambda: MistralConfig(**{**_COMMON, "num_key_value_heads": 1}, sliding_window=None,
                                         tie_word_embeddings=False),
        "qwen2_bias": lambda: Qwen2Config(**_COMMON, tie_word_embeddings=False, use_sliding_window=False),
        "llama3_rope": lambda: LlamaConfig(**_COMMON, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        "llama_sharded": lambda: LlamaConfig(**_COMMON, tie_word_embeddings=False),
        # One KV head shared by every query head (tensor parallelism replicates it).
        "llama_1kv": lambda: LlamaConfig(**{**_COMMON, "num_key_value_heads": 1}, tie_word_embeddings=False),
        "qwen2_1kv": lambda: Qwen2Config(**{**_COMMON, "num_key_value_heads": 1}, tie_word_embeddings=True,
                                         use_sliding_window=False),
    }


CHECKPOINT_KINDS = ("llama_tied_gqa", "mistral", "qwen2_bias", "llama3_rope", "llama_sharded")
# Built on demand (tensor-parallel tests), not part of every numerics module's sweep.
EXTRA_KINDS = ("llama_1kv", "qwen2_1kv")


def build_checkpoint(kind: str, directory: Path, seed: int = 0) -> Path:
    """Write checkpoint ``kind`` (one of CHECKPOINT_KINDS) into ``directory``; returns it."""
    from transformers import AutoModelForCausalLM
    configs = _configs()
    if kind not in configs:
        raise ValueError(f"unknown checkpoint kind {kind!r}; choose from {CHECKPOINT_KINDS}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(configs[kind](), dtype=torch.float32)
    _randomize(model, seed)
    shard = "200KB" if kind == "llama_sharded" else "1GB"
    model.save_pretrained(directory, max_shard_size=shard)
    save_tiny_tokenizer(directory)
    return directory


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif "bias" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.08 * noise)


def save_tiny_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer (ids < TINY_VOCAB) with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def write_llama_gguf(hf_dir: Path, path: Path, qtype: str = "F32", split_max_tensors: int = 0,
                     qtypes: dict[str, str] | None = None) -> Path:
    """Convert a tiny HF Llama or Qwen2 checkpoint to GGUF the way llama.cpp's
    convert_hf_to_gguf.py does, all matrices in ``qtype`` except the roles
    ``qtypes`` names (``{"attn_v": "Q4_0"}``: mixed types, as llama.cpp's
    K-quant mixes write them): llama's q/k rows (and biases) permuted to its
    rotary layout and llama3 scaling written as ``rope_freqs``; qwen2's rows
    left as they are. ``split_max_tensors``: split as gguf-split does, at most
    that many tensors a file; returns the first part."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_dir)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        state.update(load_file(str(file)))
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    _write_metadata(writer, cfg)
    if arch == "llama" and cfg.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    for hf_name, tensor in state.items():
        name, array = _gguf_tensor(hf_name, tensor.float().numpy(), cfg)
        role = name.split(".")[-2]
        _add_tensor(writer, name, array, (qtypes or {}).get(role, qtype))
    finish_gguf(writer)
    return writer.format_shard_names(Path(path))[0] if split_max_tensors else path


def finish_gguf(writer) -> None:
    """Write a ``gguf.GGUFWriter``'s header, metadata and tensors, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_shape_metadata(w, cfg) -> None:
    """The model-shape keys every architecture's GGUF carries (block count, widths, heads, eps)."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def _write_metadata(w, cfg) -> None:
    write_shape_metadata(w, cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:   # Qwen3: head_dim is its own key
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    if cfg.model_type == "llama":  # LlamaModel adds it; Qwen2Model does not
        w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)


_RENAME = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
           "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
           "self_attn.k_norm": "attn_k_norm"}


def _gguf_tensor(hf_name: str, array: np.ndarray, cfg) -> tuple[str, np.ndarray]:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name], array
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    permuted = cfg.model_type in ("llama", "mixtral")  # LlamaModel (and Mixtral, written as llama) permutes q/k
    if permuted and module == "self_attn.q_proj":
        array = _llama_cpp_permute(array, cfg.num_attention_heads)
    elif permuted and module == "self_attn.k_proj":
        array = _llama_cpp_permute(array, cfg.num_key_value_heads)
    return f"blk.{layer}.{_RENAME[module]}.{kind}", array


def llama3_rope_factors(cfg) -> np.ndarray:
    """rope_freqs as LlamaModel.generate_extra_tensors computes it: per dimension,
    1 (short wavelengths), ``factor`` (long ones) or the smooth blend's inverse,
    in float32. The converter reads original_max_position_embeddings from the
    top level of config.json (default 8192, which is Llama 3.1's value inside
    rope_scaling); here it comes from the rope parameters, where the tiny
    checkpoint keeps it."""
    import math
    rope = cfg.rope_parameters
    dim = cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_ctx = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(float(1 / ((1 - smooth) / factor + smooth)))
    return np.array(factors, dtype=np.float32)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # Rows of each head: [first half; second half] -> interleaved pairs.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tensor(writer, name: str, array: np.ndarray, qtype: str) -> None:
    import gguf
    t = gguf.GGMLQuantizationType[qtype]
    if array.ndim == 1 or t == gguf.GGMLQuantizationType.F32:  # norms stay F32, as llama.cpp keeps them
        writer.add_tensor(name, array.astype(np.float32))
    elif t == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, array.astype(np.float16))
    elif t == gguf.GGMLQuantizationType.IQ4_NL:   # gguf-py dequantizes it but does not quantize
        writer.add_tensor(name, quantize_iq4_nl(array), raw_dtype=t)
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, t), raw_dtype=t)


def quantize_iq4_nl(array: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> IQ4_NL blocks uint8 [rows, cols / 32 * 18]: per 32 weights d =
    max|w| / 127 (float16) and each weight's nearest codebook entry times d, as nibbles
    (weights 0-15 low, 16-31 high)."""
    import gguf
    values = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)
    rows = array.shape[0]
    w = array.reshape(rows, -1, 32).astype(np.float32)
    d = (np.abs(w).max(-1, keepdims=True) / 127).astype(np.float16)
    scaled = w / np.where(d == 0, 1, d.astype(np.float32))
    q = np.abs(scaled[..., None] - values).argmin(-1).astype(np.uint8)          # [rows, blocks, 32]
    packed = q[..., :16] | (q[..., 16:] << 4)
    return np.concatenate([d.view(np.uint8), packed], axis=-1).reshape(rows, -1)


# Where a block's float16 d (and dmin) sit; other types: (0, 2). IQ4_XS: d only (its 6-bit
# sub-scales stay random).
KQUANT_FLOAT16_OFFSETS = {"Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def random_quant_blocks(qtype, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row bytes] uint8: random blocks of GGML type ``qtype`` (gguf's writer cannot
    quantize to K-quants) whose float16 scales are ~2e-4, so the weights are of a trained
    model's size (|w| < ~0.5)."""
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for off in KQUANT_FLOAT16_OFFSETS.get(qtype.name, (0, 2)):
        d = (2e-4 * rng.uniform(0.5, 1.5, raw.shape[:2])).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def lazy_builds(root: Path, build) -> Callable[[str], Path]:
    """kind -> ``build(kind, root / kind)``, built on first use and kept."""
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = build(kind, root / kind)
        return built[kind]
    return get


def lazy_conversions(root: Path, build, write) -> Callable[..., tuple[Path, Path]]:
    """(kind, qtype="F32") -> (``build(kind, root / kind)``, a GGUF file ``write(hf_dir, path,
    qtype)`` wrote from it), each made on first use and kept."""
    checkpoints = lazy_builds(root, build)

    def get(kind: str, qtype: str = "F32") -> tuple[Path, Path]:
        hf_dir = checkpoints(kind)
        path = root / f"{kind}-{qtype}.gguf"
        if not path.exists():
            write(hf_dir, path, qtype)
        return hf_dir, path
    return get


def layer_matmul_flops(cfg) -> int:
    """FLOPs of one token through one dense decoder layer's four matmuls (qkv, o, gate_up,
    down): what --profile's GEMM classes must count, computed here from the shapes alone."""
    return sum(2 * k * n for k, n in (
        (cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size), (cfg.q_size, cfg.hidden_size),
        (cfg.hidden_size, 2 * cfg.intermediate_size), (cfg.intermediate_size, cfg.hidden_size)))


def hf_step(hf, ids: torch.Tensor, cache):
    """One forward of a transformers causal LM with its own KV cache: (its output, the cache to
    pass next). Transformers 5.x renames ``past_key_values`` to ``cache`` (the old name warns
    that it goes in 5.40); the suite installs whichever release is current."""
    import inspect
    if "cache" in inspect.signature(hf.forward).parameters:
        res = hf(ids, cache=cache, use_cache=True)
        return res, res.cache
    res = hf(ids, past_key_values=cache, use_cache=True)
    return res, res.past_key_values
