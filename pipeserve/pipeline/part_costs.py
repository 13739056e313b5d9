"""The costs auto partitioning balances: plain numbers, no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PartCosts:
    """Measured time (seconds, or any consistent unit) and memory (bytes) of the model's
    parts: the embedding, each decoder layer, the final norm + LM head.

    ``embed`` runs on the first chunk only, ``head`` (final norm + LM head) on
    the last chunk only, ``layer`` is one decoder layer.
    """

    embed: float
    layer: float
    head: float
    embed_bytes: int = 0
    layer_bytes: int = 0
    head_bytes: int = 0
    # Models whose decoder layers differ (MoE with dense layers: decoder_sparse_step,
    # mlp_only_layers): each layer's time and bytes, indexed by layer. Empty: every
    # layer costs ``layer`` and ``layer_bytes``.
    layer_times: tuple[float, ...] = ()
    layer_sizes: tuple[int, ...] = ()
    # --pp-lm-head shared: the share of the head's time the first chunk takes (the last the rest),
    # and the bytes of the head's copy the first chunk holds (0 where it is the embedding).
    head_share: float = 0.0
    first_head_bytes: int = 0

    def span_time(self, start: int, end: int) -> float:
        """Time of decoder layers [start, end)."""
        return sum(self.layer_times[start:end]) if self.layer_times else (end - start) * self.layer

    def span_bytes(self, start: int, end: int) -> int:
        """Bytes of decoder layers [start, end)."""
        return sum(self.layer_sizes[start:end]) if self.layer_sizes else (end - start) * self.layer_bytes
