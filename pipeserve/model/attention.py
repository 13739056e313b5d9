"""Paged attention: the backend interface and the PyTorch reference implementation.

The KV cache of one layer is a pair of tensors ``[num_blocks, block_size,
kv_heads, head_dim]``; token ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``. A batch is
flat: the new tokens of all sequences concatenated, each sequence with its
own query length (1 for a decode, more for a prefill or a prefill chunk) and
context length (tokens attended, the new ones included).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

KVCache = tuple[torch.Tensor, torch.Tensor]  # (K, V), each [num_blocks, block_size, kv_heads, head_dim]


@dataclass
class AttentionMetadata:
    """What every backend needs to know about one step's batch."""

    slot_mapping: torch.Tensor        # [num_tokens] int64: cache slot of each new token
    query_lens: list[int]             # per sequence
    context_lens: list[int]           # per sequence, new tokens included
    block_tables: list[list[int]]     # per sequence
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclass
class DecodeBatch:
    """The decodes of a step (one new token each), attended together."""

    query_index: torch.Tensor     # [B] rows of the flat query batch
    block_index: torch.Tensor     # [B, max_blocks] block ids (padding points at block 0)
    context_lens: torch.Tensor    # [B] int64
    block_size: int
    _bias: torch.Tensor | None = field(default=None, repr=False)

    def key_bias(self) -> torch.Tensor:
        """[B, 1, 1, max_blocks * block_size] float32: 0 for a real key, -inf for
        padding. Only the PyTorch decode path needs it: built on first use, then
        shared by every layer of the step."""
        if self._bias is None:
            keys = self.block_index.shape[1] * self.block_size
            pad = torch.arange(keys, device=self.context_lens.device) >= self.context_lens.unsqueeze(1)
            bias = torch.zeros(pad.shape, dtype=torch.float32, device=pad.device).masked_fill_(pad, float("-inf"))
            self._bias = bias[:, None, None, :]                             # [B, 1, 1, keys]
        return self._bias


@dataclass
class Prefill:
    """One sequence's prompt (or prompt chunk): ``q_len`` new tokens at rows
    ``start .. start + q_len`` of the flat batch."""

    start: int
    q_len: int
    context_len: int
    table: list[int] = field(default_factory=list, repr=False)   # the sequence's block table
    block_size: int = 0
    device: torch.device | None = None
    _context: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def fresh(self) -> bool:
        """A whole prompt with nothing cached before it: it attends to its own new keys."""
        return self.context_len == self.q_len

    def cached_context(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For a chunk after cached tokens (a prefix hit or a later chunk): its key
        slots [context_len] and mask [1, 1, q_len, context_len] (bool, True =
        attend). Only the PyTorch path needs them: built on first use, then
        shared by every layer of the step."""
        if self._context is None:
            ctx, q_len = self.context_len, self.q_len
            # Query j (absolute position ctx - q_len + j) sees keys 0 .. ctx - q_len + j.
            last_key = torch.arange(ctx - q_len, ctx).unsqueeze(1)                    # [q_len, 1]
            mask = (torch.arange(ctx).unsqueeze(0) <= last_key).view(1, 1, q_len, ctx)
            self._context = (_slots_of(self.table, ctx, self.block_size).to(self.device), mask.to(self.device))
        return self._context


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    decodes: DecodeBatch | None = None
    prefills: list[Prefill] = field(default_factory=list)
    # Per-step inputs a kernel backend derives on the first layer and reuses.
    backend_state: dict = field(default_factory=dict, repr=False)


class AttentionBackend(ABC):
    """A swappable attention kernel. The runner builds metadata once per step
    and every layer calls ``forward`` with it."""

    @abstractmethod
    def build_metadata(self, query_lens: list[int], context_lens: list[int],
                       block_tables: list[list[int]], block_size: int,
                       device: torch.device) -> AttentionMetadata: ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [n, heads, D], k/v: [n, kv_heads, D] for the new tokens. Writes k/v
        into the cache, then attends. Returns [n, heads, D]."""


def slot_mapping_for(query_lens: list[int], context_lens: list[int],
                     block_tables: list[list[int]], block_size: int) -> list[int]:
    """Cache slots of the new tokens, in batch order."""
    slots: list[int] = []
    for q_len, ctx, table in zip(query_lens, context_lens, block_tables):
        if len(table) * block_size < ctx:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {ctx} tokens "
                             f"with block_size {block_size}")
        for pos in range(ctx - q_len, ctx):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return slots


class TorchPagedAttention(AttentionBackend):
    """Reference backend, PyTorch operators only.

    Prefills: one ``scaled_dot_product_attention`` call per sequence. A fresh
    prompt attends to its own new keys (no gather from the cache) with
    ``is_causal``, so the fused CPU/GPU kernels skip the masked half; a chunk
    after cached tokens gathers its context by slot and passes a mask.
    Decodes: batched matmuls over gathered blocks (``_attend_decodes``);
    kernel backends override ``attend_decodes``.
    """

    def build_metadata(self, query_lens: list[int], context_lens: list[int],
                       block_tables: list[list[int]], block_size: int,
                       device: torch.device) -> TorchAttentionMetadata:
        for q_len, ctx in zip(query_lens, context_lens):
            if q_len < 1 or ctx < q_len:
                raise ValueError(f"invalid sequence shape: query_len {q_len}, context_len {ctx}")
        slots = slot_mapping_for(query_lens, context_lens, block_tables, block_size)
        starts = _query_starts(query_lens)
        decodes = [i for i, q in enumerate(query_lens) if q == 1]
        prefills = [Prefill(starts[i], query_lens[i], context_lens[i], block_tables[i], block_size, device)
                    for i, q in enumerate(query_lens) if q > 1]
        return TorchAttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_lens=list(query_lens), context_lens=list(context_lens),
            block_tables=[list(t) for t in block_tables], block_size=block_size,
            decodes=_build_decodes(decodes, starts, context_lens, block_tables, block_size, device)
            if decodes else None,
            prefills=prefills)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        assert isinstance(meta, TorchAttentionMetadata)  # internal: built by this backend
        k_cache, v_cache = kv_cache
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)  # [n, heads, D]
        if meta.decodes is not None:
            out[meta.decodes.query_index] = self.attend_decodes(q, k_cache, v_cache, meta.decodes, scale)
        if meta.prefills:
            self.attend_prefills(q, k, v, k_cache, v_cache, meta, scale, out)
        return out

    def attend_prefills(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: TorchAttentionMetadata, scale: float,
                        out: torch.Tensor) -> None:
        """Write the prefill rows of ``out``. Overridden by kernel backends."""
        for p in meta.prefills:
            out[p.start:p.start + p.q_len] = _attend_prefill(q, k, v, k_cache, v_cache, p, scale)

    def attend_decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       d: DecodeBatch, scale: float) -> torch.Tensor:
        """One query per sequence: [B, heads, D]. Overridden by kernel backends."""
        return _attend_decodes(q, k_cache, v_cache, d, scale)


def _attend_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, p: Prefill, scale: float) -> torch.Tensor:
    """[q_len, heads, D] for one prefill sequence."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    rows = slice(p.start, p.start + p.q_len)
    mask = None
    if p.fresh:   # its keys are the new ones, in the model dtype
        kb, vb = k[rows], v[rows]                                             # [q_len, kv_heads, D]
    else:
        key_slots, mask = p.cached_context()
        kb = k_cache.view(-1, kv_heads * head_dim).index_select(0, key_slots).view(-1, kv_heads, head_dim)
        vb = v_cache.view(-1, kv_heads * head_dim).index_select(0, key_slots).view(-1, kv_heads, head_dim)
    qb = q[rows].to(kb.dtype).transpose(0, 1).unsqueeze(0)                    # [1, heads, q_len, D]
    kb, vb = kb.transpose(0, 1).unsqueeze(0), vb.to(kb.dtype).transpose(0, 1).unsqueeze(0)
    ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=mask is None,
                                        scale=scale, enable_gqa=kv_heads != heads)  # [1, heads, q_len, D]
    return ob[0].transpose(0, 1).to(q.dtype)                                  # [q_len, heads, D]


def _attend_decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    g: DecodeBatch, scale: float) -> torch.Tensor:
    """One query per sequence, by batched matmuls over whole gathered blocks.

    On CPU, SDPA with a mask takes a slow path for a single query, and
    gathering single slots moves short rows; copying whole blocks and
    multiplying against the keys *as they lie* ([ctx, kv_heads, D] flattened)
    avoids every transposing copy. The price is computing scores of each query
    head against every kv head (then keeping the matching ones): a factor
    kv_heads more of a small product, so above a few kv heads the keys are
    laid out per head instead.
    """
    bsz, max_blocks = g.block_index.shape
    block_size, kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    heads = q.shape[1]
    group, ctx = heads // kv_heads, max_blocks * block_size
    blocks = g.block_index.view(-1)
    # A 2-D view makes index_select a plain row copy (~3x faster than on the 4-D cache).
    kb = k_cache.view(k_cache.shape[0], -1).index_select(0, blocks)          # [B * max_blocks, bs*kv*D]
    vb = v_cache.view(v_cache.shape[0], -1).index_select(0, blocks)
    qb = q.index_select(0, g.query_index).to(kb.dtype)                      # [B, heads, D]
    if kv_heads <= _SHARED_SCORE_KV_HEADS:
        scores = torch.bmm(qb, kb.view(bsz, ctx * kv_heads, head_dim).transpose(1, 2))  # [B, heads, ctx*kv]
        scores = scores.view(bsz, kv_heads, group, ctx, kv_heads).diagonal(dim1=1, dim2=4)
        scores = scores.permute(0, 3, 1, 2)                                 # [B, kv_heads, group, ctx]
    else:
        keys = kb.view(bsz, ctx, kv_heads, head_dim).permute(0, 2, 3, 1)    # [B, kv_heads, D, ctx]
        scores = torch.matmul(qb.view(bsz, kv_heads, group, head_dim), keys)
    probs = torch.softmax(scores.float() * scale + g.key_bias(), dim=-1).to(vb.dtype)  # [B, kv_heads, group, ctx]
    if kv_heads <= _SHARED_SCORE_KV_HEADS:
        out = torch.bmm(probs.reshape(bsz, heads, ctx), vb.view(bsz, ctx, kv_heads * head_dim))
        out = out.view(bsz, kv_heads, group, kv_heads, head_dim).diagonal(dim1=1, dim2=3)  # [B, group, D, kv]
        out = out.permute(0, 3, 1, 2)                                       # [B, kv_heads, group, D]
    else:
        out = torch.matmul(probs, vb.view(bsz, ctx, kv_heads, head_dim).transpose(1, 2))
    return out.reshape(bsz, heads, head_dim).to(q.dtype)                    # [n, heads, D]


# Up to this many kv heads, decode scores are computed against all kv heads at once.
_SHARED_SCORE_KV_HEADS = 4


def _query_starts(query_lens: list[int]) -> list[int]:
    starts, total = [], 0
    for q_len in query_lens:
        starts.append(total)
        total += q_len
    return starts


def _build_decodes(idx: list[int], starts: list[int], context_lens: list[int],
                   block_tables: list[list[int]], block_size: int, device: torch.device) -> DecodeBatch:
    """Block ids of each decode (padded with block 0) and their context lengths."""
    block_index = block_index_of([block_tables[i] for i in idx], [context_lens[i] for i in idx], block_size)
    return DecodeBatch(query_index=torch.tensor([starts[i] for i in idx], dtype=torch.int64, device=device),
                       block_index=block_index.to(device),
                       context_lens=torch.tensor([context_lens[i] for i in idx], dtype=torch.int64,
                                                 device=device),
                       block_size=block_size)


def block_index_of(tables: list[list[int]], context_lens: list[int], block_size: int) -> torch.Tensor:
    """[n, max_blocks] int64 CPU tensor: the blocks each sequence's context uses,
    padded with block 0 (kernels and masks stop at the context length)."""
    max_blocks = max((ctx + block_size - 1) // block_size for ctx in context_lens)
    index = torch.zeros(len(tables), max_blocks, dtype=torch.int64)
    for row, (table, ctx) in enumerate(zip(tables, context_lens)):
        used = (ctx + block_size - 1) // block_size
        index[row, :used] = torch.tensor(table[:used], dtype=torch.int64)
    return index


def _slots_of(table: list[int], ctx: int, block_size: int) -> torch.Tensor:
    blocks = torch.tensor(table[: (ctx + block_size - 1) // block_size], dtype=torch.int64)
    slots = (blocks.unsqueeze(1) * block_size + torch.arange(block_size)).reshape(-1)
    return slots[:ctx]
