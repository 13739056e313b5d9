"""One model definition for the Llama family (Llama, Mistral, Qwen2, SmolLM2).

A ``LlamaModel`` owns a contiguous range of decoder layers: a pipeline stage.
It builds only those layers, plus the embedding on the first stage and the
final norm and LM head on the last. It maps tokens (first stage) or hidden
states (other stages) to hidden states over a flat batch of tokens; the
attention metadata says which sequence each token belongs to.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeserve.model.attention import AttentionBackend, AttentionMetadata, KVCache, TorchPagedAttention
from pipeserve.model.config import ModelConfig
from pipeserve.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [n, 1, head_dim]


class LlamaAttention(nn.Module):
    ops = None   # fused CPU kernels for RoPE, as RMSNorm.ops (set by LlamaModel)

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim ** -0.5
        # q, k and v share one matmul; the loader concatenates the checkpoint's three.
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.attention_bias, dtype, device)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, False, dtype, device)
        self.backend = backend

    def forward(self, rope: Rope, x: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)      # [n, heads, D]
        k = k.view(n, self.num_kv_heads, self.head_dim)   # [n, kv_heads, D]
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, rope, self.ops)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)  # [n, heads, D]
        return self.o_proj(out.reshape(n, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(cfg, backend, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype, device)

    def forward(self, rope: Rope, h: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
                kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous layer's MLP output, not yet added to the residual stream
        (or the stage's input, with ``residual`` None). Returns this layer's MLP
        output and the residual stream before it: each residual add is fused
        with the norm after it."""
        x, residual = self.input_layernorm.add_norm(h, residual)
        x, residual = self.post_attention_layernorm.add_norm(self.self_attn(rope, x, meta, kv_cache), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, start_layer: int, end_layer: int, is_first: bool, is_last: bool,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 backend: AttentionBackend | None = None) -> None:
        super().__init__()
        if not 0 <= start_layer <= end_layer <= cfg.num_layers:
            raise ValueError(f"layer range [{start_layer}, {end_layer}) is not inside the model's "
                             f"{cfg.num_layers} layers")
        device = torch.device(device)
        self.cfg, self.start_layer, self.end_layer = cfg, start_layer, end_layer
        self.is_first, self.is_last = is_first, is_last
        self.dtype, self.device = dtype, device
        self.backend = backend or TorchPagedAttention()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device,
                                      cfg.rope_freq_factors)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device) if is_first else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, self.backend, dtype, device)
                                    for _ in range(start_layer, end_layer))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device) if is_last else None
        # With tied embeddings the last stage keeps its own copy of the
        # embedding matrix as the head: stages do not share memory.
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, device) if is_last else None
        ops = getattr(self.backend, "elementwise", None)
        if ops is not None:
            for module in self.modules():
                if isinstance(module, (RMSNorm, SwiGLU, LlamaAttention)):
                    module.ops = ops

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    def forward(self, input_ids_or_hidden: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata, kv_caches: list[KVCache]) -> torch.Tensor:
        """input: token ids [n] (first stage) or hidden [n, hidden]; returns hidden
        [n, hidden] before the final norm (``compute_logits`` applies it)."""
        if self.is_first:
            h = self.embed_tokens(input_ids_or_hidden)  # [n, hidden]
        else:
            h = input_ids_or_hidden.to(self.dtype)
        rope = self.rotary(positions)  # shared by every layer of the step
        residual = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(rope, h, residual, attn_metadata, kv)
        return h if residual is None else h + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> float32 logits [n, vocab] (final norm + head)."""
        if not self.is_last:
            raise RuntimeError("compute_logits needs the last stage (final norm and LM head)")
        return self.lm_head(self.norm(hidden)).float()

    def checkpoint_names(self) -> dict[str, list[str]]:
        """Our parameter name -> the Hugging Face checkpoint tensors it is made
        of, concatenated along dim 0 (fused q/k/v and gate/up)."""
        names: dict[str, list[str]] = {}
        if self.is_first:
            names["embed_tokens.weight"] = ["model.embed_tokens.weight"]
        for local, layer in enumerate(range(self.start_layer, self.end_layer)):
            names.update(_layer_names(local, layer, self.cfg.attention_bias))
        if self.is_last:
            names["norm.weight"] = ["model.norm.weight"]
            head = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
            names["lm_head.weight"] = [head]
        return names


def _layer_names(local: int, layer: int, bias: bool) -> dict[str, list[str]]:
    ours, hf = f"layers.{local}.", f"model.layers.{layer}."
    names = {
        ours + "input_layernorm.weight": [hf + "input_layernorm.weight"],
        ours + "post_attention_layernorm.weight": [hf + "post_attention_layernorm.weight"],
        ours + "self_attn.qkv_proj.weight": [hf + f"self_attn.{p}_proj.weight" for p in "qkv"],
        ours + "self_attn.o_proj.weight": [hf + "self_attn.o_proj.weight"],
        ours + "mlp.gate_up_proj.weight": [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"],
        ours + "mlp.down_proj.weight": [hf + "mlp.down_proj.weight"],
    }
    if bias:
        names[ours + "self_attn.qkv_proj.bias"] = [hf + f"self_attn.{p}_proj.bias" for p in "qkv"]
    return names
