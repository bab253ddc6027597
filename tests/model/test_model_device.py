"""dtype and device resolution: what `auto` picks, explicit names, and bad values."""

from __future__ import annotations

import pytest
import torch

from radixkv.cpu.features import cpu_features
from radixkv.errors import ConfigError
from radixkv.model import device as device_module
from radixkv.model import resolve_device, resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize(("native_bf16", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_on_cpu_follows_native_bf16(monkeypatch, native_bf16, expected):
    monkeypatch.delenv(device_module.AUTO_DTYPE_ENV, raising=False)
    monkeypatch.setattr(device_module, "cpu_has_native_bf16", lambda: native_bf16)
    assert resolve_dtype("auto", CPU) == expected


def test_auto_dtype_on_cuda_is_bf16_where_supported(monkeypatch):
    monkeypatch.delenv(device_module.AUTO_DTYPE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.float16


@pytest.mark.parametrize("forced", ["float32", "bfloat16"])
@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_dtype_env_overrides_the_cpus_choice(monkeypatch, forced, native_bf16):
    """The suite runs both dtypes on any CPU through RADIXKV_AUTO_DTYPE; explicit names ignore it."""
    monkeypatch.setattr(device_module, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setenv(device_module.AUTO_DTYPE_ENV, forced)
    assert resolve_dtype("auto", CPU) == getattr(torch, forced)
    assert resolve_dtype("float16", CPU) == torch.float16


def test_auto_dtype_env_rejects_unknown_names(monkeypatch):
    monkeypatch.setenv(device_module.AUTO_DTYPE_ENV, "int8")
    with pytest.raises(ConfigError, match="RADIXKV_AUTO_DTYPE"):
        resolve_dtype("auto", CPU)


@pytest.mark.parametrize(
    ("name", "expected"), [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)]
)
def test_explicit_dtype(name, expected):
    assert resolve_dtype(name, CPU) == expected
    assert resolve_dtype(expected, CPU) == expected


@pytest.mark.parametrize("bad", ["fp32", "int8", "float64"])
def test_bad_dtype(bad):
    with pytest.raises(ConfigError, match="dtype must be one of"):
        resolve_dtype(bad, CPU)


def test_cpu_features_read_cpuinfo():
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        key = "Features" if cpu_features().machine in ("aarch64", "arm64") else "flags"
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith(key)), [])
    features = cpu_features()
    assert features.flags == frozenset(flags)
    assert device_module.cpu_has_native_bf16() == features.native_bf16


def test_resolve_device(monkeypatch):
    assert resolve_device("cpu") == CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == CPU
    with pytest.raises(ConfigError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="device must be"):
        resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
