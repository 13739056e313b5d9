"""GGUF files (llama.cpp): metadata -> ModelConfig, tensors dequantized at load.

Tensors are read through the reader's memory map, so a stage touches only the
bytes of the tensors it asks for.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch

from pipeserve.model.config import ModelConfig

T = gguf.GGMLQuantizationType
SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K)

# Hugging Face name -> GGUF name; "{i}" is the layer index.
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
# Mixtral: the router, and each expert's w1 (gate) / w3 (up) / w2 (down) as one slice of
# a tensor stacking all experts ([E, rows, cols]).
_MOE_ROUTER = "block_sparse_moe.gate"
_EXPERT_RE = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])")
_EXPERT_NAMES = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def open_gguf(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the package raises bare ValueErrors on bad magic etc.
        raise ValueError(f"cannot read {path} as a GGUF file: {exc}") from exc


def read_gguf_config(path: Path) -> ModelConfig:
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} in {path} is not supported (only 'llama')")
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise ValueError(f"{path} carries llama3 'rope_freqs' scaling factors, which the GGUF "
                         "loader does not support; use the Hugging Face checkpoint instead")
    return _config_from_metadata(reader)


def _config_from_metadata(reader: gguf.GGUFReader) -> ModelConfig:
    def get(key: str, default=None):
        return _field(reader, f"llama.{key}", default)

    names = {t.name for t in reader.tensors}
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    experts = int(get("expert_count", 0) or 0)   # Mixtral: llama.cpp's "llama" with experts
    return ModelConfig(
        architecture="MixtralForCausalLM" if experts else "LlamaForCausalLM",
        vocab_size=_vocab_size(reader),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        attention_bias="blk.0.attn_q.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        num_experts=experts,
        num_experts_per_tok=int(get("expert_used_count", 0) or 0) if experts else 0,
    )


def _vocab_size(reader: gguf.GGUFReader) -> int:
    size = _field(reader, "llama.vocab_size")
    if size is not None:
        return int(size)
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[-1])  # GGUF shapes list the fastest dimension first
    raise ValueError("GGUF file has neither llama.vocab_size nor token_embd.weight")


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def gguf_location(hf_name: str) -> tuple[str, int | None]:
    """(GGUF tensor name, expert index into its stacked first dimension or None)."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name], None
    m = _LAYER_RE.fullmatch(hf_name)
    if m is not None and m.group(2) in _LAYER_NAMES:
        return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}", None
    if m is not None and m.group(2) == _MOE_ROUTER:
        return f"blk.{m.group(1)}.ffn_gate_inp.{m.group(3)}", None
    expert = _EXPERT_RE.fullmatch(m.group(2)) if m is not None else None
    if expert is None:
        raise KeyError(f"no GGUF equivalent of tensor {hf_name!r}")
    return f"blk.{m.group(1)}.{_EXPERT_NAMES[expert.group(2)]}.{m.group(3)}", int(expert.group(1))


class GGUFWeightReader:
    """Reads tensors by their Hugging Face names, dequantized to float32 and
    with llama.cpp's rotary row permutation of q/k undone."""

    def __init__(self, path: Path, cfg: ModelConfig) -> None:
        self.path = path
        self.cfg = cfg
        self.names_read: list[str] = []  # GGUF names, in read order
        self._reader = open_gguf(path)
        self._tensors = {t.name: t for t in self._reader.tensors}
        # Stacked expert tensors, dequantized once for all their experts' reads
        # (a layer's gate and up stacks are read alternately: keep the last two).
        self._stacks: dict[str, np.ndarray] = {}

    def names(self) -> set[str]:
        return set(self._tensors)

    def read(self, hf_name: str) -> torch.Tensor:
        name, expert = gguf_location(hf_name)
        tensor = self._tensors.get(name)
        if tensor is None:
            raise KeyError(f"tensor {name!r} (for {hf_name!r}) is not in {self.path}")
        self.names_read.append(name)
        array = dequantize_tensor(tensor) if expert is None else self._stack(name, tensor)[expert]
        if ".attn_q." in name:
            array = unpermute_rotary_rows(array, self.cfg.num_heads)
        elif ".attn_k." in name:
            array = unpermute_rotary_rows(array, self.cfg.num_kv_heads)
        if not array.flags.writeable:  # F32 tensors come straight from the read-only memory map
            array = array.copy()
        return torch.from_numpy(np.ascontiguousarray(array))

    def _stack(self, name: str, tensor) -> np.ndarray:
        if name not in self._stacks:
            if len(self._stacks) == 2:
                self._stacks.pop(next(iter(self._stacks)))
            self._stacks[name] = dequantize_tensor(tensor)
        return self._stacks[name]

    def close(self) -> None:
        self._tensors.clear()
        self._stacks.clear()


def dequantize_tensor(tensor) -> np.ndarray:
    """A ReaderTensor -> float32 array in PyTorch (row-major) shape."""
    if tensor.tensor_type not in SUPPORTED_TYPES:
        raise ValueError(f"tensor {tensor.name!r} has GGUF type {tensor.tensor_type.name}, which pipeserve "
                         f"cannot load (supported: {', '.join(t.name for t in SUPPORTED_TYPES)})")
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False).reshape(shape)


def unpermute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's conversion permutation of q/k rows.

    llama.cpp rotates interleaved pairs (x0, x1), (x2, x3), ...; Hugging Face
    rotates halves (x_i, x_{i + D/2}). The converter therefore reorders the
    rows of each head from [first half; second half] to interleaved pairs.
    Here each head's rows are viewed as [D/2, 2] pairs and transposed back to
    [2, D/2] halves. Works for weights [rows, in] and biases [rows].
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
