"""The radix tree's statistics: the lookups it served and the pages it evicted, counted apart
from its structure (reset_stats clears them, reset keeps them), and the `CacheStats` snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixkv.cache.radix import RadixTree


@dataclass(frozen=True, slots=True)
class CacheStats:
    queries: int
    query_tokens: int
    hit_tokens: int
    hit_rate: float  # hit_tokens / query_tokens, 0 when there were none
    cached_pages: int
    evictable_pages: int
    locked_pages: int
    evicted_pages: int
    num_nodes: int  # non-root nodes
    protected_pages: int = 0  # cached pages that served a hit (slru keeps them longer)
    retained_pages: int = 0  # cached pages under a live retention (evictable or locked)
    num_retentions: int = 0  # live retentions
    # KV bytes of every page not free (a request's or the tree's), over all layer groups: the
    # tree's pool here, the window layers' pool added by the engine's snapshot.
    kv_bytes_in_use: int = 0


class LookupCounts:
    """Lookups used (a match, or a match counted later by record_lookup) and pages evicted."""

    __slots__ = ("queries", "query_tokens", "hit_tokens", "evicted_pages")

    def __init__(self) -> None:
        self.reset()

    def record(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.queries += 1
        self.query_tokens += num_query_tokens
        self.hit_tokens += num_hit_tokens

    def reset(self) -> None:
        self.queries = self.query_tokens = self.hit_tokens = self.evicted_pages = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def snapshot(self, tree: RadixTree, num_retentions: int) -> CacheStats:
        """These counters beside what `tree` holds now; pure."""
        return CacheStats(
            queries=self.queries, query_tokens=self.query_tokens, hit_tokens=self.hit_tokens, hit_rate=self.hit_rate,
            cached_pages=tree.cached_pages, evictable_pages=tree.evictable_pages, locked_pages=tree.locked_pages,
            evicted_pages=self.evicted_pages, num_nodes=tree.num_nodes, retained_pages=tree.retained_pages,
            num_retentions=num_retentions, protected_pages=tree.protected_pages,
            kv_bytes_in_use=(tree.pool.num_pages - tree.pool.num_free) * tree.pool.page_nbytes,
        )
