"""Cascade planning (radixkv/attention/cascade.py): the Python planner groups exactly as the C
planner (radixkv/cpu/csrc/cascade.c) does, on any page tables, so a backend without the native
library (the Triton one on a machine without a C compiler) plans the same groups.

The kernels that run the groups are tested in tests/cpu/test_decode.py (CPU) and
tests/kernels/test_attention_kernels.py (Triton).
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.attention import cascade
from radixkv.cpu import decode, native

needs_c_planner = pytest.mark.skipif(native.load() is None, reason="the C planner needs the native library (no C compiler here)")


def used_ints(plan: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """The part of a plan buffer the planners write (the rest is scratch): the group count,
    each request's group and member index, group starts, members, shared lengths."""
    num_groups = int(plan[0])
    members = int(plan[1 + 2 * num_seqs + num_groups])
    return plan[: 1 + 2 * num_seqs + num_groups + 1 + members + num_groups]


def shared_tables(draw, num_seqs: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Page tables as the radix tree hands them out: each request follows a path down a small
    tree of pages (so requests share prefixes of many depths), then has pages of its own; its
    length may end anywhere in its last page."""
    tree: dict[tuple[int, ...], int] = {}
    next_page = 0
    rows, lens = [], []
    for _ in range(num_seqs):
        depth = draw(st.integers(0, 6))
        path: tuple[int, ...] = ()
        for _ in range(depth):
            branch = draw(st.integers(0, 1))  # two branches a page: deep shared prefixes are common
            path = (*path, branch)
            if path not in tree:
                tree[path] = next_page
                next_page += 1
        pages = [tree[path[: i + 1]] for i in range(depth)]
        own = draw(st.integers(0, 3))
        pages += list(range(next_page, next_page + own))
        next_page += own
        full = len(pages)
        lens.append(draw(st.integers(max(0, (full - 1) * page_size), full * page_size)) if full else 0)
        rows.append(pages)
    width = max([len(r) for r in rows] + [1])
    table = torch.zeros(num_seqs, width, dtype=torch.int32)
    for b, pages in enumerate(rows):
        table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        table[b, len(pages) :] = draw(st.integers(0, max(next_page - 1, 0)))  # padding past a request's pages
    return table, torch.tensor(lens, dtype=torch.int32)


@needs_c_planner
@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    num_seqs=st.integers(0, 16),
    page_size=st.sampled_from([1, 2, 4, 16]),
    min_pages=st.integers(0, 4),
    min_group_members=st.integers(0, 4),
    min_saved_pages=st.integers(0, 12),
)
def test_the_python_planner_gives_the_c_planners_groups(data, num_seqs, page_size, min_pages, min_group_members, min_saved_pages):
    # Thresholds around whole pages (half a page short of min_pages), so that about half the
    # examples group, many in several groups.
    page_table, seq_lens = shared_tables(data.draw, num_seqs, page_size)
    thresholds = dict(min_shared_tokens=max(0, min_pages * page_size - page_size // 2), min_group_members=min_group_members,
                      min_saved_tokens=max(0, min_saved_pages * page_size - page_size // 2))  # fmt: skip
    c_plan = decode.cascade_plan(page_table, seq_lens, page_size, **thresholds)
    py_plan = cascade.torch_cascade_plan(page_table, seq_lens, page_size, **thresholds)
    assert py_plan.saved_tokens == c_plan.saved_tokens
    assert (py_plan.plan is None) == (c_plan.plan is None)
    if c_plan.plan is not None:
        assert torch.equal(used_ints(py_plan.plan, num_seqs), used_ints(c_plan.plan, num_seqs))
        for ours, theirs in zip(py_plan.groups(num_seqs), c_plan.groups(num_seqs), strict=True):
            assert torch.equal(ours, theirs)


@pytest.mark.parametrize("native_planner", [False, True])
def test_a_group_must_save_min_saved_tokens_of_reads(native_planner):
    # Three requests over 2 shared pages of 4 tokens save (3 - 1) x 8 = 16 tokens of reads: a
    # group at 16, none at 17; a pair over the same pages saves 8.
    if native_planner and native.load() is None:
        pytest.skip("needs the native library (a C compiler)")
    rows = [[1, 2, 10 + b] for b in range(3)]
    page_table, seq_lens = torch.tensor(rows, dtype=torch.int32), torch.full((3,), 10, dtype=torch.int32)
    plan = functools.partial(cascade.plan_cascade, page_table, seq_lens, 4, min_shared_tokens=4, min_group_members=2,
                             native_planner=native_planner)  # fmt: skip
    assert plan(min_saved_tokens=16).saved_tokens == 16
    assert plan(min_saved_tokens=17).plan is None
    pair = cascade.plan_cascade(page_table[:2], seq_lens[:2], 4, min_shared_tokens=4, min_group_members=2,
                                native_planner=native_planner, min_saved_tokens=9)  # fmt: skip
    assert pair.plan is None


def test_the_python_planner_groups_by_the_deepest_prefix_that_saves_most():
    # Two prompts over a common 2-page root: requests 0-2 share pages [7, 8, 20, 21], 3-5 share
    # [7, 8, 30, 31]; one group of 6 over the root saves 5 x 2 pages, two groups of 3 over 4
    # pages save 2 x 2 x 4, so the plan takes the two. Request 6 shares nothing.
    rows = [[7, 8, 20, 21, 40 + b] for b in range(3)] + [[7, 8, 30, 31, 50 + b] for b in range(3)] + [[60, 61, 62, 63, 64]]
    page_table = torch.tensor(rows, dtype=torch.int32)
    seq_lens = torch.tensor([4 * 4 + 1 + b for b in range(7)], dtype=torch.int32)
    plan = cascade.torch_cascade_plan(page_table, seq_lens, 4, min_shared_tokens=4, min_group_members=2)
    assert plan.plan is not None and plan.saved_tokens == 2 * 2 * 16
    group_start, members, shared_len, own_begin = plan.groups(7)
    assert group_start.tolist() == [0, 3, 6]
    assert sorted(members[:3].tolist()) == [0, 1, 2] and sorted(members[3:].tolist()) == [3, 4, 5]
    assert shared_len.tolist() == [16, 16]
    assert own_begin.tolist() == [16] * 6 + [0]


def test_plan_cascade_plans_in_python_without_the_native_library(monkeypatch):
    # native_kernels=False (or no compiler) must not build the library, and still group.
    page_table = torch.tensor([[1, 2, 3], [1, 2, 4], [1, 2, 5]], dtype=torch.int32)
    seq_lens = torch.tensor([10, 11, 12], dtype=torch.int32)

    def no_library():
        raise AssertionError("the native library was asked for")

    monkeypatch.setattr(native, "load", no_library)
    plan = cascade.plan_cascade(page_table, seq_lens, 4, min_shared_tokens=8, min_group_members=2, native_planner=False)
    assert plan.saved_tokens == 2 * 8
    assert plan.groups(3)[0].tolist() == [0, 3]
