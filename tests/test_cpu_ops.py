"""The fused elementwise kernels (bfloat16 and float32) against the PyTorch ops they replace,
on each build the tests can force (native, AVX2, portable: tests.test_cpu_attention.kernel_isa)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeserve.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, _rotate
from tests.kernels import skip_without_kernel
from tests.test_cpu_attention import check_forced_isa, isa_compilers, kernel_isa  # noqa: F401 (fixtures)


needs_kernel = skip_without_kernel("elementwise")


@pytest.fixture
def ops(kernel_isa):
    from pipeserve.model.cpu_ops import CpuElementwise
    ops = CpuElementwise()
    check_forced_isa(kernel_isa, ops.isa)
    return ops


@needs_kernel
@pytest.mark.parametrize("rows,dim", [(1, 576), (37, 576), (5, 100)])
def test_add_rmsnorm_sum_exact_and_norm_within_one_bf16_step_of_torch(ops, rows, dim):
    torch.manual_seed(rows + dim)
    x, residual = (torch.randn(rows, dim) * 3).bfloat16(), torch.randn(rows, dim).bfloat16()
    norm = RMSNorm(dim, 1e-5, torch.bfloat16, torch.device("cpu"))
    norm.weight.data.copy_(torch.randn(dim))
    with torch.inference_mode():
        expected_sum = x + residual
        expected = norm(expected_sum)                    # the PyTorch path (norm.ops is None)
        got, got_sum = ops.rmsnorm(x, norm.weight, 1e-5, residual)
        alone, same = ops.rmsnorm(x, norm.weight, 1e-5)
    assert torch.equal(got_sum, expected_sum)
    # Only the float32 sum of squares may be ordered differently: allow one bf16 step on a few.
    assert (got != expected).float().mean().item() < 1e-3
    assert (got.float() - expected.float()).abs().max().item() <= 2 ** -7 * expected.float().abs().max().item()
    assert same is x and (alone != norm(x)).float().mean().item() < 1e-3


@needs_kernel
@pytest.mark.parametrize("rows,inter", [(3, 1536), (20, 40), (1, 7)])
def test_silu_mul_matches_torch(ops, rows, inter):
    torch.manual_seed(inter)
    gate_up = (torch.randn(rows, 2 * inter) * 4).bfloat16()
    gate, up = gate_up.split(inter, dim=-1)
    expected = F.silu(gate) * up
    got = ops.silu_mul(gate_up)
    assert got.shape == expected.shape
    assert torch.equal(got, expected)


@needs_kernel
@pytest.mark.parametrize("heads,head_dim", [(9, 64), (3, 64), (2, 128)])
def test_rope_on_a_qkv_slice_matches_torch(ops, heads, head_dim):
    torch.manual_seed(heads * head_dim)
    n = 11
    qkv = torch.randn(n, heads * head_dim + 40).bfloat16()        # q is a strided slice of it
    q = qkv[:, :heads * head_dim].view(n, heads, head_dim)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, None, torch.device("cpu"))(torch.arange(n) * 97)
    got = ops.rope(q, cos, sin)
    assert got.is_contiguous() and torch.equal(got, _rotate(q, cos, sin))


@needs_kernel
@pytest.mark.parametrize("rows,dim", [(1, 576), (37, 576), (5, 100)])
def test_float32_add_rmsnorm_sum_exact_and_norm_within_float32_rounding(ops, rows, dim):
    torch.manual_seed(rows + dim)
    x, residual = torch.randn(rows, dim) * 3, torch.randn(rows, dim)
    norm = RMSNorm(dim, 1e-5, torch.float32, torch.device("cpu"))
    norm.weight.data.copy_(torch.randn(dim))
    with torch.inference_mode():
        expected = norm(x + residual)
        got, got_sum = ops.rmsnorm(x, norm.weight, 1e-5, residual)
    assert torch.equal(got_sum, x + residual)
    # Only the order of the sum of squares differs: a few float32 steps at most.
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("rows,inter", [(3, 1536), (20, 40), (1, 7)])
def test_float32_silu_mul_within_exp_rounding(ops, rows, inter):
    """exp_f32 (relative error ~2e-7) is not PyTorch's exp: allow a few float32 steps."""
    torch.manual_seed(inter)
    gate_up = torch.randn(rows, 2 * inter) * 4
    gate, up = gate_up.split(inter, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-7)


@needs_kernel
@pytest.mark.parametrize("heads,head_dim", [(9, 64), (2, 128)])
def test_float32_rope_on_a_qkv_slice_is_exact(ops, heads, head_dim):
    torch.manual_seed(heads * head_dim)
    n = 11
    qkv = torch.randn(n, heads * head_dim + 40)
    q = qkv[:, :heads * head_dim].view(n, heads, head_dim)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, None, torch.device("cpu"))(torch.arange(n) * 97)
    got = ops.rope(q, cos, sin)
    assert got.is_contiguous() and torch.equal(got, _rotate(q, cos, sin))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_mlp_with_them_matches_the_mlp_without(ops, dtype):
    mlp = SwiGLU(16, 24, dtype, torch.device("cpu"))
    for p in mlp.parameters():
        p.data.copy_(torch.randn(p.shape))
    x = torch.randn(4, 16).to(dtype)
    with torch.inference_mode():
        plain = mlp(x)
        mlp.ops = ops
        fused = mlp(x)
    if dtype == torch.bfloat16:
        assert torch.equal(plain, fused)
    else:
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    assert not ops.applies(x.half())   # other dtypes stay on PyTorch


@pytest.mark.parametrize("scaling,factors", [(None, None), ({"rope_type": "llama3", "factor": 8.0,
                                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                             "original_max_position_embeddings": 8192}, None),
                                             (None, tuple(1.0 + i / 16 for i in range(32)))])
def test_rope_table_rows_equal_the_computed_ones(scaling, factors):
    """cos/sin looked up in the grown table are, bit for bit, what the step's positions give
    computed on their own (float32 identity with transformers rests on it); past
    TABLE_MAX_POSITIONS, or without a limit, they are computed."""
    rope = RotaryEmbedding(64, 10000.0, scaling, torch.device("cpu"), factors)
    rng = torch.Generator().manual_seed(0)
    for limit in (1, 7, 1500, 3000, RotaryEmbedding.TABLE_MAX_POSITIONS):   # grows as the limit does
        positions = torch.randint(0, limit, (37,), generator=rng)
        positions[0] = limit - 1
        got, want = rope.forward(positions, limit), rope._compute(positions)
        assert got[0].shape == want[0].shape == (37, 1, 64)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert rope._cos.shape[0] >= limit
    assert rope._cos.shape[0] == RotaryEmbedding.TABLE_MAX_POSITIONS
    far = torch.tensor([RotaryEmbedding.TABLE_MAX_POSITIONS + 5, 3])
    got = rope.forward(far, RotaryEmbedding.TABLE_MAX_POSITIONS + 6)
    assert torch.equal(got[0], rope._compute(far)[0]) and rope._cos.shape[0] == RotaryEmbedding.TABLE_MAX_POSITIONS
    assert torch.equal(rope.forward(far)[1], rope._compute(far)[1])
