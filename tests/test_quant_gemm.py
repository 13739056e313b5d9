"""The many-row kernel for kept-quantized weights (pipeserve/kernels/quant_gemm.c):
every kept GGUF type and the int8/int4 layouts against dequantize-then-matmul, and
the fallback to the tiled path where it does not apply.

Documented tolerance (cpu_kernels.py, quant_gemm.c): the kernel rounds each
dequantized weight to bfloat16 as ``dequantize(w, torch.bfloat16)`` does, so
against ``x.float() @ dequantize(w, bfloat16).float().T`` it differs only by
float32 summation order and the bfloat16 rounding of the output (half an ulp,
2^-9 relative); against the float32 dequantized weight add the weight's
bfloat16 rounding (2^-9 of each |w|, summed with |x|).
"""

from __future__ import annotations

import logging

import pytest
import torch

import pipeserve.kernels.build as kernel_build
import pipeserve.model.quant.cpu_kernels as quant_cpu
from pipeserve.model.quant.cpu_kernels import (AMX_MIN_ROWS, GEMM_MIN_ROWS, GEMV_MAX_ROWS, PROMPT_INT8_MAX_ROWS, amx_from,
                                               cpu_kernels)
from pipeserve.model.quant.packed import dequantize, quantize_weight
from tests.kernels import skip_without_kernel
from tests.test_quant_kernels import _read, gguf_file  # noqa: F401  (gguf_file is a fixture)
from tests.test_quant_model import _all_logits, _perplexity, _runner, smollm2  # noqa: F401  (smollm2: fixture)

ROWS = (GEMM_MIN_ROWS, GEMV_MAX_ROWS + 1, 16, 23, 64, 100)   # block tails (rows % 16) and whole blocks
needs_matmul, needs_gemm = skip_without_kernel("quant_matmul"), skip_without_kernel("quant_gemm")


def _gemm_kernels(amx: bool = False):
    kernels = cpu_kernels()
    if kernels.gemm_isa is None:
        pytest.skip("quant_gemm.c has no AVX512_BF16 kernel on this CPU/compiler (many rows run tiled)")
    if amx and kernels.gemm_amx_isa is None:
        pytest.skip("no AMX-BF16 on this CPU/compiler (or Linux refused the tile state): the AMX kernel "
                    "is not built; its rows take the 8-bit or the vdpbf16ps kernel")
    return kernels


def _bound(w, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference with bfloat16 weights, allowed |error|), both [M, N] float32."""
    wb = dequantize(w, torch.bfloat16).float()
    ref = x.float() @ wb.t()
    return ref, 2.0 ** -8 * ref.abs() + 1e-5 * (x.float().abs() @ wb.abs().t()) + 1e-30


def _cases(gguf_file):  # noqa: F811
    path, types = gguf_file
    cases = [_read(path, i)[0] for i in range(len(types))]            # every kept GGUF type
    gen = torch.Generator().manual_seed(3)
    # 57 rows: a pair of panels whose second is partial (the AMX kernel's 2 x 2 tiles)
    cases.append(quantize_weight(torch.randn(57, 256, generator=gen), 4, 32))
    w = torch.randn(41, 256, generator=gen)                            # 41 rows: a partial panel of 16
    cases += [quantize_weight(w, 8, g) for g in (32, 128)] + [quantize_weight(w, 4, g) for g in (32, 64)]
    return cases


@needs_matmul
@needs_gemm
@pytest.mark.parametrize("amx", [False, True], ids=["vdpbf16ps", "amx"])
@pytest.mark.parametrize("rows", ROWS + (AMX_MIN_ROWS, 129))
def test_gemm_matches_dequantize_then_matmul(gguf_file, rows, amx):  # noqa: F811
    """Both kernels of quant_gemm.c (AMX: 2 x 2 tiles of 16, so 129 rows leave a lone last block
    of one row, and 41 weight rows a lone partial panel) within the bound, at one and two threads
    bit for bit (each output is one thread's)."""
    kernels = _gemm_kernels(amx)
    seen = set()
    threads = torch.get_num_threads()
    for w in _cases(gguf_file):
        x = torch.randn(rows, w.in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
        x[-1] *= 50                                                     # a loud row next to quiet ones
        assert kernels.gemm_applies(w, x), (w.source, w.group)
        try:
            torch.set_num_threads(1)
            got = kernels.gemm(w, x, amx=amx)
            torch.set_num_threads(2)
            assert torch.equal(kernels.gemm(w, x, amx=amx), got), w.source
        finally:
            torch.set_num_threads(threads)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, w.out_features)
        ref, tol = _bound(w, x)
        err = (got.float() - ref).abs()
        assert (err <= tol).all(), (w.source, rows, err.max().item())
        # the dispatch: from amx_from's rows the AMX kernel where there is one, else from
        # GEMM_MIN_ROWS bfloat16 rows on the vdpbf16ps kernel (or the 8-bit one where it takes the
        # layout: tests/test_quant_gemm_i8.py)
        takes_amx = kernels.gemm_amx_isa is not None and rows >= amx_from(w.out_features)
        if takes_amx == amx and (amx or not kernels.gemm_i8_applies(w, x)):
            assert torch.equal(kernels.matmul(w, x), got), w.source
        seen.add(w.source)
    assert {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "int8", "int4"} <= seen


@needs_matmul
@needs_gemm
def test_amx_rows_by_weight_height_and_the_other_kernels_without_amx(gguf_file, monkeypatch):  # noqa: F811
    """The AMX kernel from AMX_MIN_ROWS rows of a layer's weight and of SmolLM2's 49152-row head, from
    out_features / 1536 of a taller one (128256 rows: 83); without AMX
    the same rows take the 8-bit kernel (or the vdpbf16ps one) as before."""
    assert amx_from(576) == amx_from(3072) == AMX_MIN_ROWS and amx_from(49152) == AMX_MIN_ROWS and amx_from(128256) == 83
    kernels = _gemm_kernels(amx=True)
    w = _cases(gguf_file)[-1]                                     # int4, group 64: the 8-bit kernel takes it
    calls = []
    real = kernels.gemm
    monkeypatch.setattr(kernels, "gemm", lambda w, x, amx=False: calls.append((x.shape[0], amx)) or real(w, x, amx))
    for rows in (AMX_MIN_ROWS - 1, AMX_MIN_ROWS):
        kernels.matmul(w, torch.randn(rows, w.in_features).bfloat16())
    assert calls == [(AMX_MIN_ROWS, True)], calls                 # one row fewer: the 8-bit kernel's
    monkeypatch.setattr(kernels, "_gemm_amx", None)
    x = torch.randn(AMX_MIN_ROWS, w.in_features).bfloat16()
    assert torch.equal(kernels.matmul(w, x), kernels.gemm_i8(w, x))
    with pytest.raises(ValueError, match="no AMX-BF16"):
        kernels.gemm(w, x, amx=True)


@needs_matmul
def test_gemm_only_for_bfloat16_and_falls_back_to_tiled(gguf_file, monkeypatch):  # noqa: F811
    kernels = cpu_kernels()
    w = _cases(gguf_file)[-3]   # q8: many rows take the tiles on every build (AVX2's q4 the integer gemv,
    #                             and AVX2's q8 up to PROMPT_INT8_MAX_ROWS["q8"] rows)
    few = torch.randn(min(GEMM_MIN_ROWS, kernels.gemm_i8_from(w) or GEMM_MIN_ROWS) - 1, w.in_features).bfloat16()
    assert torch.equal(kernels.matmul(w, few), kernels.gemv(w, few))   # decode-sized (below the 8-bit kernel's too)
    x = torch.randn(PROMPT_INT8_MAX_ROWS["q8"] + 1, w.in_features)
    assert not kernels.gemm_applies(w, x)                               # float32: the fidelity reference
    assert torch.equal(kernels.matmul(w, x), kernels.tiled(w, x))
    with pytest.raises(ValueError, match="does not apply"):
        kernels.gemm(w, x)
    # No kernel (no AVX512_BF16, or quant_gemm.c failed to build): bfloat16 rows go tiled, within
    # the same bound.
    xb = x.bfloat16()
    monkeypatch.setattr(kernels, "_gemm", None)
    monkeypatch.setattr(kernels, "_gemm_i8", None)       # nor the 8-bit one (quant_gemm_i8.c)
    monkeypatch.setattr(quant_cpu, "TILES_IN_FLOAT32", False)   # bfloat16 tiles, as a native CPU's
    assert not kernels.gemm_applies(w, xb)
    got = kernels.matmul(w, xb)
    assert torch.equal(got, kernels.tiled(w, xb))
    ref, tol = _bound(w, xb)
    assert ((got.float() - ref).abs() <= tol).all()


def _flat(parts: tuple) -> list:
    return [q for p in parts for q in (_flat(p) if isinstance(p, tuple) else [p])]


@pytest.mark.parametrize("name, load", [("quant_gemm", "_load_gemm"), ("quant_gemm_i8", "_load_gemm_i8")])
def test_many_row_kernel_build_failure_logs_and_keeps_the_other_paths(name, load, monkeypatch, caplog):
    """quant_gemm.c (then the tiles) and quant_gemm_i8.c (then the bfloat16 kernel or the tiles)."""
    real = kernel_build.load_kernel

    def fail(kernel):
        if kernel == name:
            raise kernel_build.KernelBuildError("compiler exploded (test)")
        return real(kernel)

    monkeypatch.setattr(kernel_build, "load_kernel", fail)
    with caplog.at_level(logging.WARNING, logger=quant_cpu.__name__):
        loaded = getattr(quant_cpu, load)()
    assert all(part is None for part in _flat(loaded)), loaded
    assert f"{name}.c unavailable" in caplog.text and "compiler exploded" in caplog.text


@needs_matmul
@needs_gemm
@pytest.mark.parametrize("amx", [False, True], ids=["vdpbf16ps", "amx"])
def test_kept_smollm2_bfloat16_prefill_through_gemm_agrees_with_bfloat16_model(smollm2, amx):
    """The whole model in bfloat16, kept Q4_1/Q8_0 through the many-row kernel (vdpbf16ps or AMX
    tiles) vs the dequantized bfloat16 model (--quantization none): same bfloat16 weights, so only
    summation order differs."""
    kernels = _gemm_kernels(amx)
    source, cfg, ids = smollm2
    calls = []
    real_gemm = kernels.gemm
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant_cpu, "GEMM_I8", False)      # the bfloat16 kernels, not the 8-bit one
        if not amx:
            mp.setattr(kernels, "_gemm_amx", None)
        mp.setattr(kernels, "gemm", lambda w, x, amx=False: calls.append((w.source, amx)) or real_gemm(w, x, amx))
        kept = _all_logits(_runner(source, "auto", cfg, dtype=torch.bfloat16), ids).float()
    assert {("Q4_1", amx), ("Q8_0", amx)} <= set(calls), set(calls)   # the layers and the tied head
    dense = _all_logits(_runner(source, "none", cfg, dtype=torch.bfloat16), ids).float()
    agree = (kept.argmax(-1) == dense.argmax(-1)).float().mean().item()
    ppl_kept, ppl_dense = _perplexity(kept, ids), _perplexity(dense, ids)
    print(f"gemm vs bfloat16 model: top-1 agreement {agree:.4f}; perplexity {ppl_kept:.4f} vs {ppl_dense:.4f}")
    # Two bfloat16 models part wherever a top-2 is close: over three 600-token stretches of the
    # reference text they agreed on 97.2-99.3 % with perplexity ratios 0.992-1.005 (before and
    # after the prompt attention's block softmax, which moved this stretch from 99.3 to 98.8 %).
    assert agree >= 0.97, agree
    assert abs(ppl_kept / ppl_dense - 1) <= 0.01, (ppl_kept, ppl_dense)
