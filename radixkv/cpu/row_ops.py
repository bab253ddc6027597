"""The decoder layer's row-wise glue (residual add + RMSNorm, rotary embedding, SiLU * up):
one native call each for bf16 and fp32 on CPU (radixkv/cpu/csrc/row_ops.c) unless the caller
passes native=False (EngineConfig.native_kernels), torch ops everywhere else.

At a decode step's few rows each torch op costs more in dispatch than in arithmetic; fusing
the five to ten ops of each piece saves about a tenth of a small model's decode step. The
kernels round where the torch ops round; only the RMSNorm's sum of squares and SiLU's exp
may differ from torch's in the last bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from radixkv.cpu.native import load

MAX_ROPE_HEAD_DIM = 1024  # the bf16 kernel's row buffer
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _native_for(native: bool, name: str, *tensors: Tensor):
    """The native kernel `name` for the tensors' dtype when native is on and every tensor is
    bf16 or fp32 (one dtype) on CPU with unit inner stride, else None."""
    dtype = tensors[0].dtype
    fits = native and dtype in _SUFFIX and all(t.dtype == dtype and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)
    library = load() if fits else None
    return None if library is None else getattr(library, f"radixkv_{name}_{_SUFFIX[dtype]}")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm: variance in fp32, the product in the model dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: Tensor, delta: Tensor | None, weight: Tensor, eps: float, native: bool = True
) -> tuple[Tensor, Tensor]:
    """(x + delta, rms_norm(x + delta)); x: [T, dim] contiguous, updated in place on the native path."""
    kernel = _native_for(native, "add_rms_norm", x, weight) if delta is None else _native_for(native, "add_rms_norm", x, delta, weight)
    if kernel is None or not x.is_contiguous() or (delta is not None and not delta.is_contiguous()):
        if delta is not None:
            x = x + delta
        return x, rms_norm(x, weight, eps)
    out = torch.empty_like(x)
    rows, dim = x.shape
    kernel(
        x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
        rows, dim, eps, torch.get_num_threads(),
    )  # fmt: skip
    return x, out


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor, native: bool = True) -> Tensor:
    """x: [T, H, D]; cos, signed_sin: [T, D] from RotaryEmbedding. Rotates in place (and returns
    x) on the native path, where x's heads must sit side by side in each row.

    transformers computes x * cos + cat(-x2, x1) * sin; the sign sits in signed_sin here, which
    rounds identically (negation is exact) and saves an op.
    """
    rows, heads, head_dim = x.shape
    kernel = _native_for(native, "rope", x, cos, signed_sin)
    if kernel is None or x.stride(1) != head_dim or head_dim > MAX_ROPE_HEAD_DIM or not cos.is_contiguous() or not signed_sin.is_contiguous():
        half = head_dim // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None] + swapped * signed_sin[:, None]
    kernel(
        x.data_ptr(), x.stride(0), rows, heads, head_dim, cos.data_ptr(), signed_sin.data_ptr(), torch.get_num_threads()
    )
    return x


def silu_mul(gate_up: Tensor, native: bool = True) -> Tensor:
    """F.silu(gate) * up for gate_up = [gate | up] along the last dim, [T, 2 * dim] -> [T, dim]."""
    kernel = _native_for(native, "silu_mul", gate_up)
    if kernel is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    rows, dim = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, dim), dtype=gate_up.dtype)
    kernel(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, dim, torch.get_num_threads())
    return out
