"""Quantized weight matrices in the two layouts the kernels read.

Every kept type is stored as one of two row-major layouts, both with a
float16 ``scale`` (and optional float16 ``minv``) per group of ``group``
weights of a row:

- ``q4``: 4-bit codes 0..15, ``qs`` uint8 [out, in / 2]. Each run of 32
  weights is 16 bytes: byte j holds weight j in its low nibble and weight
  j + 16 in its high nibble (GGUF's Q4_0/Q4_1 block order, so those bytes are
  copied as they are).
- ``q8``: 8-bit codes, ``qs`` int8 [out, in].

A weight is ``scale * q + minv`` (``minv`` absent: 0). Rows are independent,
so a row permutation or a concatenation of matrices along the output
dimension is the same operation on ``qs``, ``scale`` and ``minv``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SUB = 32  # weights per nibble run; every group is a multiple of it


@dataclass
class PackedWeight:
    kind: str                    # "q4" | "q8"
    group: int                   # weights per scale
    qs: torch.Tensor             # q4: uint8 [out, in / 2]; q8: int8 [out, in]
    scale: torch.Tensor          # float16 [out, in / group]
    minv: torch.Tensor | None    # float16 [out, in / group] or None
    source: str                  # what it came from ("Q4_1", "int8", ...), for logs and stats
    cache: dict = field(default_factory=dict, repr=False, compare=False)   # derived per-weight values (kernel args)

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    @property
    def in_features(self) -> int:
        return self.qs.shape[1] * (2 if self.kind == "q4" else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [self.qs, self.scale] + ([] if self.minv is None else [self.minv])

    def map(self, fn) -> "PackedWeight":
        """Apply ``fn`` (a row selection, ``.to(device)``, ...) to every tensor."""
        return PackedWeight(self.kind, self.group, fn(self.qs), fn(self.scale),
                            None if self.minv is None else fn(self.minv), self.source)

    def rows(self, index: torch.Tensor) -> "PackedWeight":
        return self.map(lambda t: t.index_select(0, index))


def can_concat(parts: list[PackedWeight]) -> bool:
    first = parts[0]
    return all(p.kind == first.kind and p.group == first.group and (p.minv is None) == (first.minv is None)
               and p.in_features == first.in_features for p in parts)


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Stack matrices of one layout along the output dimension (fused q/k/v, gate/up)."""
    first = parts[0]
    cat = (lambda get: torch.cat([get(p) for p in parts], dim=0))
    minv = None if first.minv is None else cat(lambda p: p.minv)
    return PackedWeight(first.kind, first.group, cat(lambda p: p.qs), cat(lambda p: p.scale), minv,
                        "+".join(sorted({p.source for p in parts})))


def dequantize(w: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in] in ``dtype``, computed in float32 on the weight's device (the
    reference the C kernels are tested against, and the CUDA/no-compiler path)."""
    rows = w.out_features
    if w.kind == "q4":
        b = w.qs.view(rows, -1, SUB // 2)                                    # [out, in / 32, 16]
        q = torch.cat([b & 15, b >> 4], dim=-1).reshape(rows, -1, w.group)   # [out, in / group, group]
    else:
        q = w.qs.view(rows, -1, w.group)
    out = q.float() * w.scale.float().unsqueeze(-1)
    if w.minv is not None:
        out = out + w.minv.float().unsqueeze(-1)
    return out.reshape(rows, -1).to(dtype)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """codes uint8 [out, in] (0..15) -> q4 ``qs`` [out, in / 2]."""
    runs = q.reshape(q.shape[0], -1, SUB)                                     # [out, in / 32, 32]
    return (runs[..., :SUB // 2] | (runs[..., SUB // 2:] << 4)).reshape(q.shape[0], -1).contiguous()


def quantize_weight(w: torch.Tensor, bits: int, group: int) -> PackedWeight:
    """Round-to-nearest, group-wise weight-only quantization of a float matrix.

    int8: symmetric (q in -127..127, no minimum); int4: asymmetric (q in 0..15
    between the group's minimum and maximum). Scales are float16; the codes are
    computed against the rounded scale so the stored pair is self-consistent.
    """
    rows, cols = w.shape
    if cols % group:
        raise ValueError(f"in_features {cols} is not a multiple of the quantization group {group}")
    g = w.float().reshape(rows, cols // group, group)
    if bits == 8:
        scale = (g.abs().amax(-1) / 127).to(torch.float16)
        s = scale.float().clamp_min(1e-30).unsqueeze(-1)
        q = torch.round(g / s).clamp(-127, 127).to(torch.int8).reshape(rows, cols)
        return PackedWeight("q8", group, q, scale, None, "int8")
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).to(torch.float16)
    minv = lo.to(torch.float16)
    s = scale.float().clamp_min(1e-30).unsqueeze(-1)
    q = torch.round((g - minv.float().unsqueeze(-1)) / s).clamp(0, 15).to(torch.uint8).reshape(rows, cols)
    return PackedWeight("q4", group, pack_nibbles(q), scale, minv, "int4")
