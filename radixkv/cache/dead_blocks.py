"""DeadBlockPredictor: an online guess of which cached tails will never be asked for again,
learned from what a server sees (prompts, their cached prefix, arrival times, the client's
own signals where it sends them), marked on the tree as liveness (dead, cold, unknown, hot)
for the `predict` eviction policy (cache/eviction.py) to order by.

Each served request leaves a *tail*: the blocks of its path past what it shares with others
(what it found cached, or what its conversation's first turn found cached). A tail belongs to
a class: its turn depth (0: a fresh prompt; 1, 2, 3+: it extends an earlier tail by that many
turns), whether it started from a cached prefix, and its length (log2 bucket); a *superseded*
remainder (below) is a class of its own. Per class, online:

- p, the share of tails that were used again (a later prompt matched at least one of their
  blocks, cached or already evicted: a ghost hit counts, so a class wrongly called dead
  revives) among those resolved (used again, or idle past the class's horizon unused);
  smoothed toward the turn depth's share and the global share;
- the idle times (gaps) between a tail's last use and its reuse.

A tail idle for `a` is used again with probability q(a) = p S(a) / (1 - p + p S(a)), where S is
the class's survival of gaps (memory of the recent gaps). q maps onto liveness: below
DEAD_BELOW dead, below COLD_BELOW cold, at or above HOT_FROM hot, else unknown (plain LRU).
The ages at which q crosses each threshold are quantiles of the class's gaps, so a tail is
re-marked on a deadline (a heap), never by scanning.

Supersession: a request that reuses part of an earlier tail and then diverges (a new turn
re-sends the previous prompt, whose partial last block now holds more tokens; an edited or
regenerated turn) leaves the earlier tail's blocks past the divergence as a superseded
remainder, its own class (learned like the others: dead where such remainders are never
asked for again, which is the usual case).

Client signals: a named session (prompt_cache_key, a trace's session id) finds its previous
turn by name; a released session (DELETE, a final-turn flag) is dead at once.

Guard (cache/duel.py, where `guard_blocks` gives the real cache's size): the marks reach the
cache only while a shadow cache ordered by them beats a shadow LRU of the same size over the
recent requests; otherwise every followed tail is unmarked (plain LRU), so a predictor wrong on
some workload costs at most the lag of the switch. Guarded, it learns from the marked shadow's
hits (what it found cached), not the real cache's, so what it learns is the same on or off.

Constants are structure, not fitted to one trace: thresholds in probability, prior strengths
in observations; they were chosen on multi_turn_trace's calibration seed and reported on
held-out seeds and other traces (docs/measurements.md).
"""

from __future__ import annotations

import heapq
import itertools
import math
from bisect import bisect_left, bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixkv.cache.duel import MarkDuel
from radixkv.cache.eviction import Liveness
from radixkv.cache.hashing import BlockHash

if TYPE_CHECKING:
    from radixkv.cache.radix import Node

# q below this: dead; below COLD_BELOW: cold; from HOT_FROM: hot; else unknown.
DEAD_BELOW = 0.1
COLD_BELOW = 0.25
HOT_FROM = 0.6
# A class's p is smoothed toward its parent's with this many pseudo-observations.
PRIOR_STRENGTH = 8.0
# Gaps remembered per class (the most recent), and the fewest before a class uses its own
# (else its parent's, then everyone's).
MAX_GAPS = 512
MIN_GAPS = 16
# A tail counts in its class's p (used again or not) once it is older than this quantile of its
# class's gaps (times HORIZON_FACTOR).
HORIZON_QUANTILE = 0.9
HORIZON_FACTOR = 1.0
MAX_TURN = 3
MAX_SIZE_BUCKET = 4

Mark = Callable[["Node", Liveness, int], object]  # (node, liveness, below_blocks): RadixTree.set_liveness's shape
ClassKey = tuple
SUPERSEDED: ClassKey = ("superseded",)


@dataclass(slots=True, eq=False)
class Tail:
    """One request's private blocks (or a superseded remainder) as the predictor follows them."""

    tail_id: int
    cls: ClassKey
    node: Node  # the deepest node of its path (evicted since, it stands for what is left)
    below: int  # blocks of its path shared with others, never marked
    end: int  # blocks of its path
    last_s: float  # its last use
    born_s: float  # when it was served
    turn: int
    level: Liveness | None = None  # what it was last marked (None: never)
    resolved: bool = False  # counted in its class's p (used again, or idle past the horizon)
    reused: bool = False
    released: bool = False
    name: object = None
    hashes: list[BlockHash] = field(default_factory=list)  # its blocks (past `below`)


@dataclass(slots=True)
class ClassStats:
    created: int = 0
    reused: int = 0
    expired: int = 0  # idle past the horizon, never used again
    ghost_hits: int = 0  # used again after RAM evicted part of it
    gaps: deque = field(default_factory=lambda: deque(maxlen=MAX_GAPS))
    _sorted: list[float] | None = None

    def add_gap(self, gap: float) -> None:
        self.gaps.append(gap)
        self._sorted = None

    def sorted_gaps(self) -> list[float]:
        if self._sorted is None:
            self._sorted = sorted(self.gaps)
        return self._sorted


class DeadBlockPredictor:
    """Follows tails request by request and marks the tree through `mark` (RadixTree.set_liveness
    or KVManager.mark). Requests come in order of time (`now_s` never decreases; a request count
    serves where there is no clock). Bounded: at most `max_blocks` block hashes are remembered
    (the oldest tails forgotten first)."""

    def __init__(self, mark: Mark, *, max_blocks: int = 1 << 20, guard_blocks: int | None = None) -> None:
        self._mark = mark
        # None: the marks always reach the cache (unguarded); else the duel decides (cache/duel.py).
        self.duel = MarkDuel(guard_blocks) if guard_blocks is not None else None
        self.max_blocks = max_blocks
        self._by_block: dict[BlockHash, Tail] = {}
        self._order: OrderedDict[int, Tail] = OrderedDict()  # every indexed tail, oldest first
        self._pending: dict[ClassKey, deque[Tail]] = {}  # per class, unresolved tails, oldest first
        self._num_blocks = 0
        self._by_name: dict[object, Tail] = {}
        self._stats: dict[ClassKey, ClassStats] = {}
        self._deadlines: list[tuple[float, int, int, Tail]] = []  # (when, tail_id, version, tail)
        self._versions: dict[int, int] = {}
        self._ids = itertools.count()
        self._now = 0.0
        # Counters for reports and tests.
        self.num_requests = 0
        self.num_extended = 0
        self.num_superseded = 0
        self.num_ghost_hits = 0
        self.num_released = 0

    # -- the one entry point ---------------------------------------------------------------------

    def served(
        self,
        block_hashes: Sequence[BlockHash],
        node: Node | None,
        cached_blocks: int,
        now_s: float,
        *,
        name: object = None,
        released: bool = False,
    ) -> Tail | None:
        """A request was served: its full blocks' hashes, the deepest node caching them (None:
        nothing cached), how many blocks it found cached, its arrival time; the client's session
        name (None: none) and whether it released the session after this turn. Marks the tree;
        returns the request's tail.

        It continues the tail holding its deepest known block (or its name's) when it re-sends
        all of that tail but at most its last block (a partial block that now holds more
        tokens); that last block, if it differs, is superseded. A request that shares less of
        an earlier tail forks it: the shared blocks are a prefix of both from now on."""
        self.num_requests += 1
        self._now = now_s = max(now_s, self._now)
        self._expire(now_s)
        self._advance(now_s)
        hashes = list(block_hashes)
        tail = self._served(hashes, node, cached_blocks, now_s, name, released)
        self._settle(hashes)
        return tail

    def _served(self, hashes: list[BlockHash], node: Node | None, cached_blocks: int, now_s: float, name: object, released: bool) -> Tail | None:
        if self.duel is not None:
            # Learn from the cache the marks would make (the marked shadow), off or on: learning
            # from an LRU-run cache teaches other classes, whose marks then never win.
            cached_blocks = self.duel.access(hashes, self._block_level)
        found, common = self._deepest(hashes, name)
        predecessor = None
        below = cached_blocks
        if found is not None and (name is not None or common >= found.end - 1):
            predecessor = found
            self._reused(found, common, cached_blocks, now_s)
            if common < found.end and len(hashes) > common:
                self._supersede(found, common, now_s)
            below = min(found.below, cached_blocks)
        elif found is not None and common > found.below:
            self._fork(found, common)
            below = max(below, min(common, cached_blocks))
        if node is None or not hashes:
            return None
        if predecessor is not None:
            self.num_extended += 1
            turn = min(predecessor.turn + 1, MAX_TURN)
        else:
            turn = 0
        size = min(MAX_SIZE_BUCKET, int(math.log2(max(1, len(hashes) - below))))
        tail = Tail(next(self._ids), (turn, int(below > 0), size), node, below, len(hashes), now_s, now_s, turn, name=name)
        self._count(tail.cls, "created")
        self._index(tail, hashes[below:])
        if name is not None:
            self._by_name[name] = tail
        if released:
            self.release(tail)
        else:
            self._remark(tail, now_s)
        return tail

    def release(self, tail: Tail) -> None:
        """The client said this session is over (DELETE, a final turn): its private tail is dead."""
        if tail.released:
            return
        tail.released = True
        self.num_released += 1
        if tail.name is not None and self._by_name.get(tail.name) is tail:
            del self._by_name[tail.name]
        self._set_level(tail, Liveness.DEAD)

    def release_name(self, name: object) -> bool:
        tail = self._by_name.get(name)
        if tail is None:
            return False
        self.release(tail)
        return True

    # -- what it learned -------------------------------------------------------------------------

    def p_reuse(self, cls: ClassKey) -> float:
        """The class's share of tails used again, smoothed toward its parent's (its turn depth's,
        then everyone's) with PRIOR_STRENGTH observations each; 0.5 where nothing is known."""
        p = 0.5
        for key in reversed(_chain(cls)):
            stats = self._stats.get(key)
            if stats is not None:
                n = stats.reused + stats.expired
                p = (stats.reused + PRIOR_STRENGTH * p) / (n + PRIOR_STRENGTH)
        return p

    def q_reuse(self, tail: Tail, now_s: float) -> float:
        """The chance `tail` is used again, idle since its last use."""
        p = self.p_reuse(tail.cls)
        survive = self._survival(tail.cls, now_s - tail.last_s)
        live = p * survive
        return live / (1.0 - p + live) if live > 0 else 0.0

    def level_of(self, tail: Tail, now_s: float | None = None) -> Liveness:
        if tail.released:
            return Liveness.DEAD
        return _level(self.q_reuse(tail, self._now if now_s is None else now_s))

    def stats(self) -> dict[ClassKey, ClassStats]:
        return self._stats

    def tail_of(self, block_hash: BlockHash) -> Tail | None:
        return self._by_block.get(block_hash)

    # -- internals -------------------------------------------------------------------------------

    def _stats_of(self, cls: ClassKey) -> ClassStats:
        stats = self._stats.get(cls)
        if stats is None:
            stats = self._stats[cls] = ClassStats()
        return stats

    def _count(self, cls: ClassKey, what: str, delta: int = 1) -> None:
        """Count for the class and the classes it is smoothed toward."""
        for key in _chain(cls):
            stats = self._stats_of(key)
            setattr(stats, what, getattr(stats, what) + delta)

    def _gaps(self, cls: ClassKey) -> list[float]:
        for key in _chain(cls):
            stats = self._stats.get(key)
            if stats is not None and len(stats.gaps) >= MIN_GAPS:
                return stats.sorted_gaps()
        return []

    def _survival(self, cls: ClassKey, age: float) -> float:
        gaps = self._gaps(cls)
        if not gaps or age <= 0:
            return 1.0
        # Share of gaps longer than age, with one pseudo-gap at infinity (never exactly 0).
        return (len(gaps) - bisect_right(gaps, age) + 1) / (len(gaps) + 1)

    def _horizon(self, cls: ClassKey) -> float:
        gaps = self._gaps(cls)
        if not gaps:
            return math.inf
        return HORIZON_FACTOR * gaps[min(len(gaps) - 1, int(HORIZON_QUANTILE * len(gaps)))]

    def _deepest(self, hashes: list[BlockHash], name: object) -> tuple[Tail | None, int]:
        """The tail holding this request's deepest known block (under a name: that name's
        tail) and how many blocks of the request lead to it."""
        named = self._by_name.get(name) if name is not None else None
        for depth in range(len(hashes) - 1, -1, -1):
            tail = self._by_block.get(hashes[depth])
            if tail is not None and (named is None or tail is named):
                return tail, depth + 1
        return named, 0

    def _reused(self, tail: Tail, common: int, cached_blocks: int, now_s: float) -> None:
        """`tail` was used again (its blocks up to `common`); a block of it RAM had evicted
        (past what the request found cached) makes it a ghost hit."""
        if cached_blocks < common:
            self._count(tail.cls, "ghost_hits")
            self.num_ghost_hits += 1
        if not tail.reused:
            for key in _chain(tail.cls):
                self._stats_of(key).add_gap(now_s - tail.last_s)
            tail.reused = True
            if tail.resolved:  # counted unused at its horizon: a late reuse (a ghost hit) proves otherwise
                self._count(tail.cls, "expired", -1)
                self._count(tail.cls, "reused")
        tail.last_s = now_s
        self._bump_version(tail)  # its successor's tail marks the path from now on

    def _supersede(self, tail: Tail, common: int, now_s: float) -> None:
        """`tail`'s blocks past `common` were re-sent differently: a remainder of its own class."""
        self.num_superseded += 1
        rest = tail.hashes[max(0, common - tail.below) :]
        remainder = Tail(next(self._ids), SUPERSEDED, tail.node, common, tail.end, now_s, now_s, tail.turn)
        self._count(SUPERSEDED, "created")
        self._index(remainder, [h for h in rest if self._by_block.get(h) is tail])
        self._remark(remainder, now_s)

    def _fork(self, tail: Tail, common: int) -> None:
        """Another request shares `tail`'s first `common` blocks and goes elsewhere: those are
        a shared prefix from now on, no one's tail."""
        shared = tail.hashes[: max(0, common - tail.below)]
        for h in shared:
            if self._by_block.get(h) is tail:
                del self._by_block[h]
                self._num_blocks -= 1
        tail.hashes = tail.hashes[len(shared) :]
        tail.below = max(tail.below, common)

    def _index(self, tail: Tail, hashes: list[BlockHash]) -> None:
        by_block = self._by_block
        for h in hashes:
            if by_block.get(h) is None:
                self._num_blocks += 1
            by_block[h] = tail
        tail.hashes = list(hashes)
        self._order[tail.tail_id] = tail
        self._pending.setdefault(tail.cls, deque()).append(tail)
        while self._num_blocks > self.max_blocks and self._order:
            _, oldest = self._order.popitem(last=False)
            self._forget(oldest)

    def _forget(self, tail: Tail) -> None:
        for h in tail.hashes:
            if self._by_block.get(h) is tail:
                del self._by_block[h]
                self._num_blocks -= 1
        if tail.name is not None and self._by_name.get(tail.name) is tail:
            del self._by_name[tail.name]
        self._versions.pop(tail.tail_id, None)

    def _expire(self, now_s: float) -> None:
        """A tail counts in its class's p once it is as old as the class's horizon: used again by
        then or not. Reused and unused tails resolve at the same age, so p is not biased toward
        reuse while the unused ones wait; an unused one stays indexed, so a later reuse (a ghost
        hit of a tail called dead) still counts and revives the class."""
        for cls, pending in self._pending.items():
            horizon = self._horizon(cls)
            while pending and now_s - pending[0].born_s > horizon:
                tail = pending.popleft()
                tail.resolved = True
                self._count(cls, "reused" if tail.reused else "expired")

    def _bump_version(self, tail: Tail) -> None:
        self._versions[tail.tail_id] = self._versions.get(tail.tail_id, 0) + 1

    def _remark(self, tail: Tail, now_s: float) -> None:
        """Mark `tail` at its level now and set the deadline of its next change."""
        if tail.released:
            return
        level = self.level_of(tail, now_s)
        self._set_level(tail, level)
        when = self._next_change(tail, now_s)
        self._bump_version(tail)
        version = self._versions[tail.tail_id]
        if when is not None:
            heapq.heappush(self._deadlines, (when, tail.tail_id, version, tail))

    def _next_change(self, tail: Tail, now_s: float) -> float | None:
        """When q falls below the next threshold under tail's level, given what is known now."""
        gaps = self._gaps(tail.cls)
        if not gaps:
            return None
        p = self.p_reuse(tail.cls)
        q = self.q_reuse(tail, now_s)
        for threshold in (HOT_FROM, COLD_BELOW, DEAD_BELOW):
            if q >= threshold and p > threshold:
                survive = threshold * (1.0 - p) / (p * (1.0 - threshold))
                # The smallest age whose survival is below `survive`.
                n = len(gaps)
                longer = math.ceil(survive * (n + 1)) - 1  # gaps longer than the age
                index = max(0, min(n - 1, n - longer))
                age = gaps[index]
                if tail.last_s + age > now_s:
                    return tail.last_s + age
        return None

    def _advance(self, now_s: float) -> None:
        """Re-mark the tails whose deadline passed."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now_s:
            _, tail_id, version, tail = heapq.heappop(deadlines)
            if self._versions.get(tail_id) != version:
                continue
            self._remark(tail, now_s)
        if len(deadlines) > 4 * len(self._order) + 1024:  # drop superseded entries now and then
            self._deadlines = [e for e in deadlines if self._versions.get(e[1]) == e[2]]
            heapq.heapify(self._deadlines)

    def _set_level(self, tail: Tail, level: Liveness) -> None:
        if level is tail.level:
            return
        tail.level = level
        duel = self.duel
        if duel is not None:
            by_block = self._by_block
            duel.marked.set_level([h for h in tail.hashes if by_block.get(h) is tail], level)
        if duel is None or duel.enabled:
            self._mark(tail.node, level, tail.below)

    def _block_level(self, block_hash: BlockHash) -> Liveness:
        tail = self._by_block.get(block_hash)
        return Liveness.UNKNOWN if tail is None or tail.level is None else tail.level

    def _settle(self, hashes: list[BlockHash]) -> None:
        """The duel's verdict after a request; on a flip every followed tail is re-marked (at
        its level, or unknown), oldest first so a newer tail's mark wins on a shared path (an
        old tail's mark runs down to what was cached under it since, an unknown tail's too)."""
        if self.duel is None or not self.duel.settle(hashes, self._block_level):
            return
        on = self.duel.enabled
        for tail in self._order.values():
            if tail.level is not None:
                # Off: the whole private path, past `below` or not (a fork since may have raised it).
                self._mark(tail.node, tail.level if on else Liveness.UNKNOWN, tail.below if on else 0)


def _chain(cls: ClassKey) -> tuple[ClassKey, ...]:
    """The class, then those it is smoothed toward: its turn depth's (a superseded remainder
    has none), then everyone's ()."""
    if cls == SUPERSEDED or len(cls) <= 1:
        return (cls, ()) if cls else ((),)
    return (cls, cls[:1], ())


def _level(q: float) -> Liveness:
    if q < DEAD_BELOW:
        return Liveness.DEAD
    if q < COLD_BELOW:
        return Liveness.COLD
    if q >= HOT_FROM:
        return Liveness.HOT
    return Liveness.UNKNOWN


__all__ = ["DeadBlockPredictor", "Tail", "ClassStats", "Mark", "SUPERSEDED"]
