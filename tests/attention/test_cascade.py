"""Cascade decode (radixkv/cpu/csrc/cascade.c): requests that share a cached prefix read its KV
once per step as a group, and merge it by log-sum-exp with their own suffix. Its output must
match the float64 reference (and so plain paged decode) within the kernel's tolerances, for
every grouping; the plan must group exactly the requests that share enough whole pages.

Tolerances are test_native_decode's: the same inputs, other summation orders.
"""

from __future__ import annotations

import pytest
import torch
from tests.attention.test_native_decode import Paged, assert_close, gen, make_q, reference  # noqa: F401  (gen is a fixture)

from radixkv.cpu import decode
from radixkv.cpu.native import load

pytestmark = pytest.mark.skipif(load() is None, reason="needs the native kernels (no C compiler here)")

PAGE = 16


class Tables:
    """A pool of shuffled pages and requests in groups: each group's members hold the same pages
    for its prefix's whole pages (as the radix tree hands them out), then pages of their own.
    A prefix ending mid-page leaves its last page private: the tree shares whole blocks only."""

    def __init__(self, gen, groups: list[tuple[int, int]], own_tokens: list[int], heads: tuple[int, int], head_dim: int, dtype, roots: int = 0):
        num_q_heads, num_kv_heads = heads
        total_pages = roots + sum(-(-prefix // PAGE) for prefix, _ in groups) + sum(-(-own // PAGE) + 1 for own in own_tokens) + 4
        shape = (total_pages, PAGE, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen).to(dtype)
        self.v_cache = torch.randn(shape, generator=gen).to(dtype)
        free = torch.randperm(total_pages, generator=gen).tolist()
        root = [free.pop() for _ in range(roots)]  # pages every group starts with
        rows, lens, self.shared_pages = [], [], []
        member = 0
        for prefix, size in groups:
            full = prefix // PAGE
            shared = root + [free.pop() for _ in range(full)]
            for _ in range(size):
                length = roots * PAGE + prefix + own_tokens[member]
                pages = shared + [free.pop() for _ in range(-(-length // PAGE) - len(shared))]
                rows.append(pages)
                lens.append(length)
                member += 1
            self.shared_pages.append(len(shared))
        width = max(map(len, rows))
        self.page_table = torch.zeros(len(rows), width, dtype=torch.int32)
        for b, pages in enumerate(rows):
            self.page_table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.groups = groups
        self.q = make_q(gen, len(rows), num_q_heads, num_kv_heads, head_dim, dtype)

    def paged(self) -> Paged:
        return Paged(self.k_cache, self.v_cache, self.page_table, self.seq_lens, PAGE)

    def expected_saved_tokens(self, min_tokens: int, min_members: int) -> int:
        """Groups of at least min_members sharing at least min_tokens of whole pages save
        (members - 1) reads of those pages."""
        return sum(
            (size - 1) * pages * PAGE
            for (_, size), pages in zip(self.groups, self.shared_pages)
            if size >= max(2, min_members) and pages * PAGE >= min_tokens
        )


# The kernel tests group every pair sharing a page; the engine's thresholds are tested apart.
ANY_SHARING = dict(min_shared_tokens=PAGE, min_group_members=2)


def check_cascade(t: Tables, dtype, what: str, **thresholds) -> decode.CascadePlan:
    scale = t.q.shape[-1] ** -0.5
    plan = decode.cascade_plan(t.page_table, t.seq_lens, PAGE, **(thresholds or ANY_SHARING))
    cascade = decode.paged_decode(t.q, t.k_cache, t.v_cache, t.page_table, t.seq_lens, scale, plan=plan.plan)
    plain = decode.paged_decode(t.q, t.k_cache, t.v_cache, t.page_table, t.seq_lens, scale)
    expected = reference(t.q, t.paged(), scale)
    assert_close(cascade, expected, dtype, f"{what}: cascade")
    assert_close(plain, expected, dtype, f"{what}: plain")
    return plan


CASES = [
    # (groups of (prefix tokens, members), GQA (q heads, kv heads), head_dim)
    ([(1024, 2), (1024, 2)], (9, 3), 64),
    ([(700, 3), (300, 1), (517, 2)], (8, 8), 64),  # prefixes off the page and chunk grid, a group of 1
    ([(1024, 64)], (8, 1), 64),  # one group of 64, GQA 8
    ([(300, 3), (280, 5)], (6, 2), 128),  # head_dim 128, GQA 3
    ([(512, 5), (256, 4)], (6, 2), 40),  # head_dim 40: the member-by-member fallback (bf16 and fp32)
    ([(260, 2), (600, 2)], (6, 2), 96),  # head_dim 96: the general vector instance
    ([(0, 3), (40, 2)], (4, 4), 64),  # nothing long enough to share
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("groups", "heads", "head_dim"), CASES)
def test_cascade_matches_the_reference_for_every_grouping(gen, dtype, groups, heads, head_dim):
    own = torch.randint(1, 90, (sum(size for _, size in groups),), generator=gen).tolist()
    t = Tables(gen, groups, own, heads=heads, head_dim=head_dim, dtype=dtype)
    plan = check_cascade(t, dtype, f"{groups} {heads} d{head_dim}")
    assert plan.saved_tokens == t.expected_saved_tokens(PAGE, 2)
    assert (plan.plan is None) == (plan.saved_tokens == 0)


def test_default_thresholds_group_only_what_pays(gen):
    # SmolLM2's heads (GQA 3): a group needs 3 members (9 query heads per KV head) and 256 shared
    # tokens; a pair over 1,024 tokens and trios over 112 and 240 tokens decode on their own.
    groups = [(1024, 2), (1024, 3), (112, 3), (240, 3), (700, 16)]
    own = torch.randint(1, 40, (sum(size for _, size in groups),), generator=gen).tolist()
    t = Tables(gen, groups, own, heads=(9, 3), head_dim=64, dtype=torch.bfloat16)
    members = decode.min_members(3)
    assert members == 3 and decode.min_members(1) == 9 and decode.min_members(8) == 2
    plan = check_cascade(t, torch.bfloat16, "default thresholds", min_shared_tokens=decode.MIN_SHARED_TOKENS, min_group_members=members)
    assert plan.saved_tokens == t.expected_saved_tokens(decode.MIN_SHARED_TOKENS, members) == 2 * 1024 + 15 * 688


def test_plan_groups_by_the_deepest_prefix_that_saves_most(gen):
    # Four system prompts of 1,024 tokens after a common 2-page root (the chat template's start):
    # one group of 64 sharing 2 pages saves 63 x 32 reads; four groups of 16 sharing 66 pages
    # each save 4 x 15 x 1,056, so the plan takes the four.
    own = torch.randint(1, 60, (64,), generator=gen).tolist()
    t = Tables(gen, [(1024, 16)] * 4, own, heads=(9, 3), head_dim=64, dtype=torch.bfloat16, roots=2)
    plan = check_cascade(t, torch.bfloat16, "four prompts over a common root")
    assert int(plan.plan[0]) == 4
    assert plan.saved_tokens == 4 * 15 * (1024 + 2 * PAGE)


def test_members_joining_and_leaving_between_steps(gen):
    # Step by step a group grows and shrinks (requests join, finish, are preempted): the plan is
    # rebuilt from each step's tables and the output always matches the reference.
    own = [30, 50, 70, 90, 110]
    t = Tables(gen, [(768, 5)], own, heads=(9, 3), head_dim=64, dtype=torch.bfloat16)
    for members in ([0], [0, 1], [0, 1, 2, 3, 4], [1, 3], [4]):
        index = torch.tensor(members)
        sub = Tables.__new__(Tables)
        sub.k_cache, sub.v_cache, sub.q = t.k_cache, t.v_cache, t.q[index]
        sub.page_table, sub.seq_lens = t.page_table[index].contiguous(), t.seq_lens[index].contiguous()
        plan = check_cascade(sub, torch.bfloat16, f"members {members}")
        assert plan.saved_tokens == 768 * (len(members) - 1)


def test_a_member_whose_whole_sequence_is_shared(gen):
    # Two requests over the very same full pages (no own keys left): the merge takes the shared
    # states alone.
    t = Tables(gen, [(512, 3)], [0, 0, 16], heads=(4, 2), head_dim=64, dtype=torch.float32)
    plan = check_cascade(t, torch.float32, "no own keys")
    assert plan.saved_tokens == 2 * 512


def test_cascade_rows_of_a_mixed_step(gen):
    # In a mixed step the decoding requests' q and out rows sit among prefill rows: each request
    # (and each group member) reads and writes only its own row.
    t = Tables(gen, [(400, 4), (300, 3)], [20, 30, 40, 50, 10, 60, 5], heads=(9, 3), head_dim=64, dtype=torch.bfloat16)
    rows = torch.tensor([9, 2, 5, 0, 11, 7, 3], dtype=torch.int32)
    q = make_q(gen, 12, 9, 3, 64, torch.bfloat16)
    q[rows.long()] = t.q
    plan = decode.cascade_plan(t.page_table, t.seq_lens, PAGE, **ANY_SHARING)
    assert plan.plan is not None
    out = torch.full((12, 9, 64), 7.0, dtype=torch.bfloat16)
    decode.paged_decode(q, t.k_cache, t.v_cache, t.page_table, t.seq_lens, 0.125, rows=rows, out=out, plan=plan.plan)
    assert_close(out[rows.long()], reference(t.q, t.paged(), 0.125), torch.bfloat16, "mixed-step rows")
    others = [r for r in range(12) if r not in rows.tolist()]
    assert (out[others] == 7.0).all()
