"""The row ops the model calls (radixkv/model/row_ops.py): the fused kernels where native is on
and they take the tensors, the torch ops they replace otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixkv.cpu import native
from radixkv.cpu import row_ops as cpu_row_ops
from radixkv.model import row_ops

BF16 = torch.bfloat16


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_native_off_takes_the_torch_ops(dtype):
    # EngineConfig.native_kernels=False: the model passes native=False to every row op.
    gen = torch.Generator().manual_seed(3)
    x, delta, weight = ((torch.randn(shape, generator=gen) * 3).to(dtype) for shape in ((5, 40), (5, 40), (40,)))
    new_x, normed = row_ops.add_rms_norm(x.clone(), delta, weight, 1e-5, native=False)
    assert torch.equal(new_x, x + delta)
    assert torch.equal(normed, row_ops.rms_norm(x + delta, weight, 1e-5))
    gate_up = torch.randn(3, 48, generator=gen).to(dtype)
    gate, up = gate_up.chunk(2, -1)
    assert torch.equal(row_ops.silu_mul(gate_up, native=False), F.silu(gate) * up)


@pytest.mark.skipif(native.load() is None, reason="no C compiler: the row kernels are not built")
def test_native_on_runs_the_cpu_kernels_in_place():
    # On CPU the fused paths update the residual stream and rotate q/k where they lie.
    gen = torch.Generator().manual_seed(4)
    x, delta, weight = (torch.randn(shape, generator=gen) for shape in ((5, 40), (5, 40), (40,)))
    given = x.clone()
    new_x, normed = row_ops.add_rms_norm(given, delta, weight, 1e-5)
    assert new_x.data_ptr() == given.data_ptr() and torch.equal(given, x + delta)
    torch.testing.assert_close(normed, row_ops.rms_norm(x + delta, weight, 1e-5), rtol=4e-7, atol=0)
    qk = torch.randn(5, 3, 16, generator=gen)
    cos, sin = torch.randn(5, 16, generator=gen), torch.randn(5, 16, generator=gen)
    expected = row_ops.torch_rope(qk.clone(), cos, sin)
    assert row_ops.apply_rope(qk, cos, sin).data_ptr() == qk.data_ptr()
    assert torch.equal(qk, expected)


@pytest.mark.skipif(native.load() is None, reason="no C compiler: the row kernels are not built")
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_native_per_head_norm_is_the_add_rms_norm_kernel_over_heads(dtype):
    # Qwen3's q/k norms (native on CPU): each head a row of the add_rms_norm kernel, whatever the
    # layout the heads come in (a strided slice of qkv is read, never written), so the fused
    # decode step, which calls that kernel over each row's heads, gets the same bits.
    gen = torch.Generator().manual_seed(5)
    qkv = (torch.randn(3, 5 * 32, generator=gen) * 2).to(dtype)
    weight = (1 + 0.2 * torch.randn(32, generator=gen)).to(dtype)
    given = qkv.clone()
    k = qkv[:, 4 * 32 :].view(3, 1, 32)  # one kv head: a strided [3, 32] view
    normed = row_ops.rms_norm(k, weight, 1e-6, native=True)
    assert torch.equal(qkv, given) and normed.shape == k.shape
    for r in range(3):
        _, row = cpu_row_ops.add_rms_norm(k[r].contiguous(), None, weight, 1e-6)
        assert torch.equal(normed[r], row)
    torch.testing.assert_close(normed, row_ops.rms_norm(k, weight, 1e-6), rtol=1e-2 if dtype == BF16 else 4e-7, atol=0)
