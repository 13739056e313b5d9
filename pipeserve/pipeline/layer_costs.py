"""The costs auto partitioning balances: plain numbers, no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerCosts:
    """Time (seconds, or any consistent unit) and memory (bytes) of the model's parts.

    ``embed`` runs on the first chunk only, ``head`` (final norm + LM head) on
    the last chunk only, ``layer`` is one decoder layer.
    """

    embed: float
    layer: float
    head: float
    embed_bytes: int = 0
    layer_bytes: int = 0
    head_bytes: int = 0
