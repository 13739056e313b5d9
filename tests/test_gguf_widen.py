"""GGUF types kept as byte-per-code q8 rows (pipeserve/model/quant/gguf_widen.py): IQ4_NL,
IQ4_XS, Q3_K and Q2_K read back as gguf-py dequantizes them, the kernels multiply them as
dequantize-then-matmul does, and a model written in IQ4_NL stays in it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pipeserve.model.loader import resolve_model
from pipeserve.model.quant.cpu_kernels import cpu_kernels
from pipeserve.model.quant.gguf_repack import KEPT_TYPES, repack
from pipeserve.model.quant.packed import dequantize
from tests.checkpoints import build_checkpoint, write_llama_gguf
from tests.test_fused_decode import _compare, _decode_logits, _runner
from tests.test_quant_kernels import _check_matmul

T = gguf.GGMLQuantizationType
WIDENED = (T.IQ4_NL, T.IQ4_XS, T.Q3_K, T.Q2_K)
SCALE_OFFSETS = {T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.Q3_K: (108,), T.Q2_K: (80, 82)}   # float16 d (and dmin)
FILE_RATIO = {T.IQ4_NL: 34 / 18, T.IQ4_XS: 2.0, T.Q3_K: 288 / 110, T.Q2_K: 320 / 84}  # q8 bytes / file bytes


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
def test_widened_types_read_back_as_gguf_dequantizes_them(ttype):
    rows, cols = 6, 512
    raw = _random_blocks(ttype, rows, cols, seed=int(ttype), exact=True)
    w = repack(ttype, raw)
    assert (w.kind, w.source) == ("q8", ttype.name)
    assert w.nbytes == pytest.approx(FILE_RATIO[ttype] * raw.nbytes)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, ttype).reshape(rows, cols).astype(np.float32))
    assert torch.equal(dequantize(w), ref)          # two-level scales exact in float16 here
    raw = _random_blocks(ttype, rows, cols, seed=int(ttype) + 1, exact=False)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, ttype).reshape(rows, cols).astype(np.float32))
    # d * sc rounded to float16 (and dmin * m for Q2_K): 2^-11 of each term at most
    codes = repack(ttype, raw).qs.float().abs().max().item()
    bound = 2 ** -11 * 1e-2 * 63 * (codes + (15 if ttype == T.Q2_K else 0))
    assert (dequantize(repack(ttype, raw)) - ref).abs().max().item() <= bound


@pytest.mark.skipif(cpu_kernels() is None, reason="no C compiler: the quantized kernels do not build here")
@pytest.mark.parametrize("ttype", WIDENED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 20, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_widened_kernels_match_dequantize_then_matmul(ttype, rows, dtype):
    w = repack(ttype, _random_blocks(ttype, 48, 512, seed=int(ttype), exact=False))
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
    _check_matmul(w, x, cpu_kernels())


@pytest.mark.parametrize("threads", [1, 2])
def test_an_iq4_nl_model_stays_iq4_nl_and_decodes_as_dequantized(threads, tmp_path):
    """A tiny Llama written in IQ4_NL (block 32 fits its width of 64): kept as q8 rows, about
    1.9x the file's matrix bytes instead of 7x as float32, and its decode logits are the
    dequantized model's up to the integer activations' rounding."""
    gguf_path = write_llama_gguf(build_checkpoint("llama_tied_gqa", tmp_path / "hf"), tmp_path / "iq4.gguf",
                                 qtype="IQ4_NL")
    source = resolve_model(str(gguf_path))
    cfg = source.load_config()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kept = _runner(source, cfg)
        qkv = kept.model.layers[0].self_attn.qkv_proj
        assert [p.source for p in qkv.parts] == ["IQ4_NL"] and qkv.parts[0].kind == "q8"
        dense = _runner(source, cfg, quantization="none")
        prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(3)]
        _compare(_decode_logits([kept], prompts, 6), _decode_logits([dense], prompts, 6), exact=False)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("ttype", WIDENED, ids=lambda t: t.name)
def test_the_c_widening_is_the_numpy_one_bit_for_bit(ttype, monkeypatch):
    import pipeserve.model.quant.gguf_widen as widen
    if widen._c_widen() is None:
        pytest.skip("no C compiler here: gguf_widen.c does not build, the numpy path runs")
    raw = _random_blocks(ttype, 5, 1024, seed=int(ttype) + 7, exact=False)
    c = repack(ttype, raw)
    monkeypatch.setattr(widen, "_c_widen", lambda: None)
    ref = repack(ttype, raw)
    for got, want in zip(c.tensors(), ref.tensors(), strict=True):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
