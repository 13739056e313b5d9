"""A stage's kept-quantized weights move into one arena advised for 2 MiB pages at load
(``worker.model_runner.weights_to_huge_pages``): same values, shared tensors still shared,
and what the modules derived from the old buffers (their parts, bound gemvs) derived again."""

from __future__ import annotations

import torch
from torch import nn

from pipeserve.model.quant.modules import QuantEmbedding, QuantLinear
from pipeserve.model.quant.packed import quantize_weight
from pipeserve.worker.model_runner import weights_to_huge_pages


def _model(rows: int) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    head = quantize_weight(torch.randn(rows, 512, generator=g), 8, 32)
    model = nn.Module()
    model.embed = QuantEmbedding(head, torch.float32)
    model.head = QuantLinear([head])                       # tied: the embedding's buffers
    model.mlp = QuantLinear([quantize_weight(torch.randn(rows, 512, generator=g), 4, 32),
                             quantize_weight(torch.randn(64, 512, generator=g), 8, 32)])
    return model


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t for name, t in model.named_buffers(remove_duplicate=False) if t is not None}


def test_weights_move_into_one_arena_with_the_same_values():
    model = _model(8192)                                   # ~7 MiB of codes and scales
    x, ids = torch.randn(3, 512), torch.tensor([5, 8191, 0])
    before = [model.head(x), model.mlp(x), model.mlp(x[:1]), model.embed(ids)]   # binds the decode gemvs
    old = {name: t.clone() for name, t in _buffers(model).items()}
    total = weights_to_huge_pages(model)
    assert total >= sum(t.numel() * t.element_size() for name, t in old.items() if not name.startswith("head."))
    moved = _buffers(model)
    assert len({t.untyped_storage().data_ptr() for t in moved.values()}) == 1          # one arena
    assert all(torch.equal(moved[name], old[name]) for name in old)
    assert all(t.data_ptr() % 64 == 0 for t in moved.values())
    assert moved["head.qs0"].data_ptr() == moved["embed.qs0"].data_ptr()               # still tied
    assert model.head.parts[0].qs.data_ptr() == moved["head.qs0"].data_ptr()           # parts re-derived
    after = [model.head(x), model.mlp(x), model.mlp(x[:1]), model.embed(ids)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_small_stage_stays_where_it_is():
    model = _model(256)
    ptrs = {name: t.data_ptr() for name, t in _buffers(model).items()}
    assert weights_to_huge_pages(model) == 0
    assert {name: t.data_ptr() for name, t in _buffers(model).items()} == ptrs
