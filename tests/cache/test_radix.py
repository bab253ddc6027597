"""Unit tests for RadixTree: match cap, full blocks only, salts, collisions, splits, insert
duplicates, locking, LRU eviction, reset, stats and the invariant checker."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixkv.cache import BlockHasher, HashFn, PagePool, RadixTree


def make_tree(num_pages: int = 64, page_size: int = 4, hash_fn: HashFn | None = None) -> RadixTree:
    return RadixTree(PagePool(num_pages, page_size), BlockHasher(page_size, seed=42, hash_fn=hash_fn))


def run_request(tree: RadixTree, tokens: list[int], salt: str | None = None) -> list[int]:
    """What the engine does for one request: match, lock, compute the rest into new pages,
    insert, swap duplicates for the tree's pages, unlock, release. Returns its page table."""
    pool, ps = tree.pool, tree.page_size
    match = tree.match(tokens, salt)
    tree.lock(match.node)
    pool.incref(match.pages)
    pages = match.pages + pool.allocate(-(-len(tokens) // ps) - len(match.pages))
    result = tree.insert(tokens, pages, salt)
    tree.lock(result.node)
    tree.unlock(match.node)
    for i in range(result.num_existing_blocks):
        if result.pages[i] != pages[i]:
            pool.release([pages[i]])
            pool.incref([result.pages[i]])
    pages[: len(result.pages)] = result.pages
    tree.check_invariants(check_hashes=True)
    tree.unlock(result.node)
    pool.release(pages)
    tree.check_invariants(check_hashes=True)
    pool.check_invariants()
    return pages


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_empty_tree_misses() -> None:
    tree = make_tree()
    result = tree.match(seq(0, 20))
    assert result.num_cached_tokens == 0 and result.pages == [] and result.node.parent is None
    tree.lock(result.node)
    tree.unlock(result.node)
    tree.check_invariants()


def test_partial_last_block_is_never_cached() -> None:
    tree = make_tree()
    pages = run_request(tree, seq(0, 10))  # 2 full blocks + 2 tokens
    assert tree.cached_pages == 2
    assert pages[2] not in tree.cached_page_set()
    assert tree.pool.refcount(pages[2]) == 0
    assert tree.match(seq(0, 10)).num_cached_tokens == 8
    assert tree.match(seq(0, 3)).num_cached_tokens == 0  # shorter than a block


def test_match_leaves_at_least_one_token() -> None:
    tree = make_tree()
    pages = run_request(tree, seq(0, 8))
    assert tree.cached_pages == 2
    exact = tree.match(seq(0, 8))  # a prompt that is exactly the cached blocks
    assert exact.num_cached_tokens == 4 and exact.pages == pages[:1]
    assert tree.match(seq(0, 9)).num_cached_tokens == 8
    assert tree.match(seq(0, 5)).num_cached_tokens == 4
    assert tree.match(seq(0, 4)).num_cached_tokens == 0
    tree.check_invariants()


def test_salts_isolate_tenants() -> None:
    tree = make_tree()
    tokens = seq(0, 9)
    run_request(tree, tokens, salt="a")
    assert tree.match(tokens, "a").num_cached_tokens == 8
    for other in (None, "", "b"):
        assert tree.match(tokens, other).num_cached_tokens == 0
    # None and "" are different tenants too.
    none_pages = run_request(tree, tokens, salt=None)
    assert tree.match(tokens, "").num_cached_tokens == 0
    empty_pages = run_request(tree, tokens, salt="")
    assert set(none_pages[:2]).isdisjoint(empty_pages[:2])
    assert tree.cached_pages == 6


def test_salts_isolate_even_when_every_hash_collides() -> None:
    tree = make_tree(hash_fn=lambda data: 0)
    tokens = seq(0, 9)
    run_request(tree, tokens, salt="a")
    run_request(tree, tokens, salt="b")
    assert tree.cached_pages == 4
    assert tree.match(tokens, "a").pages != tree.match(tokens, "b").pages
    assert tree.match(tokens, None).num_cached_tokens == 0


def test_forced_collision_is_a_miss_never_a_wrong_hit() -> None:
    tree = make_tree(hash_fn=lambda data: 0)
    a = seq(0, 13)  # 3 full blocks
    b = seq(100, 13)  # same hash for every block, different tokens
    a_pages = run_request(tree, a)
    assert tree.match(b).num_cached_tokens == 0
    pool = tree.pool
    b_pages = pool.allocate(4)
    result = tree.insert(b, b_pages)
    assert (result.num_existing_blocks, result.num_inserted_blocks, result.pages) == (0, 0, [])
    assert result.node.parent is None
    assert all(pool.refcount(page) == 1 for page in b_pages)  # still private to the caller
    pool.release(b_pages)
    # Sharing the first block then diverging: the shared block hits, the rest collides.
    c = a[:4] + seq(200, 9)
    match = tree.match(c)
    assert match.num_cached_tokens == 4 and match.pages == a_pages[:1]
    c_pages = pool.allocate(3)
    result = tree.insert(c, c_pages)
    assert (result.num_existing_blocks, result.num_inserted_blocks) == (1, 0)
    assert result.pages == a_pages[:1]
    pool.release(c_pages)
    assert tree.match(a).pages == a_pages[:3]
    tree.check_invariants(check_hashes=True)
    pool.check_invariants()


def test_insert_reports_existing_blocks_so_duplicates_can_be_freed() -> None:
    tree = make_tree()
    pool = tree.pool
    tokens = seq(0, 16)
    first = pool.allocate(4)
    assert tree.insert(tokens[:8], first).num_inserted_blocks == 2
    # A second request computed the same prefix itself (both started in one step).
    second = pool.allocate(4)
    result = tree.insert(tokens, second)
    assert (result.num_existing_blocks, result.num_inserted_blocks) == (2, 2)
    assert result.pages == first[:2] + second[2:]
    duplicates = [mine for mine, canon in zip(second, result.pages) if mine != canon]
    assert duplicates == second[:2]
    assert pool.release(duplicates) == 2  # nobody else held them
    # Inserting again changes nothing.
    again = tree.insert(tokens, result.pages)
    assert (again.num_existing_blocks, again.num_inserted_blocks, again.pages) == (4, 0, result.pages)
    pool.release(first + second[2:])
    tree.check_invariants(check_hashes=True)
    pool.check_invariants()
    assert tree.cached_pages == tree.evictable_pages == 4
    assert pool.num_free == 64 - 4


def test_insert_ignores_extra_pages_and_checks_lengths() -> None:
    tree = make_tree()
    pages = tree.pool.allocate(3)
    result = tree.insert(seq(0, 9), pages)
    assert result.num_inserted_blocks == 2 and result.pages == pages[:2]
    with pytest.raises(ValueError, match="needs at least 2 pages"):
        tree.insert(seq(50, 8), pages[:1])
    with pytest.raises(ValueError, match="block_hashes"):
        tree.insert(seq(50, 8), pages, block_hashes=[1])
    with pytest.raises(ValueError, match="block_hashes"):
        tree.match(seq(50, 9), block_hashes=[])
    tree.pool.release(pages)
    tree.check_invariants()


def test_precomputed_hashes_and_array_inputs_agree() -> None:
    tree = make_tree()
    tokens = seq(0, 17)
    hashes = tree.hasher.hash_blocks(tokens, "s")
    pages = tree.pool.allocate(5)
    tree.insert(np.array(tokens), pages, "s", block_hashes=hashes)
    tree.pool.release(pages)
    expected = tree.match(tokens, "s").pages
    assert expected == pages[:4]
    assert tree.match(torch.tensor(tokens), "s", block_hashes=hashes).pages == expected
    assert tree.match(tuple(tokens), "s", block_hashes=hashes[:2] + hashes[2:]).pages == expected
    tree.check_invariants(check_hashes=True)


def test_split_in_the_middle_of_a_run_keeps_locks_and_lru_time() -> None:
    tree = make_tree()
    pool = tree.pool
    a = seq(0, 21)  # 5 blocks in one node
    a_pages = pool.allocate(6)
    inserted = tree.insert(a, a_pages)
    tree.lock(inserted.node)  # the request that computed `a` is still running
    pool.release(a_pages[5:])  # its tail page is private; keep holding the cached ones
    assert tree.num_nodes == 1 and tree.locked_pages == 5
    run_time = inserted.node.last_access
    b = a[:8] + seq(300, 9)  # shares 2 blocks, then diverges inside the run
    b_pages = pool.allocate(5)
    result = tree.insert(b, b_pages)
    assert (result.num_existing_blocks, result.num_inserted_blocks) == (2, 2)
    assert result.pages == a_pages[:2] + b_pages[2:4]
    assert tree.num_nodes == 3  # [a0 a1] -> {[a2 a3 a4], [b2 b3]}
    top = inserted.node.parent
    assert top is result.node.parent and top.pages == a_pages[:2] and inserted.node.pages == a_pages[2:5]
    assert top.lock_ref == inserted.node.lock_ref == 1  # the split kept the lock on both halves
    assert inserted.node.last_access == run_time  # the untouched half kept its LRU time
    pool.release(b_pages[:2] + b_pages[4:])  # b's duplicates and tail
    pool.release(b_pages[2:4])  # b finished; the tree keeps [b2 b3]
    tree.check_invariants(check_hashes=True)
    assert tree.locked_pages == 5 and tree.evictable_pages == 2
    assert tree.evict(100) == 2  # only b's branch; a's path is locked
    tree.unlock(inserted.node)
    pool.release(a_pages[:5])
    tree.check_invariants(check_hashes=True)
    assert tree.evictable_pages == 5
    assert tree.evict(1) == 3 and tree.evict(1) == 2  # leaf first, then its parent
    assert pool.num_free == pool.num_pages
    tree.check_invariants()


def test_match_splits_so_the_lock_covers_exactly_the_matched_pages() -> None:
    tree = make_tree()
    pages = run_request(tree, seq(0, 16))  # 4 blocks, one node
    result = tree.match(seq(0, 8) + [999] * 5)
    assert result.num_cached_tokens == 8 and result.pages == pages[:2]
    assert result.node.pages == pages[:2]
    tree.lock(result.node)
    assert tree.locked_pages == 2 and tree.evictable_pages == 2
    assert tree.evict(100) == 2
    assert tree.match(seq(0, 16)).num_cached_tokens == 8
    tree.unlock(result.node)
    tree.check_invariants(check_hashes=True)


def test_eviction_is_lru_over_leaves() -> None:
    tree = make_tree()
    a, b, c = seq(0, 9), seq(100, 9), seq(200, 9)
    for tokens in (a, b, c):
        run_request(tree, tokens)
    tree.match(a)  # a is now the most recently used
    assert tree.evict(1) == 2  # whole node: b
    assert tree.match(b, record=False).num_cached_tokens == 0
    assert tree.match(a, record=False).num_cached_tokens == 8
    # The peek above touched a again, so c goes next, then a.
    assert tree.evict(1) == 2
    assert tree.match(c, record=False).num_cached_tokens == 0
    assert tree.evict(1) == 2
    assert tree.cached_pages == 0 and tree.evict(1) == 0
    assert tree.stats().evicted_pages == 6
    tree.check_invariants()


def test_eviction_never_touches_locked_paths() -> None:
    tree = make_tree()
    shared = seq(0, 8)
    run_request(tree, shared + seq(100, 9))
    run_request(tree, shared + seq(200, 9))
    run_request(tree, seq(300, 9))
    held = tree.match(shared + seq(100, 9))
    tree.lock(held.node)
    tree.pool.incref(held.pages)
    assert tree.locked_pages == 4
    freed = tree.evict(100)
    assert freed == 4  # the other branch and the unrelated prompt; the shared prefix is locked
    assert tree.cached_page_set() == set(held.pages)
    assert tree.evictable_pages == 0
    tree.check_invariants()
    tree.unlock(held.node)
    tree.pool.release(held.pages)
    assert tree.evictable_pages == 4
    assert tree.evict(3) == 4  # stops once enough is freed, in whole nodes
    tree.check_invariants()


def test_parent_becomes_an_evictable_leaf() -> None:
    tree = make_tree()
    shared = seq(0, 8)
    run_request(tree, shared + seq(100, 5))
    run_request(tree, shared + seq(200, 5))
    assert tree.num_nodes == 3
    assert tree.evict(1) == 1 and tree.evict(1) == 1
    tree.check_invariants()
    assert tree.num_nodes == 1 and tree.evictable_pages == 2
    assert tree.evict(1) == 2
    assert tree.num_nodes == 0 and not tree._roots  # the empty root is dropped too
    tree.check_invariants()


def test_lock_and_unlock_errors() -> None:
    tree = make_tree()
    run_request(tree, seq(0, 9))
    result = tree.match(seq(0, 9))
    with pytest.raises(RuntimeError, match="not locked"):
        tree.unlock(result.node)
    tree.evict(100)
    with pytest.raises(RuntimeError, match="evicted"):
        tree.lock(result.node)


def test_reset_releases_pages_and_refuses_while_locked() -> None:
    tree = make_tree()
    run_request(tree, seq(0, 9))
    run_request(tree, seq(100, 9), salt="x")
    held = tree.match(seq(0, 9))
    tree.lock(held.node)
    with pytest.raises(RuntimeError, match="lock"):
        tree.reset()
    tree.unlock(held.node)
    tree.reset()
    assert tree.cached_pages == tree.evictable_pages == tree.num_nodes == 0
    assert tree.pool.num_free == tree.pool.num_pages
    assert tree.match(seq(0, 9)).num_cached_tokens == 0
    tree.check_invariants()


def test_stats_count_recorded_queries() -> None:
    tree = make_tree()
    run_request(tree, seq(0, 9))  # one recorded miss of 9 tokens
    tree.match(seq(0, 9))  # 8 of 9 hit
    tree.match(seq(0, 9), record=False)
    stats = tree.stats()
    assert (stats.queries, stats.query_tokens, stats.hit_tokens) == (2, 18, 8)
    assert stats.hit_rate == pytest.approx(8 / 18)
    assert (stats.cached_pages, stats.evictable_pages, stats.locked_pages, stats.num_nodes) == (2, 2, 0, 1)
    tree.reset_stats()
    assert tree.stats().hit_rate == 0.0


def test_unseen_salts_do_not_accumulate_roots() -> None:
    tree = make_tree()
    for i in range(20):
        tree.match(seq(0, 9), salt=f"user{i}")
    assert not tree._roots
    run_request(tree, seq(0, 9), salt="u")
    tree.evict(100)
    assert not tree._roots


def test_page_size_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="page_size"):
        RadixTree(PagePool(4, 4), BlockHasher(2))


def test_check_invariants_catches_corruption() -> None:
    tree = make_tree()
    run_request(tree, seq(0, 9))
    tree._evictable_pages += 1
    with pytest.raises(AssertionError, match="evictable_pages"):
        tree.check_invariants()
    tree._evictable_pages -= 1
    tree.pool.incref(tree.cached_page_set())  # a page held outside a lock
    with pytest.raises(AssertionError, match="refcount"):
        tree.check_invariants()
