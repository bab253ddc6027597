"""The order in which the prefix cache gives up its unlocked leaves, under a policy: `lru`
(least recently used first), `slru` (leaves that never served a hit first, then those that
did, each by LRU), `session` (by the liveness a session book marks: dead, cold, unknown, hot,
each by LRU) or `predict` (ordered as `session`, by the marks of the online dead-block predictor,
cache/dead_blocks.py, which the engine runs under this policy; unmarked it is lru). `slru` honours the marks too: a marked leaf is filed as dead, cold or hot, an
unmarked one as slru files it; `lru` ignores them. Retained leaves always last, earliest expiry
first. Sorted sets, so adding, removing and taking the next victim each cost O(log n).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from typing import TYPE_CHECKING

from sortedcontainers import SortedList

if TYPE_CHECKING:
    from radixkv.cache.radix_node import Node

# (tag, last_access, node_id, node) in the probation and protected sets, (tag, retention_expires_at_s,
# node_id, node) in the retained set: node_id breaks ties, so nodes are never compared; the tag
# says which set.
EvictKey = tuple[int, float, int, "Node"]
_PROBATION, _PROTECTED, _RETAINED, _DEAD, _COLD, _HOT = 0, 1, 2, 3, 4, 5

EVICTION_POLICIES = ("slru", "lru", "session", "predict")


class Liveness(IntEnum):
    """What a session book knows of a cached node's future (policies `session` and `slru` order
    by it; `lru` ignores it). UNKNOWN: nobody said (shared prefixes, requests without a session).
    DEAD: a released or idle-expired session's private tail. COLD: a turn its successor
    superseded without extending it (the previous reply's tail). HOT: the newest turn of a
    live session."""

    UNKNOWN = 0
    DEAD = 1
    COLD = 2
    HOT = 3


_LIVENESS_SET = {Liveness.UNKNOWN: _PROBATION, Liveness.DEAD: _DEAD, Liveness.COLD: _COLD, Liveness.HOT: _HOT}
# Under slru, protected (hit) pages beyond this share of the page pool are evicted before
# probation ones, so an old hot set cannot freeze the cache against every newer prefix.
DEFAULT_PROTECTED_FRACTION = 0.5


class EvictionOrder:
    """Every unlocked non-root leaf, each in exactly one set. A node remembers the key it was
    filed under (node.evict_key), so it can always be found again; the caller removes a node
    before changing what its key is made of (last access, hits, retention) and adds it after.

    Why slru: most cached blocks are one request's private tail that is never asked for again
    (a document read once, the last turn of a conversation). Under LRU a burst of them pushes
    out the hot shared prefixes (system prompts, tool definitions); here they go first."""

    def __init__(self, policy: str = "slru") -> None:
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction policy must be one of {EVICTION_POLICIES}, got {policy!r}")
        self.policy = policy
        # Indexed by tag; the dead, cold and hot sets stay empty under `lru` and without marks.
        self._sets: tuple[SortedList, ...] = tuple(SortedList() for _ in range(6))

    def key_of(self, node: Node) -> EvictKey:
        """The key `node` belongs under now (check_tree compares it with the filed one)."""
        if node.retains:
            return (_RETAINED, node.retention_expires_at_s, node.node_id, node)
        if self.policy != "lru" and node.liveness is not Liveness.UNKNOWN:
            return (_LIVENESS_SET[node.liveness], float(node.last_access), node.node_id, node)
        if self.policy in ("session", "predict"):
            return (_PROBATION, float(node.last_access), node.node_id, node)
        tag = _PROTECTED if self.policy == "slru" and node.num_hits > 0 else _PROBATION
        return (tag, float(node.last_access), node.node_id, node)

    def add(self, node: Node) -> None:
        assert node.evict_key is None, f"{node!r} is already in the eviction order"
        key = self.key_of(node)
        self._sets[key[0]].add(key)
        node.evict_key = key

    def remove(self, node: Node) -> None:
        key = node.evict_key
        assert key is not None, f"{node!r} is not in the eviction order"
        self._sets[key[0]].remove(key)
        node.evict_key = None

    def refile(self, node: Node, change: Callable[[Node], None]) -> None:
        """Apply `change` to what `node`'s key is made of (its retention, its liveness), moving
        it to its new key if it is filed (only a leaf can be)."""
        filed = node.evict_key is not None
        if filed:
            self.remove(node)
        change(node)
        if filed:
            self.add(node)

    def pop(self, protected_over_cap: bool = False) -> Node | None:
        """The next victim: a dead leaf, then a cold one, then a probation (unknown) one, then
        a protected one, then a hot one (each LRU; `lru` files none as dead, cold or hot, only
        `slru` protected), then the retained leaf whose retention ends first; None when nothing
        is evictable. With `protected_over_cap` a protected leaf goes before probation ones (never
        before a dead or cold one: what a session says is over goes first)."""
        probation, protected, retained, dead, cold, hot = self._sets
        over_cap = protected if protected_over_cap else None
        ordered = dead or cold or over_cap or probation or protected or hot or retained
        if not ordered:
            return None
        node = ordered.pop(0)[3]
        node.evict_key = None
        return node

    def clear(self) -> None:
        for ordered in self._sets:
            for key in ordered:
                key[3].evict_key = None
            ordered.clear()

    def keys(self) -> list[EvictKey]:
        return [key for ordered in self._sets for key in ordered]

    def __len__(self) -> int:
        return sum(map(len, self._sets))
