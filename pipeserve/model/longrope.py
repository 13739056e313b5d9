"""LongRoPE (Phi-3's ``rope_scaling`` type "longrope"), as transformers computes it.

Two sets of per-frequency divisors: ``short_factor`` while a sequence is at
most ``original_max_position_embeddings`` tokens long, ``long_factor`` once
it is longer; cos and sin are multiplied by ``attention_factor`` either way.
Transformers switches on the longest position of its batch; here each
sequence switches on its own context length, which is the same for one
sequence (a prompt: its length; a decode: the length so far). Keys already
cached keep the rotation they were written with, as transformers' forward
does. Two cases therefore differ from transformers' Phi-3 ``generate()``:
a sequence that grows past the original length while decoding (generate()
then drops its cache and recomputes every key with the long factors), and a
prompt longer than it prefilled in chunks (the chunks within the original
length rotate with the short factors). Matching both needs the scheduler to
recompute the sequence at the crossing.
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
                context_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] (the flat batch, sequence by sequence with ``query_lens``
        tokens each) -> (cos, sin), each float32 [n, 1, head_dim]."""
        long_seq = torch.tensor([c > self.original_len for c in context_lens], dtype=torch.int64)
        which = long_seq.repeat_interleave(torch.tensor(query_lens)).to(positions.device)   # [n]
        freqs = positions.float().unsqueeze(1) * self.inv_freq[which]          # [n, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)                   # [n, 1, head_dim]
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
