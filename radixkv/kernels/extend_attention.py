"""Triton extend attention: a ragged batch of new query tokens over each request's paged prefix.

Request b's new tokens attend to its prefix (read through its page table, no causal mask) and
causally to each other (read from the step's contiguous k/v); with a sliding window of W keys a
query also sees none before its last W. All query heads of one KV head are
packed into the rows of one program, so each KV tile is loaded once per group, not once per head.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixkv.kernels.store_kv import quantize_rows

LOG2E = 1.4426950408889634
NO_WINDOW = 2**30  # the kernels' window for "every key": past any sequence, far from int32's end


def on_interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: fp32 inputs must not be rounded to tf32, or fp32 stops being exact."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def online_softmax(scores, m_i, l_i):
    """One tile of scores (log2 domain) into the rows' running max m_i and sum l_i: the tile's
    weights p, the factor alpha that rescales what the rows summed before, the new max and sum."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row with no visible key yet keeps max -inf; subtracting 0 instead avoids inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def load_page_rows(cache_ptr, scale_ptr, kv_offsets, kv_mask, scale_at, key_valid, QUANT: tl.constexpr):
    """One tile of K or V rows from the pages, in their storage dtype; int8 pages (QUANT) come
    back as fp32 times each (token, kv head) scale. The caller widens to q's dtype."""
    rows = tl.load(cache_ptr + kv_offsets, mask=kv_mask, other=0)
    if QUANT:
        rows = rows.to(tl.float32) * tl.load(scale_ptr + scale_at, mask=key_valid, other=0.0).to(tl.float32)[:, None]
    return rows


@triton.jit
def attend_page_tile(q, m_i, l_i, acc, visible, pos, key_valid, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                     table_row, head_offset, page_size, stride_cache_slot, dims, dim_valid, kv_head, num_kv_heads,
                     qk_scale_log2, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr):  # fmt: skip
    """One tile of a request's paged keys (positions pos, read through its page table row) into
    the query rows' online softmax; visible [rows, keys] says which keys each row sees. Pages
    are widened to q's dtype on load. Returns the rows' new max, sum and accumulator."""
    page = tl.load(table_row + pos // page_size, mask=key_valid, other=0).to(tl.int64)
    slot = page * page_size + (pos % page_size)
    kv_offsets = slot[:, None] * stride_cache_slot + head_offset + dims[None, :]
    kv_mask = key_valid[:, None] & dim_valid[None, :]
    scale_at = slot * num_kv_heads + kv_head  # int8 pages' scale of each key (QUANT)
    k = load_page_rows(k_cache_ptr, k_scale_ptr, kv_offsets, kv_mask, scale_at, key_valid, QUANT).to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
    p, alpha, m_new, l_i = online_softmax(tl.where(visible, scores, float("-inf")), m_i, l_i)
    v = load_page_rows(v_cache_ptr, v_scale_ptr, kv_offsets, kv_mask, scale_at, key_valid, QUANT).to(q.dtype)
    return m_new, l_i, acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)


# The page table's width changes from step to step: no variant compiled for its value.
@triton.jit(do_not_specialize=("stride_table",))
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_q_lens_ptr,
    seq_lens_ptr,
    page_table_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    qk_scale_log2,
    page_size,
    head_dim,
    group_size,
    k_scale_ptr,
    v_scale_ptr,
    num_kv_heads,
    window,  # keys a query sees counting itself; 2**30 stands for no window
    BLOCK_Q: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.program_id(2)

    q_start = tl.load(cu_q_lens_ptr + req)
    q_len = tl.load(cu_q_lens_ptr + req + 1) - q_start
    tile_start = tile * BLOCK_Q
    # The grid is sized for the longest request; tiles past a shorter one's end do nothing.
    if tile_start < q_len:
        seq_len = tl.load(seq_lens_ptr + req)
        prefix_len = seq_len - q_len

        # Row r of the tile is query token tile_start + r // GROUP_PAD, head r % GROUP_PAD of the group.
        rows = tl.arange(0, BLOCK_M)
        q_idx = tile_start + rows // GROUP_PAD
        head_in_group = rows % GROUP_PAD
        row_valid = (q_idx < q_len) & (head_in_group < group_size)
        q_head = kv_head * group_size + head_in_group
        dims = tl.arange(0, BLOCK_D)
        dim_valid = dims < head_dim
        q_rows = (q_start + q_idx).to(tl.int64)
        q = tl.load(
            q_ptr + q_rows[:, None] * stride_qt + q_head[:, None] * stride_qh + dims[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        table_row = page_table_ptr + req.to(tl.int64) * stride_table
        head_offset = kv_head.to(tl.int64) * stride_cache_head

        # The cached prefix: without a window every query sees all of it; with one, from the
        # tile's first query's first key on, each query masked to its own window.
        for start in range(tl.maximum(prefix_len + tile_start - window + 1, 0), prefix_len, BLOCK_N):
            pos = start + offs_n
            key_valid = pos < prefix_len
            in_window = key_valid[None, :] & (prefix_len + q_idx[:, None] - pos[None, :] < window)
            m_i, l_i, acc = attend_page_tile(
                q, m_i, l_i, acc, in_window, pos, key_valid, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_row,
                head_offset, page_size, stride_cache_slot, dims, dim_valid, kv_head, num_kv_heads, qk_scale_log2,
                DOT_PRECISION, QUANT,
            )  # fmt: skip

        # The new tokens, causally: this tile's last query sees new tokens up to its own index.
        kv_end = tl.minimum(q_len, tile_start + BLOCK_Q)
        for start in range(0, kv_end, BLOCK_N):
            key_idx = start + offs_n
            key_valid = key_idx < kv_end
            key_rows = (q_start + key_idx).to(tl.int64)
            kv_mask = key_valid[:, None] & dim_valid[None, :]
            # Round through the cache dtype so these keys equal what store_kv wrote to the pages.
            k = tl.load(
                k_ptr + key_rows[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
                mask=kv_mask,
                other=0.0,
            )
            if QUANT:  # what store_kv wrote: quantized, times its scale
                k, k_scale = quantize_rows(tl.where(kv_mask, k.to(tl.float32), 0.0))
                k = k * k_scale[:, None]
            k = k.to(k_cache_ptr.dtype.element_ty).to(q.dtype) if not QUANT else k.to(q.dtype)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
            visible = key_valid[None, :] & (key_idx[None, :] <= q_idx[:, None]) & (q_idx[:, None] - key_idx[None, :] < window)
            scores = tl.where(visible, scores, float("-inf"))
            p, alpha, m_new, l_i = online_softmax(scores, m_i, l_i)
            v = tl.load(
                v_ptr + key_rows[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
                mask=kv_mask,
                other=0.0,
            )
            if QUANT:
                v, v_scale = quantize_rows(tl.where(kv_mask, v.to(tl.float32), 0.0))
                v = v * v_scale[:, None]
            v = v.to(v_cache_ptr.dtype.element_ty).to(q.dtype) if not QUANT else v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        # Padding rows (past q_len or past the group) saw no key: l = 0, so give 0, not NaN.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_ot + q_head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )


@dataclass(frozen=True, slots=True)
class ExtendConfig:
    """Tile sizes of one launch: block_m packed rows (query tokens x padded group), block_n keys."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def extend_config(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> ExtendConfig:
    """Fixed tile sizes per head size (autotune does not run in the interpreter)."""
    if on_interpreter():
        # Interpreter cost is per operation, not per element; mid-size tiles keep tests quick
        # while still crossing tile boundaries at the test lengths.
        return ExtendConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    if dtype.itemsize == 4:
        # fp32 tiles take twice the shared memory and registers; fp32 is for checking, not speed.
        return ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if head_dim <= 64:
        return ExtendConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)
    if head_dim <= 128:
        return ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    return ExtendConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    max_q_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    config: ExtendConfig | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of q ([T, Hq, D]) over each request's paged prefix plus, causally, its new k/v
    (window: each query over its last `window` keys only)
    (rounded as store_kv stores them: through the pages' dtype, int8 quantized per row). int8
    pages come with k_scales, v_scales ([P, page_size, Hkv] fp16).

    Request b owns rows cu_q_lens[b]:cu_q_lens[b+1] of q, k, v; its prefix is the first
    seq_lens[b] - q_len_b tokens of the pages page_table[b]. The caller guarantees every index is
    in range (the kernel does not check bounds). Returns out ([T, Hq, D], q's dtype).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    page_size = k_cache.shape[1]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), (q.shape, k.shape, v.shape)
    assert k_cache.shape[-2:] == (num_kv_heads, head_dim) and k_cache.shape == v_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert cu_q_lens.dtype == seq_lens.dtype == page_table.dtype == torch.int32
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    assert out.stride(-1) == 1
    page_table = page_table if page_table.stride(-1) == 1 else page_table.contiguous()

    cfg = config or extend_config(head_dim, q.dtype)
    group_size = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group_size)
    # tl.dot on GPU needs every dimension >= 16 for 16-bit inputs; block_m >= 16 guarantees the
    # packed row count is, whatever the group size.
    block_m = max(cfg.block_m, group_pad, 16)
    block_q = block_m // group_pad
    k_slots = k_cache.view(-1, num_kv_heads, head_dim)
    v_slots = v_cache.view(-1, num_kv_heads, head_dim)
    quant = k_cache.dtype == torch.int8
    assert not quant or (k_scales is not None and v_scales is not None and k_scales.is_contiguous() and v_scales.is_contiguous())
    grid = (triton.cdiv(max_q_len, block_q), num_kv_heads, num_seqs)
    _extend_kernel[grid](
        q,
        k,
        v,
        k_slots,
        v_slots,
        out,
        cu_q_lens,
        seq_lens,
        page_table,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        k_slots.stride(0),
        k_slots.stride(1),
        page_table.stride(0),
        scale * LOG2E,
        page_size,
        head_dim,
        group_size,
        k_scales if quant else k_slots,  # unread unless QUANT
        v_scales if quant else v_slots,
        num_kv_heads,
        window or NO_WINDOW,
        BLOCK_Q=block_q,
        GROUP_PAD=group_pad,
        BLOCK_N=max(cfg.block_n, 16),
        BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
        DOT_PRECISION=dot_precision(q.dtype),
        QUANT=quant,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
