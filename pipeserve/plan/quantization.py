"""Bytes per weight of the formats a model's weights may be stored in (``--quantization``).

Weight-only: the KV cache and activations keep the dtype. Three kinds of entry:

- GGUF block types (ggml's block structs): ``bytes per block / weights per block``,
  e.g. Q4_K = 144 bytes / 256 weights = 4.5 bits, Q8_0 = 34 / 32 = 8.5 bits.
  ``llama-quantize`` keeps ``output.weight`` (the LM head, or the tied embedding)
  at Q6_K for every file type below Q8_0, so the head is counted at 6.5625 bits.
- GGUF *mixes* (``q4_k_m`` …): llama-quantize gives some tensors more bits
  (attn_v, ffn_down of some layers, the head). Their bits per weight are the
  whole-file averages llama.cpp's tools/quantize/README.md reports (Llama 2 7B:
  Q4_K_M 4.84, Q5_K_M 5.68 …); a 70B differs by about 1 % (Llama-3.1-70B Q4_K_M
  files are 42.5 GB for 70.6 B parameters: 4.82 bits).
- pipeserve's load-time ``int8`` / ``int4`` as the runtime stores them
  (model/quant/packed.py ``quantize_weight``): one float16 scale (int8) or scale and
  minimum (int4) per group of ``GROUP_SIZE`` weights along the input, the runtime's
  default ``--quantization-group-size``.

``bits`` is what the file holds; what a stage holds (and its kernels read) is
``resident_bits``, the layout pipeserve keeps a type in (model/quant/gguf_repack.py):
the legacy types as they are, Q4_K with its own two-level scales (float16 d and dmin per 256,
6-bit sub-scales and minimums a byte each: 4.625 bits), Q5_K likewise (5.625 bits), Q6_K with
its own two-level scales (6.5625 bits, the file's),
IQ4_NL / IQ4_XS as their
nibbles with a float16 scale per 32 (4.5 bits; gguf_widen.py's i4: measured 1.00x and 1.06x the
file's tensor bytes; an AVX-512 build widens them to 8.5), and Q3_K / Q2_K as their 2-bit code
pairs (Q3_K: and its high-bit mask) with their integer sub-scales per 16 and float16 d (Q2_K: and
dmin) per 256 (gguf_widen.py's q3 / q2: 3.5625 and 2.625 bits, 1.036x and 1.00x the file's tensor
bytes; an AVX-512 build widens them to 8-bit codes, 9 and 10 bits). A mix's factor,
resident over file bits of its decoder and embedding tensors, is measured on llama-quantize's
output for a 12-layer Llama of width 2048 (``RESIDENT_FACTORS``; the head is counted
apart, at Q6_K's bits); llama-quantize picks the types by layer index, so a 70B's mix
differs by a few percent. Q4_K's and Q6_K's two-level layouts moved the mixes that hold them:
Q4_K_M 1.104 -> 1.023, Q5_K_M 1.088 -> 1.078 and Q3_K_M 1.064 -> 1.033 (their files' Q4_K and
Q6_K shares, at 37/36 and 1 instead of 10/9 and 16/15), Q4_K_S 1.111 -> 1.028 and Q2_K 1.016 ->
1.006 (the same arithmetic on their old factors: Q4_K_S nearly all Q4_K, Q2_K's file 12 % Q4_K);
Q5_K_S, Q3_K_S and Q3_K_L hold neither but in the head. Q5_K's two-level layout then moved
Q5_K_M 1.078 -> 1.020 (its file 86 % Q5_K, at 45/44 instead of 12/11), Q5_K_S 1.091 -> 1.023
(all Q5_K) and Q3_K_L 1.059 -> 1.031 (the same arithmetic: about 42 % of its bytes Q5_K).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeserve.plan.presets import PlanInputError

GROUP_SIZE = 32    # int8 / int4: the runtime's default --quantization-group-size (float16 scale (+ minimum))
Q6_K_BITS = 8 * 210 / 256  # 6.5625: llama-quantize's LM head below Q8_0
Q8_0_BITS = 8 * 34 / 32    # 8.5: its fallback where a row is not a multiple of 256
# Bits per weight a stage holds a GGUF block type in (gguf_repack.py, gguf_widen.py).
RESIDENT_BITS = {"q8_0": 8.5, "q6_k": 6.5625, "q5_k": 5.625, "q5_0": 5.5, "q5_1": 6.0, "q4_k": 4.625, "q4_0": 4.5,
                 "q4_1": 5.0, "iq4_nl": 4.5, "iq4_xs": 4.5, "q3_k": 3.5625, "q2_k": 2.625}
# A mix's resident / file bits over its decoder and embedding tensors (see the module docstring).
RESIDENT_FACTORS = {"q5_k_m": 1.020, "q5_k_s": 1.023, "q4_k_m": 1.023, "q4_k_s": 1.028, "q3_k_l": 1.031,
                    "q3_k_m": 1.033, "q3_k_s": 1.036, "q2_k": 1.006}


@dataclass(frozen=True)
class WeightFormat:
    name: str
    bits: float          # bits per weight of the decoder layers and the input embedding, in the file
    head_bits: float     # bits per weight of the LM head (output.weight), in the file
    note: str
    block: int = 1       # weights per quantization block along a row (a TP cut falls on one)
    resident_bits: float | None = None        # as a stage holds them (None: as in the file)
    resident_head_bits: float | None = None

    @property
    def bytes(self) -> float:
        """Bytes per weight a stage holds and its kernels read."""
        return (self.bits if self.resident_bits is None else self.resident_bits) / 8

    @property
    def head_bytes(self) -> float:
        return (self.head_bits if self.resident_head_bits is None else self.resident_head_bits) / 8

    def head_bytes_for(self, hidden: int) -> float:
        """Bytes per weight of the LM head of a model with this hidden size: Q6_K's blocks
        are 256 weights of a row, and llama-quantize stores a head whose rows are not a
        multiple of 256 at Q8_0 instead (SmolLM2's 576: the built-in Q4_1 file's head)."""
        if self.head_bits == Q6_K_BITS and hidden % 256:
            return Q8_0_BITS / 8
        return self.head_bytes


def _block(name: str, block_bytes: int, block_weights: int, head_bits: float | None = None) -> WeightFormat:
    bits = 8 * block_bytes / block_weights
    head = Q6_K_BITS if head_bits is None else head_bits
    resident, resident_head = RESIDENT_BITS[name], RESIDENT_BITS["q6_k" if head_bits is None else name]
    return WeightFormat(name, bits, head, f"GGUF {name.upper()}: {block_bytes} bytes / {block_weights} "
                                         f"weights ({resident:g} bits held), head at {head:g} bits",
                        block_weights, resident, resident_head)


def _mix(name: str, bits: float) -> WeightFormat:
    resident = round(bits * RESIDENT_FACTORS[name], 3)
    return WeightFormat(name, bits, Q6_K_BITS, f"GGUF {name.upper()} mix: {bits} bits average "
                                               f"(llama.cpp quantize README; {resident:g} held), head Q6_K", 256,
                        resident, RESIDENT_BITS["q6_k"])


def _dense(name: str, bits: int) -> WeightFormat:
    return WeightFormat(name, bits, bits, f"{bits}-bit dense")

WEIGHT_FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    _dense("f32", 32), _dense("f16", 16), _dense("bf16", 16), _dense("fp8", 8),
    # GGUF block types (ggml block structs: bytes, weights)
    _block("q8_0", 34, 32, head_bits=8.5),
    _block("q6_k", 210, 256),
    _block("q5_0", 22, 32), _block("q5_1", 24, 32),
    _block("q4_0", 18, 32), _block("q4_1", 20, 32), _block("iq4_nl", 18, 32), _block("iq4_xs", 136, 256),
    # GGUF file-type mixes of K-quants
    _mix("q5_k_m", 5.68), _mix("q5_k_s", 5.52), _mix("q4_k_m", 4.84), _mix("q4_k_s", 4.58),
    _mix("q3_k_l", 4.27), _mix("q3_k_m", 3.91), _mix("q3_k_s", 3.50), _mix("q2_k", 3.35),
    # pipeserve's group-wise load-time quantization (weights + float16 scale [+ minimum] per group)
    WeightFormat("int8", 8 + 16 / GROUP_SIZE, 8 + 16 / GROUP_SIZE,
                 f"int8, one float16 scale per {GROUP_SIZE} weights", block=GROUP_SIZE),
    WeightFormat("int4", 4 + 32 / GROUP_SIZE, 4 + 32 / GROUP_SIZE,
                 f"int4, float16 scale and minimum per {GROUP_SIZE} weights", block=GROUP_SIZE),
)}


def weight_format(name: str) -> WeightFormat:
    """``--quantization`` (case-insensitive: Q4_K_M, q4_k_m) -> its format."""
    key = name.strip().lower().replace("-", "_")
    if key not in WEIGHT_FORMATS:
        raise PlanInputError(f"unknown --quantization {name!r}; use one of: {', '.join(WEIGHT_FORMATS)}")
    return WEIGHT_FORMATS[key]
