"""What differs between the dense decoder families, read from ``config.json``.

One decoder (pipeserve/model/llama.py) runs every dense family; the
differences are switches on ``ModelConfig``, set here from the architecture
name and the Hugging Face config keys:

    family    q/k norm  norm        MLP    extras
    Llama     -         w * x       SwiGLU llama3/linear RoPE scaling
    Mistral   -         w * x       SwiGLU sliding window on every layer
    Qwen2     -         w * x       SwiGLU q/k/v bias, window on layers >= max_window_layers
    Qwen3     per head  w * x       SwiGLU head_dim independent of hidden / heads
    Phi-3     -         w * x       SwiGLU qkv and gate_up fused in the checkpoint, longrope
    Gemma 2   -         (1 + w) * x GeGLU  sandwich norms, embeddings * sqrt(hidden),
                                           attention and final logit soft-capping,
                                           query_pre_attn_scalar, alternating windows
    Gemma 3   per head  (1 + w) * x GeGLU  as Gemma 2, plus a separate RoPE base for
                                           sliding layers (rope_local_base_freq)

A switch the engine does not implement is refused by ``refuse_unsupported``
with a message naming it: never silently ignored.
"""

from __future__ import annotations

import math

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                       "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_QK_NORM = ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM")
_FUSED_CHECKPOINT = ("Phi3ForCausalLM",)
_QKV_BIAS_DEFAULT = ("Qwen2ForCausalLM",)       # q/k/v bias without an attention_bias key
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")       # SwiGLU, GeGLU: layers.GATE_ACTIVATIONS runs them
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")
# Gemma-only switches: any other family setting one is refused.
_GEMMA_SWITCHES = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")


def architecture_of(cfg: dict) -> str:
    return (cfg.get("architectures") or ["LlamaForCausalLM"])[0]


def hidden_act(cfg: dict) -> str:
    """Gemma names the key ``hidden_activation``; the others ``hidden_act``."""
    return cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"


def normalized(cfg: dict) -> dict:
    """A copy of ``cfg`` in the layout ``ModelConfig.from_hf_dict`` reads: Gemma's
    ``layer_types`` derived as transformers does when an older config lacks it,
    Gemma 3's per-layer-type ``rope_parameters`` flattened to the global layers'
    (the sliding layers' base goes to ``rope_local_base_freq``), Phi-3's "su"
    named longrope, and longrope's defaults filled in as transformers does."""
    cfg = dict(cfg)
    arch = architecture_of(cfg)
    if arch in _GEMMA and cfg.get("layer_types") is None and cfg.get("sliding_window") is not None:
        # Configs older than transformers' layer_types: Gemma 2 alternates (sliding first),
        # Gemma 3 has one global layer every sliding_window_pattern layers.
        pattern = 2 if arch == "Gemma2ForCausalLM" else int(cfg.get("sliding_window_pattern", 6))
        cfg["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                              for i in range(cfg["num_hidden_layers"])]
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.sliding_attention.rope_type {local['rope_type']!r} is not supported "
                             "(the sliding layers run plain RoPE)")
        if "rope_theta" in local:
            cfg["rope_local_base_freq"] = local["rope_theta"]
        cfg["rope_parameters"] = params = dict(params["full_attention"])
    scaling = cfg.get("rope_scaling") or (params if isinstance(params, dict) else None)
    if scaling and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        scaling = _longrope_defaults(dict(scaling), cfg)
        cfg["rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"] = scaling
    return cfg


def _longrope_defaults(s: dict, cfg: dict) -> dict:
    # As transformers' _compute_longrope_parameters: the factor defaults to the
    # ratio of the context lengths, the attention factor to sqrt(1 + ln f / ln L0).
    s["rope_type"] = "longrope"
    s.pop("type", None)
    original = s.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("longrope scaling needs original_max_position_embeddings")
    s["original_max_position_embeddings"] = int(original)
    factor = s.get("factor") or cfg.get("max_position_embeddings", original) / original
    if s.get("attention_factor") is None:
        s["attention_factor"] = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return s


def family_fields(cfg: dict) -> dict:
    """The per-family ``ModelConfig`` switches of a (normalized) HF config."""
    arch = architecture_of(cfg)
    gemma = arch in _GEMMA
    scalar = cfg.get("query_pre_attn_scalar") if gemma else None
    return {
        "hidden_act": hidden_act(cfg),
        "qk_norm": arch in _QK_NORM,
        "norm_unit_offset": gemma,
        "sandwich_norms": gemma,
        "scale_embeddings": gemma,
        "query_pre_attn_scalar": float(scalar) if scalar is not None else None,
        "attn_logit_softcapping": _float_or_none(cfg.get("attn_logit_softcapping")) if gemma else None,
        "final_logit_softcapping": _float_or_none(cfg.get("final_logit_softcapping")) if gemma else None,
        "rope_local_theta": float(cfg.get("rope_local_base_freq", 10000.0)) if arch == "Gemma3ForCausalLM" else None,
        "fused_checkpoint": arch in _FUSED_CHECKPOINT,
    }


def _float_or_none(value) -> float | None:
    return None if value is None else float(value)


def refuse_unsupported(cfg: dict, where: object) -> None:
    """Raise ValueError naming the first config switch of a dense family that the
    engine does not implement (``where``: the config's path, for the message)."""
    cfg = normalized(cfg)
    arch = architecture_of(cfg)
    act = hidden_act(cfg)
    if act not in ACTIVATIONS:
        raise ValueError(f"{where}: hidden_act {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    if arch not in _GEMMA:
        for key in _GEMMA_SWITCHES:
            if cfg.get(key) is not None:
                raise ValueError(f"{where}: {key} is set, but {arch} does not implement it in pipeserve "
                                 "(only the Gemma families do)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{where}: use_bidirectional_attention is not supported (causal decoding only)")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{where}: mlp_bias is not supported (the MLP projections have no bias)")
    if cfg.get("attention_bias") and arch in DENSE_ARCHITECTURES and arch not in _QKV_BIAS_DEFAULT:
        raise ValueError(f"{where}: attention_bias is not supported for {arch} (it would add an o_proj bias too)")
    _refuse_rope(cfg, where)
    types = cfg.get("layer_types") or ()
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"{where}: layer_types {unknown} are not supported (supported: {', '.join(LAYER_TYPES)})")


def _refuse_rope(cfg: dict, where: object) -> None:
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"{where}: rope_scaling type {kind!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    partial = scaling.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) if scaling else 1.0
    if float(partial if partial is not None else 1.0) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor {partial} is not supported (RoPE over the whole head)")
    if kind == "longrope":
        half = (cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]) // 2
        for name in ("short_factor", "long_factor"):
            if len(scaling.get(name) or ()) != half:
                raise ValueError(f"{where}: longrope {name} has {len(scaling.get(name) or ())} entries; "
                                 f"the head needs one per frequency ({half})")
