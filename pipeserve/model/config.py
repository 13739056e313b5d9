"""Shapes of a Llama-family model: plain Python, shared by the runtime and the planner."""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # llama3-style scaling: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}; None for plain RoPE.
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    # Per-dimension divisors of the RoPE frequencies [head_dim / 2]: a GGUF's
    # rope_freqs tensor (llama.cpp's form of llama3 scaling); None for none.
    rope_freq_factors: tuple[float, ...] | None = field(default=None, hash=False, compare=False)
    attention_bias: bool = False              # q/k/v bias (Qwen2)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (planner only; the runtime refuses MoE checkpoints).
    num_experts: int = 0
    num_experts_per_tok: int = 0

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dictionary."""
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        params = cfg.get("rope_parameters")  # newer transformers layout
        if isinstance(params, dict):
            rope_theta = rope_theta or params.get("rope_theta")
            if rope_scaling is None and params.get("rope_type", "default") != "default":
                rope_scaling = params
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_experts=cfg.get("num_local_experts", 0) or 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) or 0,
        )

    # -- sizes the planner and the KV manager use --------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int, num_layers: int | None = None) -> int:
        """M_KV per token = 2 · layers · kv_heads · head_dim · bytes."""
        layers = self.num_layers if num_layers is None else num_layers
        return 2 * layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, MLP, two norms)."""
        h = self.hidden_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        experts = max(1, self.num_experts)
        mlp = 3 * h * self.intermediate_size * experts + (h * self.num_experts if self.num_experts else 0)
        return attn + mlp + 2 * h

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_params(self) -> int:
        """Final norm + LM head (the head counts even when tied: it is computed)."""
        return self.hidden_size + self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        head = self.hidden_size if self.tie_word_embeddings else self.head_params()
        return self.embedding_params() + self.num_layers * self.layer_params() + head
