"""The decoder layer's row-wise glue (residual add + RMSNorm, rotary embedding, SiLU * up, the row
blocks of a batch-invariant GEMM) on the device the model runs on: radixkv's fused kernels when native is on (C on CPU:
radixkv/cpu/row_ops.py; Triton on CUDA: radixkv/kernels/row_ops.py, one launch where torch takes
five to ten), and the torch ops they replace everywhere else (EngineConfig.native_kernels).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from radixkv.cpu import row_ops as cpu_row_ops

if TYPE_CHECKING:
    from torch import nn

    from radixkv.attention.base import AttentionMetadata

# Rows per GEMM call under batch invariance: oneDNN and MKL pick kernels by row count and
# those round differently; every call of at most this many rows gives a row the same bits
# (checked for 1..32 rows on this CPU's oneDNN), so fixed blocks make rows independent.
INVARIANT_GEMM_ROWS = 32


def rms_norm(x: Tensor, weight: Tensor, eps: float, native: bool = False) -> Tensor:
    """transformers' RMSNorm of x's last dim: variance in fp32, the product in the model dtype.
    With native on CPU (Qwen3's per-head q/k norms) the add_rms_norm kernel over the heads as
    rows, the one the fused decode step calls for them; torch ops elsewhere."""
    if native and x.device.type == "cpu":
        # Never writes x (no delta); a strided slice of the qkv output is copied.
        fused = cpu_row_ops.add_rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), None, weight, eps)
        if fused is not None:
            return fused[1].view(x.shape)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def torch_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """transformers' x * cos + cat(-x2, x1) * sin, the sign folded into signed_sin (exact)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + swapped * signed_sin[:, None]


def torch_silu_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def project_rows(layer: nn.Module, x: Tensor, meta: AttentionMetadata) -> Tensor:
    """layer(x), in blocks of INVARIANT_GEMM_ROWS rows when the step must be batch-invariant
    and the layer's rows are not independent already (the AMX kernel's are)."""
    if not meta.batch_invariant or x.shape[0] <= INVARIANT_GEMM_ROWS or getattr(layer, "rows_independent", False):
        return layer(x)
    return torch.cat([layer(block) for block in x.split(INVARIANT_GEMM_ROWS)])


def _on_gpu(native: bool, *tensors: Tensor | None) -> bool:
    return native and all(t is None or (t.is_cuda and t.is_contiguous()) for t in tensors)


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float, native: bool = True) -> tuple[Tensor, Tensor]:
    """(x + delta, rms_norm(x + delta)); x: [T, dim], updated in place on the fused paths."""
    if _on_gpu(native, x, delta, weight):
        from radixkv.kernels import row_ops

        return row_ops.add_rms_norm(x, delta, weight, eps)
    fused = cpu_row_ops.add_rms_norm(x, delta, weight, eps) if native else None
    if fused is not None:
        return fused
    if delta is not None:
        x = x + delta
    return x, rms_norm(x, weight, eps)


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor, native: bool = True) -> Tensor:
    """x: [T, H, D] rotated by RotaryEmbedding's cos and signed sin; in place on the fused paths,
    where each token's heads must sit side by side."""
    if _on_gpu(native, cos, signed_sin) and x.is_cuda and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        from radixkv.kernels import row_ops

        return row_ops.apply_rope(x, cos, signed_sin)
    fused = cpu_row_ops.apply_rope(x, cos, signed_sin) if native else None
    return fused if fused is not None else torch_rope(x, cos, signed_sin)


def silu_mul(gate_up: Tensor, native: bool = True) -> Tensor:
    """F.silu(gate) * up for gate_up = [gate | up] along the last dim."""
    if native and gate_up.is_cuda and gate_up.stride(1) == 1:
        from radixkv.kernels import row_ops

        return row_ops.silu_mul(gate_up)
    fused = cpu_row_ops.silu_mul(gate_up) if native else None
    return fused if fused is not None else torch_silu_mul(gate_up)


def gemma_norm(x: Tensor, weight: Tensor, eps: float, delta: Tensor | None = None, native: bool = True) -> tuple[Tensor, Tensor]:
    """(x + delta, Gemma's RMSNorm of it): normalized in fp32, times (1 + weight) in fp32, then
    cast, as transformers' Gemma3RMSNorm. x: [T, dim] or [T, H, dim]; on the native path (CPU)
    x is updated in place, as the fused decode step does."""
    fused = cpu_row_ops.gemma_norm(x, weight, eps, delta) if native else None
    if fused is not None:
        return x, fused
    if delta is not None:
        x = x + delta
    x32 = x.float()
    return x, (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def gelu_mul(gate_up: Tensor, native: bool = True) -> Tensor:
    """F.gelu(gate, approximate="tanh") * up for gate_up = [gate | up] along the last dim (GeGLU)."""
    fused = cpu_row_ops.gelu_mul(gate_up) if native else None
    if fused is not None:
        return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
