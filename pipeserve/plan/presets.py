"""Built-in model shapes (public ``config.json`` fields) and the ``--model`` resolver."""

from __future__ import annotations

import json
from pathlib import Path

from pipeserve.model.config import ModelConfig


class PlanInputError(ValueError):
    """Bad user input to the planner (unknown preset, unreadable file, impossible split)."""


def _llama3(hidden: int, inter: int, layers: int, heads: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    }


# Shapes copied from each model's public config.json on the Hugging Face Hub.
MODEL_PRESETS: dict[str, dict] = {
    "Llama-3.1-8B": _llama3(4096, 14336, 32, 32),
    "Llama-3.1-70B": _llama3(8192, 28672, 80, 64),
    "Llama-3.1-405B": _llama3(16384, 53248, 126, 128),
    "Qwen2.5-72B": {
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 8192,
        "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False,
    },
    "Mixtral-8x7B": {
        "architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "num_local_experts": 8, "num_experts_per_tok": 2,
    },
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    "SmolLM2-135M": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
    },
}
_ALIASES = {"smollm2-135m-instruct": "SmolLM2-135M"}


def find_preset(name: str, presets: dict, aliases: dict[str, str], kind: str) -> str:
    """Case-insensitive preset lookup; raises with the list of known names."""
    lowered = {key.lower(): key for key in presets}
    key = name.strip().lower()
    key = aliases.get(key, key)
    if key.lower() in lowered:
        return lowered[key.lower()]
    known = ", ".join(presets)
    raise PlanInputError(f"unknown {kind} preset {name!r}; use one of: {known}, or a file path")


def load_model(spec: str) -> tuple[str, ModelConfig]:
    """``--model``: a preset name, a ``config.json`` path, or a directory holding one."""
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        return str(path), ModelConfig.from_hf_dict(_read_config(path))
    if "/" in spec:
        raise PlanInputError(f"model file {spec!r} does not exist")
    name = find_preset(spec, MODEL_PRESETS, _ALIASES, "model")
    return name, ModelConfig.from_hf_dict(MODEL_PRESETS[name])


def read_json(path: Path, what: str):
    """Parse a user-given JSON file; a missing or broken file is a PlanInputError naming ``what``."""
    if not path.exists():
        raise PlanInputError(f"{what} {str(path)!r} does not exist")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanInputError(f"cannot read {what} {str(path)!r}: {exc}") from exc


def _read_config(path: Path) -> dict:
    cfg = read_json(path, "model config")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    missing = [key for key in required if key not in cfg]
    if missing:
        raise PlanInputError(f"model config {str(path)!r} lacks {', '.join(missing)}")
    return cfg
