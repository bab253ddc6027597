"""The page accounting invariant, checked over the whole engine: every page free, evictable or
in use, never two at once, and every refcount explained by the tree and the page tables of the
running sequences (EngineConfig.check_invariants runs it after every step; tests call it)."""

from __future__ import annotations

from collections.abc import Iterable

from radixkv.cache.layer_groups import WindowPages
from radixkv.cache.pages import PagePool
from radixkv.cache.radix import RadixTree
from radixkv.engine.request import SequenceState


def check_page_accounting(
    pool: PagePool, tree: RadixTree, running: Iterable[SequenceState], waiting: Iterable[SequenceState],
    windows: WindowPages | None = None,
) -> None:
    """free + evictable + in use == total, no page counted twice, refcounts explained; in
    each group's pool (the window layers' too, with layer groups)."""
    running = list(running)
    tree.check_invariants()
    free = pool.free_pages()
    evictable = tree.evictable_page_set()
    assert not free & evictable, f"pages both free and evictable: {sorted(free & evictable)[:8]}"
    expected = [0] * pool.num_pages
    for page in tree.cached_page_set():
        expected[page] += 1
    for seq in running:
        for page in seq.page_table:
            expected[page] += 1
    for seq in waiting:
        assert not seq.page_table and seq.tree_node is None, f"waiting seq {seq.seq_id} holds pages"
    actual = pool.refcounts()
    if list(actual) != expected:  # one comparison; the page at fault is looked for only on failure
        page = next(p for p in range(pool.num_pages) if actual[p] != expected[p])
        raise AssertionError(f"page {page}: refcount {actual[page]}, expected {expected[page]}")
    # Evictable pages are cached ones (expected > 0), so in use is the rest of those referenced.
    in_use = sum(1 for count in expected if count) - len(evictable)
    assert len(free) + len(evictable) + in_use == pool.num_pages
    if windows is not None:
        for seq in running:
            assert len(seq.window_table) == len(seq.page_table), f"seq {seq.seq_id}: a window page per block"
        windows.check_accounting([seq.window_table for seq in running], tree.cached_page_set())
