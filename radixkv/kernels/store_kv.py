"""Triton kernel that scatters a step's new K/V rows into their paged-cache slots.

One program per new token writes all its KV heads; a slot < 0 means "do not store". int8 pages
(EngineConfig.kv_dtype) take each (token, head) row quantized symmetrically, its scale beside it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# 1.5 * 2^23: adding and subtracting it rounds an fp32 |x| < 2^22 to the nearest integer, ties
# to even (the FPU's own rounding), as torch.round does; no rint is needed in the kernel.
ROUND_MAGIC = 12582912.0


@triton.jit
def quantize_rows(
    x, INT8_MAX: tl.constexpr = 127.0, FP16_MIN_NORMAL: tl.constexpr = 2.0**-14, FP16_MAX: tl.constexpr = 65504.0
):
    """Rows of x [R, D] (fp32, zeros past the row) as int8 values (still fp32) and their scales
    [R] (fp32 holding fp16 values): scale = absmax / 127 clamped into fp16's normal range and
    rounded to fp16, q = round-half-even(x / scale), 0 where the row is all zero:
    radixkv.cache.kv_dtype.quantize_int8's arithmetic, so the same values."""
    scale = tl.max(tl.abs(x), 1) / INT8_MAX
    scale = tl.where(scale > 0.0, tl.minimum(tl.maximum(scale, FP16_MIN_NORMAL), FP16_MAX), scale)
    scale = scale.to(tl.float16).to(tl.float32)
    safe = tl.where(scale > 0.0, scale, 1.0)
    q = tl.math.div_rn(x, safe[:, None])
    q = (q + ROUND_MAGIC) - ROUND_MAGIC
    q = tl.minimum(tl.maximum(q, -INT8_MAX), INT8_MAX)
    return tl.where(scale[:, None] > 0.0, q, 0.0), scale


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    stride_cache_head,
    k_scale_ptr,
    v_scale_ptr,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
        k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        dst = slot * stride_cache_slot + heads[:, None] * stride_cache_head + dims[None, :]
        if QUANT:  # int8 pages: scales [slots, num_kv_heads] beside them
            k, k_scale = quantize_rows(tl.where(mask, k.to(tl.float32), 0.0))
            v, v_scale = quantize_rows(tl.where(mask, v.to(tl.float32), 0.0))
            head_valid = heads < num_kv_heads
            tl.store(k_scale_ptr + slot * num_kv_heads + heads, k_scale.to(tl.float16), mask=head_valid)
            tl.store(v_scale_ptr + slot * num_kv_heads + heads, v_scale.to(tl.float16), mask=head_valid)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Write k[t], v[t] ([T, Hkv, D]) to slot slot_mapping[t] of the caches ([P, page_size, Hkv, D]),
    rounded to their dtype; int8 caches quantized, the scales into k_scales, v_scales ([P,
    page_size, Hkv] fp16).

    The caller guarantees slot_mapping[t] < P * page_size (the kernel does not check bounds).
    """
    quant = k_cache.dtype == torch.int8
    assert not quant or (k_scales is not None and v_scales is not None and k_scales.is_contiguous() and v_scales.is_contiguous())
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and k_cache.shape == v_cache.shape
    assert k_cache.shape[-2:] == (num_kv_heads, head_dim), (k.shape, k_cache.shape)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (num_tokens,)
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    k_slots = k_cache.view(-1, num_kv_heads, head_dim)
    v_slots = v_cache.view(-1, num_kv_heads, head_dim)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_slots,
        v_slots,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_slots.stride(0),
        k_slots.stride(1),
        k_scales if quant else k_slots,  # unread unless QUANT
        v_scales if quant else v_slots,
        num_kv_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT=quant,
        num_warps=4,
    )
