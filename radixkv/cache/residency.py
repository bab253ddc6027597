"""Residency of KV blocks in one cache tier: hits, evictions by reason, and histograms of how
long a block stays (lifetime) and how long between its uses (reuse gap). The tiers feed it;
stats() and /metrics read its snapshots.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from radixkv.cache.events import BlocksEvicted, BlocksStored, CacheEvent

# Seconds: from a request's own burst to a week (the longest retention anyone asks for is a day).
RESIDENCY_BUCKETS_S = (0.1, 1.0, 10.0, 60.0, 300.0, 1800.0, 3600.0, 6 * 3600.0, 86400.0, 7 * 86400.0)

# Why a block left a tier. "capacity": room was needed; "retained": room was needed and nothing
# unretained was left, so a block under a live retention went; "retention_expired": room was
# needed, and the block had been retained but its retention had ended; "flush": an admin flush;
# "rejected": a stored block failed its checks on load (another model's, corrupt, torn...).
EVICTION_REASONS = ("capacity", "retained", "retention_expired", "flush", "rejected")


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]  # upper bounds of the finite buckets
    counts: tuple[int, ...]  # per bucket (not cumulative); one more than bounds: the +Inf bucket
    sum: float
    count: int

    def cumulative(self) -> list[int]:
        total, out = 0, []
        for count in self.counts:
            total += count
            out.append(total)
        return out


class Histogram:
    """Fixed buckets, observations weighted (a run of blocks with the same value is one call)."""

    def __init__(self, bounds: tuple[float, ...] = RESIDENCY_BUCKETS_S) -> None:
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float, weight: int = 1) -> None:
        if weight <= 0:
            return
        value = max(0.0, value)
        self._counts[bisect_left(self.bounds, value)] += weight
        self._sum += value * weight

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self._counts), self._sum, sum(self._counts))


@dataclass(frozen=True, slots=True)
class TierResidency:
    """One tier's snapshot: what it holds, what it served and what it gave up, and why."""

    hit_blocks: int
    blocks: int
    bytes: int
    evicted_blocks: dict[str, int]  # by reason (EVICTION_REASONS)
    lifetime_s: HistogramSnapshot  # from entering the tier to leaving it, per block
    reuse_gap_s: HistogramSnapshot  # between consecutive uses of a block in the tier


class Residency:
    """A tier's running counts; the tier reports blocks and bytes at snapshot time."""

    def __init__(self) -> None:
        self.hit_blocks = 0
        self.evicted: Counter[str] = Counter()
        self.lifetime = Histogram()
        self.reuse_gap = Histogram()

    def evicted_block(self, reason: str, lifetime_s: float | None, num: int = 1) -> None:
        self.evicted[reason] += num
        if lifetime_s is not None:
            self.lifetime.observe(lifetime_s, num)

    def hit(self, gap_s: float | None, num: int = 1) -> None:
        self.hit_blocks += num
        if gap_s is not None:
            self.reuse_gap.observe(gap_s, num)

    def snapshot(self, blocks: int, nbytes: int) -> TierResidency:
        return TierResidency(
            self.hit_blocks,
            blocks,
            nbytes,
            {reason: self.evicted[reason] for reason in EVICTION_REASONS},
            self.lifetime.snapshot(),
            self.reuse_gap.snapshot(),
        )


class PageResidency(Residency):
    """The RAM tier's residency, kept per page (a page holds one cached block at a time): when
    it entered the tier, when it last served a hit, whether it was ever retained."""

    def __init__(self, num_pages: int) -> None:
        super().__init__()
        self._born_s = [0.0] * num_pages
        self._used_s = [0.0] * num_pages
        self._retained = [False] * num_pages

    def listen(self, event: CacheEvent) -> None:
        """A CacheEvents listener: RAM's stored blocks enter the tier, its evicted ones leave
        it (the reason from the event and the node's retentions); the disk's are not RAM's."""
        if event.tier != "ram":
            return
        if isinstance(event, BlocksStored):
            self.cached(event.pages, time.monotonic())
        elif isinstance(event, BlocksEvicted):
            node = event.node
            self.evicted_pages(node.pages, time.monotonic(), flushing=event.flushing, retained_now=bool(node.retains))

    def cached(self, pages: Iterable[int], now_s: float) -> None:
        """`pages` entered the tier (their blocks were inserted) at now_s."""
        for page in pages:
            self._born_s[page] = self._used_s[page] = now_s

    def hit_pages(self, pages: Iterable[int], now_s: float) -> None:
        used = self._used_s
        for page in pages:
            self.hit(now_s - used[page])
            used[page] = now_s

    def retained(self, pages: Iterable[int]) -> None:
        for page in pages:
            self._retained[page] = True

    def evicted_pages(self, pages: Sequence[int], now_s: float, *, flushing: bool, retained_now: bool) -> None:
        """`pages` (one node's) left the tier at now_s; the reason follows from how."""
        if flushing:
            reason = "flush"
        elif retained_now:
            reason = "retained"
        elif any(self._retained[page] for page in pages):
            reason = "retention_expired"
        else:
            reason = "capacity"
        for page in pages:
            self.evicted_block(reason, now_s - self._born_s[page])
            self._retained[page] = False
