"""The decoder layer's row-wise glue on the device the model runs on: radixkv's fused kernels
when native is on (C on CPU: radixkv/cpu/row_ops.py; Triton on CUDA: radixkv/kernels/row_ops.py,
one launch where torch takes five to ten), torch ops otherwise (EngineConfig.native_kernels)."""

from __future__ import annotations

from torch import Tensor

from radixkv.cpu import row_ops as cpu_row_ops

rms_norm = cpu_row_ops.rms_norm  # Qwen3's per-head q/k norms: torch ops on every device


def _on_gpu(native: bool, *tensors: Tensor | None) -> bool:
    return native and all(t is None or (t.is_cuda and t.is_contiguous()) for t in tensors)


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float, native: bool = True) -> tuple[Tensor, Tensor]:
    """(x + delta, rms_norm(x + delta)); x: [T, dim], updated in place on the fused paths."""
    if _on_gpu(native, x, delta, weight):
        from radixkv.kernels import row_ops

        return row_ops.add_rms_norm(x, delta, weight, eps)
    return cpu_row_ops.add_rms_norm(x, delta, weight, eps, native)


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor, native: bool = True) -> Tensor:
    """x: [T, H, D] rotated by RotaryEmbedding's cos and signed sin; in place on the fused paths,
    where each token's heads must sit side by side."""
    if _on_gpu(native, cos, signed_sin) and x.is_cuda and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        from radixkv.kernels import row_ops

        return row_ops.apply_rope(x, cos, signed_sin)
    return cpu_row_ops.apply_rope(x, cos, signed_sin, native)


def silu_mul(gate_up: Tensor, native: bool = True) -> Tensor:
    """F.silu(gate) * up for gate_up = [gate | up] along the last dim."""
    if native and gate_up.is_cuda and gate_up.stride(1) == 1:
        from radixkv.kernels import row_ops

        return row_ops.silu_mul(gate_up)
    return cpu_row_ops.silu_mul(gate_up, native)
