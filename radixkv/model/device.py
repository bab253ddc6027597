"""Resolving EngineConfig's device and dtype strings to torch objects.

`auto` picks CUDA when present, and bf16 where the hardware computes it natively (CUDA with bf16
support; CPUs with AMX, AVX512_BF16 or aarch64 bf16); elsewhere fp32, since there bf16 is emulated.
RADIXKV_AUTO_DTYPE, when set, is what `auto` means instead, so one machine can run every path.
"""

from __future__ import annotations

import os

import torch

from radixkv.config import DTYPES
from radixkv.cpu.features import cpu_has_native_bf16
from radixkv.errors import ConfigError

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_device(device: str | torch.device) -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cpu', 'cuda', 'cuda:N' as given."""
    if isinstance(device, torch.device):
        resolved = device
    elif device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            resolved = torch.device(device)
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} requested but CUDA is not available to this torch build")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {device!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' -> bf16 on CUDA (fp16 on GPUs without bf16) or a CPU with native bf16
    arithmetic (AMX, AVX512_BF16, aarch64 bf16), else fp32."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        return dtype
    if dtype == "auto":
        if forced := auto_dtype_override():
            return _DTYPES[forced]
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return _DTYPES[dtype]


# Why an environment variable: "auto" is the default in every config, server worker and scenario
# subprocess, and the suite must run both dtypes on whichever CPU CI draws (tests/README.md).
AUTO_DTYPE_ENV = "RADIXKV_AUTO_DTYPE"


def auto_dtype_override() -> str | None:
    """The dtype RADIXKV_AUTO_DTYPE makes `auto` mean (one of DTYPES but auto), or None when unset."""
    value = os.environ.get(AUTO_DTYPE_ENV, "").strip()
    if not value:
        return None
    if value not in _DTYPES:
        raise ConfigError(f"{AUTO_DTYPE_ENV} must be one of {tuple(_DTYPES)}, got {value!r}")
    return value
