"""Quantized weights: every kept GGUF type read back from a file the gguf package wrote,
and each kernel path against dequantize-then-matmul.

Documented tolerances (pipeserve/model/quant/cpu_kernels.py): with float32
activations the kernels differ from ``x @ dequantize(w).T`` only by float32
summation order; with bfloat16 activations by the bfloat16 rounding of the
output (and, on the tiled path, of the dequantized weight). The decode
kernel's integer-activation path (AVX512-VNNI builds) writes each activation as
d * (256 * q1 + q2) with two int8 codes (q8 weights) or as d' * q with one int16
code (q4 weights, d' = max|x| / 32767) and moves it by at most
d = max|x| / (127 * 256) over its block of 32; AVX2 builds use the int16 code for
q8 weights and move it by at most d' / 2, and one int8 code for q4/q5/q6/i4/q2/q3 ones
(max|x| / 127, at most half of it), as VNNI builds do for i4/q2/q3 (AVX2's kernels there):
see ``_int8_activation_bound``.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import pipeserve.model.quant.cpu_kernels as quant_cpu
import pipeserve.model.quant.modules as quant_modules
from pipeserve.model.config import ModelConfig
from pipeserve.model.loader.gguf import GGUFWeightReader
from pipeserve.model.quant.cpu_kernels import (GEMM_MIN_ROWS, GEMV_MAX_ROWS, GEMV_ONE_CALL_MAX_ROWS,
                                               GEMV_PASSES_MAX_ROWS, PROMPT_INT8_KINDS, PROMPT_INT8_MAX_ROWS,
                                               QuantKernels, cpu_kernels)
from pipeserve.model.quant.modules import QuantEmbedding, QuantLinear
from pipeserve.model.quant.packed import (IQ4_VALUES, K4_HIGH, K4_SUPER, PackedWeight, can_concat, concat_rows,
                                          dequantize, Q6_HALF, expand_codes, pack_high_codes, pack_nibbles,
                                          quantize_weight, to_q8)
from pipeserve.model.quant.packed import k2_group_scales as packed_k2_scales
from tests.checkpoints import finish_gguf
from tests.kernels import quant_matmul_for, skip_without_kernel

T = gguf.GGMLQuantizationType
LEGACY = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)   # gguf.quants can quantize these
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)                 # it cannot: random valid blocks instead
IQ4 = (T.IQ4_NL, T.IQ4_XS)                          # nor these: random blocks (every byte is valid)
K2 = (T.Q3_K, T.Q2_K)                               # nor these (their float16 d, dmin set)
FLOAT16_OFFSETS = {T.Q6_K: (208,), T.Q3_K: (108,), T.Q2_K: (80, 82)}   # others: (0, 2) (IQ4: d at 0)
COMPACT_KIND = {T.IQ4_NL: "i4", T.IQ4_XS: "i4", T.Q3_K: "q3", T.Q2_K: "q2"}   # kept so on every build
ROWS, COLS = 48, 512                                 # COLS: two K-quant super-blocks
ROW_COUNTS = (1, 3, GEMV_MAX_ROWS, 64)               # decode (gemv) and prefill (tiled) shapes
needs_kernel = skip_without_kernel("quant_matmul")
CFG = ModelConfig("LlamaForCausalLM", 64, COLS, 256, 1, 4, 4, COLS // 4, 128)


def _blocks(ttype: T, rng: np.random.Generator) -> np.ndarray:
    """A [ROWS, row_bytes] uint8 tensor of ``ttype``."""
    if ttype in LEGACY:
        return gguf.quants.quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), ttype)
    block, size = gguf.GGML_QUANT_SIZES[ttype]
    raw = rng.integers(0, 256, (ROWS, COLS // block, size), dtype=np.uint8)
    # The float16 fields (d, and dmin for Q4_K/Q5_K) must be finite and modest.
    offsets = FLOAT16_OFFSETS.get(ttype, (0, 2))
    for off in offsets:
        d = (0.01 * rng.uniform(0.5, 1.5, raw.shape[:2])).astype(np.float16)     # [rows, blocks]
        raw[..., off:off + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(ROWS, -1)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """One file, every kept type as an ffn_up, and a Q4_1 attn_q for the rotary rows."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("q") / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    data = {t: _blocks(t, rng) for t in LEGACY + K_QUANTS + IQ4 + K2}
    for i, (ttype, raw) in enumerate(data.items()):
        writer.add_tensor(f"blk.{i}.ffn_up.weight", raw, raw_dtype=ttype)
    writer.add_tensor("blk.0.attn_q.weight", data[T.Q4_1], raw_dtype=T.Q4_1)
    finish_gguf(writer)
    return path, list(data)


def _read(path, index: int):
    reader = GGUFWeightReader(path, CFG)
    name = f"model.layers.{index}.mlp.up_proj.weight"
    return reader.read_packed(name), reader.read(name)


def test_every_kept_type_reads_back_as_gguf_dequantizes_it(gguf_file):
    path, types = gguf_file
    for i, ttype in enumerate(types):
        packed, reference = _read(path, i)
        assert packed is not None and packed.source == ttype.name
        got = dequantize(packed)
        if ttype in LEGACY or ttype in K2 or ttype in K_QUANTS:   # same float16 scales (q2/q3, Q4_K,
            # Q5_K, Q6_K: and integer sub-scales, multiplied out exactly in float32 as gguf does): exact
            assert torch.equal(got, reference), ttype.name
        else:                 # IQ4_XS: d·sc rounded to float16, at most 2^-11 of a scale per code step
            tol = 2.0 ** -11 * reference.abs().max().item() + 1e-6
            assert (got - reference).abs().max().item() <= tol, ttype.name


# Resident bytes per weight in memory over bytes per weight in the file, per kept type:
# legacy types keep their block's bytes (scales moved to their own array; Q4_0's and
# Q5_0's offsets are the weight's ``zero``, not a minimum array); Q4_K and Q5_K
# their two-level scales with the 6-bit ones a byte each (148 / 144, 180 / 176 bytes per 256),
# Q6_K its file's bytes. IQ4 as i4: IQ4_NL its block's bytes, IQ4_XS a float16
# scale per 32 where the file has 6-bit ones under a float16 per 256 (144 / 136). Q3_K as q3, Q2_K
# as q2: their code bytes (Q3_K: and hmask), integer sub-scales and float16 d (Q2_K: and dmin) per
# 256 as the file has them, Q3_K's 6-bit sub-scales a byte each (114 / 110, 84 / 84). Every build
# keeps them so (AVX-512 ones too: before, they widened IQ4, Q3_K and Q2_K to q8, 1.9-3.8x the file).
RESIDENT_OVER_FILE = {T.Q4_0: 1.0, T.Q4_1: 1.0, T.Q5_0: 1.0, T.Q5_1: 1.0, T.Q8_0: 1.0,
                      T.Q4_K: 148 / 144, T.Q5_K: 180 / 176, T.Q6_K: 1.0, T.IQ4_NL: 1.0, T.IQ4_XS: 144 / 136,
                      T.Q3_K: 114 / 110, T.Q2_K: 1.0}


def test_kept_bytes_stay_close_to_the_file(gguf_file):
    """5/6-bit codes are kept compact (nibbles + high-bit planes), IQ4's as its nibbles, Q3_K's
    and Q2_K's as their bit pairs (+ hmask) and integer sub-scales, not a byte per code: Q2_K at
    its file's bytes, Q3_K within 4% of them, on every build."""
    path, types = gguf_file
    for i, ttype in enumerate(types):
        packed, _ = _read(path, i)
        block, size = gguf.GGML_QUANT_SIZES[ttype]
        file_bytes = ROWS * COLS // block * size
        assert packed.kind == COMPACT_KIND.get(ttype, packed.kind), ttype.name
        assert packed.nbytes == round(RESIDENT_OVER_FILE[ttype] * file_bytes), (ttype.name, packed.nbytes, file_bytes)
        assert packed.nbytes <= 1.17 * file_bytes


def test_compact_codes_pack_and_expand_exactly():
    codes = torch.randint(0, 64, (5, 256), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    for kind, hbits, zero in (("q5", 1, 16), ("q5", 1, 0), ("q6", 2, 32)):
        q = codes & ((1 << (4 + hbits)) - 1)
        qs, qh = pack_high_codes(q, hbits)
        assert qs.shape == (5, 128) and qh.shape == (5, 256 // 32 * 4 * hbits)
        w = PackedWeight(kind, 32, qs, torch.ones(5, 8, dtype=torch.float16), None, "test", qh, zero)
        assert torch.equal(expand_codes(w), (q.to(torch.int16) - zero).to(torch.int8)), kind
        assert torch.equal(dequantize(w), (q.float() - zero)), kind


def test_q6_holds_q6_k_bytes_and_refuses_rows_it_cannot_hold():
    """q6 is Q6_K's own ql / qh: weight 64 + l in the high nibble of byte l of a run of 128, its top
    bits in pair 2 of high-bit byte l % 32; rows must be whole runs of 128."""
    codes = torch.zeros(1, 256, dtype=torch.uint8)
    codes[0, 64 + 5] = 0b101101        # nibble 13, top bits 2
    codes[0, 128 + 32 + 7] = 0b110000  # second run: nibble 0, top bits 3
    qs, qh = pack_high_codes(codes, 2)
    assert qs[0, 5] == 13 << 4 and qh[0, 5] == 2 << 4
    assert qs[0, 64 + 32 + 7] == 0 and qh[0, 32 + 7] == 3 << 2
    assert int(qs.count_nonzero()) == 1 and int(qh.count_nonzero()) == 2
    with pytest.raises(ValueError, match="multiple of 128"):
        pack_high_codes(torch.zeros(2, 736, dtype=torch.uint8), 2)


def test_i4_codes_are_the_codebook_entries_of_the_nibbles():
    nibbles = torch.randint(0, 16, (5, 256), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    w = PackedWeight("i4", 32, pack_nibbles(nibbles), torch.full((5, 8), 0.5, dtype=torch.float16), None, "test")
    values = torch.tensor(IQ4_VALUES, dtype=torch.int8)[nibbles.long()]
    assert w.in_features == 256 and w.nbytes == 5 * (128 + 16)
    assert torch.equal(expand_codes(w), values)
    assert torch.equal(dequantize(w), values.float() / 2)
    assert torch.equal(dequantize(w.rows(torch.tensor([3, 0]))), values[[3, 0]].float() / 2)
    other = _i4(4, 256, 3)
    assert can_concat([w, other]) and not can_concat([w, to_q8(other)])
    assert torch.equal(dequantize(concat_rows([w, other])), torch.cat([dequantize(w), dequantize(other)]))


@pytest.mark.parametrize("kind", ["q2", "q3"])
def test_k2_codes_are_the_bit_pairs_and_hmask_bits_in_gguf_order(kind):
    """Weight 128h + 32j + l of a 256-weight block: bits 2j of byte 32h + l of ``qs``, and (q3)
    bit 4h + j of hmask byte l as 4; ``zero`` subtracted."""
    w = _k2(5, 512, kind, 13, with_min=False)
    qs = w.qs.view(5, 2, 2, 32).long()                      # [rows, block, h, l]
    want = torch.empty(5, 2, 2, 4, 32, dtype=torch.long)   # [rows, block, h, j, l]
    for h in range(2):
        for j in range(4):
            want[:, :, h, j] = (qs[:, :, h] >> (2 * j)) & 3
            if kind == "q3":
                want[:, :, h, j] |= ((w.qh.view(5, 2, 48)[..., :32].long() >> (4 * h + j)) & 1) << 2
    want = (want.reshape(5, 512) - w.zero).to(torch.int8)
    assert w.in_features == 512 and torch.equal(expand_codes(w), want)
    # group g of 16 of super-block b: d_b * sub_g, sub_g the int8 after q3's hmask, or q2's low nibble
    subs = w.qh.view(5, 2, -1)[..., -16:]
    subs = subs.view(torch.int8).float() if kind == "q3" else (subs & 15).float()
    scale = (w.scale.float().unsqueeze(-1) * subs).reshape(5, 32)
    assert torch.equal(dequantize(w), want.float() * scale.repeat_interleave(16, dim=1))
    assert torch.equal(to_q8(w).qs, want) and to_q8(w).in_features == 512
    assert torch.equal(to_q8(w).scale, scale.half())
    other = _k2(3, 512, kind, 14, with_min=False)
    assert torch.equal(dequantize(concat_rows([w, other])), torch.cat([dequantize(w), dequantize(other)]))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_layouts_match_their_byte_per_code_expansion(gguf_file, dtype, monkeypatch):
    """Q5_0/Q5_1/Q5_K/Q6_K in the compact q5/q6 layouts and IQ4_NL/IQ4_XS in i4 give exactly
    what the same codes a byte each (q8, their widened layout) give, on every kernel path: the
    kernels expand a row (or a panel) into those bytes and run the q8 code. Except the integer
    decode path where the compact layout takes int8 activations and q8 finer ones (AVX2: q5/q6/i4
    against int16; VNNI: i4 against two int8 terms, ``act_int8``), or the same two int8 terms in
    its own arithmetic (VNNI's q5/q6: raw codes in q4's order, their offset in the minimums term):
    each within its own bound.
    (q2/q3 keep integer sub-scales that their q8 rounds to float16: test_k2_paths_match_dequantize.)"""
    path, types = gguf_file
    kernels = cpu_kernels()
    # the q8 expansion's bfloat16 rows would take the 8-bit many-row kernel, which the compact
    # layouts do not (tests/test_quant_gemm_i8.py): compare the paths they share
    monkeypatch.setattr(quant_cpu, "GEMM_I8", False)
    weights = []
    for ttype in (T.Q5_0, T.Q5_1):
        w = _read(path, types.index(ttype))[0]
        assert w.kind == "q5", ttype.name
        weights.append(w)
    # the file's Q5_K and Q6_K keep their two-level scales, which q8's float16 ones cannot hold
    # exactly (test_two_level_scales_on_every_path); q5 / q6 with float16 scales here
    assert all(_read(path, types.index(t))[0].two_level for t in (T.Q5_K, T.Q6_K))
    # 23 blocks of 32 (odd last block, short last run of 16 blocks; q6: 24, its rows are whole
    # runs of 128), 9 rows (a partial panel)
    weights += [_compact(9, 768, "q6", 16, 32, False, 1), _compact(9, 736, "q5", 32, 0, True, 2)]
    weights += [_read(path, types.index(t))[0] for t in IQ4] + [_i4(9, 736, 3)]
    for w in weights:
        ttype = w.source
        own_activations = kernels.act_int8(w.kind)   # int8 activations where q8 takes finer ones
        own_arithmetic = own_activations or (kernels.isa == "avx512-vnni" and w.kind in ("q5", "q6"))
        wide = to_q8(w)
        assert torch.equal(dequantize(w), dequantize(wide)), ttype
        for rows in (1, 2, 3, GEMV_MAX_ROWS, 64):
            x = torch.randn(rows, w.in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)
            if own_arithmetic and kernels.int8_activations(w, x):
                ref = x.float() @ dequantize(w).t()
                gots = [kernels.gemv(w, x, int8_act=True)]
                if not own_activations and rows >= GEMM_MIN_ROWS and kernels.gemm_applies(w, x):
                    assert torch.equal(kernels.matmul(w, x), kernels.matmul(wide, x)), (ttype, rows)   # the tiles
                else:
                    gots.append(kernels.matmul(w, x))
                for got in gots:
                    assert ((got.float() - ref).abs() <= _int8_activation_bound(w, x, kernels, dtype)).all(), \
                        (ttype, rows)
            else:
                assert torch.equal(kernels.matmul(w, x), kernels.matmul(wide, x)), (ttype, rows)
            if rows <= GEMV_MAX_ROWS:
                for i8 in (False, True) if not own_arithmetic else (False,):
                    assert torch.equal(kernels.gemv(w, x, int8_act=i8), kernels.gemv(wide, x, int8_act=i8)), \
                        (ttype, rows, i8)
            assert torch.equal(kernels.tiled(w, x), kernels.tiled(wide, x)), (ttype, rows)
            if kernels.gemm_applies(w, x):
                assert torch.equal(kernels.gemm(w, x), kernels.gemm(wide, x)), (ttype, rows)


def _k2_cases(gguf_file) -> list[PackedWeight]:
    """Q3_K and Q2_K read from the file, and random q3 / q2 of 3 and 5 super-blocks (q2 with every
    minimum nibble 0 too)."""
    path, types = gguf_file
    return [_read(path, types.index(t))[0] for t in K2] + [
        _k2(9, 768, "q3", 4), _k2(9, 1280, "q2", 5), _k2(9, 768, "q2", 6, with_min=False)]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k2_paths_match_dequantize(gguf_file, dtype):
    """q2/q3 keep Q2_K's / Q3_K's integer sub-scales; every kernel path reads them: matmul
    (AVX2 and VNNI: int8 activations within their bound up to GEMV_PASSES_MAX_ROWS rows, then
    tiles), the float gemv and the dequantized tiles within float32 summation (bfloat16: the
    output's and the tile's rounding). Their q8 widening (what a build without q2/q3 kernels would
    be given) rounds d * sub and -dmin * min to float16: within 2^-11 of each."""
    kernels = cpu_kernels()
    assert kernels.takes("q2") and kernels.takes("q3"), kernels.isa
    for w in _k2_cases(gguf_file):
        wd = dequantize(w)
        scale, minv = (t.abs().repeat_interleave(16, dim=1) if t is not None else 0
                       for t in packed_k2_scales(w))
        assert ((dequantize(to_q8(w)) - wd).abs() <= 2 ** -11 * (4 * scale + minv)).all(), w.source
        for rows in (1, 2, 3, GEMV_MAX_ROWS, 20, 64):
            x = torch.randn(rows, w.in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)
            _check_matmul(w, x, kernels)
            ref = x.float() @ wd.t()
            mag = (x.float().abs() @ wd.abs().t()).max().item()
            tol = 1e-5 * mag if dtype == torch.float32 else 1e-5 * mag + 2 * ref.abs().max().item() * 2 ** -8
            if rows <= GEMV_MAX_ROWS:
                assert (kernels.gemv(w, x, int8_act=False).float() - ref).abs().max().item() <= tol, (w.source, rows)
            if dtype == torch.bfloat16:   # the tile in bfloat16, as a bfloat16 F.linear on the dequantized weight
                ref = (x @ dequantize(w, dtype).t()).float()
            assert (kernels.tiled(w, x).float() - ref).abs().max().item() <= tol, (w.source, rows, dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_lookup_in_c_matches_dequantize(gguf_file, dtype):
    """QuantEmbedding's C lookup (pipeserve_quant_dequant_at) gives the rows PyTorch's dequantize
    gives, every kept type: exact for Q8_0 (one product), else within float32 rounding of the
    scale-and-offset (an FMA where PyTorch rounds twice), which bfloat16 rounds away but at a tie
    (one bfloat16 step); out-of-range ids raise, as PyTorch's gather does. A list of ids (what a
    runner's step passes) gives the same rows and errors as a tensor of them."""
    path, types = gguf_file
    kernels = cpu_kernels()
    ids = torch.tensor([0, 17, 5, 17, ROWS - 1])
    for i, ttype in enumerate(types):
        w, _ = _read(path, i)
        emb = QuantEmbedding(w, dtype)
        got = emb.forward(ids)
        assert kernels.lookup(w, ids, dtype) is not None, ttype.name
        ref = dequantize(w.rows(ids), dtype)
        assert got.dtype == dtype and got.shape == (len(ids), COLS), ttype.name
        if ttype == T.Q8_0:
            assert torch.equal(got, ref), ttype.name
        else:
            step = 2.0 ** (-20 if dtype == torch.float32 else -7)
            assert ((got.float() - ref.float()).abs() <= step * ref.float().abs() + 1e-30).all(), ttype.name
        assert torch.equal(emb.forward(ids.tolist()), got), ttype.name
        for bad in ([0, ROWS], [-1]):
            with pytest.raises(IndexError, match="out of range"):
                emb.forward(torch.tensor(bad))
            with pytest.raises(IndexError, match=f"got ids {min(bad)}..{max(bad)}"):
                emb.forward(bad)


@needs_kernel
def test_k2_weights_out_of_whole_super_blocks_are_refused():
    kernels = cpu_kernels()
    assert kernels.takes("q2") and kernels.takes("q3"), kernels.isa
    w = _k2(3, 512, "q2", 1)
    bad = PackedWeight("q2", 16, w.qs, w.scale, w.minv, "q2", w.qh)   # a scale per 16, as the old layout
    for call in (lambda: kernels.gemv(bad, torch.randn(1, 512)), lambda: kernels.dequant_rows(bad, 0, 3, torch.float32)):
        with pytest.raises(ValueError, match="whole super-blocks of 256"):
            call()


@needs_kernel
def test_i4_k2_int8_gemv_is_its_int8_emulation(gguf_file):
    """The q2/q3 decode (AVX2 and VNNI builds: quant_k2.h) takes integer dots of the codes with the
    int8 activations times the integer sub-scales, one float multiply per block of 32; i4's
    (quant_gemv_avx2.h) its codebook values against them: each equals x rounded as the kernel
    rounds it (``_int8_rounded``) times the dequantized weight in float64 to float32 summation
    error (1e-6 of sum |x| |w|). 1 to GEMV_ONE_CALL_MAX_ROWS rows where the build takes them in
    one call (the fused decode stage's; VNNI: up to GEMV_MAX_ROWS), 37 weight rows (a last
    partial tile)."""
    kernels = cpu_kernels()
    if not kernels.act_int8("q2"):
        pytest.skip(f"i4/q2/q3 take no int8 activations on this build ({kernels.isa}: float)")
    path, types = gguf_file
    weights = _k2_cases(gguf_file) + [_k2(37, 768, "q3", 7), _k2(37, 1024, "q2", 8), _i4(37, 736, 9)] + [
        _read(path, types.index(t))[0] for t in IQ4]
    for rows in (1, 2, 3, 7, GEMV_MAX_ROWS, 9, 17, GEMV_PASSES_MAX_ROWS, GEMV_ONE_CALL_MAX_ROWS):
        for w in weights:
            x = torch.randn(rows, w.in_features, generator=torch.Generator().manual_seed(rows))
            if not kernels.int8_activations(w, x):   # VNNI: more than GEMV_MAX_ROWS rows in one call
                continue
            x[0, :32] *= 20                                   # blocks of different steps
            x[-1, -32:] *= 0.01
            wd = dequantize(w).double()
            want = _int8_rounded(x) @ wd.t()
            err = (kernels.gemv(w, x, int8_act=True).double() - want).abs()
            assert (err <= 1e-6 * (x.abs().double() @ wd.abs().t())).all(), (w.source, rows, err.max().item())


def _cpu_has(*flags: str) -> bool:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return False
    have = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return all(f in have for f in flags)


_LOADED: dict[str, QuantKernels] = {}   # march -> its build, loaded


def _kernels_for(march: str) -> QuantKernels:
    """quant_matmul.c built for ``-march=march`` (as that CPU would build it), loaded."""
    import ctypes
    if march not in _LOADED:
        lib, code, stderr = quant_matmul_for(march)
        assert code == 0, stderr[-2000:]
        _LOADED[march] = QuantKernels(ctypes.CDLL(str(lib)))
    return _LOADED[march]


@pytest.fixture(scope="module")
def avx2_kernels() -> QuantKernels:
    """The kernels an AVX2 + FMA + F16C CPU runs: this build's where it is one, else quant_matmul.c
    built for -march=haswell, where this CPU can run it (an AVX-512 one), so the AVX2-only paths
    are tested here too."""
    kernels = cpu_kernels()
    if kernels is not None and kernels.isa == "avx2":
        return kernels
    if not _cpu_has("avx2", "fma", "f16c"):
        pytest.skip("this CPU cannot run an AVX2 + FMA + F16C build")
    kernels = _kernels_for("haswell")
    assert kernels.isa == "avx2"
    return kernels


@needs_kernel
@pytest.mark.parametrize("march,isa", [("x86-64", "portable"), ("haswell", "avx2")])
def test_narrower_builds_match_dequantize_then_matmul(gguf_file, march, isa):
    """quant_matmul.c built without AVX-512, as CPUs without it run it: the portable path
    and the AVX2 + FMA + F16C one (-march=haswell), against dequantize-then-matmul, every
    kept type, decode (float and integer activations) and tiled shapes, 1 and 2 threads."""
    if isa == "avx2" and not _cpu_has("avx2", "fma", "f16c"):
        pytest.skip("this CPU cannot run an AVX2 + FMA + F16C build")
    kernels = _kernels_for(march)
    assert kernels.isa == isa
    assert kernels.has_integer_activations == (isa == "avx2")
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for w in _int8_cases(gguf_file, kernels):
                for rows in (1, 3, 20):
                    x = torch.randn(rows, w.in_features, generator=torch.Generator().manual_seed(rows))
                    ref = x @ dequantize(w).t()
                    tol = 1e-5 * (x.abs() @ dequantize(w).abs().t()).max().item()
                    if rows > GEMV_MAX_ROWS:
                        assert (kernels.tiled(w, x) - ref).abs().max().item() <= tol, (w.source, rows)
                        continue
                    got = kernels.gemv(w, x, int8_act=False)
                    assert (got - ref).abs().max().item() <= tol, (w.source, rows)
                    err = (kernels.gemv(w, x, int8_act=True) - ref).abs()
                    assert (err <= _int8_activation_bound(w, x, kernels)).all(), (w.source, rows, n_threads)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_a_vnni_build_without_bitalg_computes_the_same_bits(gguf_file):
    """VNNI CPUs without AVX512_BITALG (Cascade Lake) build chunk_codes_hb's q5/q6 expansion
    from masks joined in general registers instead of vpshufbitqmb: the same codes in the same
    order, so -march=cascadelake gives this machine's native build's bits on the integer path,
    every kept type, 1 to GEMV_MAX_ROWS rows (float activations: within float rounding)."""
    kernels = cpu_kernels()
    if kernels.isa != "avx512-vnni" or not _cpu_has("avx512_bitalg"):
        pytest.skip(f"needs a VNNI CPU with AVX512_BITALG to compare against (this build: {kernels.isa})")
    other = _kernels_for("cascadelake")
    assert other.isa == "avx512-vnni"
    cases = _int8_cases(gguf_file, kernels)
    assert {w.kind for w in cases} >= {"q5", "q6"}
    for w in cases:
        for rows in (1, 3, GEMV_MAX_ROWS):
            x = torch.randn(rows, w.in_features, generator=torch.Generator().manual_seed(rows))
            assert torch.equal(other.gemv(w, x, int8_act=True), kernels.gemv(w, x, int8_act=True)), (w.source, rows)
            # float paths: the compiler vectorizes their reductions to each -march's width
            torch.testing.assert_close(other.gemv(w, x, int8_act=False), kernels.gemv(w, x, int8_act=False),
                                       rtol=1e-5, atol=1e-5)


def test_rotary_rows_are_unpermuted_on_the_codes(gguf_file):
    path, _ = gguf_file
    reader = GGUFWeightReader(path, CFG)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(dequantize(reader.read_packed(name)), reader.read(name))


def _check_matmul(w, x: torch.Tensor, kernels) -> None:
    ref = x.float() @ dequantize(w).t()                               # [M, N] float32
    got = kernels.matmul(w, x).float()
    int8 = kernels.int8_activations(w, x[:GEMV_MAX_ROWS]) and (x.shape[0] <= GEMV_PASSES_MAX_ROWS   # as matmul
                                                              or kernels.prompt_takes_int8(w, x))
    if kernels.act_int8(w.kind) and int8:   # int8 activations
        assert ((got - ref).abs() <= _int8_activation_bound(w, x, kernels, x.dtype)).all(), (w.source, x.shape)
        return
    scale = (x.float().abs() @ dequantize(w).abs().t()).max().item()  # magnitude of the sums
    tol = 1e-5 * scale if x.dtype == torch.float32 else 1e-2 * scale
    assert (got - ref).abs().max().item() <= tol, (w.source, x.shape, x.dtype)


@needs_kernel
@pytest.mark.parametrize("kind", ["q4", "q5", "q6"])
@pytest.mark.parametrize("cols", [256, 768, 1536])
def test_two_level_scales_on_every_path(kind, cols):
    """Q4_K's, Q5_K's and Q6_K's two-level scales (packed.py) on this build's decode, pass, many-row and tile
    paths, float32 and bfloat16: each within its bound of dequantize-then-matmul, the dequantized
    rows bit for bit ``dequantize`` (d * sub exact in float32 on every path). Rows of 1, 3 and 6
    super-blocks: at 768 the VNNI decode's last 16 blocks hold one super-block alone."""
    kernels = cpu_kernels()
    w = next(v for v in _q4_variants(cols) if v.two_level) if kind == "q4" else \
        _q5_two_level(37, cols, cols) if kind == "q5" else _q6_two_level(37, cols, cols)
    assert w.two_level
    assert torch.equal(kernels.dequant_rows(w, 0, w.out_features, torch.float32), dequantize(w))
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 3, GEMV_MAX_ROWS, GEMV_PASSES_MAX_ROWS, 70):
            x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).to(dtype)
            _check_matmul(w, x, kernels)
            if rows <= GEMV_MAX_ROWS:   # the float decode too
                ref = x.float() @ dequantize(w).t()
                err = (kernels.gemv(w, x, int8_act=False).float() - ref).abs().max().item()
                scale = (x.float().abs() @ dequantize(w).abs().t()).max().item()
                assert err <= (1e-5 if dtype == torch.float32 else 1e-2) * scale, (cols, rows, dtype)


@needs_kernel
@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_dequantize_then_matmul(gguf_file, rows, dtype):
    path, types = gguf_file
    kernels = cpu_kernels()
    x = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(rows)).to(dtype)
    for i in range(len(types)):
        _check_matmul(_read(path, i)[0], x, kernels)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_tiles_equal_one(dtype, monkeypatch):
    """The prefill path over a weight cut into tiles (a 70B layer's case; a SmolLM2 matrix
    is one tile), an uneven last tile included, equals the weight in one tile, up to the
    summation order PyTorch's matmul picks for each width (float32 rounding). So do float32
    tiles multiplied the other way round (W_tile @ x^T, few rows on several threads)."""
    import pipeserve.model.quant.cpu_kernels as quant_cpu
    w = quantize_weight(torch.randn(100, 64, generator=torch.Generator().manual_seed(5)), 4, 32)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    kernels = cpu_kernels()
    monkeypatch.setattr(quant_cpu, "TRANSPOSED_MAX_ROWS", 0)   # x @ W_tile^T at any thread count
    monkeypatch.setattr(quant_cpu, "TILES_IN_FLOAT32", False)  # bfloat16 tiles (native bfloat16's way)
    whole = kernels.tiled(w, x)
    monkeypatch.setattr(quant_cpu, "TILE_BYTES", 24 * 64 * x.element_size())
    monkeypatch.setattr(quant_cpu, "TILE_MIN_ROWS", 16)      # tiles of 24 rows: 24, 24, 24, 24, 4
    tol = 1e-5 * (x.float().abs() @ dequantize(w).abs().t()).max().item()
    if dtype == torch.bfloat16:
        tol = 2 * whole.float().abs().max().item() * 2 ** -8       # an output's bfloat16 rounding
    assert (kernels.tiled(w, x).float() - whole.float()).abs().max().item() <= tol
    assert torch.equal(whole, x @ dequantize(w, dtype).t())
    if dtype == torch.float32:
        monkeypatch.setattr(quant_cpu, "TRANSPOSED_TILE_ROWS", 24)
        turned = kernels._tiled_transposed(w, x)
        assert turned.is_contiguous() and (turned - whole).abs().max().item() <= tol


@needs_kernel
@pytest.mark.parametrize("native", [False, True])
def test_bfloat16_tiles_multiply_in_float32_where_the_cpu_has_no_bfloat16(native, monkeypatch):
    """Without native bfloat16 (AVX2; PyTorch's bfloat16 matmul converts in software, 6-9x
    slower there) bfloat16 rows take the tiles in float32: the weight dequantized to float32,
    the product rounded to bfloat16 once; with it, bfloat16 tiles as before. Decided from the
    CPU's flags (config.cpu_has_native_bf16) at the first call."""
    import pipeserve.config as config
    import pipeserve.model.quant.cpu_kernels as quant_cpu
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(quant_cpu, "TILES_IN_FLOAT32", None)
    monkeypatch.setattr(quant_cpu, "TRANSPOSED_MAX_ROWS", 0)
    w = quantize_weight(torch.randn(300, 64, generator=torch.Generator().manual_seed(9)), 4, 32)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(10)).bfloat16()
    out = cpu_kernels().tiled(w, x)
    assert quant_cpu.TILES_IN_FLOAT32 is (not native) and out.dtype == torch.bfloat16
    if native:
        assert torch.equal(out, x @ dequantize(w, torch.bfloat16).t())
    else:
        assert torch.equal(out, (x.float() @ dequantize(w).t()).bfloat16())


@needs_kernel
def test_tiles_turn_round_for_few_float32_rows_of_a_wide_weight_on_threads(monkeypatch):
    import pipeserve.model.quant.cpu_kernels as quant_cpu
    kernels = cpu_kernels()
    monkeypatch.setattr(kernels, "_tiled_transposed", lambda w, x: "turned")
    monkeypatch.setattr(quant_cpu.torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(quant_cpu, "TRANSPOSED_MIN_IN", 64)
    monkeypatch.setattr(quant_cpu, "TILES_IN_FLOAT32", False)
    w = quantize_weight(torch.randn(40, 64, generator=torch.Generator().manual_seed(7)), 4, 32)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(8))
    assert kernels.tiled(w, x) == "turned"
    assert isinstance(kernels.tiled(w, x.bfloat16()), torch.Tensor)          # bfloat16: as before
    for name, value in (("TRANSPOSED_MAX_ROWS", 19), ("TRANSPOSED_MIN_IN", 96)):
        with monkeypatch.context() as m:
            m.setattr(quant_cpu, name, value)                                 # more rows; a narrower weight
            assert isinstance(kernels.tiled(w, x), torch.Tensor)
    monkeypatch.setattr(quant_cpu.torch, "get_num_threads", lambda: 1)
    assert isinstance(kernels.tiled(w, x), torch.Tensor)                      # one thread


@needs_kernel
@pytest.mark.parametrize("bits,group", [(8, 32), (8, 128), (4, 32), (4, 64)])
def test_int8_int4_quantize_within_half_a_step_and_kernel_matches(bits, group):
    # 41 rows, an odd count: the two-row decode loop has a tail.
    w = torch.randn(41, 256, generator=torch.Generator().manual_seed(bits + group))
    packed = quantize_weight(w, bits, group)
    step = packed.scale.float().repeat_interleave(group, dim=1)
    assert ((dequantize(packed) - w).abs() <= 0.5 * step + 1e-3 * w.abs()).all()
    for rows in ROW_COUNTS:
        for dtype in (torch.float32, torch.bfloat16):
            _check_matmul(packed, torch.randn(rows, 256).to(dtype), cpu_kernels())


def test_mixed_parts_concatenate_outputs_and_torch_path_matches(gguf_file, monkeypatch):
    """A fused projection whose parts differ in layout (Q4_K beside Q6_K) keeps
    them apart; with no C kernel (or on CUDA) the layers dequantize with torch."""
    path, types = gguf_file
    parts = [_read(path, types.index(t))[0] for t in (T.Q4_K, T.Q6_K, T.Q4_1)]
    bias = torch.nn.Parameter(torch.randn(3 * ROWS), requires_grad=False)
    layer = QuantLinear(parts, bias)
    assert len(layer.parts) == 3
    x = torch.randn(5, COLS)
    w = torch.cat([dequantize(p) for p in parts])
    ref = x @ w.t() + bias
    tol = 1e-5 * (x.abs() @ w.abs().t()).max().item()
    monkeypatch.setattr(quant_modules, "cpu_kernels", lambda: None)
    assert (layer(x) - ref).abs().max().item() < tol
    monkeypatch.undo()
    kernels = cpu_kernels()
    if kernels is not None:   # each part within its activations' bound (AVX2's Q6_K: int8)
        bound = torch.cat([_int8_activation_bound(p, x, kernels) if kernels.int8_activations(p, x)
                           else torch.zeros(5, p.out_features) for p in parts], dim=1)
        assert ((layer(x) - ref).abs() < bound.clamp_min(tol)).all()
        layer._decode = None          # bound again, now to each part's decode gemv
        assert ((layer(x) - ref).abs() < bound.clamp_min(tol)).all()
        assert layer._decode, "a decode of mixed parts should take the parts' bound gemvs"


def test_same_layout_parts_concatenate_rows_and_embedding_reads_rows(gguf_file):
    path, types = gguf_file
    a, b = _read(path, types.index(T.Q4_K))[0], _read(path, types.index(T.Q4_1))[0]
    with pytest.raises(ValueError, match="different layouts"):   # Q4_0 has a code offset, Q4_1 minimums
        concat_rows([_read(path, types.index(T.Q4_0))[0], b])
    with pytest.raises(ValueError, match="different layouts"):   # Q4_K's scales are two-level, Q4_1's not
        concat_rows([a, b])
    for a, b in ((a, a.rows(torch.arange(ROWS - 1, -1, -1))), (b, _read(path, types.index(T.Q4_1))[0])):
        fused = concat_rows([a, b])
        assert torch.equal(dequantize(fused), torch.cat([dequantize(a), dequantize(b)]))
    fused = concat_rows([a, b])
    assert torch.equal(dequantize(fused), torch.cat([dequantize(a), dequantize(b)]))
    emb = QuantEmbedding(fused, torch.bfloat16)
    ids = torch.tensor([0, 5, ROWS + 3, 2 * ROWS - 1])
    assert torch.equal(emb(ids), dequantize(fused, torch.bfloat16)[ids])


def _int8_activation_bound(w, x: torch.Tensor, kernels: QuantKernels,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[M, N]: sum over blocks of 32 of d * sum |w| in the block, plus float32 slack (and an
    output's bfloat16 rounding). One int8 per activation (``kernels.act_int8``: AVX2's
    q4/q5/q6/i4/q2/q3, VNNI's i4/q2/q3): d = max|x| / 254 (half a step of the int8 code); else
    VNNI: d = max|x| / (127 * 256) (half a step of q2, or a whole one where q2 saturates at 127);
    AVX2's q8: d = max|x| / 65534 (half a step of the int16 code)."""
    wd = dequantize(w).abs()                                                   # [N, K]
    blocks = x.float().abs().reshape(x.shape[0], -1, 32)                       # [M, K / 32, 32]
    per_max = 1 / 65534 if kernels.isa == "avx2" else 1 / (127 * 256)
    if kernels.act_int8(w.kind):
        per_max = 1 / 254
    step = (blocks.amax(-1) * per_max).repeat_interleave(32, dim=1)            # [M, K]
    bound = step @ wd.t() + 1e-5 * (x.float().abs() @ wd.t())
    if dtype == torch.bfloat16:
        bound = bound + 2 * (x.float() @ dequantize(w).t()).abs() * 2 ** -8
    return bound


def _compact(rows: int, cols: int, kind: str, group: int, zero: int, with_min: bool, seed: int) -> PackedWeight:
    """A random q5/q6 weight (codes, float16 scales and minimums) of any shape."""
    gen = torch.Generator().manual_seed(seed)
    hbits = 1 if kind == "q5" else 2
    codes = torch.randint(0, 1 << (4 + hbits), (rows, cols), generator=gen).to(torch.uint8)
    qs, qh = pack_high_codes(codes, hbits)
    scale = (0.01 * torch.rand(rows, cols // group, generator=gen) + 0.005).half()
    minv = (0.1 * torch.randn(rows, cols // group, generator=gen)).half() if with_min else None
    return PackedWeight(kind, group, qs, scale, minv, f"{kind}/{group}", qh, zero)


def _q6_two_level(rows: int, cols: int, seed: int) -> PackedWeight:
    """A random q6 weight with Q6_K's two-level scales (d per 256, int8 sub-scales per 16 of either
    sign before each row's high bits), ``zero`` 32."""
    gen = torch.Generator().manual_seed(seed)
    flat = _compact(rows, cols, "q6", 16, 32, False, seed)
    d = (0.002 * torch.rand(rows, cols // K4_SUPER, generator=gen) + 1e-4).half()
    sub = torch.randint(-128, 128, (rows, cols // 16), generator=gen).to(torch.int8).view(torch.uint8)
    return PackedWeight("q6", 16, flat.qs, d, None, "q6 two-level", torch.cat([sub, flat.qh], dim=1), 32)


def _q5_two_level(rows: int, cols: int, seed: int) -> PackedWeight:
    """A random q5 weight with Q5_K's two-level scales (d and -dmin per 256, 6-bit sub-scales and
    sub-minimums before each row's high-bit planes), ``zero`` 0."""
    gen = torch.Generator().manual_seed(seed)
    flat = _compact(rows, cols, "q5", 32, 0, True, seed)
    d = (0.002 * torch.rand(rows, cols // K4_SUPER, generator=gen) + 1e-4).half()
    dmin = -(0.002 * torch.rand(rows, cols // K4_SUPER, generator=gen)).half()
    sub = torch.randint(0, 64, (rows, cols // 16), generator=gen, dtype=torch.uint8)
    return PackedWeight("q5", 32, flat.qs, d, dmin, "q5 two-level", torch.cat([sub, flat.qh], dim=1))


def _i4(rows: int, cols: int, seed: int) -> PackedWeight:
    """A random i4 weight (nibbles, float16 scales of either sign, as IQ4_XS's sub-scales) of any shape."""
    gen = torch.Generator().manual_seed(seed)
    nibbles = torch.randint(0, 16, (rows, cols), generator=gen).to(torch.uint8)
    scale = (0.01 * torch.randn(rows, cols // 32, generator=gen)).half()
    return PackedWeight("i4", 32, pack_nibbles(nibbles), scale, None, "i4/32")


def _k2(rows: int, cols: int, kind: str, seed: int, with_min: bool = True) -> PackedWeight:
    """A random q2 (as Q2_K: sub-scale bytes of any scale and minimum nibbles, minimums -dmin of
    either sign; ``with_min`` False: every minimum nibble 0) or q3 (zero 4, as Q3_K: any hmask,
    sub-scales -32..31) weight, random codes and float16 d; cols a multiple of 256."""
    gen = torch.Generator().manual_seed(seed)
    supers = cols // 256
    rand = (lambda n, hi=256: torch.randint(0, hi, (rows, supers, n), generator=gen).to(torch.uint8))
    qs = torch.randint(0, 256, (rows, cols // 4), generator=gen).to(torch.uint8)
    scale = (0.01 * torch.rand(rows, supers, generator=gen) + 0.002).half()
    if kind == "q3":
        qh = torch.cat([rand(32), (rand(16, 64).to(torch.int16) - 32).to(torch.int8).view(torch.uint8)], dim=-1)
        return PackedWeight("q3", 256, qs, scale, None, "q3", qh.reshape(rows, -1), 4)
    subs = rand(16) if with_min else rand(16, 16)
    minv = (0.01 * torch.randn(rows, supers, generator=gen)).half()
    return PackedWeight("q2", 256, qs, scale, minv, "q2", subs.reshape(rows, -1))


def _int8_cases(gguf_file, kernels: QuantKernels):
    """Every kept GGUF type and awkward shapes of each layout the build ``kernels`` takes."""
    path, types = gguf_file
    cases = [_read(path, i)[0] for i in range(len(types))]                     # every kept GGUF type
    w = torch.randn(41, 256, generator=torch.Generator().manual_seed(7))
    # 23 blocks of 32: the VNNI kernel's odd last block and its short last group of 16 blocks
    odd = torch.randn(9, 736, generator=torch.Generator().manual_seed(8))
    q4 = quantize_weight(odd, 4, 32)
    q4_0 = PackedWeight("q4", 32, q4.qs, q4.scale, None, "q4/32 zero 8", None, 8)   # as Q4_0: offset, no minimums
    return cases + [q4, q4_0, quantize_weight(odd, 8, 32),
                    _compact(9, 768, "q6", 16, 32, False, 9), _compact(9, 736, "q5", 32, 16, True, 10),
                    _compact(9, 768, "q6", 16, 0, True, 11),                   # groups of 16 with minimums
                    *([_i4(9, 736, 12)] if kernels.takes("i4") else []),
                    *([_k2(9, 768, "q3", 15), _k2(9, 1280, "q2", 16)] if kernels.takes("q3") else []),
                    quantize_weight(w, 8, 32), quantize_weight(w, 4, 64)]     # odd row count


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", range(1, GEMV_MAX_ROWS + 1))
def test_int8_activation_gemv_within_the_activation_step(gguf_file, rows, threads, monkeypatch):
    kernels = cpu_kernels()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)   # what the kernels pass to OpenMP
    for w in _int8_cases(gguf_file, kernels):
        x = torch.randn(rows, w.in_features, generator=torch.Generator().manual_seed(rows))
        x[0, :32] *= 20                                   # one loud block: its step is 20x coarser
        ref = x @ dequantize(w).t()
        got = kernels.gemv(w, x, int8_act=True)           # float32 in and out: no bfloat16 rounding
        err = (got - ref).abs()
        assert (err <= _int8_activation_bound(w, x, kernels)).all(), (w.source, rows, err.max().item())
        uses_int8 = kernels.int8_activations(w, x)
        if not uses_int8:                                 # neither VNNI nor AVX2: float path
            assert torch.equal(got, kernels.gemv(w, x, int8_act=False)), w.source
        # every kept type, Q6_K's groups of 16 too
        assert uses_int8 == (kernels.isa in ("avx512-vnni", "avx2")) == kernels.has_integer_activations, w.source


def _int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as AVX2's int8 activations hold it, in float64: per block of 32,
    d * round(x * (127 / max|x|)) with d = max|x| / 127 (the reciprocal in float32, ties to even)."""
    blocks = x.reshape(x.shape[0], -1, 32)                                     # [M, K / 32, 32]
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv).double() * (amax / 127.0).double()).reshape(x.shape)


def _q4_variants(cols: int) -> list[PackedWeight]:
    """37 random weight rows of ``cols`` as Q4_1-like q4 (minimums), with Q4_0's code offset
    instead, in groups of 64 where the width allows, and with Q4_K's two-level scales (random d,
    dmin and 6-bit sub-scales) where it is whole super-blocks."""
    gen = torch.Generator().manual_seed(cols)
    w = torch.randn(37, cols, generator=gen) * 0.05
    q4 = quantize_weight(w, 4, 32)
    weights = [q4, PackedWeight("q4", 32, q4.qs, q4.scale, None, "q4/32 zero 8", None, 8)]
    if cols % K4_SUPER == 0:
        supers = (37, cols // K4_SUPER)
        d = (torch.rand(supers, generator=gen) * 2e-3 + 1e-4).half()
        dmin = -(torch.rand(supers, generator=gen) * 2e-3).half()
        sub = torch.randint(0, 64, (37, cols // K4_SUPER * K4_HIGH), generator=gen, dtype=torch.uint8)
        weights.append(PackedWeight("q4", 32, q4.qs, d, dmin, "q4 two-level", sub))
    return weights + ([quantize_weight(w, 4, 64)] if cols % 64 == 0 else [])


@needs_kernel
@pytest.mark.parametrize("cols", [192, 384, 672, 864, 1536])
def test_avx2_q4_gemv_is_its_int8_emulation(cols, avx2_kernels):
    """AVX2's q4 decode is the integer dot of its int8 activations with the codes, scaled: it
    equals x rounded as the kernel rounds it (``_int8_rounded``) times the dequantized weight
    in float64 to float32 summation error (1e-6 of sum |x| |w|), far inside the activation
    step's bound. The widths are SmolLM2's TP = 2 cuts (o_proj's 6 and 12 blocks, down_proj's
    21 and 27: an odd count has a lone last block, outside the pairs) and whole rows; 1 to
    GEMV_ONE_CALL_MAX_ROWS rows of x (the fused decode stage's one call), 37 weight rows (the
    last rows' short runs), Q4_1's minimums, Q4_0's offset, groups of 64."""
    kernels = avx2_kernels
    weights = _q4_variants(cols)
    for rows in (1, 2, 3, 7, GEMV_MAX_ROWS, 9, 17, GEMV_PASSES_MAX_ROWS, GEMV_ONE_CALL_MAX_ROWS):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        x[0, :32] *= 20                                   # blocks of different steps
        x[-1, -32:] *= 0.01
        for q in weights:
            wd = dequantize(q).double()
            want = _int8_rounded(x) @ wd.t()
            err = (kernels.gemv(q, x, int8_act=True).double() - want).abs()
            assert (err <= 1e-6 * (x.abs().double() @ wd.abs().t())).all(), (q.source, rows, err.max().item())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_takes_integer_activations_where_the_kernel_has_them(gguf_file, dtype):
    """Both activation dtypes (float32 is what CPUs without native bfloat16 compute in);
    ``int8_act=False`` keeps float dot products."""
    kernels = cpu_kernels()
    w = _int8_cases(gguf_file, kernels)[-1]
    x = torch.randn(1, w.in_features).to(dtype)
    assert kernels.int8_activations(w, x) == kernels.has_integer_activations
    assert torch.equal(kernels.matmul(w, x), kernels.gemv(w, x, int8_act=kernels.has_integer_activations))
    assert torch.equal(kernels.decode_fn(w)(x), kernels.matmul(w, x))
    if kernels.has_integer_activations:   # float32 out: bfloat16 rounding would hide the difference
        xf = x.float()
        assert not torch.equal(kernels.gemv(w, xf, int8_act=False), kernels.gemv(w, xf, int8_act=True))


@needs_kernel
def test_a_few_more_rows_than_the_gemv_take_it_in_passes(gguf_file):
    """9 to GEMV_PASSES_MAX_ROWS rows: the integer-activation gemv, 8 rows a pass (where the
    kernel has integer activations; AVX2 runs the passes in one call, over tiles of weight
    rows, to the same result, and takes up to GEMV_ONE_CALL_MAX_ROWS so), then the tiles (but
    AVX2's q4, which takes the gemv at any row count: ``prompt_takes_int8``);
    within the kernels' bound of dequantize-then-matmul either way."""
    kernels = cpu_kernels()
    w = _int8_cases(gguf_file, kernels)[-1]
    assert kernels.fused_max_rows == (GEMV_ONE_CALL_MAX_ROWS if kernels.isa == "avx2" else GEMV_PASSES_MAX_ROWS)
    for rows in (GEMV_MAX_ROWS + 1, GEMV_PASSES_MAX_ROWS, GEMV_PASSES_MAX_ROWS + 1, GEMV_ONE_CALL_MAX_ROWS):
        x = torch.randn(rows, w.in_features, generator=torch.Generator().manual_seed(rows))
        passes = torch.cat([kernels.gemv(w, x[r:r + GEMV_MAX_ROWS]) for r in range(0, rows, GEMV_MAX_ROWS)])
        in_passes = kernels.has_integer_activations and (rows <= GEMV_PASSES_MAX_ROWS
                                                         or kernels.prompt_takes_int8(w, x))
        assert torch.equal(kernels.matmul(w, x), passes if in_passes else kernels.tiled(w, x)), rows
        _check_matmul(w, x, kernels)
        if kernels.has_integer_activations and kernels.isa == "avx2":   # one call: the passes' result
            assert torch.equal(kernels.gemv(w, x), passes), rows


@needs_kernel
@pytest.mark.parametrize("cols", [256, 576, 608, 736, 1536])
def test_avx2_q4_prompt_rows_are_their_decode_bit_for_bit(cols, monkeypatch, avx2_kernels):
    """AVX2's q4 takes the integer gemv at every row count (``prompt_takes_int8``); from
    Q4T_MIN_ROWS (16) rows its many-row kernel (quant_gemv_avx2.h, q4_rows_many: 4 rows of x
    per weight row, then the last rows as before) gives each row the same bits as that row
    alone, whatever the row count, thread count (a split of the output rows) or weight row
    count (37: short last tiles and runs): a matmul row does not depend on the rows batched
    with it (attention's float order still depends on a prompt's chunking). Widths: 8, 18, 19 (odd: a lone last
    block), 23 and 48 blocks; Q4_1's minimums, Q4_0's offset, groups of 64 (the old passes)."""
    kernels = avx2_kernels
    weights = _q4_variants(cols)
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(1))
    x[3, :32] *= 20
    for q in weights:
        assert kernels.prompt_takes_int8(q, x)
        alone = torch.cat([kernels.gemv(q, x[m:m + 1]) for m in range(x.shape[0])])   # [70, 37]
        for threads in (1, 2, 3):
            monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
            for rows in (1, 2, 5, 8, 15, 16, 17, 25, 31, 40, 64, 70):
                assert torch.equal(kernels.matmul(q, x[:rows]), alone[:rows]), (q.source, cols, threads, rows)
        assert ((alone - x @ dequantize(q).t()).abs() <= _int8_activation_bound(q, x, kernels)).all(), q.source


def _q56_variants(cols: int) -> list[PackedWeight]:
    """37 random weight rows of ``cols`` in the q5/q6 layouts of each GGUF type that maps to them:
    Q5_0 (q5, groups of 32, ``zero`` 16), Q5_1 (q5, groups of 32, minimums), Q6_K (q6, groups of
    16, ``zero`` 32), and Q5_K and Q6_K with their two-level scales where the width is whole super-blocks;
    and q6 in groups of 16 with minimums, which no GGUF type has."""
    q5 = [_compact(37, cols, "q5", 32, 16, False, cols), _compact(37, cols, "q5", 32, 0, True, cols + 1)]
    if cols % Q6_HALF:   # q6 keeps Q6_K's runs of 128
        return q5
    q6 = [_compact(37, cols, "q6", 16, 32, False, cols + 2), _compact(37, cols, "q6", 16, 0, True, cols + 3)]
    two = [_q5_two_level(37, cols, cols + 5), _q6_two_level(37, cols, cols + 4)] if cols % K4_SUPER == 0 else []
    return q5 + q6 + two


@needs_kernel
@pytest.mark.parametrize("cols", [256, COLS, 576, 608, 736, 1536])
def test_avx2_q5_q6_i4_rows_are_their_decode_bit_for_bit(gguf_file, cols, monkeypatch, avx2_kernels):
    """AVX2's q5/q6/i4 gemv gives each row of x the bits of that row alone at any row count: from
    U8T_MIN_ROWS (16) rows its many-row kernel (quant_gemv_avx2.h, u8_rows_many: 4 rows of x per
    weight row), below it the passes, whose scalar minimum terms are spelt out so that no row of a
    pass is fused otherwise than a row alone; at any thread count (a split of the output rows) and
    weight row count (37: short last tiles). Where q5/q6 take it for prompts (``prompt_takes_int8``:
    up to PROMPT_INT8_MAX_ROWS rows, the tiles beyond), so does ``matmul``. Widths: 8, 16, 18, 19,
    23 and 48 blocks (not a multiple of 8: the blocks after the runs of 8); random i4 (signed
    codebook values against x with their signs); the file's Q5_0, Q5_1, Q5_K, Q6_K, IQ4_NL and
    IQ4_XS (COLS)."""
    kernels = avx2_kernels
    weights = _q56_variants(cols) + [_i4(37, cols, cols + 6)]
    if cols == COLS:
        path, types = gguf_file
        weights += [_read(path, types.index(t))[0] for t in (T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, *IQ4)]
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(2))
    x[3, :32] *= 20
    for q in weights:
        alone = torch.cat([kernels.gemv(q, x[m:m + 1]) for m in range(x.shape[0])])   # [70, 37 or 48]
        prompts = q.kind in PROMPT_INT8_KINDS
        if q.kind in PROMPT_INT8_MAX_ROWS:   # more rows: the tiles
            assert not kernels.prompt_takes_int8(q, torch.zeros(PROMPT_INT8_MAX_ROWS[q.kind] + 1, cols)), q.source
        for threads in (1, 2, 3):
            monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
            for rows in (2, 5, 8, 9, 15, 16, 17, 25, 31, 40, 64, 70):
                assert torch.equal(kernels.gemv(q, x[:rows]), alone[:rows]), (q.source, cols, threads, rows)
                takes = prompts and rows <= PROMPT_INT8_MAX_ROWS.get(q.kind, rows)   # i4: 48
                assert kernels.prompt_takes_int8(q, x[:rows]) == takes, q.source
                if takes:
                    assert torch.equal(kernels.matmul(q, x[:rows]), alone[:rows]), (q.source, cols, threads, rows)
        assert ((alone - x @ dequantize(q).t()).abs() <= _int8_activation_bound(q, x, kernels)).all(), q.source


@needs_kernel
@pytest.mark.parametrize("cols", [COLS, 576, 608, 1536])
def test_avx2_q8_rows_are_their_decode_bit_for_bit(gguf_file, cols, monkeypatch, avx2_kernels):
    """AVX2's q8 gemv (int16 activations; 9-15 rows in passes of 8 over tiles of weight rows, from
    16 q8_rows_many's 4 rows of x per weight row, one call) gives each row of x the bits of that
    row alone at any row count and thread count, so a prompt or an LM head of up to
    PROMPT_INT8_MAX_ROWS["q8"] rows, which ``matmul`` sends there
    (``prompt_takes_int8``; the tiles beyond), is its rows' decodes. Widths of 16 (COLS), 18, 19
    and 48 blocks (runs of 8 and the blocks after them); groups of 32 (int8 at load, and the file's
    Q8_0 at COLS) and of 64."""
    kernels = avx2_kernels
    limit = PROMPT_INT8_MAX_ROWS["q8"]
    gen = torch.Generator().manual_seed(cols)
    w = torch.randn(37, cols, generator=gen)
    weights = [quantize_weight(w, 8, group) for group in (32, 64) if cols % group == 0]
    if cols == COLS:
        path, types = gguf_file
        weights.append(_read(path, types.index(T.Q8_0))[0])
    x = torch.randn(limit + 1, cols, generator=gen)
    x[3, :32] *= 20
    for q in weights:
        assert q.kind == "q8", q.source
        alone = torch.cat([kernels.gemv(q, x[m:m + 1]) for m in range(x.shape[0])])
        assert not kernels.prompt_takes_int8(q, x), q.source   # more rows: the tiles
        for threads in (1, 2, 3):
            monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
            for rows in (9, 16, 17, 25, 40, limit):
                assert torch.equal(kernels.gemv(q, x[:rows]), alone[:rows]), (q.source, cols, threads, rows)
                assert kernels.prompt_takes_int8(q, x[:rows]), q.source
                assert torch.equal(kernels.matmul(q, x[:rows]), alone[:rows]), (q.source, cols, threads, rows)
        assert ((alone - x @ dequantize(q).t()).abs() <= _int8_activation_bound(q, x, kernels)).all(), q.source
