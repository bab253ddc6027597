"""Unit tests for retention in RadixTree: retained prefixes outlive eviction pressure, go last
in expiry order, become ordinary LRU nodes once expired, and count against an owner's cap and
the tree's cap over all owners."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.cache import BlockHasher, PagePool, RadixTree
from radixkv.engine.kv_manager import KVManager
from tests.cache.test_radix import run_request, seq


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def make_tree(num_pages: int = 64, page_size: int = 4) -> tuple[RadixTree, FakeClock]:
    clock = FakeClock()
    # Plain LRU, so "ordinary node" means one order; slru's own order is tested in
    # test_eviction_policy.py (under it a retain's match also counts as a hit).
    tree = RadixTree(PagePool(num_pages, page_size), BlockHasher(page_size, seed=42), clock=clock, eviction_policy="lru")
    return tree, clock


def retain(tree: RadixTree, tokens: list[int], ttl_s: float, owner: str | None = None, cap: int | None = None) -> int:
    node = tree.match(tokens + [0], record=False).node
    return tree.retain(node, ttl_s, owner, cap)


def cached(tree: RadixTree, tokens: list[int]) -> int:
    return tree.peek(tokens + [0]).num_cached_tokens


def test_retained_prefix_survives_pressure_then_goes_last_in_expiry_order() -> None:
    tree, clock = make_tree()
    long_ttl, short_ttl, plain, plain2 = seq(0, 8), seq(100, 8), seq(200, 8), seq(300, 8)
    for tokens in (long_ttl, short_ttl, plain, plain2):
        run_request(tree, tokens)
    assert retain(tree, long_ttl, 3600) == 2
    assert retain(tree, short_ttl, 300) == 2
    run_request(tree, plain2)  # most recent of all, yet unretained: still goes before any retained page
    assert tree.retained_pages == 4 and tree.evictable_pages == 8
    assert tree.evict(4) == 4
    assert cached(tree, plain) == cached(tree, plain2) == 0
    assert cached(tree, long_ttl) == cached(tree, short_ttl) == 8
    tree.check_invariants()
    assert tree.evict(1) == 2  # memory truly exhausted: the earliest expiry goes first
    assert cached(tree, short_ttl) == 0 and cached(tree, long_ttl) == 8
    assert tree.evict(2) == 2 and tree.cached_pages == 0 and tree.retained_pages == 0
    tree.check_invariants()


def test_expired_retention_is_an_ordinary_lru_node_again() -> None:
    tree, clock = make_tree()
    old, new = seq(0, 8), seq(100, 8)
    run_request(tree, old)
    retain(tree, old, 300)
    run_request(tree, new)
    clock.now_s += 299
    assert tree.evict(2) == 2 and cached(tree, new) == 0  # still retained: the newer prefix goes
    run_request(tree, new)
    clock.now_s += 1
    assert tree.expire() == 1 and tree.retained_pages == 0
    tree.check_invariants()
    assert tree.evict(2) == 2  # now plain LRU: the older one goes
    assert cached(tree, old) == 0 and cached(tree, new) == 8
    tree.check_invariants()


def test_retention_does_not_lock() -> None:
    tree, _ = make_tree()
    tokens = seq(0, 12)
    run_request(tree, tokens)
    retain(tree, tokens, 300)
    assert tree.locked_pages == 0 and tree.evictable_pages == 3 == tree.retained_pages
    match = tree.match(tokens)
    tree.lock(match.node)  # a request using a retained prefix: locked while it runs
    assert tree.locked_pages == 2 and tree.evict(10) == 1  # the unlocked retained tail still can go
    tree.unlock(match.node)
    tree.check_invariants()
    assert tree.evict(10) == 2 and tree.cached_pages == 0


def test_split_and_partial_eviction_keep_the_path_retained() -> None:
    tree, clock = make_tree()
    tokens = seq(0, 16)
    run_request(tree, tokens)
    retain(tree, tokens, 300)
    run_request(tree, seq(0, 8) + seq(500, 8))  # splits the retained node after 2 blocks
    tree.check_invariants()
    assert tree.retained_pages == 4
    assert tree.evict(2) == 2 and cached(tree, seq(0, 8)) == 8  # the unretained branch went
    assert tree.evict(1) == 2 and tree.retained_pages == 2  # the retained tail; its retained parent stays
    tree.check_invariants()
    clock.now_s += 300
    assert tree.expire() == 1 and tree.retained_pages == 0  # releases along a partly evicted path
    tree.check_invariants()


def three_prompts() -> tuple[RadixTree, list[int], list[int], list[int]]:
    """A tree caching three unrelated prompts of 2, 2 and 3 pages, for the owner-cap tests."""
    tree, _ = make_tree()
    a, b, c = seq(0, 8), seq(100, 8), seq(200, 12)
    for tokens in (a, b, c):
        run_request(tree, tokens)
    return tree, a, b, c


def test_owner_cap_releases_the_oldest_retention() -> None:
    tree, a, b, c = three_prompts()
    assert retain(tree, a, 300, "k", cap=5) == 2
    assert retain(tree, b, 300, "k", cap=5) == 2
    assert retain(tree, c, 300, "k", cap=5) == 3  # 7 > 5: a, the oldest, is released
    assert [r.num_pages for r in tree.retentions("k")] == [2, 3]
    assert retain(tree, a, 300, "other", cap=5) == 2  # caps are per owner
    assert retain(tree, c, 300, "k", cap=2) == 0  # longer than the cap on its own
    assert tree.retained_pages == 7
    tree.check_invariants()


def test_re_retaining_a_growing_prefix_does_not_count_twice() -> None:
    tree, clock = make_tree()
    turn1, turn2 = seq(0, 8), seq(0, 16)
    run_request(tree, turn2)
    assert retain(tree, turn1, 3600, "k") == 2
    assert retain(tree, turn1, 300, "k") == 2  # same path: one retention, and it never shortens
    assert [r.expires_at_s for r in tree.retentions("k")] == [clock.now_s + 3600]
    assert retain(tree, turn2, 300, "k") == 4  # the 1h prefix ends later: both kept
    assert len(tree.retentions("k")) == 2
    assert retain(tree, turn2, 7200, "k") == 4  # now it covers both, and ends later
    assert [r.num_pages for r in tree.retentions("k")] == [4] and tree.retained_pages == 4
    tree.check_invariants()


def test_release_and_reset() -> None:
    tree, _ = make_tree()
    tokens = seq(0, 8)
    run_request(tree, tokens)
    retain(tree, tokens, 300, "k")
    (retention,) = tree.retentions("k")
    assert tree.release(retention.retention_id) and not tree.release(retention.retention_id)
    assert tree.retained_pages == 0 and tree.retentions("k") == []
    retain(tree, tokens, 300, "k")
    tree.reset()
    assert tree.retained_pages == 0 and tree.stats().num_retentions == 0
    tree.check_invariants()
    with pytest.raises(ValueError):
        retain(tree, tokens, 0)


def test_kv_manager_trims_a_prefix_to_the_cap() -> None:
    tree, _ = make_tree()
    kv = KVManager(tree.pool, tree, tree.hasher, enable_prefix_caching=True)
    tokens = seq(0, 20)
    run_request(tree, tokens)
    assert kv.retain(tokens, None, 300, "k", max_owner_pages=3) == 12
    assert kv.retain(tokens, None, 300, "k", max_owner_pages=0) == 0
    assert kv.retain(seq(900, 20), None, 300, "k", max_owner_pages=3) == 0  # nothing cached: nothing retained
    assert tree.retained_pages == 3
    tree.check_invariants()


def test_retained_pages_stay_within_the_global_cap_across_many_owners() -> None:
    """Each owner within its own cap, yet many owners together stop at the tree's cap: a new
    retention past it is trimmed to the pages that fit (the count says so), and it never
    releases another owner's retention to make room."""
    tree, _ = make_tree(num_pages=64)
    tree.max_retained_pages = 10
    prompts = [seq(1000 * i, 12) for i in range(6)]  # 3 pages each
    for tokens in prompts:
        run_request(tree, tokens)
    counts = [retain(tree, tokens, 300, f"owner{i}", cap=8) for i, tokens in enumerate(prompts)]
    assert counts == [3, 3, 3, 1, 0, 0]  # the fourth trimmed to the one page left, then none
    assert tree.retained_pages == 10
    for i in range(3):  # the first owners' retentions are whole and theirs still
        assert [r.num_pages for r in tree.retentions(f"owner{i}")] == [3]
    assert cached(tree, prompts[3]) == 12  # the trim split a node; nothing was evicted
    tree.check_invariants()
    # An owner past the global cap gives up its own oldest retention first, nobody else's.
    assert retain(tree, prompts[4], 300, "owner0", cap=8) == 3
    assert tree.retained_pages == 10 and len(tree.retentions("owner0")) == 1
    assert [r.num_pages for r in tree.retentions("owner1")] == [3]
    assert [r.num_pages for r in tree.retentions("owner2")] == [3]
    tree.check_invariants()


def test_retaining_a_path_already_retained_needs_no_room() -> None:
    tree, _ = make_tree(num_pages=64)
    tree.max_retained_pages = 4
    shared = seq(0, 16)
    run_request(tree, shared)
    assert retain(tree, shared, 300, "a") == 4
    # Another owner retaining the same pages adds none: it fits although the cap is reached.
    assert retain(tree, seq(0, 8), 300, "b") == 2
    assert tree.retained_pages == 4
    tree.check_invariants()


# Prompts that share prefixes of different lengths, so retentions overlap, split nodes and
# trim inside a node.
_PROMPTS = [seq(0, 24), seq(0, 12) + seq(500, 12), seq(0, 4) + seq(600, 16), seq(700, 20), seq(800, 8)]


@settings(max_examples=150, deadline=None)
@given(
    cap=st.integers(1, 20),
    owner_cap=st.sampled_from([None, 4, 8]),
    ops=st.lists(st.tuples(st.sampled_from(["run", "retain", "evict"]), st.integers(0, 4), st.integers(0, 3)), max_size=40),
)
def test_retention_never_passes_the_global_cap_nor_takes_another_owners(cap: int, owner_cap: int | None, ops: list) -> None:
    tree, _ = make_tree(num_pages=32)
    tree.max_retained_pages = cap
    for op, prompt, owner_index in ops:
        tokens, owner = _PROMPTS[prompt], f"owner{owner_index}"
        if op == "run":
            tree.evict(len(tokens) // tree.page_size - tree.pool.num_free)
            run_request(tree, tokens)
        elif op == "evict":
            tree.evict(prompt + 1)
        else:
            others = {o: [r.retention_id for r in tree.retentions(o)] for o in (f"owner{i}" for i in range(4)) if o != owner}
            num = retain(tree, tokens, 300, owner, owner_cap)
            assert {o: [r.retention_id for r in tree.retentions(o)] for o in others} == others
            if num:
                assert tree.retentions(owner)[-1].num_pages == num
            assert num <= cached(tree, tokens) // tree.page_size
        assert tree.retained_pages <= cap
        tree.check_invariants()


def test_rehome_counts_an_owners_second_name_in_its_one_cap() -> None:
    """Issue 43: retentions filed under a disk tier's name for an owner move to the owner, oldest
    first among its own, and the owner's oldest go past its cap."""
    tree, a, b, c = three_prompts()
    assert retain(tree, a, 300, "disk:k", cap=5) == 2
    assert retain(tree, b, 300, "k", cap=5) == 2
    assert retain(tree, c, 300, "disk:k", cap=5) == 3
    assert tree.rehome("disk:k", "k", max_owner_pages=5) == 2
    assert tree.retentions("disk:k") == [] and "disk:k" not in tree.retention_owners()
    assert [r.num_pages for r in tree.retentions("k")] == [2, 3]  # a, the oldest, went: 7 > 5
    assert all(r.owner == "k" for r in tree.retentions("k"))
    assert tree.retained_pages == 5
    tree.check_invariants()
