"""GGUF files (llama.cpp): metadata -> ModelConfig; tensors kept in their type or dequantized at load.

Tensors are read through the reader's memory map, so a stage touches only the
bytes of the tensors it asks for. ``GGUF_ARCHITECTURES`` says, per
``general.architecture``, how llama.cpp's converter (convert_hf_to_gguf.py)
wrote that family; what the converter leaves out of the metadata is filled in
as llama.cpp's loader does (src/models/<arch>.cpp), so a file behaves here as
it does there, except where llama.cpp knowingly departs from transformers
(Phi-3's sliding window, which it disables; longrope, which it switches per
context size rather than per sequence length): there we follow transformers.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from pipeserve.model.config import ModelConfig
from pipeserve.model.families import family_fields
from pipeserve.model.loader.gguf_file import GGUFFile
from pipeserve.model.loader.gguf_moe import moe_fields
from pipeserve.model.quant.gguf_repack import KEPT_TYPES, repack
from pipeserve.model.quant.packed import PackedWeight

log = logging.getLogger(__name__)

T = gguf.GGMLQuantizationType
K = gguf.Keys
SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
                   T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS)

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
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",     # Qwen3's per-head norms
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",           # Phi-3's fused projections
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",   # Gemma
    # MoE routers (Mixtral, Qwen) and Qwen2-MoE's shared expert with its sigmoid gate
    "block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# Gemma's post_attention_layernorm normalises the attention output (Llama's is the pre-MLP norm).
_GEMMA_LAYER_NAMES = (("post_attention_layernorm", "post_attention_norm"),)
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
# Each expert's gate / up / down (Mixtral: w1 / w3 / w2) as one slice of a tensor
# stacking all the layer's experts ([E, rows, cols]).
_EXPERT_RE = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w[123]|gate_proj|up_proj|down_proj)")
_EXPERT_NAMES = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps",
                 "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
# Qwen2-MoE's shared-expert gate: [1, hidden] in transformers, a vector of hidden in llama.cpp.
_SHARED_GATE = ".ffn_gate_inp_shexp."


def open_gguf(path: Path) -> GGUFFile:
    """The file's header (``gguf_file.GGUFFile``: metadata decoded when asked for, tensor
    data memory-mapped), parsed once per process and version of the file, since loading a
    model asks for it several times (config, chat template, weights)."""
    path = Path(path).resolve()
    try:
        stat = path.stat()
    except OSError as exc:
        raise ValueError(f"cannot read {path} as a GGUF file: {exc}") from exc
    return _parsed_gguf(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _parsed_gguf(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


@dataclass(frozen=True)
class GGUFArchitecture:
    """How llama.cpp's converter (convert_hf_to_gguf.py) wrote one model family."""

    hf_architecture: str          # the ModelConfig.architecture the file loads as
    qk_rows_permuted: bool        # q/k rows reordered to llama.cpp's interleaved rotary layout
    attention_bias: bool | None   # q/k/v biases: always (True), or as the file has them (None)
    moe_architecture: str | None = None   # what the file loads as when it has experts
    experts_required: bool = False        # a MoE-only family (llama.cpp refuses it without experts)
    shared_expert: bool = False           # each MoE layer has a sigmoid-gated shared expert (ffn_*_shexp)
    norm_topk_prob: bool = True           # llama.cpp's graph renormalises the top-k routing weights
    layer_names: tuple[tuple[str, str], ...] = ()   # HF module -> GGUF name where it differs from _LAYER_NAMES
    norm_shift: float = 0.0       # the converter stored every "*norm.weight" plus this (Gemma: 1 + w)
    # The Hugging Face config keys this family's switches (families.py) read, from the metadata.
    hf_keys: Callable[["_ArchMetadata", int, int], dict] | None = None


def _gemma_keys(meta: "_ArchMetadata", num_layers: int, head_dim: int) -> dict:
    """Gemma 2 / 3 switches as llama.cpp's loader reads them (src/models/gemma2.cpp, gemma3.cpp)."""
    gemma2 = meta.arch == "gemma2"
    heads, hidden = int(meta.require(K.Attention.HEAD_COUNT)), int(meta.require(K.LLM.EMBEDDING_LENGTH))
    # query_pre_attn_scalar is not in the file: llama.cpp scales by 1/sqrt(hidden / heads) for the
    # 27B models (46 layers: Gemma 2; 62: Gemma 3, as their configs say) and 1/sqrt(head_dim) otherwise.
    big = num_layers == (46 if gemma2 else 62)
    window = meta.get(K.Attention.SLIDING_WINDOW, 4096 if gemma2 else None)
    keys = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if big else head_dim,
        # llama.cpp's defaults where the converter wrote no value (Gemma 3 has no attention cap)
        "attn_logit_softcapping": meta.get(K.LLM.ATTN_LOGIT_SOFTCAPPING, 50.0) if gemma2 else None,
        "final_logit_softcapping": meta.get(K.LLM.FINAL_LOGIT_SOFTCAPPING, 30.0 if gemma2 else None) or None,
        "sliding_window": int(window) if window else None,
        "layer_types": _sliding_layers(meta, num_layers, 2 if gemma2 else 6) if window else None,
    }
    if not gemma2:
        keys["rope_local_base_freq"] = float(meta.get(K.Rope.FREQ_BASE_SWA, 10000.0))
    return keys


def _sliding_layers(meta: "_ArchMetadata", num_layers: int, default_pattern: int) -> list[str]:
    """llama.cpp's sliding_window_pattern: a per-layer list of booleans, or n (every n-th
    layer global, the others sliding; 0: all sliding), or the family's default n."""
    pattern = meta.get(K.Attention.SLIDING_WINDOW_PATTERN, default_pattern)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"{meta.arch}.attention.sliding_window_pattern has {len(pattern)} entries "
                             f"for {num_layers} layers")
        sliding = [bool(p) for p in pattern]
    else:
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(num_layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _phi3_keys(meta: "_ArchMetadata", num_layers: int, head_dim: int) -> dict:
    # llama.cpp disables Phi-3's sliding window (and warns); transformers applies it on every layer.
    window = int(meta.get(K.Attention.SLIDING_WINDOW, 0) or 0)
    return {"sliding_window": window or None, "layer_types": None}


# general.architecture -> family. Adding a Llama-shaped family is one line here.
GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    # LlamaModel.modify_tensors permutes q_proj/k_proj weights and biases.
    "llama": GGUFArchitecture("LlamaForCausalLM", qk_rows_permuted=True, attention_bias=None,
                              moe_architecture="MixtralForCausalLM"),
    # Qwen2Model keeps TextModel's default modify_tensors: rows stay as Hugging Face has them.
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", qk_rows_permuted=False, attention_bias=True),
    # Qwen3Model extends Qwen2Model (no permutation); per-head q/k RMSNorm, no biases.
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", qk_rows_permuted=False, attention_bias=None),
    # Phi3MiniModel: qkv_proj and gate_up_proj stay fused (attn_qkv, ffn_up); longrope's
    # factors are the tensors rope_factors_long / rope_factors_short.
    "phi3": GGUFArchitecture("Phi3ForCausalLM", qk_rows_permuted=False, attention_bias=None, hf_keys=_phi3_keys),
    # Gemma2Model / Gemma3Model: every norm weight stored as 1 + w; the head tied to the embedding.
    "gemma2": GGUFArchitecture("Gemma2ForCausalLM", qk_rows_permuted=False, attention_bias=None,
                               layer_names=_GEMMA_LAYER_NAMES, norm_shift=1.0, hf_keys=_gemma_keys),
    "gemma3": GGUFArchitecture("Gemma3ForCausalLM", qk_rows_permuted=False, attention_bias=None,
                               layer_names=_GEMMA_LAYER_NAMES, norm_shift=1.0, hf_keys=_gemma_keys),
    # Qwen2MoeModel / Qwen3MoeModel (which extends it): each layer's experts stacked in
    # ffn_{gate,up,down}_exps, the router as ffn_gate_inp; no row permutation.
    "qwen2moe": GGUFArchitecture("Qwen2MoeForCausalLM", qk_rows_permuted=False, attention_bias=True,
                                 moe_architecture="Qwen2MoeForCausalLM", experts_required=True,
                                 shared_expert=True, norm_topk_prob=False),
    "qwen3moe": GGUFArchitecture("Qwen3MoeForCausalLM", qk_rows_permuted=False, attention_bias=None,
                                 moe_architecture="Qwen3MoeForCausalLM", experts_required=True),
}
ROPE_FREQS = "rope_freqs.weight"  # llama3 scaling as per-dimension divisors of the frequencies
ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")   # Phi-3's longrope


def gguf_architecture(arch: str, path: Path | str = "the file") -> GGUFArchitecture:
    family = GGUF_ARCHITECTURES.get(arch)
    if family is None:
        raise ValueError(f"GGUF architecture {arch!r} in {path} is not supported; pipeserve loads "
                         f"GGUF files of: {', '.join(GGUF_ARCHITECTURES)}")
    return family


def family_of(cfg: ModelConfig) -> GGUFArchitecture:
    """The GGUF family a config read from a GGUF file belongs to."""
    for family in GGUF_ARCHITECTURES.values():
        if cfg.architecture in (family.hf_architecture, family.moe_architecture):
            return family
    raise ValueError(f"{cfg.architecture} has no GGUF form in pipeserve (GGUF families: "
                     f"{', '.join(GGUF_ARCHITECTURES)})")


def qk_rows_permuted(cfg: ModelConfig) -> bool:
    """Whether a GGUF of this model stores q/k rows in llama.cpp's rotary order."""
    return family_of(cfg).qk_rows_permuted


def read_gguf_config(path: Path) -> ModelConfig:
    reader = open_gguf(path)
    arch = str(_field(reader, "general.architecture"))
    family = gguf_architecture(arch, path)
    tensors = {t.name: t for t in reader.tensors}
    meta = _ArchMetadata(reader, arch)
    heads = int(meta.require(K.Attention.HEAD_COUNT))
    hidden = int(meta.require(K.LLM.EMBEDDING_LENGTH))
    head_dim = int(meta.get(K.Attention.KEY_LENGTH, hidden // heads))
    rotary = int(meta.get(K.Rope.DIMENSION_COUNT, head_dim))
    if rotary != head_dim:
        raise ValueError(f"{path} rotates {rotary} of {head_dim} dimensions per head (partial RoPE), "
                         "which pipeserve does not implement")
    bias = "blk.0.attn_q.bias" in tensors
    if family.attention_bias and not bias:
        raise ValueError(f"{path} is a {arch!r} GGUF without the q/k/v biases that family has "
                         "(blk.0.attn_q.bias is missing); the file looks truncated or mislabelled")
    moe = moe_fields(meta, family, path)   # Mixtral: llama.cpp's "llama" with experts
    architecture = family.moe_architecture if moe else family.hf_architecture
    num_layers = int(meta.require(K.LLM.BLOCK_COUNT))
    hf_keys = {"architectures": [architecture],
               **(family.hf_keys(meta, num_layers, head_dim) if family.hf_keys else {})}
    eos = _field(reader, K.Tokenizer.EOS_ID)
    bos = _field(reader, K.Tokenizer.BOS_ID)
    return ModelConfig(
        architecture=architecture,
        vocab_size=_vocab_size(meta, tensors),
        hidden_size=hidden,
        intermediate_size=int(meta.require(K.LLM.FEED_FORWARD_LENGTH)),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(meta.get(K.Attention.HEAD_COUNT_KV, heads)),
        head_dim=head_dim,
        max_position_embeddings=int(meta.get(K.LLM.CONTEXT_LENGTH, 2048)),
        rms_norm_eps=float(meta.get(K.Attention.LAYERNORM_RMS_EPS, 1e-5)),
        rope_theta=float(meta.get(K.Rope.FREQ_BASE, 10000.0)),
        rope_scaling=_rope_scaling(meta, path, tensors),
        rope_freq_factors=_rope_freq_factors(tensors.get(ROPE_FREQS), head_dim, path),
        attention_bias=bias,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        **moe,
        sliding_window=hf_keys.get("sliding_window"),
        layer_types=tuple(hf_keys["layer_types"]) if hf_keys.get("layer_types") else None,
        **family_fields(hf_keys),
    )


class _ArchMetadata:
    """Metadata keys of one architecture: gguf's "{arch}.block_count" templates, filled in."""

    def __init__(self, reader: GGUFFile, arch: str) -> None:
        self.reader, self.arch = reader, arch

    def get(self, template: str, default=None):
        return _field(self.reader, template.format(arch=self.arch), default)

    def require(self, template: str):
        value = self.get(template)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {template.format(arch=self.arch)!r}, which pipeserve "
                             "needs to build the model")
        return value


def _rope_scaling(meta: _ArchMetadata, path: Path, tensors: dict) -> dict | None:
    if ROPE_FACTORS[1] in tensors:
        return _longrope(meta, path, tensors)
    kind = str(meta.get(K.Rope.SCALING_TYPE, "none"))
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta.require(K.Rope.SCALING_FACTOR))}
    raise ValueError(f"{path} uses {kind!r} RoPE scaling, which pipeserve does not implement "
                     "(supported in GGUF files: none, linear, llama3 via rope_freqs, and Phi-3's longrope "
                     "via rope_factors_long / rope_factors_short)")


def _longrope(meta: _ArchMetadata, path: Path, tensors: dict) -> dict:
    """Phi-3's longrope as Phi3MiniModel writes it: the two factor lists as tensors, the
    original context length and the cos/sin multiplier (attn_factor) as metadata."""
    short, long = (tensors.get(name) for name in ROPE_FACTORS)
    if short is None:
        raise ValueError(f"{path} has {ROPE_FACTORS[1]} but not {ROPE_FACTORS[0]}; longrope needs both")
    factors = [gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1).tolist()
               for t in (short, long)]
    return {"rope_type": "longrope", "short_factor": factors[0], "long_factor": factors[1],
            "original_max_position_embeddings": int(meta.require(K.Rope.SCALING_ORIG_CTX_LEN)),
            "attention_factor": float(meta.require(K.Rope.SCALING_ATTN_FACTOR))}


def _rope_freq_factors(tensor, head_dim: int, path: Path) -> tuple[float, ...] | None:
    """llama.cpp divides each RoPE frequency by its factor (llama3 context extension)."""
    if tensor is None:
        return None
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(-1)
    if values.size != head_dim // 2:
        raise ValueError(f"{path}: {ROPE_FREQS} has {values.size} factors, expected head_dim / 2 = "
                         f"{head_dim // 2}")
    return tuple(float(v) for v in values)


def _vocab_size(meta: _ArchMetadata, tensors: dict) -> int:
    size = meta.get(K.LLM.VOCAB_SIZE)
    if size is not None:
        return int(size)
    if "token_embd.weight" in tensors:
        return int(tensors["token_embd.weight"].shape[-1])  # GGUF shapes list the fastest dimension first
    raise ValueError(f"GGUF file has neither {meta.arch}.vocab_size nor token_embd.weight")


def _field(reader: GGUFFile, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def gguf_location(hf_name: str, family: GGUFArchitecture | None = None) -> tuple[str, int | None]:
    """(GGUF tensor name, expert index into its stacked first dimension or None)."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name], None
    m = _LAYER_RE.fullmatch(hf_name)
    names = {**_LAYER_NAMES, **dict(family.layer_names)} if family is not None else _LAYER_NAMES
    if m is not None and m.group(2) in names:
        return f"blk.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}", None
    expert = _EXPERT_RE.fullmatch(m.group(2)) if m is not None else None
    if expert is None:
        raise KeyError(f"no GGUF equivalent of tensor {hf_name!r}")
    return f"blk.{m.group(1)}.{_EXPERT_NAMES[expert.group(2)]}.{m.group(3)}", int(expert.group(1))


class GGUFWeightReader:
    """Reads tensors by their Hugging Face names, dequantized to float32, with what
    llama.cpp's converter changed undone: the rotary row permutation of q/k
    (llama), the 1 added to norm weights (Gemma)."""

    def __init__(self, path: Path, cfg: ModelConfig) -> None:
        self.path = path
        self.cfg = cfg
        self.names_read: list[str] = []  # GGUF names, in read order
        self._reader = open_gguf(path)
        self._tensors = {t.name: t for t in self._reader.tensors}
        # Stacked expert tensors, dequantized once for all their experts' reads
        # (a layer's gate and up stacks are read alternately: keep the last two).
        self._stacks: dict[str, np.ndarray] = {}
        self._family = family_of(cfg)
        self._permuted = self._family.qk_rows_permuted  # llama yes, qwen2 no

    def names(self) -> set[str]:
        return set(self._tensors)

    def _tensor(self, hf_name: str):
        """(the GGUF tensor holding ``hf_name``, its expert index in a stacked tensor or None)."""
        name, expert = gguf_location(hf_name, self._family)
        tensor = self._tensors.get(name)
        if tensor is None:
            raise KeyError(f"tensor {name!r} (for {hf_name!r}) is not in {self.path}")
        self.names_read.append(name)
        return tensor, expert

    def read(self, hf_name: str) -> torch.Tensor:
        tensor, expert = self._tensor(hf_name)
        name = tensor.name
        array = dequantize_tensor(tensor) if expert is None else self._stack(name, tensor)[expert]
        if self._permuted and ".attn_q." in name:
            array = unpermute_rotary_rows(array, self.cfg.num_heads)
        elif self._permuted and ".attn_k." in name:
            array = unpermute_rotary_rows(array, self.cfg.num_kv_heads)
        if _SHARED_GATE in name and array.ndim == 1:
            array = array[None]
        if self._family.norm_shift and hf_name.endswith("norm.weight"):
            # The file holds x = 1 + w; x - 1 is exact for x >= 0.5, so the norm's 1 + (x - 1)
            # is transformers' 1 + w bit for bit in float32.
            array = array - np.float32(self._family.norm_shift)
        if not array.flags.writeable:  # F32 tensors come straight from the read-only memory map
            array = array.copy()
        return torch.from_numpy(np.ascontiguousarray(array))

    def _stack(self, name: str, tensor) -> np.ndarray:
        if name not in self._stacks:
            if len(self._stacks) == 2:
                self._stacks.pop(next(iter(self._stacks)))
            self._stacks[name] = dequantize_tensor(tensor)
        return self._stacks[name]

    def shape(self, hf_name: str) -> tuple[int, ...]:
        """The tensor's shape in PyTorch (row-major) order, without reading it."""
        tensor, expert = self._tensor(hf_name)
        self.names_read.pop()
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if _SHARED_GATE in tensor.name and len(shape) == 1:
            return (1, *shape)
        return shape if expert is None else shape[1:]

    def block_size(self, hf_name: str) -> int:
        """Weights per quantization block along the tensor's input when it is kept quantized
        (32, or 256 for K-quants); 1 when it is dense, dequantized at load or absent."""
        try:
            tensor, expert = self._tensor(hf_name)
        except KeyError:
            return 1
        self.names_read.pop()
        if tensor.tensor_type not in KEPT_TYPES:
            return 1
        return gguf.GGML_QUANT_SIZES[tensor.tensor_type][0]

    def read_packed(self, hf_name: str, cut: tuple[int, tuple[tuple[int, int], ...]] | None = None
                    ) -> PackedWeight | None:
        """The tensor in its own block type (``pipeserve.model.quant``), or None
        when that type is not kept quantized (then ``read`` dequantizes it). An expert's
        tensor is its slice of the layer's stack: its rows, whole rows of blocks.

        ``cut`` (dim, [start, stop) ranges): a tensor-parallel rank's slice, taken from the
        file's block bytes before they are re-laid out: whole rows (dim 0; rows past the end
        are zero blocks, the vocabulary padding) or whole blocks of every row (dim 1, the
        input of a row-parallel layer: each range must start and stop on a block boundary)."""
        tensor, expert = self._tensor(hf_name)
        if tensor.tensor_type not in KEPT_TYPES:
            if not expert and tensor.tensor_type not in (T.F32, T.F16, T.BF16):   # once per expert stack
                log.info("GGUF tensor %s has type %s, which is not kept quantized: dequantizing it",
                         tensor.name, tensor.tensor_type.name)
            self.names_read.pop()   # the caller reads it again with ``read``
            return None
        # uint8 [rows, bytes per row]: the file's blocks (of one expert: [E, rows, bytes] indexed)
        raw = tensor.data if expert is None else tensor.data[expert]
        if self._permuted and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = self.cfg.num_heads if ".attn_q." in tensor.name else self.cfg.num_kv_heads
            # Rows are independent: undo the rotary permutation on whole rows of blocks.
            raw = raw[unpermute_rotary_rows(np.arange(raw.shape[0]), heads)]
        if cut is not None:
            raw = _cut_blocks(raw, tensor, *cut)
        return repack(tensor.tensor_type, raw)

    def close(self) -> None:
        self._tensors.clear()
        self._stacks.clear()


def _cut_blocks(raw: np.ndarray, tensor, dim: int, ranges) -> np.ndarray:
    """Rows (dim 0) or input columns (dim 1) of a block-quantized tensor's raw bytes."""
    rows = raw.shape[0]
    if dim == 0:
        pieces = []
        for start, stop in ranges:
            if start < rows:
                pieces.append(raw[start:min(stop, rows)])
            if stop > max(start, rows):   # zero blocks dequantize to zero (scale 0)
                pieces.append(np.zeros((stop - max(start, rows), raw.shape[1]), dtype=raw.dtype))
        return np.ascontiguousarray(np.concatenate(pieces, axis=0))
    block, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    pieces = []
    for start, stop in ranges:
        if start % block or stop % block:
            raise ValueError(f"tensor {tensor.name} ({tensor.tensor_type.name}) is quantized in blocks of {block} "
                             f"weights along its input; a tensor-parallel cut [{start}, {stop}) splits a block")
        pieces.append(raw[:, start // block * type_size:stop // block * type_size])
    return np.ascontiguousarray(np.concatenate(pieces, axis=1))


def dequantize_tensor(tensor) -> np.ndarray:
    """A file tensor (gguf_file.Tensor) -> float32 array in PyTorch (row-major) shape."""
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
