"""DiskIndex: which blocks the disk tier holds, their sizes and their eviction order, in memory.
A byte budget with LRU, retained blocks last; O(1) per operation. It knows nothing of files:
the disk tier (cache/disk.py) deletes what it evicts, and the trace simulator uses it alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator


class DiskIndex:
    """Keys (block ids) with their size in bytes, in two LRU orders: plain and retained. The
    retained order is only drawn from when the plain one is empty, as in the RAM tree."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._plain: OrderedDict[Hashable, int] = OrderedDict()  # key -> bytes, least recent first
        self._retained: OrderedDict[Hashable, int] = OrderedDict()
        self.bytes_used = 0

    def add(self, key: Hashable, size_bytes: int, *, retained: bool = False) -> list[Hashable] | None:
        """Record `key` as most recently used, evicting to stay within the budget; returns the
        evicted keys (the caller deletes their data), or None when it can never fit."""
        if size_bytes > self.budget_bytes:
            return None
        self.remove(key)
        evicted = []
        while self.bytes_used + size_bytes > self.budget_bytes:
            victim = self.pop_victim()
            assert victim is not None, "bytes_used > 0 means some key is indexed"
            evicted.append(victim)
        (self._retained if retained else self._plain)[key] = size_bytes
        self.bytes_used += size_bytes
        return evicted

    def touch(self, key: Hashable) -> bool:
        """Mark `key` used now; False if it is not indexed."""
        for order in (self._plain, self._retained):
            if key in order:
                order.move_to_end(key)
                return True
        return False

    def remove(self, key: Hashable) -> int:
        """Forget `key`; returns its size (0 if it was not indexed)."""
        for order in (self._plain, self._retained):
            size = order.pop(key, None)
            if size is not None:
                self.bytes_used -= size
                return size
        return 0

    def pop_victim(self) -> Hashable | None:
        """Remove and return the next key to evict: least recently used plain, then retained."""
        order = self._plain or self._retained
        if not order:
            return None
        key, size = order.popitem(last=False)
        self.bytes_used -= size
        return key

    def size_of(self, key: Hashable) -> int | None:
        size = self._plain.get(key)
        return self._retained.get(key) if size is None else size

    def clear(self) -> None:
        self._plain.clear()
        self._retained.clear()
        self.bytes_used = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._plain or key in self._retained

    def __len__(self) -> int:
        return len(self._plain) + len(self._retained)

    def __iter__(self) -> Iterator[Hashable]:
        """Keys from the next victim to the most recently used."""
        yield from list(self._plain)
        yield from list(self._retained)
