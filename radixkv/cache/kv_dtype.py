"""The storage dtype of KV pages (EngineConfig.kv_dtype), apart from the compute dtype: the
names, which need a scale per (token, KV head), and the symmetric int8 quantization every
writer of int8 pages shares (the native and Triton stores round the same way).
"""

from __future__ import annotations

import torch

from radixkv.errors import ConfigError

KV_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}
# int8 pages keep one scale per (token, KV head) in fp16: 2 bytes beside head_dim bytes of K or
# V (3 % at head_dim 64, against fp32's 6 %: 1.94x bf16's tokens per byte instead of 1.88x).
# The scale is rounded to fp16 before the row is quantized with it, so the rounding costs no
# accuracy beyond int8's own step; the kernels widen one scale per row.
SCALE_DTYPE = torch.float16
INT8_MAX = 127.0
# A nonzero row's scale is clamped into fp16's normal range: above FP16_MAX (|x| > 8.3e6) it
# would be inf, and a subnormal one (|x| < 7.8e-3) loses relative precision and may flush to
# zero on hardware that flushes denormals; a clamped-up scale only coarsens such a tiny row's
# steps to 2^-14 (an absolute error of at most 2^-15), a clamped-down one saturates at +-127.
FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0**-14
# e4m3's largest finite value: torch's cast to float8_e4m3fn does not saturate (NaN past it).
FP8_E4M3_MAX = 448.0


def resolve_kv_dtype(name: str, compute_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The torch dtype pages are stored in: "auto" is the compute dtype; "fp8" only on a CUDA
    GPU with e4m3 (compute capability 8.9 or later), else a ConfigError naming why."""
    if name == "auto":
        return compute_dtype
    if name not in KV_STORAGE_DTYPES:
        raise ConfigError(f"kv_dtype must be one of {('auto', *KV_STORAGE_DTYPES)}, got {name!r}", param="kv_dtype")
    if name == "fp8":
        if device.type != "cuda":
            raise ConfigError("kv_dtype='fp8' (e4m3) needs a CUDA GPU; CPUs have no e4m3 arithmetic to widen it", param="kv_dtype")
        if torch.cuda.get_device_capability(device) < (8, 9):
            raise ConfigError(
                f"kv_dtype='fp8' needs e4m3 support (compute capability 8.9+), this GPU has "
                f"{torch.cuda.get_device_capability(device)}", param="kv_dtype",
            )  # fmt: skip
    return KV_STORAGE_DTYPES[name]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The short name of a storage dtype (for fingerprints and reports)."""
    for name, value in KV_STORAGE_DTYPES.items():
        if value == dtype:
            return name
    return str(dtype).removeprefix("torch.")


def has_scales(dtype: torch.dtype) -> bool:
    """Whether pages of this dtype carry a scale per (token, KV head)."""
    return dtype == torch.int8


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] as int8 [..., head_dim] and fp16 scales [...]: scale = absmax / 127 in
    fp32, clamped into fp16's normal range [FP16_MIN_NORMAL, FP16_MAX] (nonzero rows), rounded
    to fp16 (nearest even); then q = round-half-even(x / scale) with that rounded scale, clamped
    to +-127. An all-zero row has scale 0 and q 0. Computed in fp32, in the order the native
    and Triton stores compute it, so every writer writes the same bytes."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / INT8_MAX
    scale = torch.where(scale > 0, scale.clamp(FP16_MIN_NORMAL, FP16_MAX), scale).to(SCALE_DTYPE)
    wide = scale.float()[..., None]
    q = torch.where(wide > 0, x / wide, 0.0).round_().clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def dequantize(data: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Pages' K or V ([..., head_dim]) widened to `dtype`; int8 times its scale ([...], fp16,
    widened exactly) in fp32."""
    if scales is None:
        return data.to(dtype)
    return (data.float() * scales.float()[..., None]).to(dtype)


def to_storage(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to a float storage dtype (fp8 saturates at e4m3's range rather than overflow)."""
    if dtype == torch.float8_e4m3fn:
        x = x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(dtype)
