"""The Triton row ops (radixkv/kernels/row_ops.py) against the torch ops they replace, on a GPU or
on CPU under TRITON_INTERPRET=1: the rotation and the residual sum bit for bit (they round where
torch rounds), the norm and SiLU to the last bit's tolerance (sum order, exp)."""

from __future__ import annotations

import pytest
import torch

from radixkv.kernels import row_ops
from radixkv.model import row_ops as torch_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 only on a GPU: the interpreter computes bf16 wrongly.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def assert_within_two_roundings(got: torch.Tensor, expected: torch.Tensor) -> None:
    """One rounding that differs by an ulp can move a later product by one more."""
    eps = torch.finfo(expected.dtype).eps
    torch.testing.assert_close(got, expected, rtol=2 * eps, atol=2 * eps * float(expected.abs().max()))


def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim"), [(1, 64), (5, 576), (33, 1000)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_torch(dtype, rows, dim, with_delta):
    x = randn(rows, dim, dtype=dtype, scale=3.0, seed=1)
    delta = randn(rows, dim, dtype=dtype, seed=2) if with_delta else None
    weight = randn(dim, dtype=dtype, seed=3)
    expected_x, expected = torch_ops.add_rms_norm(x.clone(), delta, weight, 1e-5, native=False)
    given = x.clone()
    summed, normed = row_ops.add_rms_norm(given, delta, weight, 1e-5)
    assert summed.data_ptr() == given.data_ptr()  # updated in place
    assert torch.equal(summed, expected_x)  # one rounding of the sum, as torch's
    assert_within_two_roundings(normed, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "head_dim"), [(12, 64), (3, 128), (5, 16)])
def test_rope_rotates_in_place_bit_for_bit(dtype, heads, head_dim):
    tokens = 7
    # A q/k slice of a wider qkv row, as the model passes it: heads side by side, rows apart.
    qkv = randn(tokens, heads * head_dim + 40, dtype=dtype, scale=2.0, seed=4)
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    cos, signed_sin = randn(tokens, head_dim, dtype=dtype, seed=5), randn(tokens, head_dim, dtype=dtype, seed=6)
    expected = torch_ops.apply_rope(x.clone(), cos, signed_sin, native=False)
    untouched = qkv[:, heads * head_dim :].clone()
    rotated = row_ops.apply_rope(x, cos, signed_sin)
    assert rotated.data_ptr() == x.data_ptr()
    assert torch.equal(rotated, expected)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)  # the v part of the row is left alone


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim"), [(1, 100), (9, 1536), (3, 2500)])
def test_silu_mul_matches_torch(dtype, rows, dim):
    gate_up = randn(rows, 2 * dim, dtype=dtype, scale=4.0, seed=7)
    assert_within_two_roundings(row_ops.silu_mul(gate_up), torch_ops.silu_mul(gate_up, native=False))


def test_empty_batches_launch_nothing():
    dtype = torch.float32
    x, weight = randn(0, 64, dtype=dtype), randn(64, dtype=dtype)
    assert row_ops.add_rms_norm(x, None, weight, 1e-5)[1].shape == (0, 64)
    assert row_ops.apply_rope(randn(0, 2, 16, dtype=dtype), randn(0, 16, dtype=dtype), randn(0, 16, dtype=dtype)).shape == (0, 2, 16)
    assert row_ops.silu_mul(randn(0, 64, dtype=dtype)).shape == (0, 32)
