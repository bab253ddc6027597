"""The fp32 linear kernel (radixkv/cpu/csrc/linear_f32.c, EngineConfig.linear_kernel="avx2"):
against float64 sums, row independence, odd shapes and strides, the dtype checks, and which
kernel a float32 model's linears get at load. Any x86 CPU with AVX2 runs it, so every x86
machine tests the path a user on an fp32-only CPU (Zen 1-3, Intel before Cooper Lake) takes."""

from __future__ import annotations

import pytest
import torch

from radixkv.cpu.linear import PackedLinear, can_prepack, missing_linear_kernel, resolve_linear_kernel
from radixkv.errors import ConfigError

pytestmark = pytest.mark.skipif(bool(missing_linear_kernel("avx2")), reason=f"avx2: {missing_linear_kernel('avx2')}")


def packed(in_features: int, out_features: int, bias: bool, seed: int) -> tuple[PackedLinear, torch.nn.Linear]:
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
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 32, 33, 300])
@pytest.mark.parametrize("shape", [(64, 16), (96, 40), (7, 25), (576, 960), (1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_linear_is_the_fp32_sum(rows, shape, bias):
    in_features, out_features = shape
    layer, linear = packed(in_features, out_features, bias, seed=rows)
    x = torch.randn(rows, in_features)
    y = layer(x)
    assert y.shape == (rows, out_features) and y.dtype == torch.float32
    # An fp32 sum of k products in order: each addition rounds once (relative 2^-24).
    expected = float64_reference(x, linear)
    scale = (x.double().abs() @ linear.weight.double().abs().T) + (linear.bias.double().abs() if bias else 0)
    assert ((y.double() - expected).abs() <= scale * in_features * 2**-23 + 1e-30).all()


def test_fp32_linear_rows_do_not_depend_on_the_call():
    layer, _ = packed(576, 960, bias=True, seed=1)
    x = torch.randn(37, 576)
    whole = layer(x)
    for rows in (slice(0, 1), slice(5, 9), slice(3, 36), slice(36, 37)):
        assert torch.equal(layer(x[rows]), whole[rows])


def test_fp32_linear_reads_strided_rows():
    layer, linear = packed(64, 40, bias=True, seed=2)
    wide = torch.randn(9, 100)
    x = wide[:, 10:74]  # rows 100 floats apart
    assert torch.equal(layer(x), layer(x.contiguous()))


def test_fp32_linear_names_the_expected_input():
    layer, _ = packed(64, 16, bias=False, seed=3)
    with pytest.raises(ValueError, match=r"float32 input \[rows, 64\]"):
        layer(torch.randn(2, 64).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"float32 input \[rows, 64\]"):
        layer(torch.randn(2, 65))


def test_auto_picks_the_kernel_of_the_model_dtype():
    assert resolve_linear_kernel("auto", dtype=torch.float32) == "avx2"
    assert resolve_linear_kernel("auto", native_kernels=False, dtype=torch.float32) == "onednn"
    assert resolve_linear_kernel("auto", dtype=torch.bfloat16) != "avx2"


def test_a_kernel_of_the_other_dtype_fails_naming_both():
    with pytest.raises(ConfigError, match=r"linear_kernel='avx2' runs float32 weights, and this model loads as bfloat16"):
        resolve_linear_kernel("avx2", dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"linear_kernel='avx512_bf16' runs bfloat16 weights, and this model loads as float32"):
        resolve_linear_kernel("avx512_bf16", dtype=torch.float32)


@pytest.mark.skipif(not can_prepack(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 on this CPU (the fallback)")
def test_bf16_weights_never_take_the_fp32_kernel():
    linear = torch.nn.Linear(64, 16).to(torch.bfloat16)
    assert PackedLinear(linear, "avx2").kernel == "onednn"


@pytest.mark.parametrize(("setting", "native_kernels", "expected"), [("auto", True, "avx2"), ("onednn", True, None), ("auto", False, None)])
def test_a_float32_model_loads_its_linears_for_the_setting(setting, native_kernels, expected):
    from radixkv.attention.torch_backend import TorchBackend
    from radixkv.model import load_model

    loaded = load_model(None, TorchBackend(), dtype="float32", device="cpu", native_kernels=native_kernels, linear_kernel=setting)
    linears = [module for module in loaded.model.modules() if isinstance(module, (torch.nn.Linear, PackedLinear))]
    kernels = {module.kernel if isinstance(module, PackedLinear) else None for module in linears}
    assert kernels == {expected}
