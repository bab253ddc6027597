"""Retentions: promises that a cached prefix stays cached until a time (Anthropic's
cache_control ttl, OpenAI's prompt_cache_retention). This module keeps the records, by id, by
expiry and by owner; the tree marks the retained paths and orders eviction by them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sortedcontainers import SortedList

if TYPE_CHECKING:
    from radixkv.cache.radix_node import Node


@dataclass(slots=True, eq=False)
class Retention:
    retention_id: int
    node: Node  # deepest node of the retained prefix; the path above it carries the id too
    expires_at_s: float  # on the tree's clock
    owner: str | None  # whose cap it counts against
    num_pages: int  # pages of the path when it was retained


class RetentionBook:
    """Live retentions. Expired ones leave through pop_expired, released ones through remove;
    an owner's entry goes with its last retention, so idle owners cost nothing."""

    def __init__(self) -> None:
        self._by_id: dict[int, Retention] = {}
        self._by_expiry: SortedList = SortedList()  # (expires_at_s, retention_id)
        self._by_owner: dict[str | None, dict[int, Retention]] = {}  # insertion order: oldest first
        self._next_id = 0

    def add(self, node: Node, expires_at_s: float, owner: str | None, num_pages: int) -> Retention:
        self._next_id += 1
        retention = Retention(self._next_id, node, expires_at_s, owner, num_pages)
        self._by_id[retention.retention_id] = retention
        self._by_expiry.add((expires_at_s, retention.retention_id))
        self._by_owner.setdefault(owner, {})[retention.retention_id] = retention
        return retention

    def remove(self, retention_id: int) -> Retention | None:
        retention = self._by_id.pop(retention_id, None)
        if retention is None:
            return None
        self._by_expiry.remove((retention.expires_at_s, retention_id))
        mine = self._by_owner[retention.owner]
        del mine[retention_id]
        if not mine:
            del self._by_owner[retention.owner]
        return retention

    def pop_expired(self, now_s: float) -> list[Retention]:
        """Remove and return every retention whose time has come (expires_at_s <= now_s)."""
        expired = []
        while self._by_expiry and self._by_expiry[0][0] <= now_s:
            retention = self.remove(self._by_expiry[0][1])
            assert retention is not None
            expired.append(retention)
        return expired

    def of_owner(self, owner: str | None) -> list[Retention]:
        """The owner's live retentions, oldest first."""
        return list(self._by_owner.get(owner, {}).values())

    def owners(self) -> list[str | None]:
        """Every owner with a live retention."""
        return list(self._by_owner)

    def rehome(self, alias: str | None, owner: str | None) -> int:
        """File `alias`'s retentions under `owner` (one owner known by two names); returns how
        many moved. Ids grow with age, so the merged entry stays oldest first."""
        moved = self._by_owner.pop(alias, {})
        for retention in moved.values():
            retention.owner = owner
        if moved:
            merged = {**self._by_owner.get(owner, {}), **moved}
            self._by_owner[owner] = dict(sorted(merged.items()))
        return len(moved)

    def owner_pages(self, owner: str | None) -> int:
        return sum(r.num_pages for r in self._by_owner.get(owner, {}).values())

    def get(self, retention_id: int) -> Retention | None:
        return self._by_id.get(retention_id)

    def clear(self) -> None:
        self._by_id.clear()
        self._by_expiry.clear()
        self._by_owner.clear()

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Retention]:
        return iter(list(self._by_id.values()))
