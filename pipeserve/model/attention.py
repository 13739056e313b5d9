"""Paged attention: the backend interface and the PyTorch reference implementation.

The KV cache of one layer is a pair of tensors ``[num_blocks, block_size,
kv_heads, head_dim]``; token ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``. A batch is
flat: the new tokens of all sequences concatenated, each sequence with its
own query length (1 for a decode, more for a prefill or a prefill chunk) and
context length (tokens attended, the new ones included).

Per layer, ``forward`` may narrow what a query sees and reshape its scores:
``sliding_window`` W (a query at position i sees keys j with i - W < j <= i,
as transformers' ``sliding_window_overlay``) and ``logit_softcap`` c (scores
become c * tanh(scores / c) before the softmax, as Gemma 2). One step may mix
windows (Gemma alternates local and global layers), so masks are cached per
window on the step's metadata.
"""

from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeserve.model.kv_quant import gather_rows, write_rows

# (K, V), each [num_blocks, block_size, kv_heads, head_dim] (an 8-bit cache: head_dim + 4, kv_quant.py)
KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class AttentionMetadata:
    """What every backend needs to know about one step's batch."""

    slot_mapping: torch.Tensor        # [num_tokens] int64: cache slot of each new token
    query_lens: list[int]             # per sequence
    context_lens: list[int]           # per sequence, new tokens included
    block_tables: list[list[int]]     # per sequence
    block_size: int
    # Per sequence, the tokens it holds (``SeqStep.seq_len``), set by the runner after
    # building; empty: the context lengths. Only longrope reads it.
    seq_lens: list[int] = field(default_factory=list, init=False)

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
    _bias: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)
    _windowed: dict[int, DecodeBatch] = field(default_factory=dict, repr=False)
    # What a kernel backend derives from these once per step and every layer reuses.
    backend_state: dict = field(default_factory=dict, repr=False)

    def in_window(self, window: int) -> DecodeBatch:
        """The same decodes over only the blocks a sliding window touches: each
        row's blocks from the one holding its first visible key, positions
        shifted by whole blocks (which neither the window mask nor the softmax
        sees). Built on first use per window (PyTorch decode path)."""
        if window not in self._windowed:
            ctx, size = self.context_lens, self.block_size
            first = torch.clamp(ctx - window, min=0) // size                # [B] first block in the window
            width = int(((ctx + size - 1) // size - first).max())
            if width == self.block_index.shape[1]:
                self._windowed[window] = self
            else:
                cols = torch.clamp(first.unsqueeze(1) + torch.arange(width, device=ctx.device),
                                   max=self.block_index.shape[1] - 1)       # [B, width]
                self._windowed[window] = DecodeBatch(self.query_index, self.block_index.gather(1, cols),
                                                     ctx - first * size, size)
        return self._windowed[window]

    def key_bias(self, window: int | None = None) -> torch.Tensor:
        """[B, 1, 1, max_blocks * block_size] float32: 0 for a key the query sees,
        -inf for padding and for keys before the window. Only the PyTorch decode
        path needs it: built on first use per window, then shared by every layer
        of the step with that window."""
        if window not in self._bias:
            keys = self.block_index.shape[1] * self.block_size
            key_pos = torch.arange(keys, device=self.context_lens.device)
            ctx = self.context_lens.unsqueeze(1)                            # [B, 1]; the query is at ctx - 1
            hidden = key_pos >= ctx
            if window is not None:
                hidden |= key_pos <= ctx - 1 - window
            bias = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
            self._bias[window] = bias.masked_fill_(hidden, float("-inf"))[:, None, None, :]   # [B, 1, 1, keys]
        return self._bias[window]


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
    _context: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def fresh(self) -> bool:
        """A whole prompt with nothing cached before it: it attends to its own new keys."""
        return self.context_len == self.q_len

    def first_key(self, window: int | None) -> int:
        """Position of the first key any of this chunk's queries sees."""
        first_query = self.context_len - self.q_len
        return 0 if window is None else max(0, first_query - window + 1)

    def cached_context(self, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """For a chunk after cached tokens (a prefix hit or a later chunk): the
        slots of the keys it sees, [keys] from ``first_key(window)`` on, and the
        mask [1, 1, q_len, keys] (bool, True = attend). Only the PyTorch path
        needs them: built on first use per window, then shared by every layer of
        the step with that window."""
        if window not in self._context:
            first = self.first_key(window)
            slots = _slots_of(self.table, self.context_len, self.block_size)[first:]
            mask = causal_mask(self.context_len - self.q_len, self.q_len, first, self.context_len, window)
            self._context[window] = (slots.to(self.device), mask.to(self.device))
        return self._context[window]

    def fresh_window_mask(self, window: int) -> torch.Tensor:
        """[1, 1, q_len, q_len] bool: a fresh prompt's causal mask inside the window."""
        if window not in self._window_masks:
            self._window_masks[window] = causal_mask(0, self.q_len, 0, self.q_len, window).to(self.device)
        return self._window_masks[window]


def causal_mask(first_query: int, q_len: int, first_key: int, end_key: int, window: int | None) -> torch.Tensor:
    """[1, 1, q_len, end_key - first_key] bool, True where query i (position
    first_query + i) sees key j (position first_key + j): j <= i, and
    i - window < j inside a sliding window (transformers' convention)."""
    query_pos = torch.arange(first_query, first_query + q_len).unsqueeze(1)          # [q_len, 1]
    key_pos = torch.arange(first_key, end_key).unsqueeze(0)                          # [1, keys]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask.view(1, 1, q_len, end_key - first_key)


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    decodes: DecodeBatch | None = None
    prefills: list[Prefill] = field(default_factory=list)
    # Per-step inputs a kernel backend derives on the first layer and reuses.
    backend_state: dict = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class ScoreShape:
    """How one layer turns q.k into the scores it softmaxes."""

    scale: float
    window: int | None = None      # sliding window in tokens
    softcap: float | None = None   # scores = softcap * tanh(scores / softcap)

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {self.window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"logit_softcap must be positive, got {self.softcap}")

    def cap(self, scores: torch.Tensor) -> torch.Tensor:
        """Soft-capped scores (already scaled), in place where possible."""
        if self.softcap is None:
            return scores
        return scores.div_(self.softcap).tanh_().mul_(self.softcap)


@functools.lru_cache(maxsize=64)
def score_shape(scale: float, window: int | None, softcap: float | None) -> ScoreShape:
    """``ScoreShape(scale, window, softcap)``, built (and checked) once per distinct layer
    setting instead of once per layer per step."""
    return ScoreShape(scale, window, softcap)


class AttentionBackend(ABC):
    """A swappable attention kernel. The runner builds metadata once per step
    and every layer calls ``forward`` with it."""

    @abstractmethod
    def build_metadata(self, query_lens: list[int], context_lens: list[int],
                       block_tables: list[list[int]], block_size: int,
                       device: torch.device) -> AttentionMetadata: ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                logit_softcap: float | None = None) -> torch.Tensor:
        """q: [n, heads, D], k/v: [n, kv_heads, D] for the new tokens. Writes k/v
        into the cache, then attends. Returns [n, heads, D]. ``sliding_window``
        (tokens) and ``logit_softcap``: this layer's, None for none (see the
        module docstring)."""


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
        if max(query_lens, default=0) == 1:
            return _decode_only_metadata(context_lens, block_tables, block_size, device)
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
                meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                logit_softcap: float | None = None) -> torch.Tensor:
        assert isinstance(meta, TorchAttentionMetadata)  # internal: built by this backend
        k_cache, v_cache = kv_cache
        k, v = self.write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
        shape = score_shape(scale, sliding_window, logit_softcap)
        if meta.decodes is not None and not meta.prefills:   # every row is a decode, in batch order
            return self.attend_decodes(q, k_cache, v_cache, meta.decodes, shape)
        out = torch.empty_like(q)  # [n, heads, D]
        if meta.decodes is not None:
            self.attend_decodes_into(q, k_cache, v_cache, meta.decodes, shape, out)
        if meta.prefills:
            self.attend_prefills(q, k, v, k_cache, v_cache, meta, shape, out)
        return out

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new k/v [n, kv_heads, D] at cache slots [n]; returns them as the cache
        holds them (``kv_quant.write_rows``). Overridden by kernel backends."""
        return write_rows(k_cache, slots, k), write_rows(v_cache, slots, v)

    def attend_prefills(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: TorchAttentionMetadata, shape: ScoreShape,
                        out: torch.Tensor) -> None:
        """Write the prefill rows of ``out``. Overridden by kernel backends."""
        for p in meta.prefills:
            out[p.start:p.start + p.q_len] = _attend_prefill(q, k, v, k_cache, v_cache, p, shape)

    def attend_decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       d: DecodeBatch, shape: ScoreShape) -> torch.Tensor:
        """One query per sequence: [B, heads, D]. Overridden by kernel backends."""
        return _attend_decodes(q, k_cache, v_cache, d, shape)

    def attend_decodes_into(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            d: DecodeBatch, shape: ScoreShape, out: torch.Tensor) -> None:
        """Write the decode rows of ``out`` (a step with prefills too). Overridden by kernel backends."""
        out[d.query_index] = self.attend_decodes(q, k_cache, v_cache, d, shape)


def _attend_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, p: Prefill, shape: ScoreShape) -> torch.Tensor:
    """[q_len, heads, D] for one prefill sequence."""
    head_dim = q.shape[2]
    kv_heads, slots = k_cache.shape[2], k_cache.shape[0] * k_cache.shape[1]
    rows = slice(p.start, p.start + p.q_len)
    mask = None
    if p.fresh:   # its keys are the new ones, in the model dtype
        kb, vb = k[rows], v[rows]                                             # [q_len, kv_heads, D]
        if shape.window is not None and shape.window < p.q_len:
            mask = p.fresh_window_mask(shape.window)
    else:
        key_slots, mask = p.cached_context(shape.window)
        kb = gather_rows(k_cache, key_slots, slots, q.dtype).view(-1, kv_heads, head_dim)
        vb = gather_rows(v_cache, key_slots, slots, q.dtype).view(-1, kv_heads, head_dim)
    qb = q[rows].to(kb.dtype).transpose(0, 1).unsqueeze(0)                    # [1, heads, q_len, D]
    kb, vb = kb.transpose(0, 1).unsqueeze(0), vb.to(kb.dtype).transpose(0, 1).unsqueeze(0)
    if shape.softcap is not None:
        ob = _softcapped_attention(qb, kb, vb, mask, shape)
    else:
        ob = _sdpa(qb, kb, vb, mask, shape.scale, qb.is_cuda)                    # [1, heads, q_len, D]
    return ob[0].transpose(0, 1).to(q.dtype)                                  # [q_len, heads, D]


def _sdpa(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, mask: torch.Tensor | None, scale: float,
          cuda: bool) -> torch.Tensor:
    """SDPA of qb [1, heads, q_len, D] over kb / vb [1, kv_heads, keys, D], causal without a mask;
    ``cuda``: in ``_cuda_sdpa_order``, and with a mask the KV heads repeated for the query heads
    (flash takes no mask, the efficient kernel no grouped heads, and cuDNN's is the one to avoid)."""
    gqa = kb.shape[1] != qb.shape[1]
    if cuda and mask is not None and gqa:
        group = qb.shape[1] // kb.shape[1]
        kb, vb, gqa = kb.repeat_interleave(group, dim=1), vb.repeat_interleave(group, dim=1), False
    with _cuda_sdpa_order() if cuda else contextlib.nullcontext():
        return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=gqa)


def _cuda_sdpa_order():
    """SDPA's CUDA kernels, flash attention first, cuDNN's next to last. PyTorch prefers cuDNN's on
    Hopper, which builds a graph for each new query and key length: on an H200 a 128-token
    prompt's first prefill took 752 ms over 8 layers, 21 ms with flash first (cuda_step_profile.py,
    benchmarks/README.md), and serving meets a new length with nearly every prompt. A prefill
    after cached tokens (a mask) with grouped KV heads went on to cuDNN's all the same (70-110 ms
    a layer at a new length):
    ``_sdpa`` repeats the KV heads there, so the efficient kernel takes it (not yet timed on a
    GPU)."""
    order = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:   # a torch without priorities: the first two, and the reference
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _softcapped_attention(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, mask: torch.Tensor | None,
                          shape: ScoreShape) -> torch.Tensor:
    """SDPA cannot soft-cap its scores: the explicit product, rounded as
    transformers' eager attention (float32 softmax, probabilities in the
    value dtype). qb [1, heads, q_len, D], kb/vb [1, kv_heads, keys, D]."""
    group = qb.shape[1] // kb.shape[1]
    kb, vb = kb.repeat_interleave(group, dim=1), vb.repeat_interleave(group, dim=1)
    scores = shape.cap(torch.matmul(qb, kb.transpose(2, 3)).float().mul_(shape.scale))   # [1, heads, q_len, keys]
    if mask is None:
        q_len, keys = scores.shape[2], scores.shape[3]
        mask = causal_mask(keys - q_len, q_len, 0, keys, None).to(scores.device)
    scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(vb.dtype), vb)       # [1, heads, q_len, D]


def _attend_decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    g: DecodeBatch, shape: ScoreShape) -> torch.Tensor:
    """One query per sequence, by batched matmuls over whole gathered blocks.

    On CPU, SDPA with a mask takes a slow path for a single query, and
    gathering single slots moves short rows; copying whole blocks and
    multiplying against the keys *as they lie* ([ctx, kv_heads, D] flattened)
    avoids every transposing copy. The price is computing scores of each query
    head against every kv head (then keeping the matching ones): a factor
    kv_heads more of a small product, so above a few kv heads the keys are
    laid out per head instead.
    """
    if shape.window is not None:
        g = g.in_window(shape.window)
    bsz, max_blocks = g.block_index.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    heads, head_dim = q.shape[1], q.shape[2]
    group, ctx = heads // kv_heads, max_blocks * block_size
    blocks = g.block_index.view(-1)
    # A 2-D view makes index_select a plain row copy (~3x faster than on the 4-D cache);
    # an 8-bit cache's blocks are dequantized to the model dtype once gathered.
    kb = gather_rows(k_cache, blocks, k_cache.shape[0], q.dtype)              # [B * max_blocks, bs*kv*D]
    vb = gather_rows(v_cache, blocks, v_cache.shape[0], q.dtype)
    qb = q.index_select(0, g.query_index).to(kb.dtype)                      # [B, heads, D]
    if kv_heads <= _SHARED_SCORE_KV_HEADS:
        scores = torch.bmm(qb, kb.view(bsz, ctx * kv_heads, head_dim).transpose(1, 2))  # [B, heads, ctx*kv]
        scores = scores.view(bsz, kv_heads, group, ctx, kv_heads).diagonal(dim1=1, dim2=4)
        scores = scores.permute(0, 3, 1, 2)                                 # [B, kv_heads, group, ctx]
    else:
        keys = kb.view(bsz, ctx, kv_heads, head_dim).permute(0, 2, 3, 1)    # [B, kv_heads, D, ctx]
        scores = torch.matmul(qb.view(bsz, kv_heads, group, head_dim), keys)
    scores = shape.cap(scores.float() * shape.scale) + g.key_bias(shape.window)
    probs = torch.softmax(scores, dim=-1).to(vb.dtype)                      # [B, kv_heads, group, ctx]
    if kv_heads <= _SHARED_SCORE_KV_HEADS:
        out = torch.bmm(probs.reshape(bsz, heads, ctx), vb.view(bsz, ctx, kv_heads * head_dim))
        out = out.view(bsz, kv_heads, group, kv_heads, head_dim).diagonal(dim1=1, dim2=3)  # [B, group, D, kv]
        out = out.permute(0, 3, 1, 2)                                       # [B, kv_heads, group, D]
    else:
        out = torch.matmul(probs, vb.view(bsz, ctx, kv_heads, head_dim).transpose(1, 2))
    return out.reshape(bsz, heads, head_dim).to(q.dtype)                    # [n, heads, D]


# Up to this many kv heads, decode scores are computed against all kv heads at once.
_SHARED_SCORE_KV_HEADS = 4


def _decode_only_metadata(context_lens: list[int], block_tables: list[list[int]], block_size: int,
                          device: torch.device) -> TorchAttentionMetadata:
    """``build_metadata`` of a step whose every sequence decodes one token (the common step
    of a generation): its tensors are views of one tensor built from one Python list, one
    torch.tensor call (one host-to-device copy) instead of the general path's five tensors
    and a copy per row (``prepare_step`` of one decode: 85 -> 52 us, 1 thread, measured)."""
    batch = len(context_lens)
    max_blocks = max((ctx + block_size - 1) // block_size for ctx in context_lens)
    flat: list[int] = []   # slots [B], context lengths [B], query rows [B], block index [B, max_blocks]
    for ctx, table in zip(context_lens, block_tables):
        if len(table) * block_size < ctx:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {ctx} tokens "
                             f"with block_size {block_size}")
        pos = ctx - 1
        flat.append(table[pos // block_size] * block_size + pos % block_size)
    flat += context_lens
    flat += range(batch)
    for ctx, table in zip(context_lens, block_tables):
        used = (ctx + block_size - 1) // block_size
        flat += table[:used]
        flat += [0] * (max_blocks - used)   # padding points at block 0, as block_index_of
    data = torch.tensor(flat, dtype=torch.int64, device=device)
    decodes = DecodeBatch(query_index=data[2 * batch:3 * batch],
                          block_index=data[3 * batch:].view(batch, max_blocks),
                          context_lens=data[batch:2 * batch], block_size=block_size)
    return TorchAttentionMetadata(slot_mapping=data[:batch], query_lens=[1] * batch,
                                  context_lens=list(context_lens), block_tables=[list(t) for t in block_tables],
                                  block_size=block_size, decodes=decodes)


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
