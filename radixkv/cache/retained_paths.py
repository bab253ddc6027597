"""The radix tree's retained paths: a retention's id marked on its node and every ancestor, the
retained pages counted, and the caps (per owner, over all owners) met by releasing the owner's own
oldest retentions or trimming the path. The records are the RetentionBook's (cache/retention.py).
"""

from __future__ import annotations

from collections.abc import Callable

from radixkv.cache.eviction import EvictionOrder, Liveness
from radixkv.cache.liveness import relabel
from radixkv.cache.radix_node import Node, path_pages, unretained_path_pages
from radixkv.cache.retention import Retention, RetentionBook

# Retention (the engine relies on it too): a retention of node N puts its id in the `retains`
# of N and of every ancestor, so `retains` never grows toward the leaves. It locks nothing:
# retained pages stay evictable and are counted as such; they only go last. The unlocked
# leaves are kept in sorted sets (cache/eviction.py): unretained by last access (under slru,
# split by whether they ever served a hit), retained by `retention_expires_at_s`, the latest expiry
# among their retentions. Eviction empties the unretained sets before it touches the retained
# one; since a retained node's ancestors are retained too, an empty unretained set means no
# unretained evictable page is left. Expired retentions are dropped lazily (at evict, retain
# and expire), which files their leaves back under the policy's order.


class RetainedPaths:
    """What retaining does to a tree's nodes. It never locks: a retained leaf only moves to the
    retained set of the eviction order. Times come in from the tree's clock, so a test may set it."""

    def __init__(self, book: RetentionBook, order: EvictionOrder, split: Callable[[Node, int], Node]) -> None:
        self.book = book
        self._order = order
        self._split = split  # the tree's: cuts a node after its first n blocks, returns the upper part
        self.num_pages = 0  # distinct cached pages under a live retention

    def retain(
        self,
        node: Node,
        now_s: float,
        ttl_s: float,
        owner: str | None,
        max_owner_pages: int | None,
        max_pages: int | None,
    ) -> int:
        """RadixTree.retain once its arguments are checked: expire, fit the caps, supersede the
        owner's covered retentions, mark the path; returns the pages retained."""
        self.expire(now_s)
        num_pages = path_pages(node)
        if num_pages == 0 or (max_owner_pages is not None and num_pages > max_owner_pages):
            return 0
        if max_pages is not None:
            trimmed = self._fit_retained_cap(node, owner, max_pages)
            if trimmed is None:
                return 0
            node, num_pages = trimmed, path_pages(trimmed)
        expires_at_s = self._supersede(node, now_s + ttl_s, owner)
        if max_owner_pages is not None:
            self.fit_owner_cap(owner, max_owner_pages - num_pages)
        retention = self.book.add(node, expires_at_s, owner, num_pages)
        self._mark_path(retention)
        return num_pages

    def fit_owner_cap(self, owner: str | None, max_pages: int) -> None:
        """Release the owner's oldest retentions until its retained pages are within max_pages."""
        for old in self.book.of_owner(owner):
            if self.book.owner_pages(owner) <= max_pages:
                break
            self.release(old.retention_id)

    def release(self, retention_id: int) -> bool:
        """End a retention now; False if it was unknown (expired or released already)."""
        retention = self.book.remove(retention_id)
        if retention is None:
            return False
        self._unmark_path(retention)
        return True

    def expire(self, now_s: float) -> int:
        """Drop the retentions whose time has passed; returns how many."""
        expired = self.book.pop_expired(now_s)
        for retention in expired:
            self._unmark_path(retention)
        return len(expired)

    def clear(self) -> None:
        """Forget every retention (the tree dropped every node)."""
        self.book.clear()
        self.num_pages = 0

    def _fit_retained_cap(self, node: Node, owner: str | None, cap: int) -> Node | None:
        """The deepest node of `node`'s path whose retention keeps the tree's retained pages
        within `cap` (None: not one page fits), after releasing the owner's own oldest
        retentions while the whole path does not fit. Changes the tree (releases, a split)."""
        for old in self.book.of_owner(owner):
            if self.num_pages + unretained_path_pages(node) <= cap:
                break
            self.release(old.retention_id)
        room = cap - self.num_pages
        # A retention marks its whole path, so the retained nodes of a path lead it: what this
        # retention adds is the unretained tail, top down.
        path: list[Node] = []
        current: Node | None = node
        while current is not None and current.parent is not None:
            path.append(current)
            current = current.parent
        kept: Node | None = None
        for step in reversed(path):
            if not step.retains:
                if len(step.pages) > room:
                    return self._split(step, room) if room > 0 else kept
                room -= len(step.pages)
            kept = step
        return kept

    def _supersede(self, node: Node, expires_at_s: float, owner: str | None) -> float:
        """Release the owner's retentions that the new one on `node` covers (its path or a
        prefix of it, ending no later), so re-retaining a growing conversation does not count
        its prefix twice; returns the new retention's expiry (a same-path one never shortens)."""
        path = set()
        current: Node | None = node
        while current is not None:
            path.add(current.node_id)
            current = current.parent
        for old in self.book.of_owner(owner):
            if old.node is node:
                expires_at_s = max(expires_at_s, old.expires_at_s)
            elif old.node.node_id not in path or old.expires_at_s > expires_at_s:
                continue
            self.release(old.retention_id)
        return expires_at_s

    def _mark_path(self, retention: Retention) -> None:
        rid, expires_at_s = retention.retention_id, retention.expires_at_s
        current: Node | None = retention.node
        while current is not None and current.parent is not None:
            if not current.retains:
                self.num_pages += len(current.pages)
            self._set_retains(current, lambda retains: retains.__setitem__(rid, expires_at_s))
            current = current.parent

    def _unmark_path(self, retention: Retention) -> None:
        # Walks parent pointers from the retained node even when it (or more of the path) was
        # evicted since: a removed node keeps its parent, and a split keeps the lower node's
        # identity with the id copied into the upper one, so every marked node is on this walk.
        rid = retention.retention_id
        current: Node | None = retention.node
        while current is not None and current.parent is not None:
            if rid in current.retains:
                self._set_retains(current, lambda retains: retains.__delitem__(rid))
                if not current.retains and not current.removed:
                    self.num_pages -= len(current.pages)
                if not current.retains and current.liveness is Liveness.HOT:
                    # Hot only while retained: a session's turn its owner's caps (or the
                    # owner's other retentions) released is an ordinary node again.
                    relabel(self._order, current, Liveness.UNKNOWN)
            current = current.parent

    def _set_retains(self, node: Node, change: Callable[[dict[int, float]], None]) -> None:
        """Apply `change` to node.retains, refiling the node if it is in the eviction order
        (only a leaf can be, so on a path this is at most the deepest node still cached)."""

        def apply(target: Node) -> None:
            change(target.retains)
            target.retention_expires_at_s = max(target.retains.values(), default=0.0)

        self._order.refile(node, apply)
