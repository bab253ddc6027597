"""Decode's shared reads (radixkv_decode_share_order): requests over the same cached prefix have
their work run back to back, so the prefix is read from memory once per step. The order must
never change an output bit, and the shared-token count must be exactly the repeated reads."""

from __future__ import annotations

import pytest
import torch
from tests.attention.test_native_decode import assert_close, gen, reference  # noqa: F401  (gen is a fixture)

from radixkv.cpu import decode
from radixkv.cpu.native import load

pytestmark = pytest.mark.skipif(load() is None, reason="needs the native kernels (no C compiler here)")

CHUNK = 256  # the kernel's CHUNK_TOKENS


class Tables:
    """A pool of shuffled pages and requests in groups: each group's members hold the same pages
    for its prefix (as the radix tree hands them out), then pages of their own."""

    def __init__(self, gen, groups: list[tuple[int, int]], own_tokens: list[int], page_size: int, heads: tuple[int, int], head_dim: int, dtype):
        num_q_heads, num_kv_heads = heads
        total_pages = sum(-(-prefix // page_size) for prefix, _ in groups) + sum(-(-own // page_size) + 1 for own in own_tokens) + 4
        shape = (total_pages, page_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen).to(dtype)
        self.v_cache = torch.randn(shape, generator=gen).to(dtype)
        free = torch.randperm(total_pages, generator=gen).tolist()
        rows, lens, self.prefixes = [], [], []
        member = 0
        for prefix, size in groups:
            # A prefix ending mid-page: its last page is shared only as far as the prefix goes,
            # so members hold it privately (the tree shares whole blocks only).
            full = prefix // page_size
            shared = [free.pop() for _ in range(full)]
            for _ in range(size):
                own = own_tokens[member]
                length = full * page_size + (prefix - full * page_size) + own
                pages = shared + [free.pop() for _ in range(-(-length // page_size) - full)]
                rows.append(pages)
                lens.append(length)
                self.prefixes.append(full * page_size)
                member += 1
        width = max(map(len, rows))
        self.page_table = torch.zeros(len(rows), width, dtype=torch.int32)
        for b, pages in enumerate(rows):
            self.page_table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.groups = groups
        self.q = torch.randn(len(rows), num_q_heads, head_dim, generator=gen).to(dtype)

    def expected_shared_tokens(self) -> int:
        """Tokens of chunks a request reads that an earlier member of its group read already:
        whole chunks within the shared full pages, for every member but the first."""
        shared, member = 0, 0
        for _, size in self.groups:
            prefix = self.prefixes[member]
            per_member = 0
            for start in range(0, prefix, CHUNK):
                ends = {min(start + CHUNK, int(self.seq_lens[member + m])) for m in range(size)}
                if start + CHUNK <= prefix and len(ends) == 1:
                    per_member += min(start + CHUNK, int(self.seq_lens[member]))  - start
            shared += per_member * (size - 1)
            member += size
        return shared


CASES = [
    # (groups of (prefix tokens, members), GQA (q heads, kv heads), head_dim)
    ([(1024, 2), (1024, 2)], (9, 3), 64),
    ([(700, 3), (300, 1), (517, 2)], (8, 8), 64),  # prefixes off the page and chunk grid, a group of 1
    ([(1024, 64)], (8, 1), 64),  # one group of 64, GQA 8
    ([(512, 5), (256, 4)], (6, 2), 40),  # head_dim 40: the portable item
    ([(0, 3), (40, 2)], (4, 4), 64),  # nothing long enough to share
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("groups", "heads", "head_dim"), CASES)
def test_shared_order_changes_no_output_bit(gen, dtype, groups, heads, head_dim):
    own = torch.randint(1, 90, (sum(size for _, size in groups),), generator=gen).tolist()
    t = Tables(gen, groups, own, page_size=16, heads=heads, head_dim=head_dim, dtype=dtype)
    plain = decode.paged_decode(t.q, t.k_cache, t.v_cache, t.page_table, t.seq_lens, 0.125)
    order, shared_tokens = decode.share_order(t.page_table, t.seq_lens, 16)
    ordered = decode.paged_decode(t.q, t.k_cache, t.v_cache, t.page_table, t.seq_lens, 0.125, order=order)
    assert torch.equal(plain, ordered)
    assert sorted(order.tolist()) == list(range(len(order)))  # a permutation of the items
    assert shared_tokens == t.expected_shared_tokens()


def test_members_joining_and_leaving_between_steps(gen):
    # Step by step a group grows and shrinks (requests join, finish, are preempted): the order is
    # rebuilt from each step's tables, and outputs always equal the natural order's.
    own = [30, 50, 70, 90, 110]
    t = Tables(gen, [(768, 5)], own, page_size=16, heads=(9, 3), head_dim=64, dtype=torch.bfloat16)
    for members in ([0], [0, 1], [0, 1, 2, 3, 4], [1, 3], [4]):
        index = torch.tensor(members)
        table, lens, q = t.page_table[index].contiguous(), t.seq_lens[index].contiguous(), t.q[index].contiguous()
        order, shared_tokens = decode.share_order(table, lens, 16)
        plain = decode.paged_decode(q, t.k_cache, t.v_cache, table, lens, 0.125)
        assert torch.equal(plain, decode.paged_decode(q, t.k_cache, t.v_cache, table, lens, 0.125, order=order))
        assert shared_tokens == 768 * (len(members) - 1)
