"""LongRoPE (Phi-3's ``rope_scaling`` type "longrope"), as transformers computes it.

Two sets of per-frequency divisors: ``short_factor`` while a sequence holds at
most ``original_max_position_embeddings`` tokens, ``long_factor`` once it holds
more; cos and sin are multiplied by ``attention_factor`` either way.
Transformers picks the set by the length it runs (the largest position + 1),
and Phi-3's ``generate()`` drops its cache once a sequence grows past the
original length, so every key is then recomputed with the long factors: at
every step its logits are those of one fresh forward over the whole sequence.

pipeserve gives the same logits (float32 greedy tokens equal ``generate()``'s):
  - each sequence picks its set by the tokens it holds when scheduled
    (``SeqStep.seq_len``), not by the chunk's end, so every chunk of a long
    prompt rotates as the whole prompt does;
  - a sequence whose keys were written with the short factors and that grows
    past the original length is recomputed by the scheduler before its next
    step (``Scheduler``: ``rope_switch_len``), as transformers recomputes it;
  - prefix-cache keys of sequences longer than the original length are salted
    (``BlockManager``: ``kv_variant``), so blocks rotated with one set are never
    shared with a sequence that needs the other.
"""

from __future__ import annotations

import torch
from torch import nn


class LongRotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict, device: torch.device) -> None:
        super().__init__()
        powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)  # [head_dim / 2]
        for name in ("short_factor", "long_factor"):
            if len(scaling[name]) != powers.shape[0]:
                raise ValueError(f"longrope {name} has {len(scaling[name])} entries; head_dim {head_dim} "
                                 f"needs {powers.shape[0]}")
        # 1 / (factor * theta^(2i/D)), rounded as transformers rounds it
        short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * powers)
        long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * powers)
        self.register_buffer("inv_freq", torch.stack([short, long]).to(device), persistent=False)  # [2, D/2]
        self.original_len = int(scaling["original_max_position_embeddings"])
        self.attention_factor = float(scaling["attention_factor"])

    def forward(self, positions: torch.Tensor, query_lens: list[int],
                seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] (the flat batch, sequence by sequence with ``query_lens``
        tokens each; ``seq_lens``: the tokens each sequence holds) -> (cos, sin),
        each float32 [n, 1, head_dim]."""
        long_seq = torch.tensor([n > self.original_len for n in seq_lens], dtype=torch.int64)
        which = long_seq.repeat_interleave(torch.tensor(query_lens)).to(positions.device)   # [n]
        freqs = positions.float().unsqueeze(1) * self.inv_freq[which]          # [n, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)                   # [n, 1, head_dim]
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
