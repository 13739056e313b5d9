"""Quantized weight matrices in the layouts the kernels read.

Every kept type is stored in one of seven row-major layouts, all with a
float16 ``scale`` (and optional float16 ``minv``) per group of ``group``
weights of a row:

- ``q4``: 4-bit codes 0..15, ``qs`` uint8 [out, in / 2]. Each run of 32
  weights is 16 bytes: byte j holds weight j in its low nibble and weight
  j + 16 in its high nibble (GGUF's Q4_0/Q4_1 block order, so those bytes are
  copied as they are). With ``qh`` (GGUF Q4_K, "q4k" to the kernels) its scales are the
  file's two levels: ``scale`` / ``minv`` float16 [out, in / 256] are each super-block's d and
  -dmin, and ``qh`` uint8 [out, in / 256 * ``K4_HIGH``] per super-block the eight 6-bit
  sub-scales of its runs of 32, then their eight sub-minimums. Run r's scale is d * sub_r,
  its minimum -dmin * min_r, exact in float32 as ggml computes them (``k4_group_scales``; the
  VNNI and AVX2 integer decodes in registers, the other paths into float32 scratch in L1):
  4.625 bits per weight (the file 4.5), where a float16 scale and
  minimum per run took 5.
- ``q8``: 8-bit codes, ``qs`` int8 [out, in].
- ``q5``: 5-bit codes 0..31 stored compactly: the low 4 bits as ``q4``'s ``qs``, the
  fifth in ``qh`` uint8 [out, in / 32 * 4]: per run of 32 weights a little-endian 32-bit
  plane, bit j being bit 4 of weight j's code (GGUF's Q5_0/Q5_1 block order, so those
  bytes are copied as they are). GGUF's Q5_K keeps its two-level scales ("q5k" to the kernels),
  held as Q4_K's: ``scale`` / ``minv`` float16 [out, in / 256] each super-block's d and -dmin,
  and a row's ``qh`` its 16 sub-scale bytes per super-block (as a two-level q4's ``qh``: in / 16
  bytes) before its high-bit planes (in / 8 bytes; forward, as Q6_K's): 5.625 bits per weight
  (the file 5.5), where a float16 scale and minimum per run took 6.
- ``q6``: 6-bit codes 0..63 in GGUF Q6_K's own bytes (copied as they are), ``in`` a multiple of
  ``Q6_HALF`` (128): per 128 weights 64 bytes of ``qs`` (uint8 [out, in / 2]), byte l holding
  weight l in its low nibble and weight 64 + l in its high one, and 32 bytes of ``qh`` (uint8
  [out, in / 4]), byte l holding the top two bits of weights l, 32 + l, 64 + l, 96 + l in its
  bit pairs 0, 2, 4, 6. So 32 consecutive codes are one shifted, masked nibble load or'ed with
  one shifted, masked high-bit load (a bit-plane layout, as q5's, took 7-16 instructions).
  GGUF's Q6_K keeps its two-level scales too ("q6k" to the kernels): ``scale`` float16
  [out, in / 256] is each super-block's d, and a row's ``qh`` holds its int8 sub-scales, one per
  16 weights (in / 16 bytes), then its high bits (in / 4 bytes; first, the sub-scales are read in
  step with them): group g's scale is d * sub_g, exact in float32 (``k6_group_scales``): 6.5625
  bits per weight, the file's.
- For both, ``zero`` is subtracted from every code (Q5_0: 16, Q6_K: 32), so signed codes need no
  per-group minimum. 5.5-6.5625 bits per weight with the scales, as in the file;
  the kernels expand the codes into ``q8``'s int8 codes where they compute (in
  registers on the VNNI decode and many-row paths, a scratch row in cache on
  the float decode and tiled paths) and run the ``q8`` code on them
  (``expand_codes`` is the reference).
- ``i4``: GGUF IQ4_NL / IQ4_XS codes: ``q4``'s nibbles (the file's bytes as they are),
  each an index into IQ4's 16 signed values ``IQ4_VALUES`` (-127..113), a scale per
  32 weights, no minimum, ``zero`` 0: 4.5 bits per weight. The kernels look the
  codes up (one byte shuffle per 32 on AVX2) into ``q8``'s int8 codes and run the
  ``q8`` code on them, as for q5/q6 (AVX-512 builds: the AVX2 lookup, and AVX2's int8
  decode kernels).
- ``q2`` / ``q3``: GGUF Q2_K / Q3_K as their files hold them, their integer sub-scales
  included (``K2_SUPER`` = 256 weights a super-block, ``group`` 256): ``qs`` uint8 [out, in / 4],
  per 128 weights 32 bytes, byte l holding weights l, l + 32, l + 64, l + 96 in its bit pairs
  0, 2, 4, 6; ``qh`` per super-block: q3 32 bytes of Q3_K's hmask (bit p of byte l the third
  bit (4) of weight 32p + l) then its sixteen 6-bit scales less 32 as int8 (48 bytes), q2
  Q2_K's 16 scale bytes as they are (low nibble the scale of a group of 16, high nibble its
  minimum); ``scale`` float16 [out, in / 256] the super-block's d; q2's ``minv`` [out, in / 256]
  -dmin. Weight j of group g (16 weights) of a super-block is ``d * sc_g * (q - zero)``, plus
  ``-dmin * m_g`` for q2; ``zero`` 4 for Q3_K (its codes -4..3). 3.56 bits per weight for q3
  (1.036x Q3_K's file: its scales unpacked to a byte each), 2.625 for q2 (Q2_K's file exactly).
  The kernels take the codes as they are and the sub-scales as integers (AVX2: an integer dot of
  each 16 with int8 activations times its sub-scale, one float multiply per block of 32;
  ``k2_group_scales`` gives the float32 scale and minimum per 16 the float paths use, exact:
  a float16 times a 6-bit integer). AVX-512 builds take the same AVX2 kernels for decode.

A weight is ``scale * (q - zero) + minv`` (``minv`` absent: 0; ``zero`` 0
except on q5/q6/q3 and Q4_0's q4, whose offset of 8 needs no minimum array), q2/q3's scale and
minimum times their sub-scales as above. Rows are independent, so a row permutation or a
concatenation of matrices along the output dimension is the same operation on
``qs``, ``qh``, ``scale`` and ``minv``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import gguf
import numpy as np
import torch

SUB = 32  # weights per nibble run; every group is a multiple of it
Q6_HALF = 128                    # q6: weights per self-contained run of nibble and high-bit bytes
CODES_PER_BYTE = {"q8": 1, "q2": 4, "q3": 4}   # in ``qs``; the others: 2 (nibbles)
K2_SUPER = 256                                 # q2/q3: weights per super-block (a scale, 16 sub-scales)
K2_HIGH = {"q2": 16, "q3": 48}                 # q2/q3: ``qh`` bytes per super-block (q3: hmask, sub-scales)
K4_SUPER, K4_HIGH = 256, 16                    # q4 with two-level scales: weights and ``qh`` bytes per super-block
K6_SUB = 16                                    # q6 with two-level scales: sub-scale bytes per super-block
IQ4_VALUES = tuple(int(v) for v in gguf.quants.IQ4_NL.kvalues)   # i4's codebook: -127 .. 113


@dataclass
class PackedWeight:
    kind: str                    # "q4" | "q8" | "q5" | "q6" | "i4" | "q2" | "q3"
    group: int                   # weights per scale
    qs: torch.Tensor             # q4/q5/q6/i4: uint8 [out, in / 2]; q8: int8 [out, in]; q2/q3: uint8 [out, in / 4]
    scale: torch.Tensor          # float16 [out, in / group]
    minv: torch.Tensor | None    # float16 [out, in / group] or None
    source: str                  # what it came from ("Q4_1", "int8", ...), for logs and stats
    qh: torch.Tensor | None = None   # q5: uint8 [out, in / 8] high-bit planes; q6: [out, in / 4] bit pairs (q5/q6 two-level: in / 16 sub-scale bytes first);
                                     # q2/q3: [out, in / 256 * K2_HIGH] sub-scales (q3: hmask first)
    zero: int = 0                # subtracted from each code (Q4_0: 8, Q5_0: 16, Q6_K: 32, Q3_K: 4)
    cache: dict = field(default_factory=dict, repr=False, compare=False)   # derived per-weight values (kernel args)

    def __post_init__(self) -> None:
        if self.kind == "q6" and self.qs.dim() == 2 and self.in_features % Q6_HALF:
            raise ValueError(f"a q6 weight holds Q6_K's runs of {Q6_HALF} weights; rows of {self.in_features} "
                             "are not whole runs")
        if self.kind == "q4" and self.two_level and self.qs.dim() == 2 and (
                self.in_features % K4_SUPER or self.group != SUB or self.minv is None):
            raise ValueError(f"a q4 weight with two-level scales holds Q4_K's super-blocks of {K4_SUPER} weights "
                             f"in runs of {SUB} with minimums; got rows of {self.in_features}, group {self.group}")
        if self.kind == "q5" and self.two_level and (self.in_features % K4_SUPER or self.group != SUB
                                                     or self.minv is None):
            raise ValueError(f"a q5 weight with two-level scales holds Q5_K's super-blocks of {K4_SUPER} weights "
                             f"in runs of {SUB} with minimums; got rows of {self.in_features}, group {self.group}")
        if self.kind == "q6" and self.two_level and (self.in_features % K4_SUPER or self.group != 16
                                                     or self.minv is not None):
            raise ValueError(f"a q6 weight with two-level scales holds Q6_K's super-blocks of {K4_SUPER} weights "
                             f"in groups of 16 without minimums; got rows of {self.in_features}, group {self.group}")

    @property
    def two_level(self) -> bool:
        """q4, q5 or q6 with Q4_K's / Q5_K's / Q6_K's two-level scales (the module doc): q4 with
        ``qh``, q5 / q6 whose ``qh`` rows hold sub-scales before the high bits."""
        if self.kind == "q4":
            return self.qh is not None
        high = {"q5": 8, "q6": 4}.get(self.kind)
        return (high is not None and self.qh is not None and self.qh.dim() == 2
                and self.qh.shape[1] == self.in_features // high + self.in_features // 16)

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    @property
    def in_features(self) -> int:
        return self.qs.shape[1] * CODES_PER_BYTE.get(self.kind, 2)

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the weight holds (codes, high bits, scales, minimums)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qs, self.qh, self.scale, self.minv) if t is not None]

    def map(self, fn) -> "PackedWeight":
        """Apply ``fn`` (a row selection, ``.to(device)``, ...) to every tensor."""
        opt = (lambda t: None if t is None else fn(t))
        return PackedWeight(self.kind, self.group, fn(self.qs), fn(self.scale), opt(self.minv), self.source,
                            opt(self.qh), self.zero)

    def rows(self, index: torch.Tensor) -> "PackedWeight":
        return self.map(lambda t: t.index_select(0, index))


def can_concat(parts: list[PackedWeight]) -> bool:
    first = parts[0]
    return all(p.kind == first.kind and p.group == first.group and (p.minv is None) == (first.minv is None)
               and p.two_level == first.two_level and p.zero == first.zero and p.in_features == first.in_features
               for p in parts)


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Stack matrices of one layout along the output dimension (fused q/k/v, gate/up)."""
    if not can_concat(parts):
        raise ValueError("cannot stack weights of different layouts as one: "
                         + ", ".join(f"{p.source} ({p.kind}{' two-level' if p.two_level else ''}, group {p.group}, "
                                     f"zero {p.zero}, "
                                     f"{'with' if p.minv is not None else 'no'} minimum)" for p in parts))
    first = parts[0]
    cat = (lambda get: torch.cat([get(p) for p in parts], dim=0))
    minv = None if first.minv is None else cat(lambda p: p.minv)
    qh = None if first.qh is None else cat(lambda p: p.qh)
    return PackedWeight(first.kind, first.group, cat(lambda p: p.qs), cat(lambda p: p.scale), minv,
                        "+".join(sorted({p.source for p in parts})), qh, first.zero)


def dequantize(w: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in] in ``dtype``, computed in float32 on the weight's device (the
    reference the C kernels are tested against, and the CUDA/no-compiler path)."""
    rows = w.out_features
    if w.kind in ("q2", "q3"):
        scale, minv = k2_group_scales(w)                                     # [out, in / 16] each
        out = _k2_codes(w).view(rows, -1, 16).float() * scale.unsqueeze(-1)
        return (out if minv is None else out + minv.unsqueeze(-1)).reshape(rows, -1).to(dtype)
    if w.kind == "q8":
        q = w.qs.view(rows, -1, w.group).float()
    else:
        q = expand_codes(w).view(rows, -1, w.group).float() if w.kind != "q4" else \
            _nibbles(w.qs).reshape(rows, -1, w.group).float() - w.zero       # [out, in / group, group]
    scale, minv = (k6_group_scales(w), None) if w.two_level and w.kind == "q6" else \
        k4_group_scales(w) if w.two_level else (w.scale, w.minv)
    out = q * scale.float().unsqueeze(-1)
    if minv is not None:
        out = out + minv.float().unsqueeze(-1)
    return out.reshape(rows, -1).to(dtype)


def k4_group_scales(w: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """A two-level q4 or q5 weight's scale and minimum per run of 32, float32 [out, in / 32] each:
    d * sub and -dmin * min, exact (a float16 times an integer below 64), as ggml dequantizes
    Q4_K / Q5_K and the kernels compute them."""
    rows = w.out_features
    sub = w.qh[:, :w.in_features // 16].reshape(rows, -1, 2, K4_HIGH // 2).float()   # [out, in / 256, sc | min, 8]
    scale = w.scale.float().unsqueeze(-1) * sub[:, :, 0]
    minv = w.minv.float().unsqueeze(-1) * sub[:, :, 1]
    return scale.reshape(rows, -1), minv.reshape(rows, -1)


def k6_group_scales(w: PackedWeight) -> torch.Tensor:
    """A two-level q6 weight's scale per group of 16, float32 [out, in / 16]: d * sub, exact."""
    rows, k = w.out_features, w.in_features
    sub = w.qh[:, :k // 16].view(torch.int8).float().view(rows, -1, K6_SUB)   # [out, in / 256, 16]
    return (w.scale.float().unsqueeze(-1) * sub).reshape(rows, -1)


def k2_group_scales(w: PackedWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A q2/q3 weight's scale and minimum (q3: None) per group of 16, float32 [out, in / 16]:
    d * sc and -dmin * m, exact (a float16 times an integer below 64 needs 17 bits)."""
    rows = w.out_features
    high = w.qh.view(rows, -1, K2_HIGH[w.kind])                             # [out, in / 256, bytes]
    per = (lambda t: t.float().repeat_interleave(16, dim=1))                 # a super-block's to its groups
    if w.kind == "q3":
        return per(w.scale) * high[..., 32:].view(torch.int8).reshape(rows, -1).float(), None
    return per(w.scale) * (high & 15).reshape(rows, -1).float(), per(w.minv) * (high >> 4).reshape(rows, -1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """q4 ``qs`` [out, in / 2] -> codes uint8 [out, in] in weight order."""
    b = qs.view(qs.shape[0], -1, SUB // 2)                                  # [out, in / 32, 16]
    return torch.cat([b & 15, b >> 4], dim=-1).reshape(qs.shape[0], -1)


def expand_codes(w: PackedWeight) -> torch.Tensor:
    """A q5/q6/q2/q3 weight's codes minus ``zero``, or an i4 weight's codebook values, as int8
    [out, in]: the ``q8`` codes the kernels expand a row into (``to_q8`` builds the
    byte-per-code layout from them)."""
    if w.kind == "i4":
        values = torch.tensor(IQ4_VALUES, dtype=torch.int8, device=w.qs.device)
        return values[_nibbles(w.qs).long()]
    if w.kind in ("q2", "q3"):
        return _k2_codes(w)
    rows = w.out_features
    if w.kind == "q6":
        ql = w.qs.view(rows, -1, Q6_HALF // 2)                             # [out, in / 128, 64]
        low = torch.cat([ql & 15, ql >> 4], dim=-1).to(torch.int16)        # weights 0-63, then 64-127
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=ql.device).view(4, 1)
        qh = w.qh[:, w.in_features // 16:] if w.two_level else w.qh         # the high bits (two-level: after scales)
        high = (qh.reshape(rows, -1, 1, Q6_HALF // 4) >> shifts) & 3        # [out, in / 128, 4, 32]: 32p + l
        q = low | (high.reshape(low.shape).to(torch.int16) << 4)
        return (q - w.zero).to(torch.int8).reshape(rows, -1)
    q = _nibbles(w.qs).view(rows, -1, SUB).to(torch.int16)                  # [out, in / 32, 32]
    qh = w.qh[:, w.in_features // 16:] if w.two_level else w.qh             # the planes (two-level: after scales)
    planes = qh.reshape(rows, -1, 4)                                       # [out, in / 32, 4 bytes]
    shifts = torch.arange(8, device=planes.device, dtype=torch.uint8)
    bits = ((planes.unsqueeze(-1) >> shifts) & 1).reshape(rows, -1, SUB).to(torch.int16)
    return ((q | (bits << 4)) - w.zero).to(torch.int8).reshape(rows, -1)


def _k2_codes(w: PackedWeight) -> torch.Tensor:
    """q2/q3 codes (bit pairs, q3's hmask bit as 4) minus ``zero``, int8 [out, in]."""
    rows, dev = w.out_features, w.qs.device
    pairs = w.qs.view(rows, -1, 1, 32)                                     # [out, in / 128, 1, 32 bytes]
    q = (pairs >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=dev).view(4, 1)) & 3   # [.., 4, 32]
    q = q.reshape(rows, -1).to(torch.int16)
    if w.kind == "q3":
        mask = w.qh.view(rows, -1, K2_HIGH["q3"])[..., None, :32]          # [out, in / 256, 1, 32 bytes]
        high = (mask >> torch.arange(8, dtype=torch.uint8, device=dev).view(8, 1)) & 1   # [.., 8, 32]
        q = q | (high.reshape(rows, -1).to(torch.int16) << 2)
    return (q - w.zero).to(torch.int8)


def to_q8(w: PackedWeight) -> PackedWeight:
    """A q5/q6/i4/q2/q3 weight in the byte-per-code ``q8`` layout (the layout they had before
    the compact one, and IQ4's, Q3_K's and Q2_K's on AVX-512 builds until the fourteenth session:
    benchmarks compare the two;
    tests check the kernels agree). q2/q3's scale and minimum per 16 (``k2_group_scales``) are
    rounded to float16 there: at most 2^-11 of each. Q4_K's / Q5_K's / Q6_K's two-level weights are refused
    (q4 has no q8 form; a float16 per group would not hold d * sub exactly)."""
    if w.two_level:
        raise ValueError(f"{w.source}: a weight with two-level scales is not widened to q8")
    if w.kind in ("q2", "q3"):
        scale, minv = k2_group_scales(w)
        return PackedWeight("q8", 16, expand_codes(w), scale.half(), None if minv is None else minv.half(), w.source)
    return PackedWeight("q8", w.group, expand_codes(w), w.scale, w.minv, w.source)


def pack_high_codes(q: torch.Tensor, hbits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """codes uint8 [out, in] (0 .. 2^(4 + hbits) - 1) -> q5 (hbits 1) or q6 (hbits 2) ``qs``, ``qh``."""
    if hbits == 2:
        return pack_q6(q)
    return pack_nibbles(q & 15), pack_planes(q.numpy() >> 4)


def pack_q6(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes uint8 [out, in] (0..63), ``in`` a multiple of 128 -> q6 ``qs``, ``qh`` (Q6_K's bytes)."""
    rows, cols = q.shape
    if cols % Q6_HALF:
        raise ValueError(f"q6 keeps Q6_K's bytes, whose runs are {Q6_HALF} weights: in_features {cols} is not a "
                         f"multiple of {Q6_HALF}")
    h = q.reshape(rows, -1, Q6_HALF)                                          # [out, in / 128, 128]
    qs = (h[..., :64] & 15) | ((h[..., 64:] & 15) << 4)
    top = (h >> 4).reshape(rows, -1, 4, 32)                                   # [out, in / 128, 4, 32]: 32p + l
    qh = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
    return qs.reshape(rows, -1).contiguous(), qh.reshape(rows, -1).contiguous()


def pack_planes(high: np.ndarray) -> torch.Tensor:
    """q5's fifth bits, uint8 [out, in] (0 or 1) -> ``qh`` [out, in / 8]: per run of 32 weights a
    little-endian 32-bit plane (np.packbits in little bit order puts weight j at bit j % 8 of byte
    j // 8, so bit j of the word). A loader's hot path: a 70B model's Q5_K tensors go through it."""
    rows = high.shape[0]
    return torch.from_numpy(np.packbits(high.reshape(rows, -1, SUB) & 1, axis=-1, bitorder="little").reshape(rows, -1))


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
