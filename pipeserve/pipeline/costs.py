"""Measure the per-part costs ``auto`` partitioning balances, on the actual device.

Builds a one-layer stage of the real model (random weights, the real shapes,
the configured attention backend), runs a representative decode step and a
prefill step through it, and times the embedding, one decoder layer and the
final norm + LM head separately. Memory per part comes from the model's
parameter counts.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from pipeserve.model.config import ModelConfig
from pipeserve.pipeline.part_costs import PartCosts


def parameter_bytes(cfg: ModelConfig, dtype: torch.dtype) -> PartCosts:
    """Memory of each part (no timing): used alone when memory is all that matters.
    A layer's bytes are its TOTAL parameters (MoE: every expert is stored)."""
    size = dtype.itemsize
    sizes = tuple(cfg.layer_params(i) * size for i in range(cfg.num_layers))
    return PartCosts(embed=0.0, layer=0.0, head=0.0, embed_bytes=cfg.embedding_params() * size,
                      layer_bytes=max(sizes, default=0), head_bytes=cfg.head_params() * size,
                      layer_sizes=sizes if len(set(sizes)) > 1 else ())


def layer_times(cfg: ModelConfig, measured: float, measured_layer: int) -> tuple[float, ...]:
    """Each layer's time from one measured layer, scaled by ACTIVE parameters (MoE: the
    router, k experts and the shared expert a token runs); empty when all layers match."""
    active = [cfg.active_layer_params(i) for i in range(cfg.num_layers)]
    if len(set(active)) <= 1:
        return ()
    return tuple(measured * a / active[measured_layer] for a in active)


def _best_time(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up: first calls allocate and pick kernels
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    # The minimum, not the median: other processes only ever add time.
    return min(times)


def random_stage(cfg: ModelConfig, start: int, end: int, is_first: bool, is_last: bool,
                 dtype: torch.dtype, device: torch.device, attention_backend: str = "auto"):
    """The runtime's own stage model (``LlamaModel``) for layers [start, end), random weights.

    The real shapes and the configured attention backend, so a timing of it is a
    timing of the runtime's layers; used here and by ``pipeserve plan --calibrate``.
    """
    from pipeserve.model.cpu_attention import select_backend
    from pipeserve.model.llama import LlamaModel
    stage = LlamaModel(cfg, start, end, is_first, is_last, dtype, device,
                       backend=select_backend(attention_backend, device))
    for p in stage.parameters():
        p.normal_(0.0, 0.02)
    return stage


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTensors(NamedTuple):
    """What one forward of a stage takes, for a step of a given shape (see ``step_tensors``)."""

    kv: list                  # one layer's (K, V) paged cache, [blocks, block_size, kv_heads, head_dim] each
    meta: object              # the backend's AttentionMetadata for the step
    positions: torch.Tensor   # [tokens]
    ids: torch.Tensor         # [tokens] random token ids (a first stage's input)
    hidden: torch.Tensor      # [tokens, hidden] random activations (a later stage's input)


def step_tensors(cfg: ModelConfig, backend, query_lens: list[int], context_lens: list[int], block_size: int,
                 dtype: torch.dtype, device: torch.device, cache_blocks: int = 0) -> StepTensors:
    """KV cache, metadata, positions, ids and hidden states for one step of the given shape,
    for timing a ``random_stage`` (here and by ``pipeserve plan --calibrate``).

    ``context_lens`` include the step's new tokens (``query_lens``); the metadata
    comes from ``backend.build_metadata``, as the runner builds it.

    By default each sequence's blocks are consecutive in a cache just big enough.
    ``cache_blocks``: a cache of that many blocks (allocated as the runtime does)
    with every sequence's blocks drawn at random from it, as a long-running
    engine's block tables end up (freed blocks are reused in LRU order), so
    attention pays for reading scattered blocks.
    """
    blocks = [-(-ctx // block_size) for ctx in context_lens]
    total = max(sum(blocks), cache_blocks)
    shape = (total, block_size, cfg.num_kv_heads, cfg.head_dim)
    if device.type == "cpu":
        from pipeserve.worker.model_runner import zeros_on_huge_pages
        kv = [(zeros_on_huge_pages(shape, dtype), zeros_on_huge_pages(shape, dtype))]
    else:
        kv = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))]
    order = torch.randperm(total, generator=torch.Generator().manual_seed(0)).tolist() if cache_blocks \
        else list(range(total))
    tables, at = [], 0
    for n in blocks:
        tables.append(order[at:at + n])
        at += n
    meta = backend.build_metadata(query_lens, context_lens, tables, block_size, device)
    positions = torch.cat([torch.arange(ctx - q, ctx) for q, ctx in zip(query_lens, context_lens)]).to(device)
    tokens = int(positions.shape[0])
    ids = torch.randint(0, cfg.vocab_size, (tokens,), device=device)             # [tokens]
    hidden = torch.randn(tokens, cfg.hidden_size, dtype=dtype, device=device)    # [tokens, hidden]
    return StepTensors(kv, meta, positions, ids, hidden)


@torch.inference_mode()
def measure_layer_costs(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu", *,
                        batch: int = 8, context: int = 128, prefill_tokens: int = 512, block_size: int = 16,
                        repeats: int = 5, attention_backend: str = "auto") -> PartCosts:
    """Time embedding, one decoder layer and norm + LM head per *unit of
    work*: one prompt token plus one generated token, the mix of a chat
    workload whose prompts and answers have similar lengths.

    A layer's unit cost is its time per token in a decode step (``batch``
    tokens, each attending to ``context`` earlier ones) plus its time per
    token in a prefill step (``prefill_tokens`` fresh prompt tokens, in
    prompts of ``context`` tokens). The head runs on sampled rows only, so its
    unit cost is its time per row of the decode batch. Timing decode alone
    would overweight the head (it sees every decode token but only the last
    token of each prompt) and skew the partition towards the first stage.
    """
    device = torch.device(device)
    torch.manual_seed(0)
    # Only the model's public forward: a one-layer middle stage, and embedding-
    # only / head-only end stages (zero decoder layers).
    # The measured layer: the first with experts where the model has any (its routed
    # experts run on random router weights, so tokens spread over them as in use).
    measured = next((i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)), 0)
    layer_stage = random_stage(cfg, measured, measured + 1, False, False, dtype, device, attention_backend)
    embed_stage = random_stage(cfg, 0, 0, True, False, dtype, device)
    head_stage = random_stage(cfg, 0, 0, False, True, dtype, device)
    prompt = max(2, min(context, prefill_tokens))
    shapes = {"decode": ([1] * batch, [context + 1] * batch),
              "prefill": ([prompt] * max(1, prefill_tokens // prompt), [prompt] * max(1, prefill_tokens // prompt))}
    embed_s = layer_s = 0.0
    for query_lens, context_lens in shapes.values():
        kv, meta, positions, ids, hidden = step_tensors(cfg, layer_stage.backend, query_lens, context_lens,
                                                        block_size, dtype, device)
        tokens = len(ids)
        embed_s += _best_time(lambda: embed_stage(ids, positions, meta, []), repeats, device) / tokens
        layer_s += _best_time(lambda: layer_stage(hidden, positions, meta, kv), repeats, device) / tokens
    rows = torch.randn(batch, cfg.hidden_size, dtype=dtype, device=device)       # [batch, hidden]
    head_s = _best_time(lambda: head_stage.compute_logits(rows), repeats, device) / batch
    mem = parameter_bytes(cfg, dtype)
    return PartCosts(embed=embed_s, layer=layer_s, head=head_s, embed_bytes=mem.embed_bytes,
                      layer_bytes=mem.layer_bytes, head_bytes=mem.head_bytes,
                      layer_times=layer_times(cfg, layer_s, measured), layer_sizes=mem.layer_sizes)
