"""The row kernels (radixkv/cpu/row_ops.py over csrc/row_ops.c), bf16 and fp32, against the torch
ops they replace (radixkv/model/row_ops.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixkv.cpu import native, row_ops
from radixkv.model.row_ops import rms_norm, torch_rope

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler: the row kernels are not built")

BF16 = torch.bfloat16


@pytest.mark.parametrize("dim", [576, 40])  # 40: not a multiple of 16, the scalar loop
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 runs on all threads
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_is_bit_identical_to_the_torch_ops(dim, rows, with_delta):
    gen = torch.Generator().manual_seed(dim + rows)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(BF16)
    delta = torch.randn(rows, dim, generator=gen).to(BF16) if with_delta else None
    weight = torch.randn(dim, generator=gen).to(BF16)
    expected_x = x + delta if with_delta else x.clone()
    expected = rms_norm(expected_x, weight, 1e-5)
    new_x, normed = row_ops.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(new_x, expected_x)
    assert torch.equal(normed, expected)
    if with_delta:  # the residual stream is updated in place
        assert torch.equal(x, expected_x)


@pytest.mark.parametrize("head_dim", [64, 128, 48])  # 48: half not a multiple of 16, scalar loop
def test_rope_in_place_is_bit_identical_to_the_torch_ops(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    rows, q_heads, kv_heads = 9, 6, 2
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(BF16)
    qk = qkv[:, : (q_heads + kv_heads) * head_dim].view(rows, q_heads + kv_heads, head_dim)
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(BF16)
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1).to(BF16)
    expected = torch_rope(qk.clone(), cos, signed_sin)
    v_before = qkv[:, (q_heads + kv_heads) * head_dim :].clone()
    out = row_ops.apply_rope(qk, cos, signed_sin)
    assert out.data_ptr() == qk.data_ptr()  # rotated where it lies
    assert torch.equal(out, expected)
    assert torch.equal(qkv[:, (q_heads + kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dim", [1536, 24])
def test_silu_mul_matches_the_torch_ops(dim):
    gen = torch.Generator().manual_seed(dim)
    gate_up = (torch.randn(33, 2 * dim, generator=gen) * 4).to(BF16)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = row_ops.silu_mul(gate_up)
    # exp is computed differently from torch's (both about 1 ulp in fp32): a rounding to bf16
    # may land one step apart now and then, never more.
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=0)
    assert (out == expected).float().mean() > 0.99


@pytest.mark.parametrize("dim", [576, 44])  # 44: a tail past the last 8-lane vector
@pytest.mark.parametrize("rows", [1, 300])  # 300 x 576 runs on all threads
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_in_float32_matches_the_torch_ops(dim, rows, with_delta):
    gen = torch.Generator().manual_seed(dim + rows)
    x, weight = torch.randn(rows, dim, generator=gen) * 3, torch.randn(dim, generator=gen)
    delta = torch.randn(rows, dim, generator=gen) if with_delta else None
    expected_x = x + delta if with_delta else x.clone()
    expected = rms_norm(expected_x, weight, 1e-5)
    new_x, normed = row_ops.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(new_x, expected_x) and torch.equal(x, expected_x)  # the add rounds once, in place
    # Only the sum of squares is ordered differently: a few ulp in 1 / rms, none in the rest.
    torch.testing.assert_close(normed, expected, rtol=4e-7, atol=0)


@pytest.mark.parametrize("head_dim", [64, 20])  # 20: half of it past the last 8-lane vector
def test_rope_in_float32_is_bit_identical_to_the_torch_ops(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    rows, heads = 5, 4
    qkv = torch.randn(rows, (heads + 1) * head_dim, generator=gen)
    qk = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1)
    expected, last_head = torch_rope(qk.clone(), cos, signed_sin), qkv[:, heads * head_dim :].clone()
    assert torch.equal(row_ops.apply_rope(qk, cos, signed_sin), expected)
    assert torch.equal(qkv[:, heads * head_dim :], last_head)  # past the heads: untouched


@pytest.mark.parametrize("dim", [1536, 20])
def test_silu_mul_in_float32_matches_the_torch_ops(dim):
    gen = torch.Generator().manual_seed(dim)
    gate_up = torch.randn(33, 2 * dim, generator=gen) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    # exp differs from torch's by about an ulp, the rest rounds as torch does.
    torch.testing.assert_close(row_ops.silu_mul(gate_up), F.silu(gate) * up, rtol=4e-7, atol=1e-30)


def test_tensors_the_kernels_do_not_take_are_left_to_the_caller():
    # float16, or a row with a strided last dim: None, and the torch ops run (radixkv.model.row_ops).
    x = torch.randn(3, 64).half()
    assert row_ops.add_rms_norm(x, None, torch.ones(64).half(), 1e-5) is None
    assert row_ops.silu_mul(torch.randn(3, 64, 2)[..., 0]) is None
    assert row_ops.apply_rope(torch.randn(3, 2, 16).half(), torch.ones(3, 16).half(), torch.ones(3, 16).half()) is None


def _torch_gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma3RMSNorm: fp32 throughout, times (1 + w), cast once."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=str)
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 40])  # 40 x 640 runs on all threads
def test_gemma_norm_against_transformers_ops(dtype, with_delta, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 640, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, 640, generator=gen).to(dtype) if with_delta else None
    weight = (torch.randn(640, generator=gen) * 0.5).to(dtype)
    expected_x = x + delta if with_delta else x.clone()
    expected = _torch_gemma_norm(expected_x, weight, 1e-6)
    normed = row_ops.gemma_norm(x, weight, 1e-6, delta)
    assert torch.equal(x, expected_x)  # the residual add in place, rounded as torch's
    # The sum of squares is ordered otherwise: within an ulp or two of the model dtype.
    torch.testing.assert_close(normed, expected, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=str)
def test_gemma_norm_over_heads_of_a_strided_row(dtype):
    """The per-head q norm over the q heads of a fused qkv row (row stride wider than the heads)."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(7, (4 + 2) * 32, generator=gen).to(dtype)
    q = qkv[:, : 4 * 32].view(7, 4, 32)
    weight = torch.randn(32, generator=gen).to(dtype)
    before = qkv.clone()
    normed = row_ops.gemma_norm(q, weight, 1e-6)
    torch.testing.assert_close(normed, _torch_gemma_norm(q, weight, 1e-6), rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
    assert torch.equal(qkv, before)  # a new tensor: the qkv row untouched


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=str)
@pytest.mark.parametrize("dim", [2048, 40])  # 40: a vector tail
def test_gelu_mul_against_the_torch_ops(dtype, dim):
    gen = torch.Generator().manual_seed(dim)
    gate_up = (torch.randn(3, 2 * dim, generator=gen) * 4).to(dtype)
    gate_up[0, :8] = torch.tensor([-100.0, -20.0, -5.0, 0.0, 1e-4, 5.0, 20.0, 100.0]).to(dtype)  # both tanh saturations
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.gelu(gate, approximate="tanh") * up
    got = row_ops.gelu_mul(gate_up)
    assert torch.isfinite(got).all()
    # tanh as 1 - 2 / (e^2u + 1) and a polynomial exp: a few fp32 ulps before any rounding.
    torch.testing.assert_close(got, expected, rtol=2 * torch.finfo(dtype).eps if dtype == BF16 else 1e-5, atol=1e-5)
