"""GGUF files (llama.cpp): metadata -> ModelConfig, tensors dequantized at load.

Tensors are read through the reader's memory map, so a stage touches only the
bytes of the tensors it asks for.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import gguf
import numpy as np
import torch

from pipeserve.model.config import ModelConfig
from pipeserve.model.quant.gguf_repack import KEPT_TYPES, repack
from pipeserve.model.quant.packed import PackedWeight

log = logging.getLogger(__name__)

T = gguf.GGMLQuantizationType
SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
                   T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)

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
    return ModelConfig(
        architecture="LlamaForCausalLM",
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


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    m = _LAYER_RE.fullmatch(hf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise KeyError(f"no GGUF equivalent of tensor {hf_name!r}")
    return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


class GGUFWeightReader:
    """Reads tensors by their Hugging Face names, dequantized to float32 and
    with llama.cpp's rotary row permutation of q/k undone."""

    def __init__(self, path: Path, cfg: ModelConfig) -> None:
        self.path = path
        self.cfg = cfg
        self.names_read: list[str] = []  # GGUF names, in read order
        self._reader = open_gguf(path)
        self._tensors = {t.name: t for t in self._reader.tensors}

    def names(self) -> set[str]:
        return set(self._tensors)

    def _tensor(self, hf_name: str):
        name = gguf_name(hf_name)
        tensor = self._tensors.get(name)
        if tensor is None:
            raise KeyError(f"tensor {name!r} (for {hf_name!r}) is not in {self.path}")
        self.names_read.append(name)
        return tensor

    def read(self, hf_name: str) -> torch.Tensor:
        tensor = self._tensor(hf_name)
        name = tensor.name
        array = dequantize_tensor(tensor)
        if ".attn_q." in name:
            array = unpermute_rotary_rows(array, self.cfg.num_heads)
        elif ".attn_k." in name:
            array = unpermute_rotary_rows(array, self.cfg.num_kv_heads)
        if not array.flags.writeable:  # F32 tensors come straight from the read-only memory map
            array = array.copy()
        return torch.from_numpy(np.ascontiguousarray(array))

    def read_packed(self, hf_name: str) -> PackedWeight | None:
        """The tensor in its own block type (``pipeserve.model.quant``), or None
        when that type is not kept quantized (then ``read`` dequantizes it)."""
        tensor = self._tensor(hf_name)
        if tensor.tensor_type not in KEPT_TYPES:
            if tensor.tensor_type not in (T.F32, T.F16, T.BF16):
                log.info("GGUF tensor %s has type %s, which is not kept quantized: dequantizing it",
                         tensor.name, tensor.tensor_type.name)
            self.names_read.pop()   # the caller reads it again with ``read``
            return None
        packed = repack(tensor.tensor_type, tensor.data)
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
            heads = self.cfg.num_heads if ".attn_q." in tensor.name else self.cfg.num_kv_heads
            # Rows are independent: undo the rotary permutation on whole rows of codes.
            order = unpermute_rotary_rows(np.arange(packed.out_features), heads)
            packed = packed.rows(torch.from_numpy(np.ascontiguousarray(order)))
        return packed

    def close(self) -> None:
        self._tensors.clear()


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
