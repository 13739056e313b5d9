"""Mixture-of-experts GGUF metadata -> ModelConfig's MoE fields, as llama.cpp reads them.

llama.cpp's converter (convert_hf_to_gguf.py) writes ``expert_count``,
``expert_used_count`` and, for the Qwen MoE families, ``expert_feed_forward_length``
(the routed expert's width) and ``expert_shared_feed_forward_length`` (Qwen2-MoE's
shared expert). Whether the top-k routing weights are renormalised is not in the
file: llama.cpp's graphs fix it per family (src/models/qwen2moe.cpp: no;
qwen3moe.cpp and llama.cpp, Mixtral's: yes), which is what the published
transformers configs say (Qwen1.5-MoE, Qwen2-57B-A14B: ``norm_topk_prob`` false;
Qwen3-MoE: true). A file that states it (the generic ``expert_weights_norm``, which
those graphs ignore) is followed, as transformers follows its config. Every layer has experts (llama.cpp's loaders, and its converter's
tensor maps, have no dense layer in these families).
"""

from __future__ import annotations

from pathlib import Path

import gguf

K = gguf.Keys

# Routing switches of other MoE families, with the values that mean "routed as pipeserve
# routes" (softmax, top-k, no scaling, no expert groups): any other value is refused by name.
_NEUTRAL = {
    K.LLM.EXPERT_GATING_FUNC: (int(gguf.ExpertGatingFuncType.SOFTMAX),),
    K.LLM.EXPERT_WEIGHTS_SCALE: (0.0, 1.0),     # llama.cpp: 0 = not set
    K.LLM.EXPERT_GROUP_COUNT: (0, 1),
    K.LLM.EXPERT_GROUP_USED_COUNT: (0, 1),
}


def moe_fields(meta, family, path: Path | str) -> dict:
    """The MoE fields of ModelConfig for a file of ``family`` (gguf.GGUFArchitecture);
    ``meta`` reads "{arch}." keys. A dense file: {}."""
    experts = int(meta.get(K.LLM.EXPERT_COUNT, 0) or 0)
    key = K.LLM.EXPERT_COUNT.format(arch=meta.arch)
    if not experts:
        if family.experts_required:
            raise ValueError(f"{path}: a {meta.arch!r} GGUF needs {key!r} (its number of experts), which the "
                             "file lacks or sets to 0")
        return {}
    if family.moe_architecture is None:
        raise ValueError(f"{path}: {key}={experts}, but pipeserve runs {meta.arch!r} GGUF files as dense models; "
                         "mixture-of-experts GGUF architectures: llama (Mixtral), qwen2moe, qwen3moe")
    _refuse_switches(meta, family, path)
    used = int(meta.get(K.LLM.EXPERT_USED_COUNT, 0) or 0)
    if not 1 <= used <= experts:
        raise ValueError(f"{path}: {K.LLM.EXPERT_USED_COUNT.format(arch=meta.arch)}={used} must be between 1 "
                         f"and the {experts} experts")
    n_ff = int(meta.require(K.LLM.FEED_FORWARD_LENGTH))
    # llama.cpp's defaults where the converter wrote no width: Mixtral's experts are n_ff wide,
    # the Qwen families' n_ff / used; the shared expert is n_ff wide.
    width = int(meta.get(K.LLM.EXPERT_FEED_FORWARD_LENGTH, 0) or 0) or (
        n_ff // used if family.experts_required else n_ff)
    shared = int(meta.get(K.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0) or 0) or n_ff
    norm = meta.get(K.LLM.EXPERT_WEIGHTS_NORM)
    return {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": shared if family.shared_expert else 0,
        "norm_topk_prob": family.norm_topk_prob if norm is None else bool(norm),
    }


def _refuse_switches(meta, family, path: Path | str) -> None:
    for template, neutral in _NEUTRAL.items():
        value = meta.get(template)
        if value is not None and value not in neutral:
            raise ValueError(f"{path}: MoE switch {template.format(arch=meta.arch)}={value!r} is not supported "
                             "(pipeserve routes with softmax, top-k, no scaling or expert groups)")
    shared = int(meta.get(K.LLM.EXPERT_SHARED_COUNT, 0) or 0)
    if shared > int(family.shared_expert):
        raise ValueError(f"{path}: {K.LLM.EXPERT_SHARED_COUNT.format(arch=meta.arch)}={shared}; a {meta.arch!r} "
                         f"model runs {int(family.shared_expert)} shared expert(s) in pipeserve")
