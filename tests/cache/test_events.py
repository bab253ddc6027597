"""The cache floor's observer bus: what the tree and the disk tier publish, in what order, and
that listeners come and go without touching one another."""

from __future__ import annotations

from pathlib import Path

import torch

from radixkv.cache import AllCleared, BlockHasher, BlocksDropped, BlocksEvicted, BlocksStored, CacheEvent, CacheEvents
from radixkv.cache import PagePool, RadixTree
from radixkv.cache.disk import DiskTier

PAGE = 4


def test_listeners_are_told_in_order_and_may_publish_in_turn() -> None:
    bus = CacheEvents()
    seen: list[tuple[str, CacheEvent]] = []

    def first(event: CacheEvent) -> None:
        seen.append(("first", event))
        if isinstance(event, BlocksEvicted):
            bus.publish(BlocksDropped([7]))  # as a write-back's save makes the disk drop blocks

    bus.subscribe(first)
    bus.subscribe(lambda event: seen.append(("second", event)))
    cleared = AllCleared()
    bus.publish(cleared)
    assert seen == [("first", cleared), ("second", cleared)]
    bus.unsubscribe(first)
    bus.unsubscribe(first)  # not subscribed any more: ignored
    assert len(bus) == 1 and first not in bus


def test_the_tree_publishes_stores_evictions_before_freeing_and_resets() -> None:
    pool = PagePool(8, PAGE)
    tree = RadixTree(pool, BlockHasher(PAGE, seed=0))
    events: list[CacheEvent] = []
    refcounts: list[list[int]] = []

    def listen(event: CacheEvent) -> None:
        events.append(event)
        if isinstance(event, BlocksEvicted):
            refcounts.append([pool.refcount(page) for page in event.node.pages])  # still the tree's

    tree.events.subscribe(listen)
    pages = pool.allocate(2)
    result = tree.insert(list(range(2 * PAGE)), pages)
    pool.release(pages)  # the tree keeps its own reference
    [stored] = events
    assert isinstance(stored, BlocksStored) and stored.tier == "ram" and stored.node is result.node
    assert list(stored.pages) == pages and len(stored.hashes) == 2
    assert tree.evict(2) == 2
    evicted = events[-1]
    assert isinstance(evicted, BlocksEvicted) and evicted.node is result.node
    assert not evicted.flushing and evicted.write_back and refcounts == [[1, 1]]
    tree.reset()
    assert isinstance(events[-1], AllCleared)


def test_the_disk_tier_publishes_what_it_stores_and_drops(tmp_path: Path) -> None:
    pool = PagePool(4, PAGE, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    bus = CacheEvents()
    block_bytes = 2 * PAGE * pool.page_nbytes  # room for about two blocks
    tier = DiskTier(tmp_path / "kv", block_bytes, fingerprint="m", page_size=PAGE, payload_bytes=pool.page_nbytes, events=bus)
    events: list[CacheEvent] = []
    bus.subscribe(events.append)
    try:
        tokens = list(range(6 * PAGE))
        keys = tier.keys(tokens, None)
        payload = bytes(pool.page_nbytes)
        tier.save(tokens, None, keys, 0, 6, lambda i: payload)
        stored = [e for e in events if isinstance(e, BlocksStored)]
        dropped = [key for e in events if isinstance(e, BlocksDropped) for key in e.hashes]
        assert [e.tier for e in stored] == ["disk"] and list(stored[0].hashes) == keys
        assert dropped and set(dropped) <= set(keys)  # the budget made it drop the oldest
    finally:
        tier.close()
