"""Packed bf16 linears (radixkv/cpu/linear.py): the AMX kernel against fp32 sums and
against oneDNN, row independence, odd shapes, and the oneDNN fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixkv.cpu import native
from radixkv.cpu.features import cpu_features
from radixkv.cpu.linear import PackedLinear, can_prepack

BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif(not can_prepack(BF16, torch.device("cpu")), reason="no oneDNN bf16 on this CPU")


def amx_available() -> bool:
    library = native.load()
    return cpu_features().amx_bf16 and library is not None and bool(library.radixkv_amx_linear_available())


needs_amx = pytest.mark.skipif(not amx_available(), reason="needs AMX tiles (amx_bf16) and the native kernels")


def packed(in_features: int, out_features: int, bias: bool, seed: int) -> tuple[PackedLinear, torch.nn.Linear]:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).to(BF16)
    return PackedLinear(linear), linear



def rounded_fp32_reference(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    y = x.float() @ linear.weight.float().T
    if linear.bias is not None:
        y = y + linear.bias.float()
    return y


@needs_amx
@pytest.mark.parametrize("rows", [0, 1, 15, 16, 17, 32, 33, 257, 300])  # one/two A tiles, row groups of 256
@pytest.mark.parametrize("shape", [(64, 16), (96, 40), (576, 960), (1536, 576)])  # 40: a half-filled pair
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_is_the_fp32_sum_rounded_once(rows, shape, bias):
    layer, linear = packed(*shape, bias=bias, seed=rows + shape[1])
    assert layer.rows_independent and "kernel=amx" in repr(layer)
    x = torch.randn(rows, shape[0]).to(BF16)
    y = layer(x)
    assert y.shape == (rows, shape[1]) and y.dtype == BF16
    # fp32 sums in another order differ in their last bits, so the bf16 result by one step at most.
    torch.testing.assert_close(y.float(), rounded_fp32_reference(x, linear), rtol=2**-7, atol=1e-3)


@needs_amx
@pytest.mark.parametrize("rows", [1, 4, 32])
def test_amx_linear_matches_onednn_bit_for_bit_at_decode_row_counts(rows):
    layer, linear = packed(576, 3072, bias=False, seed=rows)
    x = torch.randn(rows, 576).to(BF16)
    assert torch.equal(layer(x), F.linear(x, linear.weight))


@needs_amx
def test_amx_linear_rows_do_not_depend_on_the_call():
    layer, _ = packed(576, 960, bias=True, seed=1)
    x = torch.randn(600, 576).to(BF16)
    whole = layer(x)
    for start, stop in [(0, 1), (5, 6), (100, 133), (250, 270), (599, 600), (17, 300)]:
        assert torch.equal(layer(x[start:stop]), whole[start:stop])


@needs_amx
def test_amx_linear_reads_strided_rows():
    layer, linear = packed(64, 48, bias=False, seed=2)
    wide = torch.randn(9, 200).to(BF16)
    x = wide[:, 10:74]  # rows 200 apart
    assert torch.equal(layer(x), layer(x.contiguous()))


@needs_amx
def test_amx_linear_names_the_expected_input():
    layer, _ = packed(64, 16, bias=False, seed=3)
    with pytest.raises(ValueError, match=r"bf16 input \[rows, 64\]"):
        layer(torch.randn(2, 64))


def test_widths_the_tiles_cannot_take_fall_back_to_onednn():
    layer, linear = packed(48, 32, bias=True, seed=4)  # 48 inputs: not a multiple of 32
    assert not layer.rows_independent and "kernel=onednn" in repr(layer)
    x = torch.randn(5, 48).to(BF16)
    assert torch.equal(layer(x), F.linear(x, linear.weight, linear.bias))


def test_native_off_keeps_onednn():
    torch.manual_seed(5)
    linear = torch.nn.Linear(64, 32, bias=True).to(BF16)
    layer = PackedLinear(linear, native=False)  # EngineConfig.native_kernels=False
    assert not layer.rows_independent and "kernel=onednn" in repr(layer)
    x = torch.randn(5, 64).to(BF16)
    assert torch.equal(layer(x), F.linear(x, linear.weight, linear.bias))
