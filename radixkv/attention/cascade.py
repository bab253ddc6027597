"""Cascade planning: which decoding requests read their shared cached prefix once, as a group.

Planned from the step's page tables alone, in Python over torch tensors, so every backend (the
Triton one on a machine without a C compiler too) groups; the C planner (radixkv/cpu/csrc/
cascade.c) is the fast path where the native library is built. Both give the very same plan.
"""

from __future__ import annotations

import torch

from radixkv.cpu import native
from radixkv.cpu.decode import CascadePlan, cascade_plan

__all__ = ["CascadePlan", "plan_cascade", "plan_ints", "torch_cascade_plan"]


def plan_cascade(
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    *,
    min_shared_tokens: int,
    min_group_members: int,
    native_planner: bool = True,
    min_saved_tokens: int = 0,
) -> CascadePlan:
    """The step's cascade groups (see torch_cascade_plan), planned by the C planner where
    native_planner is on (EngineConfig.native_kernels) and the library is built, else in Python.
    Tables on the host, as paged decode takes them: int32, checked."""
    page_table = page_table.to(device="cpu", dtype=torch.int32).contiguous()
    seq_lens = seq_lens.to(device="cpu", dtype=torch.int32).contiguous()
    if native_planner and native.load() is not None:
        return cascade_plan(page_table, seq_lens, page_size, min_shared_tokens, min_group_members, min_saved_tokens)
    return torch_cascade_plan(page_table, seq_lens, page_size, min_shared_tokens, min_group_members, min_saved_tokens)


def plan_ints(num_seqs: int) -> int:
    """Ints of the plan buffer for num_seqs requests (radixkv_cascade_plan_ints in cascade.c)."""
    return 2 + 5 * max(num_seqs, 0)


def torch_cascade_plan(
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    min_shared_tokens: int,
    min_group_members: int,
    min_saved_tokens: int = 0,
) -> CascadePlan:
    """Groups requests by the deepest cached prefix they share (equal page ids at the same
    positions: the same radix tree blocks, whole pages only), choosing the grouping that saves
    the most reads; a group has at least min_group_members requests sharing min_shared_tokens
    or more, saving at least min_saved_tokens of KV reads ((members - 1) x shared tokens). The
    plan buffer is laid out as radixkv_cascade_plan writes it (Plan in csrc/paged_decode.c);
    each step below is that function's, in its order."""
    num_seqs = seq_lens.shape[0]
    plan = torch.zeros(plan_ints(num_seqs), dtype=torch.int32)
    plan[1 : 1 + num_seqs] = -1
    if num_seqs < 2 or page_size <= 0:
        return CascadePlan(None, 0)
    full = [row[: length // page_size] for row, length in zip(page_table.tolist(), seq_lens.tolist(), strict=True)]
    # Sorted by page table (a prefix before what extends it, then by index), requests sharing a
    # prefix are neighbours, and the pages two neighbours share bound what any run of them shares.
    order = sorted(range(num_seqs), key=lambda b: (full[b], b))
    lcp = [0] + [_common_pages(full[a], full[b]) for a, b in zip(order, order[1:])]
    min_pages = max(1, -(-min_shared_tokens // page_size))
    min_members = max(2, min_group_members)
    min_saved_pages = -(-max(0, min_saved_tokens) // page_size)
    merged = _best_grouping(lcp, min_pages, min_members, min_saved_pages)
    groups = _emit_groups(lcp, merged)
    group_of, member_index = plan[1 : 1 + num_seqs], plan[1 + num_seqs : 1 + 2 * num_seqs]
    starts, members, shared, saved = [0], [], [], 0
    for g, (lo, hi, pages) in enumerate(groups):
        for i in range(lo, hi):
            group_of[order[i]], member_index[order[i]] = g, i - lo
            members.append(order[i])
        starts.append(len(members))
        shared.append(pages * page_size)
        saved += (hi - lo - 1) * pages * page_size
    plan[0] = len(groups)
    tail = torch.tensor(starts + members + shared, dtype=torch.int32)
    plan[1 + 2 * num_seqs : 1 + 2 * num_seqs + len(tail)] = tail
    return CascadePlan(plan if groups else None, saved)


def _common_pages(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _argmin(lcp: list[int], lo: int, hi: int) -> int:
    """The first position of the smallest lcp in (lo, hi): where the run [lo, hi) splits."""
    k = lo + 1
    for i in range(lo + 2, hi):
        if lcp[i] < lcp[k]:
            k = i
    return k


def _best_grouping(lcp: list[int], min_pages: int, min_members: int, min_saved_pages: int = 0) -> dict[int, bool]:
    """For each split point k, whether the run it splits is one group (merged) or its two sides'
    best groupings: the one that saves more reads, (members - 1) x shared pages; a tie merges.
    Iterative, children before parent (the C code recurses), so any batch size fits the stack."""
    merged: dict[int, bool] = {}
    saving: dict[tuple[int, int], int] = {}
    stack: list[tuple[int, int, bool]] = [(0, len(lcp), False)]
    while stack:
        lo, hi, children_done = stack.pop()
        if hi - lo < 2:
            saving[(lo, hi)] = 0
            continue
        k = _argmin(lcp, lo, hi)
        if not children_done:
            stack += [(lo, hi, True), (k, hi, False), (lo, k, False)]
            continue
        split = saving.pop((lo, k)) + saving.pop((k, hi))
        saves = (hi - lo - 1) * lcp[k]
        worth = lcp[k] >= min_pages and hi - lo >= min_members and saves >= min_saved_pages
        whole = saves if worth else 0
        merged[k] = whole > 0 and whole >= split
        saving[(lo, hi)] = whole if merged[k] else split
    return merged


def _emit_groups(lcp: list[int], merged: dict[int, bool]) -> list[tuple[int, int, int]]:
    """The merged runs (lo, hi, shared pages) of the sorted requests, left to right."""
    groups = []
    stack = [(0, len(lcp))]
    while stack:
        lo, hi = stack.pop()
        if hi - lo < 2:
            continue
        k = _argmin(lcp, lo, hi)
        if merged[k]:
            groups.append((lo, hi, lcp[k]))
        else:
            stack += [(k, hi), (lo, k)]
    return groups
