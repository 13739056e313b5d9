"""Shapes of a Llama-family model: plain Python, shared by the runtime and the planner."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeserve.model.families import DENSE_ARCHITECTURES, family_fields, normalized

SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES
# Mixture-of-experts families (pipeserve/model/moe.py); Qwen3-MoE has Qwen3's q/k norm.
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ARCHITECTURES = SUPPORTED_ARCHITECTURES + MOE_ARCHITECTURES


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
    # Mixture of experts (pipeserve/model/moe.py); num_experts 0 = dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0               # a routed expert's width (0: intermediate_size)
    shared_expert_intermediate_size: int = 0     # Qwen2-MoE's sigmoid-gated shared expert (0: none)
    norm_topk_prob: bool = True                  # renormalise the top-k routing weights to sum 1
    decoder_sparse_step: int = 1                 # layer i has experts iff (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()        # ... and i is not listed here
    # Sliding-window attention (HF semantics: a query at position i sees keys
    # j with i - window < j <= i). ``layer_types`` says per layer whether it
    # slides ("sliding_attention") or not ("full_attention"); None with a
    # window set means every layer slides (Mistral).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    # Per-family switches (pipeserve/model/families.py sets them from config.json).
    hidden_act: str = "silu"                     # the gate's activation: silu (SwiGLU), gelu_pytorch_tanh (GeGLU)
    qk_norm: bool = False                        # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    norm_unit_offset: bool = False               # Gemma: RMSNorm scales by (1 + weight)
    sandwich_norms: bool = False                 # Gemma: norms on the attention and MLP outputs too
    scale_embeddings: bool = False               # Gemma: embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None   # Gemma: attention scale = scalar ** -0.5 (else head_dim)
    attn_logit_softcapping: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: the same on the logits
    rope_local_theta: float | None = None        # Gemma 3: plain-RoPE base of the sliding layers
    fused_checkpoint: bool = False               # Phi-3: the checkpoint stores qkv_proj and gate_up_proj

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dictionary."""
        cfg = normalized(cfg)
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
            attention_bias=bool(cfg.get("attention_bias", cfg.get(
                "qkv_bias", arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")))),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_moe_fields(cfg, arch),
            **_sliding_window_fields(cfg, cfg["num_hidden_layers"]),
            **family_fields(cfg),
        )

    @property
    def rope_switch_len(self) -> int | None:
        """Longrope: a sequence holding more tokens than this rotates with the long
        factors, so keys written before it grew past must be recomputed (see
        pipeserve/model/longrope.py); None for every other RoPE."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") != "longrope" or scaling["short_factor"] == scaling["long_factor"]:
            return None     # nothing switches (equal factors: one rotation at every length)
        return int(scaling["original_max_position_embeddings"])

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_sliding_window(self, layer: int) -> int | None:
        """The attention window of (global) decoder layer ``layer``; None = full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

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

    def layer_params(self, layer: int | None = None) -> int:
        """TOTAL parameters of decoder layer ``layer`` (attention, MLP or all its
        experts, two norms): what it stores. None: the largest layer."""
        return self._attn_norm_params() + self._mlp_params(layer, active=False)

    def active_layer_params(self, layer: int | None = None) -> int:
        """Parameters one token's forward through layer ``layer`` multiplies by
        (MoE: the router, its top-k experts and the shared expert): what it
        computes. None: the largest layer."""
        return self._attn_norm_params() + self._mlp_params(layer, active=True)

    # -- mixture of experts (owner: the MoE helper; pipeserve/model/moe.py) --
    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has routed experts (else a dense MLP), as transformers decides."""
        return (self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0
                and layer not in self.mlp_only_layers)

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def _mlp_params(self, layer: int | None, active: bool) -> int:
        """MLP parameters of ``layer`` (None: the largest layer), all experts or the active ones."""
        if layer is None:
            return max(self._mlp_params(i, active) for i in range(self.num_layers))
        h = self.hidden_size
        if not self.is_moe_layer(layer):
            return 3 * h * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        shared = self.shared_expert_intermediate_size
        shared_params = 3 * h * shared + h if shared else 0       # the shared expert and its gate
        return h * self.num_experts + experts * 3 * h * self.expert_intermediate_size + shared_params

    def _attn_norm_params(self) -> int:
        h = self.hidden_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        norms = 4 if self.sandwich_norms else 2
        return attn + norms * h

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_params(self) -> int:
        """Final norm + LM head (the head counts even when tied: it is computed)."""
        return self.hidden_size + self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        head = self.hidden_size if self.tie_word_embeddings else self.head_params()
        return self.embedding_params() + sum(map(self.layer_params, range(self.num_layers))) + head


def _sliding_window_fields(cfg: dict, num_layers: int) -> dict:
    """``sliding_window`` and ``layer_types`` as transformers reads them.

    Qwen2 slides only with ``use_sliding_window``, and then only layers
    ``>= max_window_layers``; Mistral slides on every layer when the window is
    set; a saved ``layer_types`` list (transformers 5) wins over both."""
    window = cfg.get("sliding_window")
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        window = None
    if window is None:
        return {"sliding_window": None, "layer_types": None}
    types = cfg.get("layer_types")
    if types is None and "max_window_layers" in cfg:
        first = int(cfg["max_window_layers"])
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if types is not None and len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    return {"sliding_window": int(window), "layer_types": tuple(types) if types is not None else None}


# -- mixture of experts (owner: the MoE helper; pipeserve/model/moe.py) -----------------------

def _moe_fields(cfg: dict, arch: str) -> dict:
    """The MoE keys of a Hugging Face config (Mixtral: num_local_experts; Qwen: num_experts)."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    shared = cfg.get("shared_expert_intermediate_size") or 0
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or 0),
        "shared_expert_intermediate_size": int(shared) if arch == "Qwen2MoeForCausalLM" else 0,
        # Mixtral always renormalises; Qwen only with norm_topk_prob (default False).
        "norm_topk_prob": arch == "MixtralForCausalLM" or bool(cfg.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(cfg.get("decoder_sparse_step") or 1),
        "mlp_only_layers": tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    }

