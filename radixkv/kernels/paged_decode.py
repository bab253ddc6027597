"""Triton paged decode attention: one query token per request over its KV pages, split-KV,
with cascade groups for requests that share a cached prefix.

Stage 1 computes, per (request, KV head, split), the partial output and log-sum-exp of the
packed query heads of that KV head over one slice of the sequence; stage 2 merges the splits
by their log-sum-exps. Splitting keeps the GPU busy when batch x KV heads is small.

Cascade: where requests share a cached prefix (CascadeGroups), a group's shared keys are read
once per (group, KV head, split) for all its members' query heads, as one [members x heads,
keys] matrix product, into extra split slots of each member; the members' own splits cover
only their keys past the prefix, and the same merge adds the two.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixkv.kernels.extend_attention import LOG2E, attend_page_tile, dot_precision, on_interpreter

MAX_SPLITS = 16
# A split shorter than this costs more in stage-2 traffic and launch overhead than it saves.
MIN_TOKENS_PER_SPLIT = 512
# Aim for this many stage-1 programs per multiprocessor, so short and long splits even out.
PROGRAMS_PER_SM = 4
# The interpreter has no SMs to fill; a small fixed number still exercises the merge.
INTERPRETER_SPLITS = 4


@triton.jit
def _split_bounds(begin, seq_len, split, num_splits, BLOCK_N: tl.constexpr):
    # Each request splits its own keys [begin, seq_len), rounded up to whole tiles, so short
    # requests finish in few splits and long ones spread over all of them.
    split_len = tl.cdiv(tl.cdiv(seq_len - begin, num_splits), BLOCK_N) * BLOCK_N
    start = begin + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    return start, end


@triton.jit
def _attend_keys(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, head_offset, start, end, page_size,
                 stride_cache_slot, dims, dim_valid, qk_scale_log2, k_scale_ptr, v_scale_ptr, kv_head, num_kv_heads,
                 BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr):
    """Online softmax of the query rows q over keys [start, end) of one page list. Pages are
    widened to q's dtype on load; int8 pages (QUANT) times their (token, kv head) scale."""
    offs_n = tl.arange(0, BLOCK_N)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n
        key_valid = pos < end
        m_i, l_i, acc = attend_page_tile(
            q, m_i, l_i, acc, key_valid[None, :], pos, key_valid, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
            table_row, head_offset, page_size, stride_cache_slot, dims, dim_valid, kv_head, num_kv_heads, qk_scale_log2,
            DOT_PRECISION, QUANT,
        )  # fmt: skip
    return m_i, l_i, acc


# Integers that change from step to step (the page table's width, the split counts and the
# partial buffers' strides that follow from them) are not specialized on: Triton would compile a
# new variant, for a second or more, the first time one of them is 1 or a multiple of 16.
STEP_VARYING = ("stride_table", "stride_pob", "stride_poh", "stride_plb", "stride_plh", "num_splits")


@triton.jit(do_not_specialize=STEP_VARYING)
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    own_begin_ptr,
    page_table_ptr,
    stride_qb,
    stride_qh,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    qk_scale_log2,
    page_size,
    head_dim,
    group_size,
    num_splits,
    k_scale_ptr,
    v_scale_ptr,
    num_kv_heads,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    start, end = _split_bounds(tl.load(own_begin_ptr + req), seq_len, split, num_splits, BLOCK_N)
    # Empty splits write nothing; stage 2 recomputes the bounds and skips them.
    if start < end:
        heads = tl.arange(0, BLOCK_H)
        head_valid = heads < group_size
        q_head = kv_head * group_size + heads
        dims = tl.arange(0, BLOCK_D)
        dim_valid = dims < head_dim
        req64 = req.to(tl.int64)
        q = tl.load(
            q_ptr + req64 * stride_qb + q_head[:, None] * stride_qh + dims[None, :],
            mask=head_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        m_i, l_i, acc = _attend_keys(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, page_table_ptr + req64 * stride_table,
            kv_head.to(tl.int64) * stride_cache_head, start, end, page_size, stride_cache_slot, dims, dim_valid,
            qk_scale_log2, k_scale_ptr, v_scale_ptr, kv_head, num_kv_heads, BLOCK_N, DOT_PRECISION, QUANT,
        )  # fmt: skip
        # A non-empty split has at least one visible key per row, so l > 0 for the real heads.
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        lse = m_i + tl.log2(l_safe)  # log2 domain, like the scores
        out_rows = req64 * stride_pob + q_head.to(tl.int64) * stride_poh + split * stride_pos
        tl.store(
            part_out_ptr + out_rows[:, None] + dims[None, :],
            acc / l_safe[:, None],
            mask=head_valid[:, None] & dim_valid[None, :],
        )
        tl.store(part_lse_ptr + req64 * stride_plb + q_head * stride_plh + split, lse, mask=head_valid)


@triton.jit(do_not_specialize=STEP_VARYING[:-1] + ("first_slot", "num_shared_splits"))
def _cascade_shared_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    part_out_ptr,
    part_lse_ptr,
    page_table_ptr,
    group_start_ptr,
    members_ptr,
    shared_len_ptr,
    stride_qb,
    stride_qh,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    qk_scale_log2,
    page_size,
    head_dim,
    group_size,
    first_slot,
    num_shared_splits,
    k_scale_ptr,
    v_scale_ptr,
    num_kv_heads,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    # One program: a group's shared keys of one split, one KV head, BLOCK_M of the query rows
    # (member x query head of that KV head) -- every member's heads against keys read once.
    group = tl.program_id(0)
    kv_head = tl.program_id(1)
    row_block = tl.program_id(2) // num_shared_splits
    split = tl.program_id(2) % num_shared_splits
    first = tl.load(group_start_ptr + group)
    num_rows = (tl.load(group_start_ptr + group + 1) - first) * group_size
    start, end = _split_bounds(0, tl.load(shared_len_ptr + group), split, num_shared_splits, BLOCK_N)
    if (start < end) & (row_block * BLOCK_M < num_rows):
        rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_valid = rows < num_rows
        req = tl.load(members_ptr + first + rows // group_size, mask=row_valid, other=0).to(tl.int64)
        q_head = (kv_head * group_size + rows % group_size).to(tl.int64)
        dims = tl.arange(0, BLOCK_D)
        dim_valid = dims < head_dim
        q = tl.load(
            q_ptr + req[:, None] * stride_qb + q_head[:, None] * stride_qh + dims[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        leader = tl.load(members_ptr + first).to(tl.int64)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i, l_i, acc = _attend_keys(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, page_table_ptr + leader * stride_table,
            kv_head.to(tl.int64) * stride_cache_head, start, end, page_size, stride_cache_slot, dims, dim_valid,
            qk_scale_log2, k_scale_ptr, v_scale_ptr, kv_head, num_kv_heads, BLOCK_N, DOT_PRECISION, QUANT,
        )  # fmt: skip
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        lse = m_i + tl.log2(l_safe)
        slot = first_slot + split
        out_rows = req * stride_pob + q_head * stride_poh + slot * stride_pos
        tl.store(part_out_ptr + out_rows[:, None] + dims[None, :], acc / l_safe[:, None], mask=row_valid[:, None] & dim_valid[None, :])
        tl.store(part_lse_ptr + req * stride_plb + q_head * stride_plh + slot, lse, mask=row_valid)


@triton.jit(do_not_specialize=STEP_VARYING[1:] + ("num_shared_slots",))
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    seq_lens_ptr,
    own_begin_ptr,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    head_dim,
    num_splits,
    num_shared_slots,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req)
    splits = tl.arange(0, BLOCK_S)
    start, end = _split_bounds(tl.load(own_begin_ptr + req), seq_len, splits, num_splits, BLOCK_N)
    own_valid = (splits < num_splits) & (start < end)
    # Cascade slots follow the own splits; the ones no group wrote still hold -inf.
    shared = (splits >= num_splits) & (splits < num_splits + num_shared_slots)
    lse = tl.load(
        part_lse_ptr + req * stride_plb + head * stride_plh + splits,
        mask=own_valid | shared,
        other=float("-inf"),
    )
    split_valid = own_valid | (shared & (lse > float("-inf")))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.where(split_valid, tl.exp2(lse - lse_max), 0.0)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim
    parts = tl.load(
        part_out_ptr + req * stride_pob + head * stride_poh + splits[:, None] * stride_pos + dims[None, :],
        mask=split_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + req * stride_ob + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_valid,
    )


@dataclass(frozen=True, slots=True)
class CascadeGroups:
    """Requests that decode a shared cached prefix together, as tensors on the kernels' device.

    Group g's members are members[group_start[g]:group_start[g + 1]]; they share the first
    shared_len[g] keys, read through the first member's pages. own_begin[b] is where request
    b's own keys start (0 outside groups). max_shared_len and max_members are host numbers,
    for the launch grid.
    """

    group_start: torch.Tensor  # [G + 1] int32
    members: torch.Tensor  # [M] int32
    shared_len: torch.Tensor  # [G] int32
    own_begin: torch.Tensor  # [B] int32
    max_shared_len: int
    max_members: int

    @property
    def num_groups(self) -> int:
        return self.shared_len.shape[0]


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Tile sizes of one launch: block_n keys per loop step."""

    block_n: int
    num_warps: int
    num_stages: int


def decode_config(head_dim: int) -> DecodeConfig:
    """Fixed tile sizes per head size (autotune does not run in the interpreter)."""
    if on_interpreter():
        return DecodeConfig(block_n=32, num_warps=4, num_stages=1)
    if head_dim <= 64:
        return DecodeConfig(block_n=128, num_warps=4, num_stages=3)
    if head_dim <= 128:
        return DecodeConfig(block_n=64, num_warps=4, num_stages=3)
    return DecodeConfig(block_n=32, num_warps=4, num_stages=2)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits per (request, KV head) for a launch on `device`, from host-side numbers only (no sync)."""
    if device.type != "cuda" or on_interpreter():
        return INTERPRETER_SPLITS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return splits_for(num_seqs, num_kv_heads, max_seq_len, _num_sms(index))


def splits_for(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Enough stage-1 programs to fill the GPU, but no split shorter than MIN_TOKENS_PER_SPLIT.

    Many requests or heads -> 1 split; a few long requests -> up to MAX_SPLITS.
    """
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(1, num_seqs * num_kv_heads))
    by_length = triton.cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT)
    return max(1, min(MAX_SPLITS, wanted, by_length))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    groups: CascadeGroups | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of one query per request (q: [B, Hq, D]) over its first seq_lens[b] cached tokens
    (window: its last `window` of them only, never with groups).
    Pages may be stored in another dtype (widened to q's on load); int8 pages come with
    k_scales, v_scales ([P, page_size, Hkv] fp16).

    Request b's KV lives in pages page_table[b, :ceil(seq_lens[b] / page_size)]. The caller
    guarantees every index is in range (the kernel does not check bounds) and seq_lens >= 1.
    groups: requests that share a cached prefix read it together (cascade); None: each request
    reads all its keys. Returns out ([B, Hq, D], q's dtype).
    """
    num_seqs, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.shape == v_cache.shape and k_cache.shape[-1] == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert seq_lens.shape == (num_seqs,) and page_table.shape[0] == num_seqs
    assert seq_lens.dtype == page_table.dtype == torch.int32
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert out.stride(-1) == 1
    page_table = page_table if page_table.stride(-1) == 1 else page_table.contiguous()

    cfg = config or decode_config(head_dim)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, q.device)
    assert 1 <= num_splits <= 64, num_splits
    shared_splits = 0
    if groups is not None and groups.num_groups:
        shared_splits = choose_num_splits(groups.num_groups, num_kv_heads, groups.max_shared_len, q.device)
    group_size = num_q_heads // num_kv_heads
    # tl.dot on GPU needs M >= 16 for 16-bit inputs: pad the group's rows to 16.
    block_h = max(16, triton.next_power_of_2(group_size))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = max(16, cfg.block_n)
    slots = num_splits + shared_splits
    part_out = torch.empty(num_seqs, num_q_heads, slots, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, num_q_heads, slots, dtype=torch.float32, device=q.device)
    assert window is None or not shared_splits, "a window layer decodes without cascade groups"
    if shared_splits:
        part_lse[:, :, num_splits:] = float("-inf")  # the merge skips slots no group writes
        own_begin = groups.own_begin
    elif window is not None:  # where each request's own keys start is where its window starts
        own_begin = (seq_lens - window).clamp(min=0).to(torch.int32)
    else:
        own_begin = torch.zeros(num_seqs, dtype=torch.int32, device=q.device)
    k_slots = k_cache.view(-1, num_kv_heads, head_dim)
    v_slots = v_cache.view(-1, num_kv_heads, head_dim)
    quant = k_cache.dtype == torch.int8
    assert not quant or (k_scales is not None and v_scales is not None and k_scales.is_contiguous() and v_scales.is_contiguous())
    scales = (k_scales, v_scales) if quant else (k_slots, v_slots)  # unread unless QUANT
    part_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1))
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_slots, v_slots, part_out, part_lse, seq_lens, own_begin, page_table,
        q.stride(0), q.stride(1), k_slots.stride(0), k_slots.stride(1), page_table.stride(0), *part_strides,
        scale * LOG2E, page_size, head_dim, group_size, num_splits, *scales, num_kv_heads,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, DOT_PRECISION=dot_precision(q.dtype), QUANT=quant,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if shared_splits:
        # Rows are (member, query head) pairs of one KV head: at least 16 for tl.dot on GPU.
        block_m = max(16, min(64, triton.next_power_of_2(groups.max_members * group_size)))
        row_blocks = triton.cdiv(groups.max_members * group_size, block_m)
        _cascade_shared_kernel[(groups.num_groups, num_kv_heads, row_blocks * shared_splits)](
            q, k_slots, v_slots, part_out, part_lse, page_table, groups.group_start, groups.members, groups.shared_len,
            q.stride(0), q.stride(1), k_slots.stride(0), k_slots.stride(1), page_table.stride(0), *part_strides,
            scale * LOG2E, page_size, head_dim, group_size, num_splits, shared_splits, *scales, num_kv_heads,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT_PRECISION=dot_precision(q.dtype), QUANT=quant,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    _decode_merge_kernel[(num_seqs, num_q_heads)](
        part_out, part_lse, out, seq_lens, own_begin, *part_strides, out.stride(0), out.stride(1),
        head_dim, num_splits, shared_splits,
        BLOCK_S=triton.next_power_of_2(slots), BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=1 if block_d <= 64 else 2,
    )  # fmt: skip
    return out
