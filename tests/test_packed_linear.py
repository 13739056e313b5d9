"""bfloat16 Linear with its weight packed once. bf16_gemm.c: each output within one bfloat16
rounding of the exact product plus float32's summation error (as F.linear), the same
at any thread count. oneDNN packed: bit-identical to F.linear (the same oneDNN kernel
without the per-call reorder, so the tolerance is zero; with a bias on non-contiguous
N-D input F.linear rounds before adding it, so there the reference is F.linear on the
contiguous input). Both: float32
untouched, repacked when the weight changes, and F.linear, logged, when packing is not
possible."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from pipeserve.model import packed_linear
from pipeserve.model.layers import Linear

needs_ops = pytest.mark.skipif(not packed_linear.available(),
                               reason="this torch has no oneDNN packed-linear ops, or this CPU no oneDNN bfloat16 path "
                                      "(AVX512BW/VL/DQ or AVX_NE_CONVERT; Linear keeps F.linear)")
CPU = torch.device("cpu")


def random_linear(n_in: int, n_out: int, bias: bool, dtype: torch.dtype, seed: int = 0) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(n_in, n_out, bias, dtype, CPU)
    layer.prepack = True
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return layer


@pytest.fixture
def onednn_only(monkeypatch):
    """Layers take oneDNN's packed weights, as where bf16_gemm.c is unavailable."""
    monkeypatch.setattr(packed_linear, "gemm_kernel", lambda: None)


@needs_ops
@pytest.mark.parametrize("n_in,n_out", [(576, 960), (33, 77), (1000, 5), (7, 1), (1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_packed_equals_f_linear_exactly(onednn_only, n_in, n_out, bias):
    layer = random_linear(n_in, n_out, bias, torch.bfloat16, seed=n_in + n_out)
    with torch.inference_mode():
        for rows in (0, 1, 3, 17, 130):
            x = torch.randn(rows, n_in).bfloat16()
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias)), rows
        x = torch.randn(2, 5, 2 * n_in).bfloat16()[..., ::2]        # 3-D, strided
        # F.linear adds the bias after rounding here (matmul, then add); oneDNN adds it in
        # float32, as F.linear does on contiguous input: the one case they differ.
        assert torch.equal(layer(x), F.linear(x.contiguous(), layer.weight, layer.bias))
    assert layer.packed.kind == "onednn"


def within_bf16_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Each output within one bfloat16 rounding (2**-8 relative) of the exact product plus
    the float32 summation error bound K * 2**-24 * (|x| . |w|^T)."""
    exact = F.linear(x.double(), w.double())
    bound = 2 ** -8 * exact.abs() + x.shape[-1] * 2 ** -24 * F.linear(x.double().abs(), w.double().abs())
    return bool(((got.double() - exact).abs() <= bound).all())


needs_gemm = pytest.mark.skipif(packed_linear.gemm_kernel() is None,
                                reason="bf16_gemm.c is not usable here (no compiler or no AVX512_BF16)")


@needs_gemm
@pytest.mark.parametrize("n_in,n_out", [(576, 960), (32, 77), (1536, 5), (64, 1), (1536, 576)])
def test_gemm_kernel_within_bf16_rounding_at_any_thread_count(n_in, n_out, monkeypatch):
    monkeypatch.setattr(packed_linear, "cpu_has_amx_bf16", lambda: False)   # AMX CPUs take oneDNN
    layer = random_linear(n_in, n_out, False, torch.bfloat16, seed=n_in + n_out)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for rows in (0, 1, 3, 17, 130, 300):    # 300 rows of 1536: two of the kernel's L2 chunks
                x = torch.randn(rows, n_in).bfloat16()
                torch.set_num_threads(1)
                one = layer(x)
                torch.set_num_threads(2)
                assert torch.equal(layer(x), one), rows   # each output is one thread's sum
                assert one.shape == (rows, n_out) and within_bf16_rounding(one, x, layer.weight), rows
                # F.linear meets the same bound; the two differ by summation order only
                assert within_bf16_rounding(F.linear(x, layer.weight), x, layer.weight)
            x = torch.randn(2, 5, 2 * n_in).bfloat16()[..., ::2]    # 3-D, strided
            assert within_bf16_rounding(layer(x), x, layer.weight)
    finally:
        torch.set_num_threads(threads)
    assert layer.packed.kind == "gemm"


@needs_gemm
@needs_ops
def test_amx_cpus_pack_for_onednn(monkeypatch):
    """On CPUs with AMX-BF16 oneDNN multiplies with tiles, ~10x bf16_gemm.c's vdpbf16ps at prefill
    rows: a layer bf16_gemm.c would take packs for oneDNN there, bit for bit F.linear's."""
    monkeypatch.setattr(packed_linear, "cpu_has_amx_bf16", lambda: True)
    layer = random_linear(576, 960, False, torch.bfloat16)
    x = torch.randn(64, 576).bfloat16()
    assert torch.equal(layer(x), F.linear(x, layer.weight)) and layer.packed.kind == "onednn"


@needs_gemm
@needs_ops
def test_bias_or_a_ragged_width_takes_onednn():
    for layer in (random_linear(64, 16, True, torch.bfloat16), random_linear(33, 16, False, torch.bfloat16)):
        layer(torch.randn(3, layer.weight.shape[1]).bfloat16())
        assert layer.packed.kind == "onednn"


@pytest.fixture
def no_compiler(monkeypatch):
    """Every kernel build fails as without a C compiler; the kernels' caches are cleared before
    and after, so no other test sees the failure."""
    from pipeserve.kernels import build

    def refuse(name):
        raise build.KernelBuildError("no C compiler found (install gcc, or set CC)")
    monkeypatch.setattr(build, "load_kernel", refuse)
    for cached in (packed_linear.gemm_kernel, packed_linear.gemv_kernel):
        cached.cache_clear()
    yield
    for cached in (packed_linear.gemm_kernel, packed_linear.gemv_kernel):
        cached.cache_clear()


@needs_ops
def test_kernel_build_failure_falls_back_to_onednn_and_logs_once(no_compiler, caplog, monkeypatch):
    monkeypatch.setattr(packed_linear, "cpu_has_amx_bf16", lambda: False)   # else oneDNN without asking
    layers = [random_linear(64, 16, False, torch.bfloat16, seed) for seed in range(2)]
    x = torch.randn(4, 64).bfloat16()
    with caplog.at_level(logging.WARNING, logger=packed_linear.__name__):
        for layer in layers:
            assert torch.equal(layer(x), F.linear(x, layer.weight))
            assert layer.packed.kind == "onednn"
    messages = [r.getMessage() for r in caplog.records if r.name == packed_linear.__name__]
    assert messages == ["bfloat16 linear layers: oneDNN with packed weights "
                        "(no C compiler found (install gcc, or set CC))"]


@needs_ops
def test_float32_and_grad_stay_on_f_linear():
    layer = random_linear(64, 32, True, torch.float32)
    with torch.inference_mode():
        layer(torch.randn(8, 64))
    assert layer.packed.packed is None
    bf16 = random_linear(64, 32, False, torch.bfloat16)
    bf16(torch.randn(8, 64).bfloat16().requires_grad_())
    assert bf16.packed.packed is None


@needs_ops
@pytest.mark.parametrize("n_in", [48, 64])   # oneDNN, and bf16_gemm.c where it is usable
def test_repacked_when_the_weight_changes(n_in):
    layer = random_linear(n_in, 40, False, torch.bfloat16)
    x = torch.randn(9, n_in).bfloat16()
    layer(x)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, n_in))                  # in place: version counter moves
    assert within_bf16_rounding(layer(x), x, layer.weight)
    layer.weight = torch.nn.Parameter(torch.randn(40, n_in).bfloat16(), requires_grad=False)   # new storage
    assert within_bf16_rounding(layer(x), x, layer.weight)


@needs_ops
def test_packing_failure_falls_back_to_f_linear_and_logs_once(onednn_only, monkeypatch, caplog):
    def refuse(weight):
        raise RuntimeError("oneDNN: unsupported\nsecond line")
    monkeypatch.setattr(packed_linear, "pack", refuse)
    monkeypatch.setattr(packed_linear, "_warned", [])
    layers = [random_linear(32, 16, False, torch.bfloat16, seed) for seed in range(2)]
    x = torch.randn(4, 32).bfloat16()
    with caplog.at_level(logging.WARNING, logger=packed_linear.__name__):
        for layer in layers * 2:
            assert torch.equal(layer(x), F.linear(x, layer.weight))
            assert layer.packed.failed
    messages = [r.getMessage() for r in caplog.records if r.name == packed_linear.__name__]
    assert messages == ["bfloat16 linear layers: F.linear (packing a (16, 32) weight failed: "
                        "oneDNN: unsupported)"]


def test_without_kernel_or_ops_f_linear_is_used(onednn_only, monkeypatch):
    monkeypatch.setattr(packed_linear, "available", lambda: False)
    layer = random_linear(32, 16, False, torch.bfloat16)
    x = torch.randn(4, 32).bfloat16()
    assert torch.equal(layer(x), F.linear(x, layer.weight))
    assert layer.packed.packed is None


@needs_ops
def test_tensor_parallel_slices_run_packed(tiny_checkpoints):
    """Each rank's row-cut (q/k/v, gate/up, vocabulary-padded head) and column-cut (o, down)
    bfloat16 weights, loaded as a TP rank loads them, give F.linear's result."""
    from pipeserve.model.loader import load_model, resolve_model
    from pipeserve.model.tensor_parallel import TensorParallelGroup, plan_shard
    source = resolve_model(str(tiny_checkpoints("qwen2_bias")))
    cfg = source.load_config()
    for rank in range(2):
        model = load_model(source, cfg, 0, cfg.num_layers, True, True, torch.bfloat16, "cpu",
                           tp=TensorParallelGroup(plan_shard(cfg, rank, 2)))
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert linears
        with torch.inference_mode():
            for layer in linears:
                layer.prepack = True
                x = torch.randn(6, layer.weight.shape[1]).bfloat16()
                if layer.bias is not None:
                    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
                else:
                    assert within_bf16_rounding(layer(x), x, layer.weight)
                assert layer.packed.packed is not None


@needs_ops
def test_prepack_weights_is_off_by_default_and_counted_when_on(tiny_checkpoints):
    """``--prepack-weights`` packs every bfloat16 Linear at load and LLM.stats() counts the
    second copy; without it nothing is packed and the stage holds one copy."""
    from pipeserve import LLM, SamplingParams
    path = str(tiny_checkpoints("llama_tied_gqa"))
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4)
    stats, texts = {}, {}
    for on in (False, True):
        with LLM(model=path, dtype="bfloat16", kv_cache_memory="16MiB", threads_per_stage=1,
                 prepack_weights=on) as llm:
            out = llm.generate([{"prompt_token_ids": [1, 5, 9, 13]}], params)
            stats[on] = llm.stats()["weight_bytes"][0]
            runner = llm.engine.executor.runner
            linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
            assert all(m.prepack == on and (m.packed.packed is not None) == on for m in linears)
            packed = sum(m.packed.nbytes for m in linears)
            texts[on] = len(out[0].outputs[0].token_ids)
    assert texts == {False: 4, True: 4}
    assert packed > 0 and stats[True] == stats[False] + packed


needs_gemv = pytest.mark.skipif(packed_linear.gemv_kernel() is None,
                                reason="bf16_gemv.c is not usable here (no compiler or no AVX-512): decode rows "
                                       "take F.linear")


def plain_linear(n_in: int, n_out: int, bias: bool, seed: int = 0) -> Linear:
    layer = random_linear(n_in, n_out, bias, torch.bfloat16, seed)
    layer.prepack = False                          # the default: decode rows by bf16_gemv.c
    return layer


@needs_gemv
@pytest.mark.parametrize("n_in,n_out", [(576, 960), (33, 77), (1000, 5), (7, 1), (1536, 578)])
@pytest.mark.parametrize("bias", [False, True])
def test_decode_rows_take_the_gemv_within_bf16_rounding(n_in, n_out, bias):
    """Up to 8 rows of x: each output within one bfloat16 rounding of the exact product (plus the
    bias, added in float32 before the rounding), the same at any thread count and whatever other
    rows share the call (batch-invariant; 1-4 rows take weight rows 4 at a time, 5-8 two); a
    ragged width, a width not a multiple of 4 rows."""
    layer = plain_linear(n_in, n_out, bias, seed=n_in + n_out)
    w, b = layer.weight, layer.bias
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            x = torch.randn(packed_linear.GEMV_MAX_ROWS, n_in).bfloat16()
            assert packed_linear.decode_rows(x, w, b) is not None
            torch.set_num_threads(1)
            alone = [layer(x[i:i + 1]) for i in range(x.shape[0])]
            torch.set_num_threads(2)
            for rows in range(1, x.shape[0] + 1):
                got = layer(x[:rows])
                assert got.shape == (rows, n_out)
                assert torch.equal(got, torch.cat(alone[:rows])), rows   # batch- and thread-invariant
                exact = F.linear(x[:rows].double(), w.double(), None if b is None else b.double())
                bound = (2 ** -8 * exact.abs()
                         + n_in * 2 ** -24 * F.linear(x[:rows].double().abs(), w.double().abs()))
                assert ((got.double() - exact).abs() <= bound).all(), rows
            strided = torch.randn(1, 2, 2 * n_in).bfloat16()[..., ::2]   # 3-D, 2 rows, not contiguous
            assert torch.equal(layer(strided), layer(strided.contiguous()))
    finally:
        torch.set_num_threads(threads)


@needs_gemv
def test_more_rows_or_no_kernel_take_f_linear(monkeypatch):
    layer = plain_linear(64, 40, True)
    x = torch.randn(packed_linear.GEMV_MAX_ROWS + 1, 64).bfloat16()
    assert packed_linear.decode_rows(x, layer.weight, layer.bias) is None
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    monkeypatch.setattr(packed_linear, "gemv_kernel", lambda: None)
    assert torch.equal(layer(x[:1]), F.linear(x[:1], layer.weight, layer.bias))
    f32 = random_linear(64, 40, True, torch.float32)
    f32.prepack = False
    assert torch.equal(f32(x.float()[:1]), F.linear(x.float()[:1], f32.weight, f32.bias))


def test_gemv_build_failure_leaves_decode_rows_on_f_linear(no_compiler, caplog):
    layer = plain_linear(64, 16, True)
    x = torch.randn(2, 64).bfloat16()
    with caplog.at_level(logging.INFO, logger=packed_linear.__name__):
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    messages = [r.getMessage() for r in caplog.records if r.name == packed_linear.__name__]
    assert messages == ["bfloat16 linear layers: F.linear for decode rows "
                        "(no C compiler found (install gcc, or set CC))"]
