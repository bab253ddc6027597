"""DiskIndex: which blocks the disk tier holds, their sizes and their eviction order, in memory.
A byte budget with LRU; retained blocks (a retention with an expiry and an owner) last,
earliest expiry first, each owner's retained bytes capped. It knows nothing of files: the disk
tier (cache/disk.py) deletes what it evicts, and the trace simulator uses it alone.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

from sortedcontainers import SortedList


@dataclass(slots=True)
class _Retained:
    size: int
    expires_at_s: float  # on the index's clock (wall time: it must mean the same after a restart)
    owner: Hashable
    order: tuple[float, int]  # its key in the expiry order: (expires_at_s, tie-breaker)


@dataclass(frozen=True, slots=True)
class DiskRetention:
    expires_at_s: float
    owner: Hashable


class DiskIndex:
    """Keys (block ids) with their size in bytes. Plain keys are evicted least recently used
    first; retained keys only when no plain key is left, earliest expiry first, as in the RAM
    tree. A retention that expires files its key back among the plain ones, first in line.
    `max_owner_bytes` caps each owner's retained bytes: past it, the owner's retentions that
    end first are given up (the blocks stay, unretained)."""

    def __init__(
        self,
        budget_bytes: int,
        *,
        max_owner_bytes: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.max_owner_bytes = max_owner_bytes
        self._clock = clock
        self._plain: OrderedDict[Hashable, int] = OrderedDict()  # key -> bytes, least recent first
        self._retained: dict[Hashable, _Retained] = {}
        self._by_expiry = SortedList()  # (expires_at_s, tie, key)
        self._owner_bytes: dict[Hashable, int] = {}
        self._expired: set[Hashable] = set()  # plain keys whose retention ended, unused since
        self._tie = 0
        self.bytes_used = 0
        self.last_reason = "capacity"  # why pop_victim's last key went (EVICTION_REASONS)
        self.reasons: list[str] = []  # why each key the last add() evicted went

    # ----------------------------------------------------------------- membership

    def add(
        self, key: Hashable, size_bytes: int, *, retention_expires_at_s: float = 0.0, owner: Hashable = None
    ) -> list[Hashable] | None:
        """Record `key` as most recently used (retained until `retention_expires_at_s` when that is in
        the future), evicting to stay within the budget; returns the evicted keys (the caller
        deletes their data; `reasons` says why each went), or None when it can never fit."""
        if size_bytes > self.budget_bytes:
            return None
        self.remove(key)
        evicted = []
        self.reasons = []
        while self.bytes_used + size_bytes > self.budget_bytes:
            victim = self.pop_victim()
            assert victim is not None, "bytes_used > 0 means some key is indexed"
            evicted.append(victim)
            self.reasons.append(self.last_reason)
        self._plain[key] = size_bytes
        self.bytes_used += size_bytes
        if retention_expires_at_s:
            self.retain(key, retention_expires_at_s, owner)
        return evicted

    def retain(self, key: Hashable, expires_at_s: float, owner: Hashable = None) -> bool:
        """Keep `key` until `expires_at_s` (a later expiry already there stands), counted against
        `owner`'s cap; False if the key is not indexed, its time has passed, or it alone is
        more than the owner's cap."""
        size = self.size_of(key)
        if size is None or expires_at_s <= self._clock():
            return False
        if self.max_owner_bytes is not None and size > self.max_owner_bytes:
            return False
        old = self._retained.get(key)
        if old is not None:
            expires_at_s = max(expires_at_s, old.expires_at_s)
            self._unretain(key)
        else:
            del self._plain[key]
        self._expired.discard(key)
        self._tie += 1
        entry = _Retained(size, expires_at_s, owner, (expires_at_s, self._tie))
        self._retained[key] = entry
        self._by_expiry.add((*entry.order, key))
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + size
        self._enforce_owner_cap(owner, keep=key)
        return True

    def retention(self, key: Hashable) -> DiskRetention | None:
        """The live retention of `key`, if any."""
        self.expire()
        entry = self._retained.get(key)
        return None if entry is None else DiskRetention(entry.expires_at_s, entry.owner)

    def retentions(self) -> Iterator[tuple[Hashable, DiskRetention]]:
        """Every live retention (what a restart must find again)."""
        self.expire()
        for key, entry in list(self._retained.items()):
            yield key, DiskRetention(entry.expires_at_s, entry.owner)

    def owner_bytes(self, owner: Hashable) -> int:
        return self._owner_bytes.get(owner, 0)

    def touch(self, key: Hashable) -> bool:
        """Mark `key` used now; False if it is not indexed. A retained key keeps its place
        (retained keys go by expiry, not by use)."""
        if key in self._plain:
            self._plain.move_to_end(key)
            self._expired.discard(key)
            return True
        return key in self._retained

    def remove(self, key: Hashable) -> int:
        """Forget `key`; returns its size (0 if it was not indexed)."""
        size = self._plain.pop(key, None)
        if size is None:
            if key not in self._retained:
                return 0
            size = self._unretain(key)
        self._expired.discard(key)
        self.bytes_used -= size
        return size

    def pop_victim(self) -> Hashable | None:
        """Remove and return the next key to evict: least recently used plain (expired
        retentions first among them), then the retained key whose retention ends first; why it
        went is left in `last_reason`."""
        self.expire()
        if self._plain:
            key, size = self._plain.popitem(last=False)
            self.last_reason = "retention_expired" if key in self._expired else "capacity"
            self._expired.discard(key)
        elif self._retained:
            key = self._by_expiry[0][2]
            size = self._unretain(key)
            self.last_reason = "retained"
        else:
            return None
        self.bytes_used -= size
        return key

    def expire(self, now_s: float | None = None) -> int:
        """File the keys whose retention has ended back among the plain ones, next in line;
        returns how many."""
        now_s = self._clock() if now_s is None else now_s
        expired = []
        while self._by_expiry and self._by_expiry[0][0] <= now_s:
            key = self._by_expiry[0][2]
            expired.append((key, self._unretain(key)))
        for key, size in reversed(expired):
            self._plain[key] = size
            self._plain.move_to_end(key, last=False)
            self._expired.add(key)
        return len(expired)

    def size_of(self, key: Hashable) -> int | None:
        size = self._plain.get(key)
        if size is None and key in self._retained:
            return self._retained[key].size
        return size

    def clear(self) -> None:
        self._plain.clear()
        self._retained.clear()
        self._by_expiry.clear()
        self._owner_bytes.clear()
        self._expired.clear()
        self.bytes_used = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._plain or key in self._retained

    def __len__(self) -> int:
        return len(self._plain) + len(self._retained)

    def __iter__(self) -> Iterator[Hashable]:
        """Keys from the next victim to the last (plain by use, then retained by expiry)."""
        yield from list(self._plain)
        yield from [key for *_, key in self._by_expiry]

    @property
    def num_retained(self) -> int:
        return len(self._retained)

    # ----------------------------------------------------------------- internals

    def _unretain(self, key: Hashable) -> int:
        """Take `key` out of the retained set (not the index's bytes); returns its size."""
        entry = self._retained.pop(key)
        self._by_expiry.remove((*entry.order, key))
        left = self._owner_bytes[entry.owner] - entry.size
        if left:
            self._owner_bytes[entry.owner] = left
        else:
            del self._owner_bytes[entry.owner]
        return entry.size

    def _enforce_owner_cap(self, owner: Hashable, keep: Hashable) -> None:
        """Past the cap, give up the owner's retentions that end first (never `keep`'s): their
        keys become plain, most recently used (they are still wanted, just not promised)."""
        if self.max_owner_bytes is None:
            return
        for *_, key in list(self._by_expiry):
            if self._owner_bytes.get(owner, 0) <= self.max_owner_bytes:
                break
            if key != keep and self._retained[key].owner == owner:
                self._plain[key] = self._unretain(key)
