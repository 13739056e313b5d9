"""Memory of one pipeline stage on one device: weights + KV cache + activations."""

from __future__ import annotations

from dataclasses import dataclass

from pipeserve.model.config import ModelConfig
from pipeserve.plan.hardware import Hardware
from pipeserve.plan.roofline import LayerCosts


@dataclass(frozen=True)
class StageMemory:
    stage: int
    layers: int
    weights: float        # bytes
    kv: float             # bytes for the planned KV tokens
    activations: float    # bytes of the largest transient (one micro-batch's forward)
    usable: float         # bytes the device offers (memory × utilization − reserved)

    @property
    def total(self) -> float:
        return self.weights + self.kv + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.usable


def stage_weight_bytes(model: ModelConfig, costs: LayerCosts, layers: int, first: bool,
                       last: bool) -> float:
    """Bytes of the weights a stage stores on its fullest TP rank (tied embeddings stored
    on both ends if P > 1). Quantized: layers and embedding at ``costs.weight_bytes``, the LM
    head at ``costs.head_weight_bytes`` (a tied embedding is the head, so it too);
    the final norm stays in the dtype. MoE: ALL experts are stored, not just the active ones.
    Under TP the runtime's split (``LayerCosts.layer_fraction``: uneven heads, rebalanced
    MLP rows; the vocabulary padded to T equal slices); the final norm is on every rank."""
    average_layer = sum(map(model.layer_params, range(model.num_layers))) / model.num_layers
    nbytes = layers * average_layer * costs.weight_bytes * costs.layer_fraction
    head_matrix = model.head_params() - model.hidden_size
    if first:
        embed = costs.head_weight_bytes if model.tie_word_embeddings else costs.weight_bytes
        nbytes += model.embedding_params() * embed * costs.vocab_fraction
    if last:
        nbytes += model.hidden_size * costs.bytes  # final norm
    if last and not (first and model.tie_word_embeddings):
        nbytes += head_matrix * costs.head_weight_bytes * costs.vocab_fraction
    return nbytes


def kv_bytes_per_token(costs: LayerCosts, layers: int) -> float:
    """M_KV per token on one rank of a stage: 2 · layers · H_kv/T · D_head · bytes."""
    return layers * costs.kv_bytes_per_token_layer()


def activation_bytes(model: ModelConfig, costs: LayerCosts, tokens: int, last: bool) -> float:
    """Peak transient of a forward over ``tokens`` tokens (one layer live at a time)."""
    per_token = 3 * model.hidden_size + model.q_size + 2 * model.kv_size + 3 * costs.mlp_width()
    act = tokens * per_token * costs.bytes / costs.tp
    if last:
        act += tokens * model.vocab_size * 4 / costs.tp  # fp32 logits (upper bound: all rows)
    return act


def stage_memory(model: ModelConfig, hw: Hardware, costs: LayerCosts, stage_layers: list[int],
                 kv_tokens: float, max_batched_tokens: int) -> list[StageMemory]:
    """Per-worker memory; ``stage_layers`` gives each worker's total layer count."""
    last = len(stage_layers) - 1
    result = []
    for i, layers in enumerate(stage_layers):
        weights = stage_weight_bytes(model, costs, layers, i == 0, i == last)
        kv = kv_tokens * kv_bytes_per_token(costs, layers)
        act = activation_bytes(model, costs, max_batched_tokens, i == last)
        result.append(StageMemory(i, layers, weights, kv, act, hw.usable_bytes))
    return result


def kv_token_capacity(mems: list[StageMemory], costs: LayerCosts) -> float:
    """KV tokens every stage can hold beside its weights and activations (the min over stages)."""
    caps = []
    for mem in mems:
        free = mem.usable - mem.weights - mem.activations
        caps.append(max(0.0, free) / kv_bytes_per_token(costs, mem.layers))
    return min(caps)
