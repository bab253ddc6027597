"""The whole cache as the engine reports it, beside KVManager's per-sequence verbs: a prompt's
cached tokens (RAM, then disk), per-tier residency, the disk tier's counters and directory,
cache reports by reason, and the two verbs that act on all of it (flush, close).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from radixkv.cache.disk import DiskStats
from radixkv.cache.events import CacheEvents
from radixkv.cache.ghost import GhostIndex
from radixkv.cache.hashing import BlockHasher
from radixkv.cache.layer_groups import WindowPages
from radixkv.cache.pages import PagePool
from radixkv.cache.radix import RadixTree
from radixkv.cache.residency import PageResidency, TierResidency
from radixkv.engine.cache_report import MissExplainer
from radixkv.engine.disk_loader import DiskLoader
from radixkv.engine.request import CacheLookup


@dataclass(frozen=True, slots=True)
class CacheView:
    """KVManager's parts, seen whole; only `flush` and `close` change anything. Built by
    KVManager (`listening`) and handed out by its `cache_view()`: the engine calls it directly."""

    tree: RadixTree
    pool: PagePool
    ram_residency: PageResidency
    misses: MissExplainer
    loader: DiskLoader | None
    caching: bool
    windows: WindowPages | None = None  # layer groups: a hit ends where a window lacks its pages

    @classmethod
    def listening(
        cls, tree: RadixTree, pool: PagePool, hasher: BlockHasher, loader: DiskLoader | None, caching: bool,
        buses: Iterable[CacheEvents], max_ghost_blocks: int | None, windows: WindowPages | None = None,
    ) -> CacheView:
        """The view over a new RAM residency and ghost index (evicted hashes, so a request's cache
        report tells evicted from never seen), both, and the loader's write-back, subscribed to `buses`."""
        residency = PageResidency(pool.num_pages)
        misses = MissExplainer(GhostIndex(max_ghost_blocks or 4 * pool.num_pages), tree, hasher, windows is not None)
        listeners = [residency.listen, misses.ghost.listen] + ([loader.listen] if loader is not None else [])
        for bus in buses:
            for listener in listeners:
                bus.subscribe(listener)
        return cls(tree, pool, residency, misses, loader, caching, windows)

    def lookup(self, token_ids: list[int], salt: str | None) -> CacheLookup:
        """The tokens of the prompt's full blocks cached in RAM, and those cached on disk right
        after them, changing nothing: no LRU time, no hit counted, no file read. With layer
        groups, RAM's count ends at the cut a request would take (its window's pages held)."""
        if not self.caching:
            return CacheLookup(0, 0)
        tokens = list(token_ids)
        # match() and peek() leave the last token to compute; one more token lets peek count
        # every full block of the prompt itself (a partial block never matches).
        found = self.tree.peek(tokens + [0], salt)
        ram = found.num_cached_tokens
        if self.windows is not None:  # what admission would take: where the window layers still hold theirs
            ram = self.windows.usable_tokens(found.pages, ram)
        return CacheLookup(ram, self.loader.lookup(tokens, salt, ram) if self.loader is not None else 0)

    def flush(self, ram: bool, disk: bool) -> tuple[int, int]:
        """Drop what the cache holds: every unlocked RAM page (pages in use by requests or pins
        stay), every disk block. Returns (pages freed, blocks deleted). Flushing both drops RAM
        first without writing it back; RAM alone is written back as by any eviction."""
        pages = blocks = 0
        if ram:
            pages = self.tree.evict(self.tree.evictable_pages, flushing=True, write_back=not disk)
        if disk and self.loader is not None:
            blocks = self.loader.flush()
        return pages, blocks

    def close(self) -> int:
        """Stop the background reads, write every block cached in RAM to the disk tier and close
        it (its directory is the next process's); returns blocks written (0 without a tier).
        The cache stays usable, without the disk tier."""
        return self.loader.close() if self.loader is not None else 0

    def residency(self) -> dict[str, TierResidency]:
        """Per tier ("ram", "disk" with a disk tier): hits, what it holds, evictions by reason,
        block lifetime and reuse gap histograms."""
        cached = self.tree.cached_pages
        window_bytes = self.windows.tree_pages * self.windows.pool.page_nbytes if self.windows is not None else 0
        tiers = {"ram": self.ram_residency.snapshot(cached, cached * self.pool.page_nbytes + window_bytes)}
        if self.loader is not None:
            tiers["disk"] = self.loader.residency()
        return tiers

    def disk_stats(self) -> DiskStats | None:
        """The disk tier's counters; None without one."""
        return self.loader.stats() if self.loader is not None else None

    def disk_directory(self) -> Path | None:
        """The directory of the disk tier while it is in use; None without one (or once off)."""
        return self.loader.directory() if self.loader is not None else None

    def miss_counts(self) -> dict[str, int]:
        """Cache reports so far by reason (MISS_REASONS)."""
        return self.misses.snapshot()
