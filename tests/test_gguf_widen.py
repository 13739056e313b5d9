"""GGUF types re-laid out by pipeserve/model/quant/gguf_widen.py: IQ4_NL and IQ4_XS as i4 (their
nibbles, a float16 scale per 32), Q3_K as q3 and Q2_K as q2 (their code bytes and integer
sub-scales, a float16 d (and -dmin) per 256) where the kernels take those layouts, else as
byte-per-code q8 rows. Each
reads back as gguf-py dequantizes it, the kernels multiply it as dequantize-then-matmul does, and
a model written in IQ4_NL stays in it."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

import pipeserve.model.quant.gguf_widen as widen
from pipeserve.model.loader import resolve_model
from pipeserve.model.quant.cpu_kernels import cpu_kernels
from pipeserve.model.quant.gguf_repack import KEPT_TYPES, repack
from pipeserve.model.quant.load import weight_bytes
from pipeserve.model.quant.packed import dequantize, to_q8
from tests.checkpoints import build_checkpoint, write_llama_gguf
from tests.test_fused_decode import _compare, _decode_logits, _runner
from tests.test_quant_kernels import _check_matmul

T = gguf.GGMLQuantizationType
WIDENED = (T.IQ4_NL, T.IQ4_XS, T.Q3_K, T.Q2_K)
IQ4 = (T.IQ4_NL, T.IQ4_XS)
COMPACT = {T.IQ4_NL: "i4", T.IQ4_XS: "i4", T.Q3_K: "q3", T.Q2_K: "q2"}   # the layout each keeps where it can
SCALE_OFFSETS = {T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.Q3_K: (108,), T.Q2_K: (80, 82)}   # float16 d (and dmin)
FILE_RATIO = {T.IQ4_NL: 34 / 18, T.IQ4_XS: 2.0, T.Q3_K: 288 / 110, T.Q2_K: 320 / 84}  # q8 bytes / file bytes
# compact bytes / file bytes: i4 a float16 scale per 32 (XS: 6 bits); q3 / q2 per 256 weights 64 bytes
# of bit pairs, 16 sub-scale bytes (q3: and 32 of hmask) and the float16 d (q2: and dmin), as the
# file has them but for Q3_K's 6-bit sub-scales unpacked to a byte each
COMPACT_FILE_RATIO = {T.IQ4_NL: 1.0, T.IQ4_XS: 144 / 136, T.Q3_K: 114 / 110, T.Q2_K: 1.0}
K2 = (T.Q3_K, T.Q2_K)


@pytest.fixture(params=["compact", "q8"])
def layout(request, monkeypatch) -> str:
    """Whether IQ4 / Q3_K / Q2_K are kept compact (i4 / q3 / q2: this build's kernels take
    them, as every build's do) or widened to q8 (the support check answers no, monkeypatched)."""
    if request.param == "compact":
        assert all(widen.keeps(kind) for kind in ("i4", "q3", "q2")), "every build's kernels take i4/q3/q2"
    if request.param == "q8":
        monkeypatch.setattr(widen, "keeps", lambda kind: False)
    return request.param


def _layout(ttype, layout: str) -> str:
    return COMPACT[ttype] if layout == "compact" else "q8"


def _random_blocks(ttype, rows: int, cols: int, seed: int, exact: bool) -> np.ndarray:
    """Random bytes as a [rows, cols] tensor of ``ttype``, its float16 scales set: a power of
    two (every two-level scale then exact in float16) or random in [1e-3, 1e-2)."""
    block, size = gguf.GGML_QUANT_SIZES[ttype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, size)
    for offset in SCALE_OFFSETS[ttype]:
        d = np.full(blocks.shape[:2], 2.0 ** -8) if exact else rng.uniform(1e-3, 1e-2, blocks.shape[:2])
        blocks[..., offset:offset + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return raw


def test_widened_types_are_kept():
    assert set(WIDENED) <= set(KEPT_TYPES)


@pytest.mark.parametrize("ttype", WIDENED, ids=lambda t: t.name)
def test_widened_types_read_back_as_gguf_dequantizes_them(ttype, layout):
    rows, cols = 6, 512
    raw = _random_blocks(ttype, rows, cols, seed=int(ttype), exact=True)
    w = repack(ttype, raw)
    kind = _layout(ttype, layout)
    assert (w.kind, w.source) == (kind, ttype.name)
    ratio = FILE_RATIO[ttype] if kind == "q8" else COMPACT_FILE_RATIO[ttype]
    assert w.nbytes == pytest.approx(ratio * raw.nbytes)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, ttype).reshape(rows, cols).astype(np.float32))
    assert torch.equal(dequantize(w), ref)          # two-level scales exact in float16 here
    raw = _random_blocks(ttype, rows, cols, seed=int(ttype) + 1, exact=False)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, ttype).reshape(rows, cols).astype(np.float32))
    got = dequantize(repack(ttype, raw))
    if kind != "q8" and ttype in K2:   # q2 / q3 keep d and the integer sub-scales apart: exact
        assert torch.equal(got, ref)
        return
    # d * sc rounded to float16 (and dmin * m for Q2_K): 2^-11 of each term at most
    codes = (w if kind == "q8" else to_q8(w)).qs.float().abs().max().item()
    bound = 2 ** -11 * 1e-2 * 63 * (codes + (15 if ttype == T.Q2_K else 0))
    assert (got - ref).abs().max().item() <= bound


@pytest.mark.skipif(cpu_kernels() is None, reason="no C compiler: the quantized kernels do not build here")
@pytest.mark.parametrize("ttype", WIDENED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 20, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_widened_kernels_match_dequantize_then_matmul(ttype, rows, dtype, layout):
    """Through ``matmul`` (gemv with integer activations, passes, tiles), in either layout;
    i4/q3/q2 on every path in tests/test_quant_kernels.py."""
    w = repack(ttype, _random_blocks(ttype, 48, 512, seed=int(ttype), exact=False))
    assert w.kind == _layout(ttype, layout)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
    _check_matmul(w, x, cpu_kernels())


@pytest.mark.parametrize("ttype", WIDENED, ids=lambda t: t.name)
def test_compact_types_are_widened_where_the_kernels_take_no_compact_layout(ttype, monkeypatch, caplog):
    """Kernels that take none of the compact layouts (a library from before them; monkeypatched
    here, since every build takes them): IQ4 / Q3_K / Q2_K as q8 rows, the same
    weights (Q3_K / Q2_K: d * sub and -dmin * min rounded to float16, within 2^-11 of each),
    and a log line that says why; no C kernels at all: i4 / q3 / q2, which PyTorch's dequantize
    takes."""
    raw = _random_blocks(ttype, 4, 512, seed=3, exact=False)
    monkeypatch.setattr(widen, "cpu_kernels", lambda: None)
    kept = repack(ttype, raw)
    assert kept.kind == COMPACT[ttype] and kept.nbytes == pytest.approx(COMPACT_FILE_RATIO[ttype] * raw.nbytes)
    older = SimpleNamespace(isa="older-build", takes=lambda kind: kind not in ("i4", "q3", "q2"))   # its support check
    monkeypatch.setattr(widen, "cpu_kernels", lambda: older)
    widen._log_widened.cache_clear()
    with caplog.at_level("INFO", logger=widen.log.name):
        wide = repack(ttype, raw)
    assert wide.kind == "q8" and wide.nbytes == pytest.approx(FILE_RATIO[ttype] * raw.nbytes)
    if ttype in K2:
        scale = wide.scale.float().abs().repeat_interleave(16, dim=1)
        minv = 0 if wide.minv is None else wide.minv.float().abs().repeat_interleave(16, dim=1)
        assert ((dequantize(wide) - dequantize(kept)).abs() <= 2 ** -11 * (4 * scale + minv)).all()
    else:
        assert torch.equal(dequantize(wide), dequantize(kept))
    assert "widened" in caplog.text and "older-build" in caplog.text


@pytest.mark.parametrize("threads", [1, 2])
def test_an_iq4_nl_model_stays_iq4_nl_and_decodes_as_dequantized(threads, layout, tmp_path):
    """A tiny Llama written in IQ4_NL (block 32 fits its width of 64): kept as i4, its matrices'
    resident bytes the file's (q8 where the kernels take no i4: about 1.9x, instead of 7x as
    float32), and its decode logits are the dequantized model's up to the integer activations'
    rounding."""
    gguf_path = write_llama_gguf(build_checkpoint("llama_tied_gqa", tmp_path / "hf"), tmp_path / "iq4.gguf",
                                 qtype="IQ4_NL")
    source = resolve_model(str(gguf_path))
    cfg = source.load_config()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kept = _runner(source, cfg)
        qkv = kept.model.layers[0].self_attn.qkv_proj
        assert [p.source for p in qkv.parts] == ["IQ4_NL"] and qkv.parts[0].kind == _layout(T.IQ4_NL, layout)
        reader = gguf.GGUFReader(gguf_path)
        file_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type == T.IQ4_NL)
        dense_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type != T.IQ4_NL)
        held = weight_bytes(kept.model) - dense_bytes   # norms: float32 in the file and here
        assert held == pytest.approx((1.0 if layout == "compact" else 34 / 18) * file_bytes, rel=1e-3)
        dense = _runner(source, cfg, quantization="none")
        prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(3)]
        _compare(_decode_logits([kept], prompts, 6), _decode_logits([dense], prompts, 6), exact=False)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("ttype", WIDENED, ids=lambda t: t.name)
def test_the_c_widening_is_the_numpy_one_bit_for_bit(ttype, layout, monkeypatch):
    if widen._c_widen() is None:
        pytest.skip("no C compiler here: gguf_widen.c does not build, the numpy path runs")
    raw = _random_blocks(ttype, 5, 1024, seed=int(ttype) + 7, exact=False)
    c = repack(ttype, raw)
    assert c.kind == _layout(ttype, layout)
    monkeypatch.setattr(widen, "_c_widen", lambda: None)
    ref = repack(ttype, raw)
    for got, want in zip(c.tensors(), ref.tensors(), strict=True):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
