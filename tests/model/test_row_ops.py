"""The row kernels (radixkv/cpu/csrc/row_ops.c), bf16 and fp32, against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixkv.cpu import native
from radixkv.cpu import row_ops

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler: the row kernels are not built")

BF16 = torch.bfloat16


def torch_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin[:, None]


@pytest.mark.parametrize("dim", [576, 40])  # 40: not a multiple of 16, the scalar loop
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 runs on all threads
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_is_bit_identical_to_the_torch_ops(dim, rows, with_delta):
    gen = torch.Generator().manual_seed(dim + rows)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(BF16)
    delta = torch.randn(rows, dim, generator=gen).to(BF16) if with_delta else None
    weight = torch.randn(dim, generator=gen).to(BF16)
    expected_x = x + delta if with_delta else x.clone()
    expected = row_ops.rms_norm(expected_x, weight, 1e-5)
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
    expected = row_ops.rms_norm(expected_x, weight, 1e-5)
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


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_native_off_takes_the_torch_ops(dtype):
    # EngineConfig.native_kernels=False: the model passes native=False to every row op.
    gen = torch.Generator().manual_seed(3)
    x, delta, weight = ((torch.randn(shape, generator=gen) * 3).to(dtype) for shape in ((5, 40), (5, 40), (40,)))
    new_x, normed = row_ops.add_rms_norm(x.clone(), delta, weight, 1e-5, native=False)
    assert torch.equal(normed, row_ops.rms_norm(x + delta, weight, 1e-5))
    gate_up = torch.randn(3, 48, generator=gen).to(dtype)
    gate, up = gate_up.chunk(2, -1)
    assert torch.equal(row_ops.silu_mul(gate_up, native=False), F.silu(gate) * up)
