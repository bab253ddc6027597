"""Packed linears (radixkv/cpu/linear.py). bf16: each native kernel (AMX, AVX512_BF16) against
fp32 sums, AMX against oneDNN, row independence, odd shapes, the oneDNN fallback, and the kernel
EngineConfig.linear_kernel resolves to; every native kernel this CPU can run is tested, whichever
`auto` picks, and a skip names the missing CPU feature. fp32 (csrc/linear_f32.c,
linear_kernel="avx2"): against float64 sums, row independence, odd shapes and strides, the dtype
checks, and which kernel a float32 model's linears get at load. Any x86 CPU with AVX2 runs it, so
every x86 machine tests the path a user on an fp32-only CPU (Zen 1-3, Intel before Cooper Lake) takes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixkv.cpu.linear import PackedLinear, can_prepack, linear_kernels_for, missing_linear_kernel, resolve_linear_kernel
from radixkv.errors import ConfigError

BF16 = torch.bfloat16
BF16_KERNELS = linear_kernels_for(BF16)  # the fp32 kernel: its own tests below

# Every bf16 test needs oneDNN's bf16 linear, the fallback and the yardstick of the native kernels.
# torch's oneDNN takes bf16 on x86 CPUs with avx512bw, avx512vl and avx512dq (or on ARM's bf16).
ONEDNN_BF16_MISSING = "oneDNN's bf16 linear needs avx512bw, avx512vl and avx512dq, which this CPU lacks"
needs_bf16 = pytest.mark.skipif(not can_prepack(BF16, torch.device("cpu")), reason=ONEDNN_BF16_MISSING)


def runs(kernel: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(bool(missing_linear_kernel(kernel)), reason=f"{kernel}: {missing_linear_kernel(kernel)}")


needs_amx = runs("amx")
NATIVE = [pytest.param(kernel, marks=runs(kernel)) for kernel in BF16_KERNELS]


def packed(in_features: int, out_features: int, bias: bool, seed: int, kernel: str = "amx") -> tuple[PackedLinear, torch.nn.Linear]:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).to(BF16)
    return PackedLinear(linear, kernel), linear


def rounded_fp32_reference(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    y = x.float() @ linear.weight.float().T
    if linear.bias is not None:
        y = y + linear.bias.float()
    return y


@needs_bf16
@pytest.mark.parametrize("kernel", NATIVE)
# one/two AMX A tiles, vdpbf16ps blocks of 8 rows and their tails, row groups (L2-sized)
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 15, 16, 17, 32, 33, 257, 300, 2000])
@pytest.mark.parametrize("shape", [(64, 16), (96, 40), (576, 960), (1536, 576)])  # 40: a half-filled pair
@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_is_the_fp32_sum_rounded_once(kernel, rows, shape, bias):
    layer, linear = packed(*shape, bias=bias, seed=rows + shape[1], kernel=kernel)
    assert layer.rows_independent and f"kernel={kernel}" in repr(layer)
    x = torch.randn(rows, shape[0]).to(BF16)
    y = layer(x)
    assert y.shape == (rows, shape[1]) and y.dtype == BF16
    # fp32 sums in another order differ in their last bits, so the bf16 result by one step at most.
    torch.testing.assert_close(y.float(), rounded_fp32_reference(x, linear), rtol=2**-7, atol=1e-3)


@needs_bf16
@needs_amx
@pytest.mark.parametrize("rows", [1, 4, 32])
def test_amx_linear_matches_onednn_bit_for_bit_at_decode_row_counts(rows):
    layer, linear = packed(576, 3072, bias=False, seed=rows)
    x = torch.randn(rows, 576).to(BF16)
    assert torch.equal(layer(x), F.linear(x, linear.weight))


@needs_bf16
@pytest.mark.parametrize("kernel", NATIVE)
def test_native_linear_rows_do_not_depend_on_the_call(kernel):
    layer, _ = packed(576, 960, bias=True, seed=1, kernel=kernel)
    x = torch.randn(2100, 576).to(BF16)  # more rows than one L2-sized group
    whole = layer(x)
    for start, stop in [(0, 1), (5, 6), (100, 133), (250, 270), (599, 600), (17, 300), (3, 2100)]:
        assert torch.equal(layer(x[start:stop]), whole[start:stop])


@needs_bf16
@pytest.mark.parametrize("kernel", NATIVE)
def test_native_linear_reads_strided_rows(kernel):
    layer, linear = packed(64, 48, bias=False, seed=2, kernel=kernel)
    wide = torch.randn(9, 200).to(BF16)
    x = wide[:, 10:74]  # rows 200 apart
    assert torch.equal(layer(x), layer(x.contiguous()))


@needs_bf16
@pytest.mark.parametrize("kernel", NATIVE)
def test_native_linear_names_the_expected_input(kernel):
    layer, _ = packed(64, 16, bias=False, seed=3, kernel=kernel)
    with pytest.raises(ValueError, match=r"bfloat16 input \[rows, 64\]"):
        layer(torch.randn(2, 64))


@needs_bf16
def test_widths_the_tiles_cannot_take_fall_back_to_onednn():
    layer, linear = packed(48, 32, bias=True, seed=4)  # 48 inputs: not a multiple of 32
    assert not layer.rows_independent and "kernel=onednn" in repr(layer)
    x = torch.randn(5, 48).to(BF16)
    assert torch.equal(layer(x), F.linear(x, linear.weight, linear.bias))


@needs_bf16
def test_native_off_keeps_onednn():
    torch.manual_seed(5)
    linear = torch.nn.Linear(64, 32, bias=True).to(BF16)
    layer = PackedLinear(linear, resolve_linear_kernel("auto", native_kernels=False))  # EngineConfig.native_kernels=False
    assert not layer.rows_independent and "kernel=onednn" in repr(layer)
    x = torch.randn(5, 64).to(BF16)
    assert torch.equal(layer(x), F.linear(x, linear.weight, linear.bias))


@needs_bf16
@pytest.mark.parametrize("kernel", NATIVE)
def test_the_two_native_kernels_agree_within_rounding(kernel):
    # Either kernel against the other where both run (an AMX machine): same layout, other sums.
    other = next(name for name in BF16_KERNELS if name != kernel)
    if missing_linear_kernel(other):
        pytest.skip(f"{other}: {missing_linear_kernel(other)}")
    a, linear = packed(576, 960, bias=True, seed=9, kernel=kernel)
    b = PackedLinear(linear, other)
    x = torch.randn(40, 576).to(BF16)
    torch.testing.assert_close(a(x).float(), b(x).float(), rtol=2**-7, atol=1e-3)


@needs_bf16
def test_auto_picks_a_native_kernel_where_one_runs():
    runnable = [name for name in BF16_KERNELS if not missing_linear_kernel(name)]
    assert resolve_linear_kernel("auto") == (runnable[0] if runnable else "onednn")
    assert resolve_linear_kernel("onednn") == "onednn"


@needs_bf16
@pytest.mark.parametrize("kernel", BF16_KERNELS)
def test_a_named_kernel_that_cannot_run_fails_naming_why(kernel):
    reason = missing_linear_kernel(kernel)
    if not reason:
        assert resolve_linear_kernel(kernel) == kernel
        return
    with pytest.raises(ConfigError, match=f"linear_kernel='{kernel}' cannot run here: "):
        resolve_linear_kernel(kernel)


# ---- The fp32 kernel (csrc/linear_f32.c) ----

needs_avx2 = pytest.mark.skipif(bool(missing_linear_kernel("avx2")), reason=f"avx2: {missing_linear_kernel('avx2')}")


def packed_f32(in_features: int, out_features: int, bias: bool, seed: int) -> tuple[PackedLinear, torch.nn.Linear]:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    layer = PackedLinear(linear, "avx2")
    assert layer.kernel == "avx2" and layer.rows_independent
    return layer, linear


def float64_reference(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    y = x.double() @ linear.weight.double().T
    return y + linear.bias.double() if linear.bias is not None else y


# Blocks of 4 rows and their tails, row groups (x past 256 KiB), panels of 24 features and a
# last one partly padding (16, 40, 25), inputs of any count (7).
@needs_avx2
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 32, 33, 300])
@pytest.mark.parametrize("shape", [(64, 16), (96, 40), (7, 25), (576, 960), (1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_linear_is_the_fp32_sum(rows, shape, bias):
    in_features, out_features = shape
    layer, linear = packed_f32(in_features, out_features, bias, seed=rows)
    x = torch.randn(rows, in_features)
    y = layer(x)
    assert y.shape == (rows, out_features) and y.dtype == torch.float32
    # An fp32 sum of k products in order: each addition rounds once (relative 2^-24).
    expected = float64_reference(x, linear)
    scale = (x.double().abs() @ linear.weight.double().abs().T) + (linear.bias.double().abs() if bias else 0)
    assert ((y.double() - expected).abs() <= scale * in_features * 2**-23 + 1e-30).all()


@needs_avx2
def test_fp32_linear_rows_do_not_depend_on_the_call():
    layer, _ = packed_f32(576, 960, bias=True, seed=1)
    x = torch.randn(37, 576)
    whole = layer(x)
    for rows in (slice(0, 1), slice(5, 9), slice(3, 36), slice(36, 37)):
        assert torch.equal(layer(x[rows]), whole[rows])


@needs_avx2
def test_fp32_linear_reads_strided_rows():
    layer, linear = packed_f32(64, 40, bias=True, seed=2)
    wide = torch.randn(9, 100)
    x = wide[:, 10:74]  # rows 100 floats apart
    assert torch.equal(layer(x), layer(x.contiguous()))


@needs_avx2
def test_fp32_linear_names_the_expected_input():
    layer, _ = packed_f32(64, 16, bias=False, seed=3)
    with pytest.raises(ValueError, match=r"float32 input \[rows, 64\]"):
        layer(torch.randn(2, 64).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"float32 input \[rows, 64\]"):
        layer(torch.randn(2, 65))


@needs_avx2
def test_auto_picks_the_kernel_of_the_model_dtype():
    assert resolve_linear_kernel("auto", dtype=torch.float32) == "avx2"
    assert resolve_linear_kernel("auto", native_kernels=False, dtype=torch.float32) == "onednn"
    assert resolve_linear_kernel("auto", dtype=torch.bfloat16) != "avx2"


@needs_avx2
def test_a_kernel_of_the_other_dtype_fails_naming_both():
    with pytest.raises(ConfigError, match=r"linear_kernel='avx2' runs float32 weights, and this model loads as bfloat16"):
        resolve_linear_kernel("avx2", dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"linear_kernel='avx512_bf16' runs bfloat16 weights, and this model loads as float32"):
        resolve_linear_kernel("avx512_bf16", dtype=torch.float32)


@needs_avx2
@pytest.mark.skipif(not can_prepack(torch.bfloat16, torch.device("cpu")), reason=ONEDNN_BF16_MISSING + " (the fallback)")
def test_bf16_weights_never_take_the_fp32_kernel():
    linear = torch.nn.Linear(64, 16).to(torch.bfloat16)
    assert PackedLinear(linear, "avx2").kernel == "onednn"


@needs_avx2
@pytest.mark.parametrize(("setting", "native_kernels", "expected"), [("auto", True, "avx2"), ("onednn", True, None), ("auto", False, None)])
def test_a_float32_model_loads_its_linears_for_the_setting(setting, native_kernels, expected):
    from radixkv.attention.torch_backend import TorchBackend
    from radixkv.model import load_model

    loaded = load_model(None, TorchBackend(), dtype="float32", device="cpu", native_kernels=native_kernels, linear_kernel=setting, weight_dtype="float")
    linears = [module for module in loaded.model.modules() if isinstance(module, (torch.nn.Linear, PackedLinear))]
    kernels = {module.kernel if isinstance(module, PackedLinear) else None for module in linears}
    assert kernels == {expected}

