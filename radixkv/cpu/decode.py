"""The CPU paged-decode, cascade-plan and store-KV kernels (radixkv/cpu/csrc/paged_decode.c,
cascade.c) as tensor functions.

Checks what the C code trusts (dtypes, shapes, index ranges), allocates the decode work buffer
and calls the library that radixkv.cpu.native builds and loads.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass

import torch

from radixkv.cache.kv_dtype import SCALE_DTYPE
from radixkv.cpu.features import cpu_caches
from radixkv.cpu.native import load

_FUNCTIONS = {torch.bfloat16: "radixkv_paged_decode_bf16", torch.float32: "radixkv_paged_decode_f32"}
# Pages the fp32 kernel widens on load (radixkv_paged_decode_f32_kv's kv_kind): a bf16 is the
# top half of an fp32; an int8 element times its (token, kv head) fp16 scale. The bf16 kernel
# (radixkv_paged_decode_bf16_kv) widens int8 pages.
_WIDENED_KINDS = {torch.bfloat16: 2, torch.int8: 3}
_WIDENING = {
    torch.float32: ("radixkv_paged_decode_f32_kv", (torch.bfloat16, torch.int8)),
    torch.bfloat16: ("radixkv_paged_decode_bf16_kv", (torch.int8,)),
}


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """The kernel's fixed-size buffers (MAX_HEAD_DIM, MAX_GROUP in csrc/paged_decode.c) and its
    chunk grid (CHUNK_TOKENS in csrc/decode.h: an item's keys, on a grid from key 0)."""

    max_head_dim: int
    max_group: int  # query heads per kv head
    chunk_tokens: int


@functools.cache
def limits() -> DecodeLimits:
    """The limits the compiled library reports (asked once: they are compile-time constants)."""
    library = load()
    assert library is not None, "the native library is not available"
    head_dim, group, chunk = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_int32()
    library.radixkv_decode_limits(ctypes.byref(head_dim), ctypes.byref(group), ctypes.byref(chunk))
    return DecodeLimits(head_dim.value, group.value, chunk.value)


def cache_fits(k_cache: torch.Tensor) -> bool:
    """Whether the kernel reads this page pool: CPU, bf16, fp32 or int8, contiguous [pages,
    page_size, kv_heads, head_dim] (which compute dtype reads it: pages_fit)."""
    return (
        k_cache.device.type == "cpu"
        and (k_cache.dtype in _FUNCTIONS or k_cache.dtype in _WIDENED_KINDS)
        and k_cache.dim() == 4
        and k_cache.is_contiguous()
        and k_cache.shape[2] > 0
        and k_cache.shape[3] <= limits().max_head_dim
    )


def widened_kind(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> int:
    """The C kernels' kv_kind for pages of kv_dtype under compute dtype q_dtype: 0 for the
    same dtype, 2 for bf16 pages (under fp32) and 3 for int8 pages (under fp32 or bf16)."""
    return 0 if q_dtype == kv_dtype else _WIDENED_KINDS[kv_dtype]


def pages_fit(q_dtype: torch.dtype, k_cache: torch.Tensor) -> bool:
    """Whether a kernel reads pages of k_cache's dtype under compute dtype q_dtype: the same
    float dtype, bf16 or int8 pages under fp32 compute, int8 pages under bf16 (AVX2 vectors
    where head_dim % 8 == 0, else portable loops)."""
    if q_dtype == k_cache.dtype:
        return q_dtype in _FUNCTIONS
    library = load()
    widening = _WIDENING.get(q_dtype)
    return widening is not None and k_cache.dtype in widening[1] and library is not None and bool(
        library.radixkv_decode_kv_fits(_WIDENED_KINDS[k_cache.dtype], k_cache.shape[-1])
    )


def heads_fit(num_q_heads: int, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes num_q_heads query heads over this pool's kv heads (GQA group limit)."""
    num_kv_heads = k_cache.shape[2]
    return num_q_heads % num_kv_heads == 0 and num_q_heads // num_kv_heads <= limits().max_group


def query_fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether q's dtype and layout fit the kernel: heads side by side in each row, unit inner stride."""
    return (
        q.dtype == k_cache.dtype
        and q.shape[-1] == k_cache.shape[3]
        and q.stride(-1) == 1
        and q.stride(-2) == q.shape[-1]
    )


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors (and the library is built)."""
    return (
        q.device.type == "cpu"
        and load() is not None
        and cache_fits(k_cache)
        and heads_fit(q.shape[1], k_cache)
        and query_fits(q, k_cache)
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    check: bool = True,
    plan: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per request over its paged KV, without copying the KV.

    q: [R, num_q_heads, head_dim] (rows may be strided); page_table: [B, P] int32; seq_lens:
    [B] int32; rows: [B] int32, the q/out row of each request (None: row b). Returns out
    [R, num_q_heads, head_dim], contiguous; rows no request names are left as they were.
    check=False skips every check, for a caller that ran check_tables on these same tables
    (the CPU backend, once per step) and built out itself. plan: cascade_plan's groups for these
    same tables (None: every request reads all its keys itself). Pages in another dtype than q
    (pages_fit: bf16 or int8 under fp32, int8 under bf16) are widened on load, int8 times k_scales, v_scales
    ([num_pages, page_size, num_kv_heads] fp32); cascade groups widen each shared chunk once.
    window: a sliding window, each request attending to its last `window` keys only (never with
    a plan: a group's shared keys may fall out of a member's window). sinks: gpt-oss's logit per
    query head [num_q_heads], joining each softmax's sum where a request's states merge, so
    cascade groups take them as they are (sink_logits makes them).
    """
    if window is not None and plan is not None:
        raise ValueError("a sliding window decodes without cascade groups (plan=None)")
    library = load()
    assert library is not None, "call supports() first"
    num_seqs = seq_lens.shape[0]
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    page_table = page_table.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    if rows is not None:
        rows = rows.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    widened = k_cache.dtype != q.dtype
    if check:
        check_buffers(q, k_cache, v_cache, out)
        check_tables(page_table, seq_lens, rows, q.shape[0], k_cache.shape[0], page_size)
        if widened:
            check_scales(k_cache, k_scales, v_scales)
        if sinks is not None:
            check_sinks(sinks, num_q_heads)
    plan_pointer = plan.data_ptr() if plan is not None else None
    work = torch.empty(max(work_floats(seq_lens, plan, num_q_heads, head_dim, window), 1), dtype=torch.float32)
    args = (
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        page_table.data_ptr(), page_table.stride(0), seq_lens.data_ptr(),
        rows.data_ptr() if rows is not None else None, num_seqs, num_q_heads, num_kv_heads, head_dim,
        page_size, scale, out.data_ptr(), work.data_ptr(), plan_pointer, torch.get_num_threads(), window or 0,
    )  # fmt: skip
    # The _sinks variants take the logits after the same arguments (NULL: none).
    suffix, tail = ("_sinks", (sinks.data_ptr(),)) if sinks is not None else ("", ())
    if widened:
        assert q.dtype in _WIDENING, "call pages_fit() first"
        scales = (k_scales.data_ptr(), v_scales.data_ptr()) if k_scales is not None else (None, None)
        status = getattr(library, _WIDENING[q.dtype][0] + suffix)(*args, *scales, _WIDENED_KINDS[k_cache.dtype], *tail)
    else:
        status = getattr(library, _FUNCTIONS[q.dtype] + suffix)(*args, *tail)
    if status == 2:
        raise MemoryError("paged decode could not allocate its work item tables")
    if status != 0:
        limit = limits()
        raise ValueError(
            f"paged decode kernel rejected the shapes: {num_q_heads} query heads, {num_kv_heads} kv heads, "
            f"head_dim {head_dim} (limits: group <= {limit.max_group}, head_dim <= {limit.max_head_dim})"
        )
    return out


def work_floats(
    seq_lens: torch.Tensor, plan: torch.Tensor | None, num_q_heads: int, head_dim: int, window: int | None = None
) -> int:
    """Floats of softmax state the kernel needs for these lengths, plan and window."""
    plan_pointer = plan.data_ptr() if plan is not None else None
    return load().radixkv_decode_work_floats(
        seq_lens.data_ptr(), seq_lens.shape[0], plan_pointer, num_q_heads, head_dim, window or 0
    )


# Who decodes as a cascade group on CPU. A shared item transposes and pairs its keys and values
# once for all its queries, then runs at the matrix-product rate; the group pays by the KV reads
# it saves: (members - 1) x the shared K and V of one layer, in bytes, at least a fraction of a
# core's L2 (below that the members' re-reads come from cache and the set-up is not won back).
# Two floors stand beside the bytes rule: a chunk's worth of shared keys (the transposing is per
# chunk) and enough query heads per KV head to fill a tile (members x GQA group). The runs that
# set them are in docs/measurements.md ("Cascade decode: where a group pays on CPU" and "Cascade
# chosen by the bytes it saves"; scenarios/cascade_threshold.py --ab).
MIN_SAVED_L2_FRACTION = 4.0
MIN_SHARED_TOKENS = 256
L2_BYTES_UNKNOWN = 512 << 10  # the smallest L2 of the CPUs radixkv has met, where sysfs is silent
MIN_GROUP_QUERY_HEADS = 18


def use_cascade_tiles(on: bool) -> bool:
    """Cascade groups' shared keys as matrix-product tiles (vdpbf16ps in bf16, FMAs in fp32;
    on by default) or, off, each member over them with the plain kernel; returns whether tiles
    are on. One setting per process (the library holds it), as EngineConfig.cascade_tiles."""
    return bool(load().radixkv_cascade_use_tiles(int(on)))


def min_saved_tokens(num_kv_heads: int, head_dim: int, kv_itemsize: int, l2_bytes: int | None = None) -> int:
    """The fewest KV tokens a cascade group must save reading ((members - 1) x shared tokens):
    those whose K and V, over one layer's KV heads at the pages' element size, fill
    MIN_SAVED_L2_FRACTION of a core's L2 (this CPU's where l2_bytes is None)."""
    l2_bytes = l2_bytes or cpu_caches().l2_bytes or L2_BYTES_UNKNOWN
    bytes_per_token = 2 * num_kv_heads * head_dim * kv_itemsize
    return max(1, math.ceil(MIN_SAVED_L2_FRACTION * l2_bytes / bytes_per_token))


def min_members(query_heads_per_kv_head: int) -> int:
    """The fewest requests worth a cascade group for this GQA group size."""
    return max(2, -(-MIN_GROUP_QUERY_HEADS // max(1, query_heads_per_kv_head)))


def cascade_thresholds(num_q_heads: int, num_kv_heads: int, head_dim: int, kv_itemsize: int,
                       l2_bytes: int | None = None) -> dict[str, int]:  # fmt: skip
    """The automatic choice as cascade_plan's keyword arguments: min_shared_tokens,
    min_group_members and min_saved_tokens for this model's heads and page dtype on this CPU."""
    return dict(
        min_shared_tokens=MIN_SHARED_TOKENS,
        min_group_members=min_members(num_q_heads // num_kv_heads),
        min_saved_tokens=min_saved_tokens(num_kv_heads, head_dim, kv_itemsize, l2_bytes),
    )


@dataclass(frozen=True, slots=True)
class CascadePlan:
    """Which requests decode their shared cached prefix together this step (the kernel's int32
    plan buffer, None where nobody shares), and the KV tokens that saves reading."""

    plan: torch.Tensor | None
    saved_tokens: int

    def groups(self, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The plan as int32 tensors: group_start [G + 1], members, shared_len [G] (tokens) and
        own_begin [num_seqs], where each request's own keys start (the buffer's layout is
        radixkv_decode's Plan in csrc/paged_decode.c)."""
        assert self.plan is not None
        buffer, num_groups = self.plan, int(self.plan[0])
        group_of = buffer[1 : 1 + num_seqs]
        group_start = buffer[1 + 2 * num_seqs : 2 + 2 * num_seqs + num_groups]
        members_at = 2 + 2 * num_seqs + num_groups
        members = buffer[members_at : members_at + int(group_start[-1])]
        shared_len = buffer[members_at + int(group_start[-1]) : members_at + int(group_start[-1]) + num_groups]
        own_begin = torch.where(group_of >= 0, shared_len[group_of.clamp(min=0).long()], 0).to(torch.int32)
        return group_start.clone(), members.clone(), shared_len.clone(), own_begin


def cascade_plan(
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    min_shared_tokens: int,
    min_group_members: int = 2,
    min_saved_tokens: int = 0,
) -> CascadePlan:
    """Groups requests by the deepest cached prefix they share (equal page ids: the same radix
    tree blocks), choosing the grouping that saves the most reads (radixkv_cascade_plan); a
    group has at least min_group_members requests sharing min_shared_tokens or more, and saves
    at least min_saved_tokens of KV reads ((members - 1) x shared tokens). Tables as
    paged_decode takes them, already checked. The backends plan through radixkv.attention.cascade,
    whose Python planner gives the same plan where this library is not built."""
    library = load()
    num_seqs = seq_lens.shape[0]
    plan = torch.empty(library.radixkv_cascade_plan_ints(num_seqs), dtype=torch.int32)
    saved = library.radixkv_cascade_plan(
        page_table.data_ptr(), page_table.stride(0), seq_lens.data_ptr(), num_seqs, page_size, min_shared_tokens,
        min_group_members, min_saved_tokens, plan.data_ptr(),
    )  # fmt: skip
    if saved < 0:
        raise MemoryError("cascade planning could not allocate its sort buffers")
    return CascadePlan(plan if int(plan[0]) > 0 else None, int(saved))


def batch_invariant_plan(plan: CascadePlan, num_seqs: int) -> CascadePlan:
    """plan made batch-invariant (radixkv_cascade_plan_exact): each group's shared length cut
    to the kernel's 256-key chunk grid and every member run through the plain kernel's own
    code over the shared chunks, so a member's output is the bits it gets decoded alone, and the
    shared keys still come from memory once per group. A new plan; plan is left as it was."""
    if plan.plan is None:
        return plan
    exact = plan.plan.clone()
    saved = load().radixkv_cascade_plan_exact(exact.data_ptr(), num_seqs)
    return CascadePlan(exact if saved > 0 else None, int(saved))


def check_buffers(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
    """The caches and the output buffer have the shapes and dtypes the kernel assumes."""
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or not v_cache.is_contiguous():
        raise ValueError(f"v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)}, contiguous")
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)}")


def sink_logits(sinks: torch.Tensor) -> torch.Tensor:
    """A layer's sink parameter as the kernels read it: contiguous fp32 [num_q_heads]."""
    return sinks.detach().to(torch.float32).contiguous()


def check_sinks(sinks: torch.Tensor, num_q_heads: int) -> None:
    """The kernels read one fp32 sink logit per query head."""
    if sinks.shape != (num_q_heads,) or sinks.dtype != torch.float32 or not sinks.is_contiguous() or sinks.device.type != "cpu":
        raise ValueError(f"sinks must be a contiguous fp32 CPU tensor of shape ({num_q_heads},), got {tuple(sinks.shape)} {sinks.dtype}")


def check_scales(k_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> None:
    """int8 pages come with fp16 scales [num_pages, page_size, num_kv_heads], contiguous."""
    if k_cache.dtype != torch.int8:
        return
    for scales in (k_scales, v_scales):
        if scales is None or scales.shape != k_cache.shape[:3] or scales.dtype != SCALE_DTYPE or not scales.is_contiguous():
            raise ValueError(f"int8 pages need contiguous fp16 scales of shape {tuple(k_cache.shape[:3])}")


def check_tables(
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor | None,
    num_q_rows: int,
    num_pages: int,
    page_size: int,
) -> None:
    """The C kernel trusts its indices; a bad one would read or write outside a tensor and take
    the process down, so they are checked before it runs (a few microseconds on CPU)."""
    num_seqs = seq_lens.shape[0]
    if page_table.shape[0] != num_seqs or (rows is not None and rows.shape[0] != num_seqs):
        raise ValueError(f"page_table has {page_table.shape[0]} rows for {num_seqs} sequences")
    if num_seqs == 0:
        return
    if int(seq_lens.min()) < 0 or int(seq_lens.max()) > page_table.shape[1] * page_size:
        raise IndexError(f"sequence lengths must lie in [0, {page_table.shape[1] * page_size}] (page table width x page size)")
    if page_table.numel() and (int(page_table.min()) < 0 or int(page_table.max()) >= num_pages):
        raise IndexError(f"page ids must lie in [0, {num_pages})")
    if rows is None and num_seqs > num_q_rows:
        raise IndexError(f"{num_seqs} sequences but q has {num_q_rows} rows")
    if rows is not None and (int(rows.min()) < 0 or int(rows.max()) >= num_q_rows):
        raise IndexError(f"rows must lie in [0, {num_q_rows})")


def check_slots(slots: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Every slot a step stores to must lie in the cache: the C store trusts them."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if slots.numel() and int(slots.max()) >= num_slots:
        raise IndexError(f"slot {int(slots.max())} is out of range: the cache has {num_slots} slots")


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
) -> bool:  # fmt: skip
    """Copy the rows of k and v ([T, heads, head_dim], rows may be strided) into their slots of
    the caches in one call; slots < 0 are skipped. fp32 rows into bf16 pages round to nearest
    even; fp32 or bf16 rows into int8 pages quantize per (token, head) as
    radixkv.cache.kv_dtype.quantize_int8 does (the same bytes), the scales into k_scales,
    v_scales. The caller has checked slots < the number of slots (check_slots). Returns False,
    having done nothing, where the tensors do not fit the kernel."""
    library = load()
    kind = _WIDENED_KINDS[k_cache.dtype] if k_cache.dtype in _WIDENING.get(k.dtype, ("", ()))[1] else None
    fits = (
        library is not None
        and k.device.type == "cpu"
        and k.dtype == v.dtype
        and k_cache.dtype == v_cache.dtype
        and (k.dtype == k_cache.dtype or kind is not None)
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and slots.dtype == torch.int64
        and slots.is_contiguous()
        and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
        and k.shape[1:] == v.shape[1:] == k_cache.shape[2:]
    )
    if not fits:
        return False
    if kind is not None:
        check_scales(k_cache, k_scales, v_scales)
        scales = (k_scales.data_ptr(), v_scales.data_ptr()) if k_scales is not None else (None, None)
        rows = (k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), slots.data_ptr(), k.shape[0], k.shape[1], k.shape[2])
        if k.dtype == torch.bfloat16:
            library.radixkv_store_kv_narrow_bf16(k_cache.data_ptr(), v_cache.data_ptr(), *scales, *rows)
        else:
            library.radixkv_store_kv_narrow(k_cache.data_ptr(), v_cache.data_ptr(), *scales, *rows, kind)
        return True
    row_bytes = k.shape[1] * k.shape[2] * k.element_size()
    library.radixkv_store_kv(
        k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0) * k.element_size(),
        v.stride(0) * v.element_size(), slots.data_ptr(), k.shape[0], row_bytes,
    )  # fmt: skip
    return True


def prefill_rows_plan(request_of_row: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor | None:
    """A batch-invariant prefill's rows (each its own one-token request over its prefix) grouped
    by request and chunk band: the rows of a request whose keys end in the same 256-key chunk
    share all the whole chunks before it, so each such chunk is one shared item for all of them
    (the plan's layout: csrc/paged_decode.c's Plan, marked batch-invariant). None: no group."""
    num_seqs, chunk = seq_lens.shape[0], limits().chunk_tokens
    band = (seq_lens.to(torch.int64) - 1) // chunk
    bands = int(band.max()) + 1 if num_seqs else 1
    keys, inverse, counts = torch.unique(request_of_row.to(torch.int64) * bands + band, return_inverse=True, return_counts=True)
    shared = keys % bands * chunk
    live = (counts >= 2) & (shared > 0)
    if not bool(live.any()):
        return None
    group_id = torch.full((keys.shape[0],), -1, dtype=torch.int64)
    group_id[live] = torch.arange(int(live.sum()))
    group_of = group_id[inverse]
    grouped = torch.nonzero(group_of >= 0).flatten()
    order = grouped[torch.argsort(group_of[grouped], stable=True)]
    sizes = counts[live]
    group_start = torch.zeros(sizes.shape[0] + 1, dtype=torch.int64)
    group_start[1:] = torch.cumsum(sizes, 0)
    member_index = torch.zeros(num_seqs, dtype=torch.int64)
    member_index[order] = torch.arange(order.shape[0]) - group_start[group_of[order]]
    plan = torch.zeros(load().radixkv_cascade_plan_ints(num_seqs), dtype=torch.int32)
    num_groups = sizes.shape[0]
    plan[0] = num_groups
    plan[1 : 1 + num_seqs] = group_of.to(torch.int32)
    plan[1 + num_seqs : 1 + 2 * num_seqs] = member_index.to(torch.int32)
    at = 1 + 2 * num_seqs
    plan[at : at + num_groups + 1] = group_start.to(torch.int32)
    at += num_groups + 1
    plan[at : at + order.shape[0]] = order.to(torch.int32)
    at += order.shape[0]
    plan[at : at + num_groups] = shared[live].to(torch.int32)
    plan[-1] = 1  # batch-invariant: every member gets its own item's bits
    return plan
