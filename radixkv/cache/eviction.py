"""The order in which the prefix cache gives up its unlocked leaves: unretained leaves first,
least recently used first; then retained leaves, earliest retention expiry first. Two sorted
sets, so adding, removing and taking the next victim each cost O(log n).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sortedcontainers import SortedList

if TYPE_CHECKING:
    from radixkv.cache.radix import Node

# (0, last_access, node_id, node) in the LRU set, (1, retain_until_s, node_id, node) in the
# retained set: node_id breaks ties, so nodes are never compared; the tag says which set.
EvictKey = tuple[int, float, int, "Node"]
_LRU, _RETAINED = 0, 1


class EvictionOrder:
    """Every unlocked non-root leaf, each in exactly one of two sets. A node remembers the key
    it was filed under (node.evict_key), so it can always be found again; the caller removes a
    node before changing what its key is made of (last access, retention) and adds it after."""

    def __init__(self) -> None:
        self._lru: SortedList = SortedList()
        self._retained: SortedList = SortedList()

    def add(self, node: Node) -> None:
        assert node.evict_key is None, f"{node!r} is already in the eviction order"
        if node.retains:
            key: EvictKey = (_RETAINED, node.retain_until_s, node.node_id, node)
            self._retained.add(key)
        else:
            key = (_LRU, float(node.last_access), node.node_id, node)
            self._lru.add(key)
        node.evict_key = key

    def remove(self, node: Node) -> None:
        key = node.evict_key
        assert key is not None, f"{node!r} is not in the eviction order"
        (self._retained if key[0] == _RETAINED else self._lru).remove(key)
        node.evict_key = None

    def pop(self) -> Node | None:
        """The next victim: the least recently used unretained leaf, else the retained leaf
        whose retention ends first; None when nothing is evictable."""
        ordered = self._lru or self._retained
        if not ordered:
            return None
        node = ordered.pop(0)[3]
        node.evict_key = None
        return node

    def clear(self) -> None:
        for key in (*self._lru, *self._retained):
            key[3].evict_key = None
        self._lru.clear()
        self._retained.clear()

    def keys(self) -> list[EvictKey]:
        return [*self._lru, *self._retained]

    def __len__(self) -> int:
        return len(self._lru) + len(self._retained)

    @property
    def num_retained_leaves(self) -> int:
        return len(self._retained)
