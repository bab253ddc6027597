"""The decoder layer's row-wise glue as one Triton kernel each: residual add + RMSNorm, rotary
embedding, SiLU * up. On a GPU every torch op is a kernel launch, and these pieces are five to
ten ops each, about twenty launches a layer that a decode step of a small model waits on.

Each kernel rounds to the model's dtype where the torch ops it replaces round (the residual
sum, each product of the rotation, the activation), computing in fp32 between; only the sum of
squares' order and exp's last bit may differ from torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# SiLU * up: columns per program (a row of the MLP's intermediate size is split over several).
SILU_BLOCK = 1024


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, out_ptr, stride_x, stride_delta, stride_out, dim, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(dtype)
        tl.store(x_ptr + row * stride_x + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / dim
    normed = (x32 * tl.rsqrt(variance + eps)).to(dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) for x, delta: [T, dim] with unit inner stride; x is updated
    in place. As transformers' RMSNorm: the variance in fp32, the product with weight in x's dtype."""
    rows, dim = x.shape
    assert x.stride(1) == 1 and weight.shape == (dim,) and weight.is_contiguous()
    assert delta is None or (delta.shape == x.shape and delta.stride(1) == 1)
    out = torch.empty_like(x)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x, x if delta is None else delta, weight, out, x.stride(0), 0 if delta is None else delta.stride(0),
            out.stride(0), dim, eps, HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(dim),
        )  # fmt: skip
    return x, out


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, stride_token, num_heads, head_dim,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program rotates every head of one token in place: each element and its partner across
    # the half are loaded before anything is stored.
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim
    mask = (heads < num_heads)[:, None] & dim_valid[None, :]
    half = head_dim // 2
    partner = tl.where(dims < half, dims + half, dims - half)
    row = x_ptr + token * stride_token + heads[:, None] * head_dim
    dtype = x_ptr.dtype.element_ty
    x = tl.load(row + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    swapped = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * head_dim + dims, mask=dim_valid, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * head_dim + dims, mask=dim_valid, other=0.0).to(tl.float32)
    rotated = (x * cos[None, :]).to(dtype).to(tl.float32) + (swapped * sin[None, :]).to(dtype).to(tl.float32)
    tl.store(row + dims[None, :], rotated.to(dtype), mask=mask)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x ([T, H, D], heads side by side in each token's row) in place and return it;
    cos and signed_sin ([T, D], contiguous) as RotaryEmbedding makes them, the sign of
    rotate-half folded into the sine."""
    tokens, heads, head_dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == head_dim and head_dim % 2 == 0
    assert cos.shape == signed_sin.shape == (tokens, head_dim) and cos.is_contiguous() and signed_sin.is_contiguous()
    if tokens:
        _rope_kernel[(tokens,)](
            x, cos, signed_sin, x.stride(0), heads, head_dim,
            BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(head_dim),
        )  # fmt: skip
    return x


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_gate_up, stride_out, dim, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < dim
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_gate_up + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_gate_up + dim + cols, mask=mask, other=0.0).to(tl.float32)
    activation = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    tl.store(out_ptr + row * stride_out + cols, (activation.to(tl.float32) * up).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for gate_up = [gate | up] along the last dim: [T, 2 * dim] -> [T, dim]."""
    rows, width = gate_up.shape
    assert gate_up.stride(1) == 1 and width % 2 == 0
    dim = width // 2
    out = torch.empty((rows, dim), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(SILU_BLOCK, triton.next_power_of_2(dim))
        _silu_mul_kernel[(rows, triton.cdiv(dim, block))](gate_up, out, gate_up.stride(0), out.stride(0), dim, BLOCK=block)
    return out
