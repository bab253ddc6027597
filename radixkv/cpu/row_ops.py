"""The decoder layer's row-wise glue (residual add + RMSNorm, rotary embedding, SiLU * up) as one
native call each for bf16 and fp32 on CPU (radixkv/cpu/csrc/row_ops.c). Each returns None where
its kernel cannot take the tensors; the torch ops they replace are radixkv.model.row_ops's.

At a decode step's few rows each torch op costs more in dispatch than in arithmetic; fusing
the five to ten ops of each piece saves about a tenth of a small model's decode step. The
kernels round where the torch ops round; only the RMSNorm's sum of squares and SiLU's exp
may differ from torch's in the last bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from radixkv.cpu.native import load

MAX_ROPE_HEAD_DIM = 1024  # the bf16 kernel's row buffer
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _native_for(name: str, *tensors: Tensor) -> Callable[..., object] | None:
    """The native kernel `name` for the tensors' dtype when every tensor is bf16 or fp32 (one
    dtype) on CPU with unit inner stride and the library is built, else None."""
    dtype = tensors[0].dtype
    fits = dtype in _SUFFIX and all(t.dtype == dtype and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)
    library = load() if fits else None
    return None if library is None else getattr(library, f"radixkv_{name}_{_SUFFIX[dtype]}")


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor] | None:
    """(x + delta, rms_norm(x + delta)) with x updated in place, or None where the kernel does
    not take these tensors (x: [T, dim] and delta contiguous)."""
    kernel = _native_for("add_rms_norm", x, weight) if delta is None else _native_for("add_rms_norm", x, delta, weight)
    if kernel is None or not x.is_contiguous() or (delta is not None and not delta.is_contiguous()):
        return None
    out = torch.empty_like(x)
    rows, dim = x.shape
    kernel(
        x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
        rows, dim, eps, torch.get_num_threads(),
    )  # fmt: skip
    return x, out


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor | None:
    """x: [T, H, D] rotated in place (and returned) by RotaryEmbedding's cos and signed sin, or
    None where the kernel does not take these tensors (each row's heads side by side, contiguous
    cos and sin). The sign of rotate-half sits in signed_sin, which rounds identically
    (negation is exact) and saves an op."""
    rows, heads, head_dim = x.shape
    kernel = _native_for("rope", x, cos, signed_sin)
    if kernel is None or x.stride(1) != head_dim or head_dim > MAX_ROPE_HEAD_DIM or not cos.is_contiguous() or not signed_sin.is_contiguous():
        return None
    kernel(
        x.data_ptr(), x.stride(0), rows, heads, head_dim, cos.data_ptr(), signed_sin.data_ptr(), torch.get_num_threads()
    )
    return x


def silu_mul(gate_up: Tensor) -> Tensor | None:
    """F.silu(gate) * up for gate_up = [gate | up] along the last dim, [T, 2 * dim] -> [T, dim],
    or None where the kernel does not take it."""
    kernel = _native_for("silu_mul", gate_up)
    if kernel is None:
        return None
    rows, dim = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, dim), dtype=gate_up.dtype)
    kernel(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, dim, torch.get_num_threads())
    return out


def gemma_norm(x: Tensor, weight: Tensor, eps: float, delta: Tensor | None = None) -> Tensor | None:
    """Gemma's RMSNorm (normalized in fp32, times (1 + weight) in fp32, rounded once) of x's
    last dim, x: [T, dim] or [T, H, dim] (each row's heads side by side, any row stride), as a
    new contiguous tensor; with delta (x's shape, contiguous, x contiguous too) x += delta in
    place first, the residual add. None where the kernel does not take these tensors. The fused
    decode step (radixkv/cpu/csrc/decode_layers.c) calls the same kernel."""
    tensors = (x, weight) if delta is None else (x, delta, weight)
    kernel = _native_for("gemma_norm", *tensors)
    if kernel is None or x.dim() not in (2, 3) or weight.numel() != x.shape[-1]:
        return None
    rows, dim = x.shape[0], x.shape[-1]
    heads = 1 if x.dim() == 2 else x.shape[1]
    if (heads > 1 and x.stride(1) != dim) or not weight.is_contiguous():
        return None
    if delta is not None and (not x.is_contiguous() or not delta.is_contiguous() or delta.shape != x.shape):
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    kernel(
        x.data_ptr(), x.stride(0), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
        heads * dim, rows, heads, dim, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out


def gelu_mul(gate_up: Tensor) -> Tensor | None:
    """F.gelu(gate, approximate="tanh") * up for gate_up = [gate | up] along the last dim,
    [T, 2 * dim] -> [T, dim] (GeGLU), or None where the kernel does not take it."""
    kernel = _native_for("gelu_mul", gate_up)
    if kernel is None or gate_up.dim() != 2:
        return None
    rows, dim = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, dim), dtype=gate_up.dtype)
    kernel(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, dim, torch.get_num_threads())
    return out
