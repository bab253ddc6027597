"""RadixTree: the prefix cache. Maps (salt, full-block token prefix) to the KV pages holding it,
as one compressed radix tree per salt, with lock counts on paths in use, retentions (paths kept
until a time) and eviction of unlocked leaves in O(log n) under a policy (cache/eviction.py),
retained last. The tree holds one pool reference on every page it caches. Its node record and
pure walks are in radix_node.py, retained paths in retained_paths.py, marks in liveness.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from radixkv.cache.events import AllCleared, BlocksEvicted, BlocksStored, CacheEvents
from radixkv.cache.eviction import DEFAULT_PROTECTED_FRACTION, EvictionOrder, Liveness
from radixkv.cache.hashing import BlockHash, BlockHasher
from radixkv.cache.liveness import mark_private_path
from radixkv.cache.pages import PagePool
from radixkv.cache.radix_check import check_tree
from radixkv.cache.radix_node import (
    InsertResult,
    MatchResult,
    Node,
    PeekResult,
    check_hashes_len,
    common_blocks,
    iter_preorder,
    iter_subtrees,
    path_tokens,
    token_list,
)
from radixkv.cache.radix_stats import CacheStats, LookupCounts
from radixkv.cache.retained_paths import RetainedPaths
from radixkv.cache.retention import Retention, RetentionBook

# Where callers have always found them; their home is radix_node.py and radix_stats.py.
__all__ = ["CacheStats", "InsertResult", "MatchResult", "Node", "PeekResult", "RadixTree", "path_tokens"]

# Ownership (the engine relies on it): the tree holds exactly one reference on each page it
# caches; a running request holds one on each page of its page table and locks the deepest
# node covering its cached pages. So a page of an unlocked node has refcount 1 and evicting
# the node frees it, while a locked node's pages are never evicted.
#
# Hits (slru): match() adds one to `num_hits` of every node on the matched path, so hits never
# grow toward the leaves (as retains do not: cache/retained_paths.py says why), and a hit
# node's ancestors are protected too. Liveness marks: cache/liveness.py.


Clock = Callable[[], float]  # seconds; time.monotonic, or a test's own


class RadixTree:
    """Prefix cache over a PagePool. Not thread-safe: the engine's step loop owns it."""

    def __init__(
        self,
        pool: PagePool,
        hasher: BlockHasher,
        *,
        clock: Clock = time.monotonic,
        eviction_policy: str = "slru",
        protected_fraction: float = DEFAULT_PROTECTED_FRACTION,
        events: CacheEvents | None = None,
        max_retained_pages: int | None = None,
    ):
        if hasher.page_size != pool.page_size:
            raise ValueError(f"hasher page_size {hasher.page_size} != pool page_size {pool.page_size}")
        if not 0.0 < protected_fraction <= 1.0:
            raise ValueError(f"protected_fraction must be in (0, 1], got {protected_fraction!r}")
        self.pool = pool
        self.hasher = hasher
        self.page_size = hasher.page_size
        self._roots: dict[str | None, Node] = {}
        self._order = EvictionOrder(eviction_policy)  # every unlocked non-root leaf
        self._protected_fraction = protected_fraction
        self._protected_pages = 0  # pages of nodes with num_hits > 0
        # Where the tree says what it stores, evicts and clears (cache/events.py): its own bus
        # unless the engine's, which the disk tier shares, is handed in.
        self.events = events if events is not None else CacheEvents()
        self._book = RetentionBook()
        self._retained = RetainedPaths(self._book, self._order, self._split)
        self._now_s = clock
        # Over all owners, at most this many pages retained at once (None: no bound but the
        # pool): each owner's cap bounds one tenant, this bounds how many tenants together may
        # turn the pool into pages that go last.
        self.max_retained_pages = max_retained_pages
        self._clock = 0
        self._next_id = 0
        self._cached_pages = 0
        self._evictable_pages = 0
        self._num_nodes = 0
        self._counts = LookupCounts()

    # ----------------------------------------------------------------- public operations

    def match(
        self,
        token_ids: Sequence[int],
        salt: str | None = None,
        *,
        block_hashes: Sequence[BlockHash] | None = None,
        record: bool = True,
        serves: bool = True,
    ) -> MatchResult:
        """Longest cached full-block prefix of `token_ids`, leaving at least one token to
        compute (its logits are needed). Splits a node where the match ends inside its run,
        so that locking the result pins exactly the matched pages. A MatchResult stays valid
        until the next evict()/reset(): lock it before then. `serves=False`: no request is
        served from it (a retention finding its path), so it counts no hit (num_hits)."""
        tokens = token_list(token_ids)
        max_blocks = (len(tokens) - 1) // self.page_size if tokens else 0
        check_hashes_len(block_hashes, max_blocks)
        now = self._tick()
        root = self._roots.get(salt)
        if root is None:
            # Not registered: a miss for an unseen salt must not grow the root table.
            root = self._new_node(None, salt, [], [], [])
        node, num_blocks, pages, _, _ = self._descend(root, tokens, salt, max_blocks, block_hashes)
        if serves:
            self._count_hit(node)
        self._touch_path(node, now)
        if record:
            self.record_lookup(len(tokens), num_blocks * self.page_size)
        return MatchResult(num_blocks * self.page_size, pages, node)

    def peek(
        self,
        token_ids: Sequence[int],
        salt: str | None = None,
        *,
        block_hashes: Sequence[BlockHash] | None = None,
    ) -> PeekResult:
        """What match() would return now, without changing anything: no split, no LRU time,
        no statistics. For lookups that may not lead to a use (scheduling order, checks)."""
        tokens = token_list(token_ids)
        max_blocks = (len(tokens) - 1) // self.page_size if tokens else 0
        check_hashes_len(block_hashes, max_blocks)
        pages, unlocked = [], 0
        for child, common in self._cached_runs(tokens, salt, max_blocks, block_hashes):
            pages.extend(child.pages[:common])
            unlocked += common if child.lock_ref == 0 else 0
        return PeekResult(len(pages) * self.page_size, pages, unlocked)

    def deepest_node(
        self,
        token_ids: Sequence[int],
        salt: str | None = None,
        *,
        block_hashes: Sequence[BlockHash] | None = None,
    ) -> Node | None:
        """The deepest node whose whole run is a prefix of the full blocks of `token_ids`
        (every block, none left to compute), or None when not even one node is; pure like peek.
        What a session book marks (set_liveness) when it knows a prefix, not a node."""
        tokens = token_list(token_ids)
        num_blocks = len(tokens) // self.page_size
        check_hashes_len(block_hashes, num_blocks)
        found = None
        for child, common in self._cached_runs(tokens, salt, num_blocks, block_hashes):
            if common < len(child.pages):
                break
            found = child
        return found

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one lookup that was used (a match made with record=False, then locked)."""
        self._counts.record(num_query_tokens, num_hit_tokens)

    def insert(
        self,
        token_ids: Sequence[int],
        pages: Sequence[int],
        salt: str | None = None,
        *,
        block_hashes: Sequence[BlockHash] | None = None,
    ) -> InsertResult:
        """Cache the full blocks of `token_ids`, whose KV is in `pages` (one per block; extra
        pages are ignored). Blocks already cached keep the tree's pages; the caller compares
        and frees its duplicates. A hash collision with different tokens stops the insert."""
        tokens = token_list(token_ids)
        num_full = len(tokens) // self.page_size
        if len(pages) < num_full:
            raise ValueError(f"insert of {num_full} full blocks needs at least {num_full} pages, got {len(pages)}")
        check_hashes_len(block_hashes, num_full)
        now = self._tick()
        root = self._roots.get(salt)
        if num_full == 0:
            return InsertResult(0, 0, [], root if root is not None else self._new_node(None, salt, [], [], []))
        if root is None:
            root = self._roots[salt] = self._new_node(None, salt, [], [], [])
        node, num_existing, out_pages, next_hash, collided = self._descend(
            root, tokens, salt, num_full, block_hashes
        )
        num_inserted = 0
        if num_existing < num_full and not collided:
            assert next_hash is not None
            node = self._adopt(node, tokens, pages, num_existing, num_full, next_hash, block_hashes, now)
            num_inserted = num_full - num_existing
            out_pages.extend(node.pages)
        self._touch_path(node, now)
        self._maybe_drop_root(root)  # a collision on the very first block leaves it empty
        return InsertResult(num_existing, num_inserted, out_pages, node)

    def lock(self, node: Node) -> None:
        """Pin `node` and its ancestors: their pages cannot be evicted until unlock()."""
        if node.removed:
            raise RuntimeError(f"lock of {node!r}, which was evicted; match again before locking")
        now = self._tick()
        if node.evict_key is not None:
            self._order.remove(node)
        current: Node | None = node
        while current is not None:
            if current.lock_ref == 0 and current.parent is not None:
                self._evictable_pages -= len(current.pages)
            current.lock_ref += 1
            current.last_access = now
            current = current.parent

    def unlock(self, node: Node) -> None:
        """Undo one lock(node). Counts as a use: the path's LRU time becomes now."""
        # lock_ref never grows toward the leaves, so checking the node covers its whole path.
        if node.lock_ref <= 0:
            raise RuntimeError(f"unlock of {node!r}, which is not locked")
        now = self._tick()
        current: Node | None = node
        root = node
        while current is not None:
            current.lock_ref -= 1
            current.last_access = now
            if current.lock_ref == 0 and current.parent is not None:
                self._evictable_pages += len(current.pages)
            root = current
            current = current.parent
        if self._is_evictable_leaf(node):
            self._order.add(node)
        self._maybe_drop_root(root)

    def evict(self, num_pages: int, *, flushing: bool = False, write_back: bool = True) -> int:
        """Evict unlocked leaves (whole nodes) until at least `num_pages` pages were freed or
        nothing is evictable; returns the pages freed. Unretained leaves go first, least
        recently used first; retained ones only then, earliest expiry first. O(log n) per node.
        Each leaf is published (BlocksEvicted, with `flushing` and `write_back`) before its
        pages are freed."""
        if num_pages <= 0:
            return 0
        self.expire()
        freed = 0
        while freed < num_pages and (node := self._order.pop(self._protected_over_cap())) is not None:
            if self.events:
                self.events.publish(BlocksEvicted(node, flushing, write_back))
            freed += self._remove_leaf(node)
        self._counts.evicted_pages += freed
        return freed

    def set_liveness(self, node: Node, liveness: Liveness, *, below_blocks: int = 0, tail: Liveness | None = None) -> int:
        """Mark the path private to `node` with `liveness`, refiling the leaf among it
        (liveness.mark_private_path says which nodes); changes the eviction order, returns the
        nodes marked (0 for a root or a branch point)."""
        return mark_private_path(self._order, node, liveness, below_blocks=below_blocks, tail=tail)

    def mark_dead(self, node: Node, *, below_blocks: int = 0) -> int:
        """A released or idle-expired session's private tail: evicted first (set_liveness)."""
        return self.set_liveness(node, Liveness.DEAD, below_blocks=below_blocks)

    def mark_cold(self, node: Node, *, below_blocks: int = 0) -> int:
        """A turn superseded by its successor: evicted after dead, before unknown (set_liveness)."""
        return self.set_liveness(node, Liveness.COLD, below_blocks=below_blocks)

    def mark_hot(self, node: Node, *, below_blocks: int = 0) -> int:
        """The newest turn of a live session, `node` the deepest its retention holds: evicted
        after unknown (set_liveness). What continues below it is unknown: a turn the owner's
        caps trimmed is ordinary past them, never hot outside every cap."""
        return self.set_liveness(node, Liveness.HOT, below_blocks=below_blocks, tail=Liveness.UNKNOWN)

    def retain(self, node: Node, ttl_s: float, owner: str | None = None, max_owner_pages: int | None = None) -> int:
        """Keep `node`'s path cached for `ttl_s` seconds: evicted only after every unretained
        evictable page, and then in expiry order. Returns the pages retained (the path's).

        Per owner, at most `max_owner_pages` pages (summed over its retentions): the owner's
        retentions of this path or a prefix of it that end no later are replaced by this one;
        past the cap, its oldest retentions are released first. A path longer than the cap is
        not retained at all: the caller trims the prefix to the cap before matching it.

        Over all owners, at most `max_retained_pages` pages (distinct) stay retained: past it
        the owner's own oldest retentions are released first, never another owner's, and then
        the path is trimmed to its first pages that fit (splitting a node if need be), so the
        count returned may be short of the path's, down to 0."""
        if node.removed:
            raise RuntimeError(f"retain of {node!r}, which was evicted; match again before retaining")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")
        return self._retained.retain(node, self._now_s(), ttl_s, owner, max_owner_pages, self.max_retained_pages)

    def rehome(self, alias: str | None, owner: str | None, max_owner_pages: int | None = None) -> int:
        """Count `alias`'s retentions as `owner`'s from now on (one owner the disk tier named
        otherwise), then release the owner's oldest past `max_owner_pages`, so the two names
        share one cap; returns the retentions moved. Changes the retention book, no node."""
        moved = self._book.rehome(alias, owner)
        if moved and max_owner_pages is not None:
            self._retained.fit_owner_cap(owner, max_owner_pages)
        return moved

    def retention_owners(self) -> list[str | None]:
        """Every owner with a live retention (as of the last expire); pure."""
        return self._book.owners()

    def release(self, retention_id: int) -> bool:
        """End a retention now; False if it was unknown (expired or released already)."""
        return self._retained.release(retention_id)

    def expire(self, now_s: float | None = None) -> int:
        """Drop the retentions whose time has passed; returns how many. Their nodes become
        ordinary LRU nodes again (unless another retention still covers them)."""
        return self._retained.expire(self._now_s() if now_s is None else now_s)

    def retentions(self, owner: str | None) -> list[Retention]:
        """The owner's live retentions (as of the last expire), oldest first."""
        return self._book.of_owner(owner)

    def retention(self, retention_id: int) -> Retention | None:
        """A live retention by id (the keys of Node.retains)."""
        return self._book.get(retention_id)

    def now_s(self) -> float:
        """The clock retention expiries are on."""
        return self._now_s()

    @property
    def evictable_pages(self) -> int:
        return self._evictable_pages

    @property
    def cached_pages(self) -> int:
        return self._cached_pages

    @property
    def locked_pages(self) -> int:
        return self._cached_pages - self._evictable_pages

    @property
    def retained_pages(self) -> int:
        return self._retained.num_pages

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def protected_pages(self) -> int:
        return self._protected_pages

    @property
    def eviction_policy(self) -> str:
        return self._order.policy

    def stats(self) -> CacheStats:
        """A snapshot of the counters; pure."""
        return self._counts.snapshot(self, len(self._book))

    def reset_stats(self) -> None:
        self._counts.reset()

    def reset(self) -> None:
        """Drop every cached block, releasing the tree's page references. Query statistics are
        kept (reset_stats() clears them). Refused while any path is locked."""
        locked = sum(root.lock_ref for root in self._roots.values())
        if locked:
            raise RuntimeError(f"cannot reset the prefix cache while {locked} lock(s) are held; unlock them first")
        for node in list(self._iter_nodes()):
            self.pool.release(node.pages)
            node.removed = True
        self._roots.clear()
        self._order.clear()
        self._retained.clear()
        self._cached_pages = self._evictable_pages = self._num_nodes = 0
        self._protected_pages = 0
        if self.events:
            self.events.publish(AllCleared())

    def cached_page_set(self) -> set[int]:
        return {page for node in self._iter_nodes() for page in node.pages}

    def evictable_page_set(self) -> set[int]:
        return {page for node in self._iter_nodes() if node.lock_ref == 0 for page in node.pages}

    def check_invariants(self, *, check_hashes: bool = False) -> None:
        """Raise AssertionError unless the tree is consistent with itself and with the pool.
        `check_hashes` also recomputes every block hash from the tokens."""
        check_tree(self, check_hashes=check_hashes)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_node(
        self, parent: Node | None, salt: str | None, tokens: list[int], pages: list[int], hashes: list[BlockHash]
    ) -> Node:
        self._next_id += 1
        return Node(self._next_id, parent, salt, tokens, pages, hashes)

    @staticmethod
    def _is_evictable_leaf(node: Node) -> bool:
        # The membership rule of self._order; check_invariants verifies it holds.
        return node.parent is not None and node.lock_ref == 0 and not node.children

    def _block_hash(
        self,
        node: Node,
        tokens: list[int],
        block: int,
        salt: str | None,
        block_hashes: Sequence[BlockHash] | None,
    ) -> BlockHash:
        """Hash of block `block` of `tokens`, whose preceding blocks match the path to `node`."""
        if block_hashes is not None:
            return block_hashes[block]
        # The path's stored hash equals the query's own chain (same salt, same tokens), so
        # hashes are computed only at node boundaries, not for every block of the prompt.
        parent = node.hashes[-1] if node.parent is not None else None
        ps = self.page_size
        return self.hasher.hash_block(parent, tokens[block * ps : (block + 1) * ps], salt)

    def _cached_runs(
        self, tokens: list[int], salt: str | None, max_blocks: int, block_hashes: Sequence[BlockHash] | None
    ) -> Iterator[tuple[Node, int]]:
        """Each node on the cached path of the first `max_blocks` blocks of `tokens`, with how
        many of its leading blocks they match; the walk ends after a node matched in part
        (none, on a collision). Pure: no split, no time, no statistics."""
        node, block, ps = self._roots.get(salt), 0, self.page_size
        while node is not None and block < max_blocks:
            child = node.children.get(self._block_hash(node, tokens, block, salt, block_hashes))
            if child is None:
                return
            common = common_blocks(child.tokens, tokens, block * ps, max_blocks - block, ps)
            yield child, common
            block += common
            node = child if common == len(child.pages) else None

    def _descend(
        self,
        root: Node,
        tokens: list[int],
        salt: str | None,
        limit_blocks: int,
        block_hashes: Sequence[BlockHash] | None,
    ) -> tuple[Node, int, list[int], BlockHash | None, bool]:
        """Follow the longest cached prefix of the first `limit_blocks` blocks of `tokens`,
        splitting the node in which it ends. Returns (deepest node, matched blocks, their pages,
        hash of the next block when the walk stopped at a missing or colliding child, whether
        it stopped on a collision)."""
        ps = self.page_size
        node, block, pages = root, 0, []
        while block < limit_blocks:
            key = self._block_hash(node, tokens, block, salt, block_hashes)
            child = node.children.get(key)
            if child is None:
                return node, block, pages, key, False
            common = common_blocks(child.tokens, tokens, block * ps, limit_blocks - block, ps)
            if common == 0:
                # Same hash, different tokens: a collision costs a miss, never a wrong hit.
                return node, block, pages, key, True
            if common < len(child.pages):
                child = self._split(child, common)
            pages.extend(child.pages)
            block += common
            node = child
        return node, block, pages, None, False

    def _split(self, node: Node, num_blocks: int) -> Node:
        """Cut `node` after its first `num_blocks` blocks; the new upper node is returned and
        `node` keeps the rest (and its id, so its LRU key stays valid)."""
        ps = self.page_size
        parent = node.parent
        assert parent is not None and 0 < num_blocks < len(node.pages)
        top = self._new_node(
            parent, node.salt, node.tokens[: num_blocks * ps], node.pages[:num_blocks], node.hashes[:num_blocks]
        )
        # Locks on node or below are locks below top too; the same access time keeps
        # "a parent is never older than its child".
        top.lock_ref = node.lock_ref
        top.last_access = node.last_access
        # Every retention of node covers all of it, so all of top too; retained pages only
        # move between the two.
        top.retains = dict(node.retains)
        top.retention_expires_at_s = node.retention_expires_at_s
        top.num_hits = node.num_hits  # both halves served the same matches
        # top.liveness stays UNKNOWN: a split means a path that shares part of the run.
        del node.tokens[: num_blocks * ps]
        del node.pages[:num_blocks]
        del node.hashes[:num_blocks]
        node.parent = top
        top.children[node.hashes[0]] = node
        parent.children[top.hashes[0]] = top  # same key as node had: top starts with its blocks
        self._num_nodes += 1
        return top

    def _adopt(
        self,
        parent: Node,
        tokens: list[int],
        pages: Sequence[int],
        first_block: int,
        end_block: int,
        first_hash: BlockHash,
        block_hashes: Sequence[BlockHash] | None,
        now: int,
    ) -> Node:
        """Add blocks [first_block, end_block) as a new leaf under `parent`, taking a
        reference on their pages."""
        ps = self.page_size
        new_pages = [int(page) for page in pages[first_block:end_block]]  # numpy ids would leak into the pool
        if block_hashes is not None:
            hashes = list(block_hashes[first_block:end_block])
        else:
            rest = tokens[(first_block + 1) * ps : end_block * ps]
            hashes = [first_hash, *self.hasher.hash_blocks(rest, parent=first_hash)]
        self.pool.incref(new_pages)
        if parent.evict_key is not None:
            self._order.remove(parent)  # no longer a leaf
        if parent.children:
            parent.liveness = Liveness.UNKNOWN  # a branch point now: shared, no session's own
        child = self._new_node(parent, parent.salt, tokens[first_block * ps : end_block * ps], new_pages, hashes)
        child.last_access = now
        parent.children[first_hash] = child
        self._order.add(child)
        self._cached_pages += len(new_pages)
        self._evictable_pages += len(new_pages)
        self._num_nodes += 1
        if self.events:
            self.events.publish(BlocksStored("ram", child.hashes, child.pages, child))
        return child

    def _touch_path(self, node: Node, now: int) -> None:
        """Mark `node` and its ancestors used at `now`. Only `node` itself can be in the
        eviction order (its ancestors have children), so only its key is moved."""
        if node.evict_key is not None:
            moved = node.last_access != now and not node.retains
            promoted = node.evict_key[0] != self._order.key_of(node)[0]  # its first hit, under slru
            if moved or promoted:
                self._order.remove(node)
                node.last_access = now
                self._order.add(node)
        current: Node | None = node
        while current is not None:
            current.last_access = now
            current = current.parent

    def _remove_leaf(self, node: Node) -> int:
        """Drop an unlocked leaf already taken out of the eviction order; returns pages freed.
        Its retentions stay live on the ancestors, which now go in their expiry order."""
        parent = node.parent
        assert parent is not None and node.lock_ref == 0 and not node.children
        del parent.children[node.hashes[0]]
        num = len(node.pages)
        self._cached_pages -= num
        self._evictable_pages -= num
        if node.retains:
            self._retained.num_pages -= num
        if node.num_hits:
            self._protected_pages -= num
        self._num_nodes -= 1
        node.removed = True
        freed = self.pool.release(node.pages)
        if self._is_evictable_leaf(parent):
            self._order.add(parent)  # it just became an unlocked leaf
        elif parent.parent is None:
            self._maybe_drop_root(parent)
        return freed

    def _count_hit(self, node: Node) -> None:
        """A match used the path down to `node`: count it on every node of the path. The
        caller refiles `node` if it is a leaf in the eviction order (_touch_path)."""
        current: Node | None = node
        while current is not None and current.parent is not None:
            if current.num_hits == 0:
                self._protected_pages += len(current.pages)
            current.num_hits += 1
            current = current.parent

    def _protected_over_cap(self) -> bool:
        # Of the pool, not of what is cached: a large request that evicts many pages at once
        # must not turn the hot set into the over-cap set halfway through its evictions.
        return self._protected_pages > self._protected_fraction * self.pool.num_pages

    def _maybe_drop_root(self, root: Node) -> None:
        # Per-request salts would otherwise leave one empty root per tenant forever.
        if not root.children and root.lock_ref == 0 and self._roots.get(root.salt) is root:
            del self._roots[root.salt]

    def iter_nodes(self) -> Iterator[Node]:
        """Every cached node, each before its children (what a disk tier persists in order)."""
        return iter_preorder(self._roots.values())

    def _iter_nodes(self) -> Iterator[Node]:
        """Every non-root node of every registered root."""
        return iter_subtrees(self._roots.values())
