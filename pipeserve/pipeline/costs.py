"""Measure the per-part costs ``auto`` partitioning balances, on the actual device.

Builds a one-layer stage of the real model (random weights, the real shapes),
runs a representative decode batch through it, and times the embedding, one
decoder layer and the final norm + LM head separately. Memory per part comes
from the model's parameter counts.
"""

from __future__ import annotations

import time

import torch

from pipeserve.model.config import ModelConfig
from pipeserve.pipeline.layer_costs import LayerCosts


def parameter_bytes(cfg: ModelConfig, dtype: torch.dtype) -> LayerCosts:
    """Memory of each part (no timing): used alone when memory is all that matters."""
    size = dtype.itemsize
    return LayerCosts(embed=0.0, layer=0.0, head=0.0, embed_bytes=cfg.embedding_params() * size,
                      layer_bytes=cfg.layer_params() * size, head_bytes=cfg.head_params() * size)


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


def _random_stage(cfg: ModelConfig, start: int, end: int, is_first: bool, is_last: bool,
                  dtype: torch.dtype, device: torch.device, attention_backend: str = "auto"):
    from pipeserve.model.cpu_attention import select_backend
    from pipeserve.model.llama import LlamaModel  # the runtime's own layers, real shapes
    stage = LlamaModel(cfg, start, end, is_first, is_last, dtype, device,
                       backend=select_backend(attention_backend, device))
    for p in stage.parameters():
        p.normal_(0.0, 0.02)
    return stage


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_layer_costs(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu", *,
                        batch: int = 8, context: int = 128, block_size: int = 16,
                        repeats: int = 5, attention_backend: str = "auto") -> LayerCosts:
    """Time embedding, one decoder layer and norm + LM head for ``batch`` decode
    tokens, each attending to ``context`` earlier tokens."""
    device = torch.device(device)
    torch.manual_seed(0)
    # Only the model's public forward: a one-layer middle stage, and embedding-
    # only / head-only end stages (zero decoder layers).
    layer_stage = _random_stage(cfg, 0, 1, False, False, dtype, device, attention_backend)
    embed_stage = _random_stage(cfg, 0, 0, True, False, dtype, device)
    head_stage = _random_stage(cfg, 0, 0, False, True, dtype, device)
    blocks_per_seq = -(-(context + 1) // block_size)
    shape = (batch * blocks_per_seq, block_size, cfg.num_kv_heads, cfg.head_dim)
    kv = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))]
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    meta = layer_stage.backend.build_metadata([1] * batch, [context + 1] * batch, tables, block_size, device)
    positions = torch.full((batch,), context, dtype=torch.int64, device=device)   # [batch]
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=device)                # [batch]
    hidden = torch.randn(batch, cfg.hidden_size, dtype=dtype, device=device)       # [batch, hidden]
    embed_s = _best_time(lambda: embed_stage(ids, positions, meta, []), repeats, device)
    layer_s = _best_time(lambda: layer_stage(hidden, positions, meta, kv), repeats, device)
    head_s = _best_time(lambda: head_stage.compute_logits(hidden), repeats, device)
    mem = parameter_bytes(cfg, dtype)
    return LayerCosts(embed=embed_s, layer=layer_s, head=head_s, embed_bytes=mem.embed_bytes,
                      layer_bytes=mem.layer_bytes, head_bytes=mem.head_bytes)
