"""Build a stage whose linear and embedding weights stay quantized.

The model is constructed on the meta device, so no ``--dtype`` copy of a
weight is ever allocated: each Linear/Embedding is replaced by its quantized
module straight from the checkpoint bytes, and only what is left (norms,
biases, layers whose type is not kept) is allocated and filled in ``--dtype``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from pipeserve.model.layers import Embedding, Linear
from pipeserve.model.moe import SparseMoeBlock
from pipeserve.model.quant.modules import QuantEmbedding, QuantLinear
from pipeserve.model.quant.packed import SUB, PackedWeight, can_concat, concat_rows, quantize_weight

log = logging.getLogger(__name__)

MODES = ("auto", "none", "int8", "int4")


def weight_format(source_kind: str, quantization: str) -> str:
    """``--quantization`` and the checkpoint kind -> "dense" | "gguf" | "int8" | "int4"."""
    if quantization not in MODES:
        raise ValueError(f"quantization must be one of {', '.join(MODES)}, got {quantization!r}")
    if quantization == "none" or (quantization == "auto" and source_kind != "gguf"):
        return "dense"
    return "gguf" if quantization == "auto" else quantization


def replace_quantized(model: nn.Module, reader, sources: dict[str, list[str]], fmt: str, group: int,
                      dtype: torch.dtype, device: torch.device) -> None:
    """Swap each Linear/Embedding of ``model`` (on meta) for its quantized module.
    A tied head reuses the embedding's tensors when both are on this stage."""
    seen: dict[tuple[str, ...], list[PackedWeight]] = {}
    for path, module in list(model.named_modules()):
        if not isinstance(module, (Linear, Embedding)):
            continue
        names = tuple(sources[f"{path}.weight"])
        if names not in seen:
            parts = _read_parts(reader, list(names), fmt, group)
            seen[names] = parts and [p.map(lambda t: t.to(device)) for p in parts]
        parts = seen[names]
        if not parts:
            continue  # stays dense: allocated and filled with the remaining parameters
        if isinstance(module, Embedding):
            model.set_submodule(path, QuantEmbedding(parts[0], dtype))
        else:
            model.set_submodule(path, QuantLinear(parts, module.bias))
    if fmt == "gguf":
        _keep_experts_quantized(model, reader, sources, device)


def _keep_experts_quantized(model: nn.Module, reader, sources: dict[str, list[str]], device: torch.device) -> None:
    """A GGUF's expert stacks in a kept block type: each expert's gate/up and down become its
    own QuantLinear, built from its rows of the stack as a dense layer's weight is, so the
    experts stay as small as in the file. A stack in another type stays a dense parameter."""
    for path, block in list(model.named_modules()):
        if isinstance(block, SparseMoeBlock):
            block.keep_quantized(*(_expert_linears(reader, sources[f"{path}.{name}"], block.num_experts, device)
                                   for name in ("gate_up_proj", "down_proj")))


def _expert_linears(reader, names: list[str], experts: int, device: torch.device) -> list[QuantLinear] | None:
    """``names``: each expert's tensors in expert order (gate, up; or down)."""
    per = len(names) // experts
    linears = []
    for e in range(experts):
        parts = _read_parts(reader, names[e * per:(e + 1) * per], "gguf", 0)
        if parts is None:
            return None
        linears.append(QuantLinear([p.map(lambda t: t.to(device)) for p in parts]))
    return linears


def _read_parts(reader, names: list[str], fmt: str, group: int) -> list[PackedWeight] | None:
    if fmt == "gguf":
        parts = [reader.read_packed(n) for n in names]
        if any(p is None for p in parts):
            return None
        return [concat_rows(parts)] if can_concat(parts) else parts
    w = torch.cat([reader.read(n) for n in names], dim=0) if len(names) > 1 else reader.read(names[0])
    if w.shape[1] % group:
        if w.shape[1] % SUB:
            log.info("%s: %d inputs is not a multiple of %d; kept in --dtype", names[0], w.shape[1], SUB)
            return None
        group = SUB
    return [quantize_weight(w, 8 if fmt == "int8" else 4, group)]


def materialize_rest(model: nn.Module, sources: dict[str, list[str]], dtype: torch.dtype,
                     device: torch.device, fill: Callable[[torch.Tensor, str, list[str]], None]) -> None:
    """Allocate every parameter still on meta and fill it from the checkpoint."""
    for name, param in list(model.named_parameters()):
        if not param.is_meta:
            continue
        real = nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device), requires_grad=False)
        owner, attr = name.rsplit(".", 1) if "." in name else ("", name)
        setattr(model.get_submodule(owner), attr, real)
        with torch.no_grad():
            fill(real, name, sources[name])


def weight_bytes(model: nn.Module) -> int:
    """Resident bytes of the stage's parameters and buffers (shared tensors once), and
    of the packed copies of ``--prepack-weights``."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    packed = sum(m.packed.nbytes for m in model.modules() if isinstance(m, Linear))
    return sum(seen.values()) + packed


def describe(model: nn.Module) -> str:
    """"210 x Q4_1, 1 x Q8_0, 61 dense" for the start-up log line."""
    kinds: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            kinds.update(module.sources)
        elif isinstance(module, (Linear, Embedding)):
            kinds[str(module.weight.dtype).removeprefix("torch.")] += 1
    return ", ".join(f"{count} x {kind}" for kind, count in sorted(kinds.items()))
