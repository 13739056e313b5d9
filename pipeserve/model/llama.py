"""One decoder for every dense family (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3, SmolLM2).

A ``LlamaModel`` owns a contiguous range of decoder layers: a pipeline stage.
It builds only those layers, plus the embedding on the first stage and the
final norm and LM head on the last. It maps tokens (first stage) or hidden
states (other stages) to hidden states over a flat batch of tokens; the
attention metadata says which sequence each token belongs to.

The families differ by switches on ``ModelConfig`` (set in
pipeserve/model/families.py, which tabulates them): per-head q/k norm,
Gemma's (1 + w) norms, its norms on the attention and MLP outputs, GeGLU,
scaled embeddings, soft-capping, per-layer windows and RoPE bases. The
checkpoint name map at the end of this file is where their tensor names differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pipeserve.model.attention import AttentionBackend, AttentionMetadata, KVCache, TorchPagedAttention
from pipeserve.model.config import ModelConfig
from pipeserve.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary
from pipeserve.model.longrope import LongRotaryEmbedding
from pipeserve.model.tensor_parallel import TensorParallelGroup, local_config

if TYPE_CHECKING:
    from pipeserve.model.cpu_ops import CpuElementwise

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [n, 1, head_dim]


class LlamaAttention(nn.Module):
    ops = None   # fused CPU kernels for RoPE, as RMSNorm.ops (set by LlamaModel)

    def __init__(self, cfg: ModelConfig, layer: int, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.attention_scale
        # Keywords for the backend: this layer's window and soft-cap, only when set.
        self.backend_options = {key: value for key, value in (
            ("sliding_window", cfg.layer_sliding_window(layer)),
            ("logit_softcap", cfg.attn_logit_softcapping)) if value is not None}
        # q, k and v share one matmul; the loader concatenates the checkpoint's three.
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.attention_bias, dtype, device)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, False, dtype, device)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:  # RMSNorm over each head, before RoPE (Qwen3, Gemma 3)
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, cfg.norm_unit_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, cfg.norm_unit_offset)
        self.backend = backend

    def forward(self, rope: Rope, x: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj.forward(x)   # .forward: see LlamaModel.forward
        if n == 1 and self.q_norm is None and self.ops is not None and self.ops.applies(qkv):
            # One decode row: q and k's heads are adjacent in the row, so one fused RoPE call
            # rotates both (same per-element math as two); its two slices stay contiguous.
            cos, sin = rope
            qk = self.ops.rope(qkv[:, :self.q_size + self.kv_size].view(1, self.num_heads + self.num_kv_heads,
                                                                          self.head_dim), cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            v = qkv[:, self.q_size + self.kv_size:].view(1, self.num_kv_heads, self.head_dim)
            out = self.backend.forward(q, k, v, kv_cache, meta, self.scale, **self.backend_options)
            return self.o_proj.forward(out.reshape(1, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)      # [n, heads, D]
        k = k.view(n, self.num_kv_heads, self.head_dim)   # [n, kv_heads, D]
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(n, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(n, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, rope, self.ops)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale, **self.backend_options)  # [n, heads, D]
        return self.o_proj.forward(out.reshape(n, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cfg.norm_unit_offset)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(cfg, layer, backend, dtype, device)
        self.post_attention_layernorm = norm()   # before the MLP (Gemma's pre_feedforward_layernorm)
        self.mlp = _mlp(cfg, layer, dtype, device)
        # Gemma's "sandwich": norms on the attention and MLP outputs, before each residual add.
        self.attn_output_norm = norm() if cfg.sandwich_norms else None
        self.mlp_output_norm = norm() if cfg.sandwich_norms else None
        # Gemma 3's sliding layers use their own RoPE base.
        self.rope_kind = "local" if cfg.rope_local_theta and cfg.layer_sliding_window(layer) else "global"

    # Tensor parallelism (pipeserve/model/tensor_parallel.py): o_proj and down_proj hold
    # this rank's input slice, so their outputs are partial sums until all-reduced.
    tp = None

    def forward(self, rope: Rope, h: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
                kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous layer's MLP output, not yet added to the residual stream
        (or the stage's input, with ``residual`` None). Returns this layer's MLP
        output and the residual stream before it: each residual add is fused
        with the norm after it."""
        x, residual = self.input_layernorm.add_norm(h, residual)
        attn = self.self_attn.forward(rope, x, meta, kv_cache)   # .forward: see LlamaModel.forward
        if self.tp is not None:
            attn = self.tp.all_reduce(attn)
        if self.attn_output_norm is not None:
            attn = self.attn_output_norm(attn)
        x, residual = self.post_attention_layernorm.add_norm(attn, residual)
        out = self.mlp.forward(x)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        if self.mlp_output_norm is not None:
            out = self.mlp_output_norm(out)
        return out, residual


def _mlp(cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    if cfg.num_experts:  # mixture-of-experts families
        from pipeserve.model.moe import build_mlp
        return build_mlp(cfg, layer, dtype, device)
    return SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype, device, cfg.hidden_act)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, start_layer: int, end_layer: int, is_first: bool, is_last: bool,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 backend: AttentionBackend | None = None, tp: TensorParallelGroup | None = None) -> None:
        """``tp``: this rank's group when the stage is split over tensor-parallel ranks; the
        layers are then built with the rank's heads and intermediate slice (``self.cfg`` is
        that local config, ``self.full_cfg`` the model's), embedding and head with its
        vocabulary rows."""
        super().__init__()
        if not 0 <= start_layer <= end_layer <= cfg.num_layers:
            raise ValueError(f"layer range [{start_layer}, {end_layer}) is not inside the model's "
                             f"{cfg.num_layers} layers")
        device = torch.device(device)
        self.full_cfg, self.tp = cfg, tp
        if tp is not None:
            cfg = local_config(cfg, tp.shard)
        self.cfg, self.start_layer, self.end_layer = cfg, start_layer, end_layer
        self.is_first, self.is_last = is_first, is_last
        self.dtype, self.device = dtype, device
        self.backend = backend or TorchPagedAttention()
        self.rotary = _rotary(cfg, device)
        self.local_rotary = (RotaryEmbedding(cfg.head_dim, cfg.rope_local_theta, None, device)
                             if cfg.rope_local_theta else None)
        vocab_rows = cfg.vocab_size if tp is None else tp.shard.vocab_rows
        self.embed_tokens = Embedding(vocab_rows, cfg.hidden_size, dtype, device) if is_first else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, layer, self.backend, dtype, device)
                                    for layer in range(start_layer, end_layer))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cfg.norm_unit_offset) if is_last else None
        # With tied embeddings a last stage that is not also first holds its own copy of the
        # embedding matrix as the head (stages do not share memory); one that is first too, or a
        # first stage that shares the head (--pp-lm-head shared), uses the embedding's tensor.
        self.lm_head = Linear(cfg.hidden_size, vocab_rows, False, dtype, device) if is_last else None
        if tp is not None:
            for layer in self.layers:
                layer.tp = tp
        ops = _elementwise_ops(dtype, device)
        if ops is not None:  # each module checks it applies (dtype, and no Gemma norm / GeGLU)
            for module in self.modules():
                if hasattr(type(module), "ops"):
                    module.ops = ops

    # The stage's decode steps in one C call (pipeserve/model/cpu_decode.py): None until the
    # first CPU forward decides, then the FusedDecode or False; --profile's hook sees it made.
    fused_decode = None
    on_fused_decode = None

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    def forward(self, input_ids_or_hidden: torch.Tensor | list[int], positions: torch.Tensor,
                attn_metadata: AttentionMetadata, kv_caches: list[KVCache]) -> torch.Tensor:
        """input: token ids [n] (first stage: a tensor or a list) or hidden [n, hidden]; returns
        hidden [n, hidden] before the final norm (``compute_logits`` applies it)."""
        if self.is_first:
            h = self._embed(input_ids_or_hidden, positions.device)  # [n, hidden]
            if self.cfg.scale_embeddings:  # sqrt(hidden) rounded to the activation dtype, as Gemma does
                h = h * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=h.dtype)
        else:
            h = input_ids_or_hidden.to(self.dtype)
        fused = self.fused_decode
        if fused is None and h.device.type == "cpu" and self.layers:   # decided once, with the weights loaded
            from pipeserve.model.cpu_decode import fused_decode
            fused = self.fused_decode = fused_decode(self) or False
            if fused and self.on_fused_decode is not None:
                self.on_fused_decode(fused)
        if fused and fused.applies(h, attn_metadata, kv_caches):
            table = (self.rotary.table(max(attn_metadata.context_lens, default=0))
                     if type(self.rotary) is RotaryEmbedding and self.local_rotary is None else None)
            if table is not None:     # the C code picks the step's rows
                return fused(h, table, attn_metadata, kv_caches, positions)
            return fused(h, self._ropes(positions, attn_metadata)["global"], attn_metadata, kv_caches)
        ropes = self._ropes(positions, attn_metadata)  # shared by every layer of the step
        residual = None
        # The decoder's modules carry no hooks, so the hot path calls ``forward`` directly:
        # nn.Module.__call__ costs ~1.5 us a call, ~210 calls per decode step (measured, 1 thread).
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            h, residual = layer.forward(ropes[layer.rope_kind], h, residual, attn_metadata, kv)
        return h if residual is None else h + residual

    def _embed(self, ids: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
        """ids: int64 [n], or a list of ints (a runner's step), which the embedding takes as they
        are (a kept-quantized table looks them up in C without a tensor of them); the
        vocabulary-parallel lookup makes a tensor of them on ``device``."""
        if self.tp is None:
            return self.embed_tokens.forward(ids)   # .forward: see forward
        if isinstance(ids, list):
            ids = torch.tensor(ids, dtype=torch.int64, device=device)
        # Vocabulary-parallel: look up the ids in our rows, zero the others, sum over ranks.
        start, stop = self.tp.shard.vocab
        mine = (ids >= start) & (ids < stop)
        h = self.embed_tokens(torch.where(mine, ids - start, 0))
        return self.tp.all_reduce(h * mine.unsqueeze(1).to(h.dtype))

    def _ropes(self, positions: torch.Tensor, meta: AttentionMetadata) -> dict[str, Rope]:
        limit = max(meta.context_lens, default=0)   # past every position of the step
        if isinstance(self.rotary, LongRotaryEmbedding):
            ropes = {"global": self.rotary.forward(positions, meta.query_lens, meta.seq_lens or meta.context_lens)}
        else:
            ropes = {"global": self.rotary.forward(positions, limit)}
        if self.local_rotary is not None:
            ropes["local"] = self.local_rotary.forward(positions, limit)
        return ropes

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor | None:
        """hidden [n, hidden] -> float32 logits [n, vocab] (final norm + head). Under
        tensor parallelism the full logits exist on TP rank 0 only (None elsewhere).
        ``widen`` False: in the head's dtype where nothing follows the head (the sampler
        widens them where it needs to; a greedy token does not)."""
        if not self.is_last:
            raise RuntimeError("compute_logits needs the last stage (final norm and LM head)")
        logits = self.lm_head.forward(self.norm.forward(hidden))
        if not widen and self.tp is None and self.cfg.final_logit_softcapping is None:
            return logits
        logits = logits.float()
        if self.tp is not None:
            logits = self.tp.gather_to_first(logits)   # [n, T * vocab rows] on rank 0
            if logits is None:
                return None
            logits = logits[:, :self.full_cfg.vocab_size]
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def checkpoint_names(self) -> dict[str, list[str]]:
        """Our parameter name -> the Hugging Face checkpoint tensors it is made
        of, concatenated along dim 0 (fused q/k/v and gate/up)."""
        names: dict[str, list[str]] = {}
        if self.is_first:
            names["embed_tokens.weight"] = ["model.embed_tokens.weight"]
        for local, layer in enumerate(range(self.start_layer, self.end_layer)):
            names.update(_layer_names(self.cfg, f"layers.{local}.", f"model.layers.{layer}.", layer))
        if self.is_last:
            names["norm.weight"] = ["model.norm.weight"]
            head = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
            names["lm_head.weight"] = [head]
        return names


def _elementwise_ops(dtype: torch.dtype, device: torch.device) -> CpuElementwise | None:
    """The fused RMSNorm/RoPE/SiLU kernels for a CPU stage (a quantized stage is built
    on the meta device first), or None; independent of the attention backend.
    bfloat16 always; float32 only with quantized weights: dense float32 is the fidelity
    reference and keeps PyTorch's ops, bit for bit as transformers (the C RMSNorm and
    SiLU round differently by an ulp), while a quantized float32 stage (--dtype auto on
    a CPU without native bfloat16) spent a tenth of each decode step in these small ops."""
    if device.type not in ("cpu", "meta"):
        return None
    if dtype != torch.bfloat16 and not (dtype == torch.float32 and device.type == "meta"):
        return None
    from pipeserve.model.cpu_ops import cpu_elementwise
    return cpu_elementwise()


def _rotary(cfg: ModelConfig, device: torch.device) -> nn.Module:
    kind = (cfg.rope_scaling or {}).get("rope_type")
    if kind == "longrope":
        return LongRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
    return RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device, cfg.rope_freq_factors)


def _layer_names(cfg: ModelConfig, ours: str, hf: str, layer: int) -> dict[str, list[str]]:
    attn = hf + "self_attn."
    # Gemma's post_attention_layernorm is the attention-output norm; its pre-MLP norm is pre_feedforward_layernorm.
    pre_mlp = "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm"
    names = {
        ours + "input_layernorm.weight": [hf + "input_layernorm.weight"],
        ours + "post_attention_layernorm.weight": [hf + pre_mlp + ".weight"],
        ours + "self_attn.qkv_proj.weight": ([attn + "qkv_proj.weight"] if cfg.fused_checkpoint
                                             else [attn + f"{p}_proj.weight" for p in "qkv"]),
        ours + "self_attn.o_proj.weight": [attn + "o_proj.weight"],
    }
    if cfg.attention_bias:
        names[ours + "self_attn.qkv_proj.bias"] = [attn + f"{p}_proj.bias" for p in "qkv"]
    if cfg.qk_norm:
        names[ours + "self_attn.q_norm.weight"] = [attn + "q_norm.weight"]
        names[ours + "self_attn.k_norm.weight"] = [attn + "k_norm.weight"]
    if cfg.sandwich_norms:
        names[ours + "attn_output_norm.weight"] = [hf + "post_attention_layernorm.weight"]
        names[ours + "mlp_output_norm.weight"] = [hf + "post_feedforward_layernorm.weight"]
    if cfg.num_experts:
        from pipeserve.model.moe import mlp_checkpoint_names
        names.update(mlp_checkpoint_names(cfg, ours, hf, layer))
    else:
        gate_up = ([hf + "mlp.gate_up_proj.weight"] if cfg.fused_checkpoint
                   else [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"])
        names[ours + "mlp.gate_up_proj.weight"] = gate_up
        names[ours + "mlp.down_proj.weight"] = [hf + "mlp.down_proj.weight"]
    return names
