"""MarkDuel: set dueling for the dead-block predictor's marks (cache/dead_blocks.py): two shadow
caches the real cache's size, plain LRU and LRU ordered by the marks, and the marks applied only while theirs wins.

Each shadow holds block hashes only (no KV), so memory is bounded by twice the real capacity in
hashes; each request costs O(blocks) in the LRU shadow and O(blocks log n) in the marked one. Both
see every request (whatever the real cache does), so the comparison is not biased by the mode the
real cache is in. The score is a decayed sum over about WINDOW_REQUESTS recent requests of
(marked hits - LRU hits), in blocks; the marks go on once it exceeds MARGIN of LRU's decayed hits
and off once it falls under minus that (the margin keeps a tie from flapping, each flip re-marks
every followed tail). Off is where it starts: the predictor must win before it is trusted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from sortedcontainers import SortedList

from radixkv.cache.eviction import Liveness
from radixkv.cache.hashing import BlockHash

# About this many recent requests make up the score (exponential decay 1 - 1/WINDOW_REQUESTS).
WINDOW_REQUESTS = 1024
# The score must pass this share of LRU's windowed hits to switch either way.
MARGIN = 0.005
# The marked shadow's eviction order, as EvictionOrder.pop under `predict` (no retained leaves here).
_ORDER = (Liveness.DEAD, Liveness.COLD, Liveness.UNKNOWN, Liveness.HOT)


class ShadowLRU:
    """Block hashes under LRU; a request's blocks are touched deepest first, so its shallower
    blocks are the more recent and go last (as the tree evicts leaves before their parents)."""

    __slots__ = ("capacity", "_blocks")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()

    def access(self, hashes: Sequence[BlockHash]) -> int:
        """The request's prefix hit in blocks, then its blocks cached (most recent)."""
        blocks = self._blocks
        hits = _prefix_hits(hashes, blocks)
        for h in reversed(hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
        return hits

    def __len__(self) -> int:
        return len(self._blocks)


class ShadowMarked:
    """Block hashes in four LRU sets by liveness (dead, cold, unknown, hot evicted in that order),
    each ordered by a stamp of last access; O(log n) per block touched, marked or evicted."""

    __slots__ = ("capacity", "_entry", "_sets", "_stamp")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entry: dict[BlockHash, tuple[Liveness, int]] = {}
        self._sets: dict[Liveness, SortedList] = {level: SortedList() for level in _ORDER}
        self._stamp = 0

    def access(self, hashes: Sequence[BlockHash], level_of: Callable[[BlockHash], Liveness]) -> int:
        """The request's prefix hit in blocks, then its blocks cached at the level their tail has
        now (`level_of`). Evicting waits for `evict`, after the predictor marked this request."""
        hits = _prefix_hits(hashes, self._entry)
        for h in reversed(hashes):
            self._stamp += 1
            self._put(h, level_of(h), self._stamp)
        return hits

    def set_level(self, hashes: Sequence[BlockHash], level: Liveness) -> None:
        """A tail was marked: its cached blocks move to `level`'s set, keeping their last access."""
        for h in hashes:
            entry = self._entry.get(h)
            if entry is not None and entry[0] is not level:
                self._put(h, level, entry[1])

    def relevel(self, hashes: Sequence[BlockHash], level_of: Callable[[BlockHash], Liveness]) -> None:
        """After the predictor took the request: its blocks at the level their tail has now (a
        fork made some shared, so unknown, as the tree's branch point is)."""
        for h in hashes:
            entry = self._entry.get(h)
            if entry is not None:
                level = level_of(h)
                if entry[0] is not level:
                    self._put(h, level, entry[1])

    def evict(self) -> None:
        while len(self._entry) > self.capacity:
            for level in _ORDER:
                ordered = self._sets[level]
                if ordered:
                    _, h = ordered.pop(0)
                    del self._entry[h]
                    break

    def level(self, h: BlockHash) -> Liveness | None:
        entry = self._entry.get(h)
        return None if entry is None else entry[0]

    def _put(self, h: BlockHash, level: Liveness, stamp: int) -> None:
        old = self._entry.get(h)
        if old is not None:
            self._sets[old[0]].remove((old[1], h))
        self._entry[h] = (level, stamp)
        self._sets[level].add((stamp, h))

    def __len__(self) -> int:
        return len(self._entry)


class MarkDuel:
    """The two shadows and the switch. `enabled` says whether the predictor's marks reach the
    real cache now; `switches` counts its flips (reports, tests)."""

    __slots__ = ("lru", "marked", "enabled", "score", "base", "switches", "_decay", "_margin")

    def __init__(self, capacity_blocks: int, *, window: int = WINDOW_REQUESTS, margin: float = MARGIN) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be at least 1, got {capacity_blocks}")
        if window < 1:
            raise ValueError(f"window must be at least 1 request, got {window}")
        self.lru = ShadowLRU(capacity_blocks)
        self.marked = ShadowMarked(capacity_blocks)
        self.enabled = False
        self.score = 0.0  # decayed (marked hits - LRU hits)
        self.base = 0.0  # decayed LRU hits
        self.switches = 0
        self._decay = 1.0 - 1.0 / window
        self._margin = margin

    def access(self, hashes: Sequence[BlockHash], level_of: Callable[[BlockHash], Liveness]) -> int:
        """A request arrived: both shadows serve it and the score moves by their hits' difference.
        Returns the marked shadow's hit, what the predictor learns from (so what it learns does
        not depend on whether its marks reach the real cache)."""
        lru_hits = self.lru.access(hashes)
        marked_hits = self.marked.access(hashes, level_of)
        self.score = self.score * self._decay + (marked_hits - lru_hits)
        self.base = self.base * self._decay + lru_hits
        return marked_hits

    def settle(self, hashes: Sequence[BlockHash] = (), level_of: Callable[[BlockHash], Liveness] | None = None) -> bool:
        """After the request's marks: its blocks re-levelled (`level_of`), the marked shadow
        evicts to capacity, then the switch is decided. Returns whether it flipped (the caller
        re-marks the real cache)."""
        if level_of is not None:
            self.marked.relevel(hashes, level_of)
        self.marked.evict()
        margin = self._margin * self.base
        flip = self.score < -margin if self.enabled else self.score > margin
        if flip:
            self.enabled = not self.enabled
            self.switches += 1
        return flip


def _prefix_hits(hashes: Sequence[BlockHash], cached: object) -> int:
    hits = 0
    for h in hashes:
        if h not in cached:  # type: ignore[operator]
            break
        hits += 1
    return hits


__all__ = ["MarkDuel", "ShadowLRU", "ShadowMarked", "WINDOW_REQUESTS", "MARGIN"]
