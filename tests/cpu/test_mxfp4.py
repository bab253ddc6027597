"""The MXFP4 grouped expert kernel (radixkv/cpu/mxfp4.py over csrc/moe_mxfp4.c): every compiled
path (AVX-512, AVX2, portable) gives torch_mxfp4_linear's bits, for tokens and rows across the
kernel's 4-token passes and 32-row tiles, with and without biases, over subnormal and large scales."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixkv.cpu import mxfp4
from radixkv.cpu import native

if native.load() is None:
    pytest.skip("the native library could not be built here", allow_module_level=True)

# The CPU feature each path needs, for the skip that names it.
FEATURES = {"avx512": "AVX-512 F", "avx2": "AVX2", "portable": "none"}


def random_experts(rng: np.random.Generator, experts: int, rows: int, k: int) -> np.ndarray:
    """Stacked experts' blocks [E, rows, k / 32 * 17] with random codes; scales around 2^0, and
    the subnormal scale bytes 0 and 1 in a few blocks."""
    blocks = rng.integers(0, 256, size=(experts, rows, k // 32, 17), dtype=np.uint8)
    blocks[..., 0] = rng.integers(120, 132, size=blocks.shape[:-1])
    blocks[0, 0, 0, 0], blocks[-1, -1, -1, 0] = 0, 1
    return blocks.reshape(experts, rows, -1)


@pytest.mark.parametrize("kernel", list(mxfp4.KERNELS))
@pytest.mark.parametrize(("rows", "k"), [(70, 96), (32, 32), (5, 2880)])
@pytest.mark.parametrize("biased", [True, False], ids=["bias", "no-bias"])
def test_every_path_gives_the_references_bits(kernel, rows, k, biased):
    if kernel not in mxfp4.compiled_kernels():
        pytest.skip(f"the {kernel} path needs {FEATURES[kernel]}, which this CPU lacks")
    rng = np.random.default_rng(rows * k)
    weights = random_experts(rng, 4, rows, k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(k))
    bias = torch.randn(4, rows) if biased else None
    # Experts 0 (one token), 1 (seven: a full pass of 4 and a short one) and 3 (one); 2 unrouted.
    experts, offsets = torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([0, 1, 8, 9], dtype=torch.int32)
    tokens = torch.tensor([4, 0, 1, 2, 5, 6, 7, 8, 3])
    wide = torch.full((9, rows + 3), 7.0)  # out as a view with a wider row stride
    out = wide[:, :rows]
    mxfp4.native_mxfp4(weights, x, experts, offsets, tokens, out, bias, kernel)
    for g, expert in enumerate(experts.tolist()):
        start, stop = int(offsets[g]), int(offsets[g + 1])
        expected = mxfp4.torch_mxfp4_linear(x[tokens[start:stop]], weights[expert], k, None if bias is None else bias[expert])
        assert torch.equal(out[start:stop], expected), f"{kernel}: expert {expert}"
    assert (wide[:, rows:] == 7.0).all(), "the kernel wrote past its rows"


def test_the_reference_is_the_dequantized_product():
    """The lane order changes only the rounding: the reference is x W^T within fp32's error."""
    rng = np.random.default_rng(1)
    weights = random_experts(rng, 1, 40, 256)[0]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    product = x.double() @ mxfp4.dequantize_mxfp4(weights, 256).double().T
    torch.testing.assert_close(mxfp4.torch_mxfp4_linear(x, weights, 256).double(), product, rtol=1e-5, atol=1e-4)


def test_indices_out_of_range_are_refused_before_the_kernel_reads():
    weights = random_experts(np.random.default_rng(2), 2, 8, 32)
    x, out = torch.randn(3, 32), torch.empty(3, 8)
    offsets = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(IndexError, match="expert id"):
        mxfp4.native_mxfp4(weights, x, torch.tensor([2], dtype=torch.int32), offsets, torch.arange(3), out)
    with pytest.raises(IndexError, match="routed row"):
        mxfp4.native_mxfp4(weights, x, torch.tensor([1], dtype=torch.int32), offsets, torch.tensor([0, 1, 3]), out)
    with pytest.raises(ValueError, match="not compiled"):
        mxfp4.native_mxfp4(weights, x, torch.tensor([1], dtype=torch.int32), offsets, torch.arange(3), out, kernel="neon")
