"""kernels/gguf_repack.c against gguf_repack.py's numpy path: the K-quants re-laid out at load."""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import pytest
import torch

import pipeserve.model.quant.gguf_repack as repack_module
from pipeserve.model.quant.gguf_repack import repack

T = gguf.GGMLQuantizationType


def _numpy_repack(ttype, raw, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(repack_module, "_c_repack", lambda: None)
        return repack(ttype, raw)


@pytest.mark.parametrize("ttype", [T.Q4_K, T.Q5_K, T.Q6_K])
@pytest.mark.parametrize("shape", [(1, 256), (7, 768), (64, 2048)])
def test_c_repack_is_the_numpy_repack_bit_for_bit(ttype, shape, monkeypatch) -> None:
    if repack_module._c_repack() is None:
        pytest.skip("kernels/gguf_repack.c does not build here (no C compiler): only the numpy path runs")
    block, size = gguf.GGML_QUANT_SIZES[ttype]
    rows, cols = shape
    # Random bytes: every code, and float16 scales of every kind (subnormal, huge, inf, NaN).
    raw = np.random.default_rng(rows).integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # numpy's float16 products overflow
        fast, slow = repack(ttype, raw), _numpy_repack(ttype, raw, monkeypatch)
    assert (fast.kind, fast.group, fast.zero, fast.source) == (slow.kind, slow.group, slow.zero, slow.source)
    for name in ("qs", "qh"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    for name in ("scale", "minv"):   # float16 bits, any NaN as any NaN
        a, b = getattr(fast, name), getattr(slow, name)
        if a is None:
            assert b is None, name
            continue
        a, b = a.numpy(), b.numpy()
        same = (a.view(np.uint16) == b.view(np.uint16)) | (np.isnan(a) & np.isnan(b))
        assert a.shape == b.shape and same.all(), (name, a[~same][:4], b[~same][:4])
