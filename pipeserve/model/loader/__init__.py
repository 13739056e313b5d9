"""Model loading: resolve a name or path, read its config, fill one stage's weights."""

from __future__ import annotations

import torch

from pipeserve.model.config import ModelConfig
from pipeserve.model.layers import Embedding, Linear
from pipeserve.model.llama import LlamaModel
from pipeserve.model.loader.resolve import ModelSource, WeightReader, resolve_model

__all__ = ["ModelSource", "WeightReader", "load_model", "resolve_model"]


def load_model(source: ModelSource, cfg: ModelConfig, start_layer: int, end_layer: int,
               is_first: bool, is_last: bool, dtype: torch.dtype,
               device: torch.device | str, attention_backend: str = "auto",
               quantization: str = "auto", quantization_group_size: int = 32, tp=None) -> LlamaModel:
    """Build the stage owning layers [start_layer, end_layer) and read only its tensors.

    ``quantization`` (see ``pipeserve.model.quant.load.weight_format``): "none"
    fills every weight in ``dtype``; "auto" keeps a GGUF's block-quantized
    tensors as they are; "int8"/"int4" quantize linear and embedding weights
    group-wise at load.

    ``tp`` (a ``TensorParallelGroup``): build and fill only this tensor-parallel
    rank's slices; kept-quantized weights are cut before they are re-laid out (a GGUF's
    block bytes) or before they are quantized (int8/int4), on the block boundaries
    ``split_alignment`` gave the shard plan."""
    from pipeserve.model.cpu_attention import select_backend
    from pipeserve.model.quant.load import materialize_rest, replace_quantized, weight_format
    fmt = weight_format(source.kind, quantization)
    device = torch.device(device)
    build_on = device if fmt == "dense" else torch.device("meta")
    model = LlamaModel(cfg, start_layer, end_layer, is_first, is_last, dtype, build_on,
                       backend=select_backend(attention_backend, device), tp=tp)
    params = dict(model.named_parameters())
    sources = model.checkpoint_names()
    if set(sources) != set(params):  # a parameter left out would keep torch.empty garbage
        raise RuntimeError(f"model/checkpoint name map out of sync: {sorted(set(params) ^ set(sources))}")
    reader = source.open_weights(cfg)
    try:
        if fmt == "dense":
            with torch.no_grad():
                for ours, names in sources.items():
                    if tp is not None:
                        parts = _read_shard(reader, source, cfg, tp.shard, ours, names)
                    else:
                        parts = [_read(reader, source, n) for n in names]
                    _fill(params[ours], ours, parts)
            return _tie_head(model)
        # Only the rotary buffers (Gemma 3: two) are built from the config rather than read: take real ones.
        real = LlamaModel(cfg, start_layer, start_layer, False, False, dtype, device)
        model.rotary, model.local_rotary = real.rotary, real.local_rotary
        model.device = device
        if tp is not None:
            reader = _ShardReader(reader, source, cfg, tp.shard, sources)
        replace_quantized(model, reader, sources, fmt, quantization_group_size, dtype, device)
        materialize_rest(model, sources, dtype, device,
                         lambda param, ours, names: _fill(param, ours, [_read(reader, source, n) for n in names]))
    finally:
        reader.close()
    return _tie_head(model)


def _tie_head(model: LlamaModel) -> LlamaModel:
    """A stage holding both the embedding and a head tied to it in --dtype: one tensor for both
    (filled from the same checkpoint tensor; kept-quantized ones share theirs already)."""
    embed, head = model.embed_tokens, model.lm_head
    if (model.cfg.tie_word_embeddings and model.tp is None and type(embed) is Embedding
            and type(head) is Linear and embed.weight.shape == head.weight.shape):
        head.weight = embed.weight
    return model


def split_alignment(source: ModelSource, cfg: ModelConfig, quantization: str, group: int):
    """Where a tensor-parallel split may cut the row-parallel layers' inputs (o_proj,
    down_proj) with these weights kept quantized: a ``SplitAlign`` of the largest block
    (GGUF: the file's types, every layer; int8/int4: the group, as ``quantize_weight``
    would take it for the whole tensor), or None for dense weights (no constraint)."""
    from pipeserve.model.quant.load import weight_format
    from pipeserve.model.quant.packed import SUB
    from pipeserve.model.tensor_parallel import SplitAlign
    kind = getattr(source, "kind", None)
    if kind is None or cfg.num_experts or weight_format(kind, quantization) == "dense":
        return None
    if quantization in ("int8", "int4"):
        def unit(inputs: int) -> int:
            return group if inputs % group == 0 else SUB if inputs % SUB == 0 else 1
        return SplitAlign(unit(cfg.num_heads * cfg.head_dim), unit(cfg.intermediate_size),
                          f"o_proj ({quantization}, group {group})", f"down_proj ({quantization}, group {group})")
    reader = source.open_weights(cfg)
    try:
        layers = range(cfg.num_layers)
        attention = [reader.block_size(f"model.layers.{i}.self_attn.o_proj.weight") for i in layers]
        mlp = [reader.block_size(f"model.layers.{i}.mlp.down_proj.weight") for i in layers]
    finally:
        reader.close()
    a, m = max(attention), max(mlp)
    return SplitAlign(a, m, f"layer {attention.index(a)}'s o_proj (GGUF attn_output)",
                      f"layer {mlp.index(m)}'s down_proj (GGUF ffn_down)")


class _ShardReader:
    """A tensor-parallel rank's view of the checkpoint for the kept-quantized path:
    ``read`` and ``read_packed`` return only this rank's slice of each checkpoint tensor
    (a fused parameter's ranges, given on the concatenation of its tensors, are mapped
    onto each tensor), so ``replace_quantized`` quantizes or re-lays out shards only."""

    def __init__(self, reader: WeightReader, source: ModelSource, cfg: ModelConfig, shard,
                 sources: dict[str, list[str]]) -> None:
        from pipeserve.model.tensor_parallel import parameter_slices
        self._reader, self._source = reader, source
        self._cuts: dict[str, tuple[int, tuple[tuple[int, int], ...]]] = {}
        for ours, names in sources.items():
            cut = parameter_slices(cfg, shard, ours)
            if cut is None:
                continue
            for name, local in _per_tensor(reader, source, names, *cut).items():
                if self._cuts.setdefault(name, local) != local:
                    raise RuntimeError(f"checkpoint tensor {name} is cut two ways for tensor parallelism")

    def read(self, name: str) -> torch.Tensor:
        from pipeserve.model.tensor_parallel import take_slices
        tensor = self._reader.read(name)
        cut = self._cuts.get(name)
        return tensor if cut is None else take_slices(tensor, *cut)

    def read_packed(self, name: str):
        return self._reader.read_packed(name, self._cuts.get(name))

    def close(self) -> None:
        self._reader.close()


def _per_tensor(reader: WeightReader, source: ModelSource, names: list[str], dim: int,
                ranges) -> dict[str, tuple[int, tuple[tuple[int, int], ...]]]:
    """A parameter's cut (ranges along ``dim`` of its tensors concatenated by rows) as one
    cut per tensor; rows past the end (vocabulary padding) stay with the last tensor."""
    if dim == 1 or len(names) == 1:
        return {n: (dim, tuple(ranges)) for n in names}
    try:
        rows = [reader.shape(n)[0] for n in names]
    except KeyError as exc:
        raise ValueError(f"checkpoint {source.path} is missing a tensor the model needs: {exc}") from None
    local: dict[str, list[tuple[int, int]]] = {n: [] for n in names}
    for start, stop in ranges:
        offset = 0
        for i, (n, r) in enumerate(zip(names, rows)):
            end = offset + r if i < len(names) - 1 else max(stop, offset + r)
            a, b = max(start, offset), min(stop, end)
            if a < b:
                local[n].append((a - offset, b - offset))
            offset += r
    if any(not v for v in local.values()):
        raise RuntimeError(f"a tensor-parallel cut leaves nothing of one of {names}")
    return {n: (0, tuple(v)) for n, v in local.items()}


def _read_shard(reader: WeightReader, source: ModelSource, cfg: ModelConfig, shard, name: str,
                names: list[str]) -> list[torch.Tensor]:
    """A tensor-parallel rank's slice of parameter ``name``, whose checkpoint tensors
    ``names`` concatenate along dim 0. A reader with ``read_slice`` (safetensors) reads only
    the slice's rows / columns; otherwise (GGUF, dequantized whole) the full tensor is read
    and cut."""
    from pipeserve.model.tensor_parallel import parameter_slices, take_slices
    cut = parameter_slices(cfg, shard, name)
    if cut is None:
        return [_read(reader, source, n) for n in names]
    dim, ranges = cut
    if not hasattr(reader, "read_slice"):
        parts = [_read(reader, source, n) for n in names]
        return [take_slices(parts[0] if len(parts) == 1 else torch.cat(parts, dim=0), dim, ranges)]
    try:
        shapes = [reader.shape(n) for n in names]
    except KeyError as exc:
        raise ValueError(f"checkpoint {source.path} is missing a tensor the model needs: {exc}") from None
    pieces: list[torch.Tensor] = []
    if dim == 1:   # columns of every part, the parts stacked by rows
        for n in names:
            pieces.append(torch.cat([reader.read_slice(n, 1, a, b) for a, b in ranges], dim=1))
        return [torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]]
    total = sum(s[0] for s in shapes)
    for start, stop in ranges:   # rows of the concatenation: intersect with each part
        offset = 0
        for n, s in zip(names, shapes):
            a, b = max(start, offset), min(stop, offset + s[0])
            if a < b:
                pieces.append(reader.read_slice(n, 0, a - offset, b - offset))
            offset += s[0]
        if stop > total:   # vocabulary padding past the last row
            pieces.append(torch.zeros((stop - max(start, total),) + tuple(shapes[0][1:]),
                                      dtype=pieces[-1].dtype if pieces else torch.float32))
    return [torch.cat(pieces, dim=0)]


def _read(reader: WeightReader, source: ModelSource, name: str) -> torch.Tensor:
    try:
        return reader.read(name)
    except KeyError as exc:
        raise ValueError(f"checkpoint {source.path} is missing a tensor the model needs: {exc}") from None


def _fill(param: torch.Tensor, name: str, parts: list[torch.Tensor]) -> None:
    if param.dim() == parts[0].dim() + 1:  # stacked experts [E, ...]: parts listed expert by expert
        tensor = torch.stack([torch.cat(group, dim=0) for group in _per_expert(parts, param.shape[0], name)])
    else:
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor(s) for {name} have shape {tuple(tensor.shape)}, "
                         f"the config implies {tuple(param.shape)}")
    param.copy_(tensor)  # casts to the stage's dtype and moves to its device


def _per_expert(parts: list[torch.Tensor], experts: int, name: str) -> list[list[torch.Tensor]]:
    if len(parts) % experts:
        raise ValueError(f"{name} stacks {experts} experts but the checkpoint gives {len(parts)} tensors")
    per = len(parts) // experts
    return [parts[e * per:(e + 1) * per] for e in range(experts)]
