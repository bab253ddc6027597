"""Stateful property test of RadixTree + PagePool against a plain reference model: a dict from
(salt, cached full-block prefix) to its page. Requests behave as the engine's do; after every
step the match results, the page accounting and the tree's own invariants are checked.
Retentions run on a clock the machine moves: eviction must take unretained leaves by LRU, then
retained ones by expiry, and an expired retention must count for nothing. Under the slru policy
blocks that served a match (protected) go after those that never did (probation), each by LRU,
unless the protected share of the cache passes its cap."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import xxhash
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.cache import BlockHasher, BlocksEvicted, HashFn, Node, OutOfPages, PagePool, RadixTree
from tests.helpers.pool import allocate_checked

# Shared prefixes plus a tail from a 3-letter alphabet, so prompts overlap at every depth.
PREFIXES = ((), (0,) * 8, (0, 1, 2, 0, 1, 2, 0, 1), (0, 1, 2, 0, 1, 2, 2, 2, 1, 0, 0, 1), (1, 1, 0, 0), (2,) * 4)
tokens_st = st.builds(
    lambda prefix, tail: list(PREFIXES[prefix]) + tail,
    st.integers(0, len(PREFIXES) - 1),
    st.lists(st.integers(0, 2), max_size=10),
).filter(bool)
salt_st = st.sampled_from([None, None, None, "", "t"])
index_st = st.integers(0, 1 << 16)

Key = tuple[str | None, tuple[int, ...]]
# (expires_at_s, the block keys it covers): those cached when it was made, less those evicted since
# (a block computed again later is a new block, not retained).
RefRetention = tuple[float, set[Key]]
OWNER = "capped"
OWNER_CAP_PAGES = 3


@dataclass(slots=True, eq=False)
class Req:
    tokens: list[int]
    salt: str | None
    pages: list[int]  # page table: one reference held on each
    node: Node  # locked
    depth: int  # blocks covered by the locked node's path


def _few_values_hash(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data) % 3


class CacheMachine(RuleBasedStateMachine):
    hash_fn: HashFn | None = None
    eviction_policy = "slru"

    @initialize(
        page_size=st.sampled_from([2, 4]),
        num_pages=st.integers(6, 24),
        protected_fraction=st.sampled_from([0.5, 1.0]),
    )
    def setup(self, page_size: int, num_pages: int, protected_fraction: float) -> None:
        self.ps = page_size
        self.hasher = BlockHasher(page_size, seed=1234, hash_fn=self.hash_fn)
        self.pool = PagePool(num_pages, page_size)
        self.now_s = 0.0
        self.protected_fraction = protected_fraction
        self.tree = RadixTree(
            self.pool,
            self.hasher,
            clock=lambda: self.now_s,
            eviction_policy=self.eviction_policy,
            protected_fraction=protected_fraction,
        )
        self.tree.events.subscribe(lambda event: isinstance(event, BlocksEvicted) and self.evicting(event.node))
        self.hook_pages: list[int] = []  # pages the eviction hook saw, still cached when it ran
        self.ref_hit: set[Key] = set()  # blocks that served a match since they were cached
        self.ref_retentions: dict[str, list[RefRetention]] = {}  # by owner
        self.owners = 0
        self.ref: dict[Key, int] = {}
        self.ref_time: dict[Key, int] = {}
        self.clock = 0
        self.requests: list[Req] = []
        self.side: list[list[int]] = []  # pages held outside the cache (other users of the pool)
        self.queries = 0

    # ------------------------------------------------------------ reference model

    def key(self, tokens: list[int], salt: str | None, blocks: int) -> Key:
        return (salt, tuple(tokens[: blocks * self.ps]))

    def ref_match(self, tokens: list[int], salt: str | None) -> tuple[int, list[int]]:
        limit = (len(tokens) - 1) // self.ps
        pages: list[int] = []
        while len(pages) < limit and (k := self.key(tokens, salt, len(pages) + 1)) in self.ref:
            pages.append(self.ref[k])
        return len(pages), pages

    def evicting(self, node: Node) -> None:
        """The tree's eviction hook (the disk tier's write-back): the node is still whole."""
        assert not node.removed and not node.children and node.lock_ref == 0
        assert all(self.pool.refcount(page) == 1 for page in node.pages)
        self.hook_pages.extend(node.pages)

    def ref_matched(self, tokens: list[int], salt: str | None, blocks: int) -> None:
        """A match used the first `blocks` blocks: under slru they are protected from now."""
        self.ref_hit.update(self.key(tokens, salt, i) for i in range(1, blocks + 1))

    def ref_touch(self, tokens: list[int], salt: str | None, blocks: int) -> None:
        self.clock += 1
        for i in range(1, blocks + 1):
            self.ref_time[self.key(tokens, salt, i)] = self.clock

    def chain_hash(self, key: Key) -> int:
        return self.hasher.hash_blocks(list(key[1]), key[0])[-1]

    def collides(self, tokens: list[int], salt: str | None, block: int) -> bool:
        """Would block `block` of tokens land on a cached sibling with the same hash?"""
        mine = self.key(tokens, salt, block + 1)
        parent = mine[1][: block * self.ps]
        mine_hash = self.chain_hash(mine)
        return any(
            k[0] == salt and len(k[1]) == len(mine[1]) and k[1][: block * self.ps] == parent
            and self.chain_hash(k) == mine_hash
            for k in self.ref
        )

    def ref_insert(self, tokens: list[int], salt: str | None, pages: list[int]) -> tuple[int, int, list[int]]:
        full = len(tokens) // self.ps
        canon: list[int] = []
        while len(canon) < full and (k := self.key(tokens, salt, len(canon) + 1)) in self.ref:
            canon.append(self.ref[k])
        existing = len(canon)
        if existing == full or self.collides(tokens, salt, existing):
            return existing, 0, canon
        for block in range(existing, full):
            self.ref[self.key(tokens, salt, block + 1)] = pages[block]
            canon.append(pages[block])
        return existing, full - existing, canon

    def locked_keys(self) -> set[Key]:
        return {self.key(r.tokens, r.salt, i) for r in self.requests for i in range(1, r.depth + 1)}

    def ref_evict(self, num_pages: int) -> None:
        retained = {k: self.retained_until(k) for k in self.ref}  # evict() expires first, at the same now
        slru = self.eviction_policy == "slru"
        hit = {k for k in self.ref if k in self.ref_hit and slru}
        protected_pages = sum(1 for k in self.ref if k in self.ref_hit)
        assert self.tree.protected_pages == protected_pages
        never_over_cap = self.protected_fraction >= 1.0
        leaves_before = set(self.unlocked_leaf_keys())
        self.hook_pages = []
        freed = self.tree.evict(num_pages)
        cached = self.tree.cached_page_set()
        evicted = {k for k, page in self.ref.items() if page not in cached}
        assert freed == len(evicted)
        assert sorted(self.hook_pages) == sorted(self.ref[k] for k in evicted), "the hook saw other blocks than went"
        assert not evicted & self.locked_keys(), "evicted a locked block"
        for k in evicted:
            del self.ref[k]
        leaves = self.unlocked_leaf_keys()
        if freed < num_pages:
            assert not leaves and self.tree.evictable_pages == 0
        plain_left = [self.ref_time[k] for k in leaves if not retained[k]]
        kept_left = [retained[k] for k in leaves if retained[k]]
        plain_gone = [self.ref_time[k] for k in evicted if not retained[k]]
        kept_gone = [retained[k] for k in evicted if retained[k]]
        assert not (kept_gone and plain_left), "evicted a retained block while an unretained one was evictable"
        # LRU within each segment (one segment under lru), among the leaves there were before: an
        # over-cap protected leaf may go first, and a probation leaf evicted after it can expose
        # an older protected parent, which was not a leaf when the protected victim was chosen.
        for protected in (False, True):
            gone = [self.ref_time[k] for k in evicted if not retained[k] and (k in hit) == protected]
            left = [self.ref_time[k] for k in leaves if k in leaves_before and not retained[k] and (k in hit) == protected]
            if gone and left:
                assert max(gone) <= min(left), "not LRU"
        if never_over_cap:
            probation_left = [k for k in leaves if not retained[k] and k not in hit]
            protected_gone = [k for k in evicted if not retained[k] and k in hit]
            assert not (probation_left and protected_gone), "evicted a hit block while a never-hit one was evictable"
        self.ref_hit -= evicted
        if kept_gone and kept_left:
            assert max(kept_gone) <= min(kept_left), "retained blocks not evicted in expiry order"
        for k in evicted:
            del self.ref_time[k]
        for rs in self.ref_retentions.values():
            for _, covered in rs:
                covered -= evicted

    def retained_until(self, k: Key) -> float:
        """The latest expiry of a live retention covering block key k; 0 when none does."""
        return max(
            (expiry for rs in self.ref_retentions.values() for expiry, covered in rs if k in covered and expiry > self.now_s),
            default=0.0,
        )

    def tree_retentions(self, owner: str) -> list[RefRetention]:
        """The owner's retentions as the tree reports them, in the reference's terms."""
        out = []
        for r in self.tree.retentions(owner):
            path, node = [], r.node
            while node.parent is not None:
                path.append(node)
                node = node.parent
            prefix: tuple[int, ...] = ()
            covered = set()
            for n in reversed(path):
                for block in range(len(n.pages)):
                    key = (n.salt, prefix + tuple(n.tokens[: (block + 1) * self.ps]))
                    if not n.removed:
                        covered.add(key)
                prefix += tuple(n.tokens)
            out.append((r.expires_at_s, covered))
        return out

    def unlocked_leaf_keys(self) -> list[Key]:
        parents = {(k[0], k[1][: -self.ps]) for k in self.ref}
        locked = self.locked_keys()
        return [k for k in self.ref if k not in parents and k not in locked]

    # ------------------------------------------------------------ rules

    @rule(tokens=tokens_st, salt=salt_st, precomputed=st.booleans(), record=st.booleans())
    def start_request(self, tokens: list[int], salt: str | None, precomputed: bool, record: bool) -> None:
        self._start(tokens, salt, precomputed, record)

    def _start(self, tokens: list[int], salt: str | None, precomputed: bool, record: bool) -> Req | None:
        """Match, lock, evict if short of pages, allocate the rest; None when out of pages."""
        hashes = self.hasher.hash_blocks(tokens, salt) if precomputed else None
        result = self.tree.match(tokens, salt, block_hashes=hashes, record=record)
        blocks, pages = self.ref_match(tokens, salt)
        assert (result.num_cached_tokens, result.pages) == (blocks * self.ps, pages)
        self.ref_matched(tokens, salt, blocks)
        self.ref_touch(tokens, salt, blocks)
        self.queries += record
        self.tree.lock(result.node)
        self.ref_touch(tokens, salt, blocks)
        peeked = self.tree.peek(tokens, salt)  # the same match, now locked: nothing is evictable
        assert peeked.pages == result.pages and peeked.num_unlocked_pages == 0
        self.pool.incref(result.pages)
        req = Req(tokens, salt, result.pages, result.node, blocks)
        self.requests.append(req)  # its lock counts while we evict for it
        need = -(-len(tokens) // self.ps) - blocks
        if need > self.pool.num_free:
            self.ref_evict(need - self.pool.num_free)
        if need > self.pool.num_free:
            with pytest.raises(OutOfPages):
                self.pool.allocate(need)
            self.requests.remove(req)
            self.tree.unlock(result.node)
            self.ref_touch(tokens, salt, blocks)
            self.pool.release(result.pages)
            return None
        req.pages = req.pages + self.pool.allocate(need)
        return req

    @rule(tokens=tokens_st, salt=salt_st, precomputed=st.booleans())
    def peek(self, tokens: list[int], salt: str | None, precomputed: bool) -> None:
        """A peek answers what match would, and changes nothing: no split, no time, no stats."""
        hashes = self.hasher.hash_blocks(tokens, salt) if precomputed else None
        before = self.tree_snapshot()
        result = self.tree.peek(tokens, salt, block_hashes=hashes)
        blocks, pages = self.ref_match(tokens, salt)
        assert (result.num_cached_tokens, result.pages) == (blocks * self.ps, pages)
        assert self.tree_snapshot() == before
        evictable_before = self.tree.evictable_pages
        match = self.tree.match(tokens, salt, block_hashes=hashes, record=False)
        self.ref_matched(tokens, salt, blocks)
        self.ref_touch(tokens, salt, blocks)
        self.tree.lock(match.node)
        self.ref_touch(tokens, salt, blocks)
        assert self.tree.evictable_pages == evictable_before - result.num_unlocked_pages  # what admission counts on
        self.tree.unlock(match.node)
        self.ref_touch(tokens, salt, blocks)

    def tree_snapshot(self) -> tuple:
        nodes = sorted((n.node_id, n.last_access, n.lock_ref, tuple(n.pages)) for n in self.tree._iter_nodes())
        return nodes, self.tree._order.keys(), self.tree.stats(), self.tree._clock

    @precondition(lambda self: self.requests)
    @rule(i=index_st, precomputed=st.booleans())
    def insert_request(self, i: int, precomputed: bool) -> None:
        self._insert(self.requests[i % len(self.requests)], precomputed)

    def _insert(self, req: Req, precomputed: bool) -> None:
        hashes = self.hasher.hash_blocks(req.tokens, req.salt) if precomputed else None
        expected = self.ref_insert(req.tokens, req.salt, req.pages)
        result = self.tree.insert(req.tokens, req.pages, req.salt, block_hashes=hashes)
        assert (result.num_existing_blocks, result.num_inserted_blocks, result.pages) == expected
        depth = result.num_existing_blocks + result.num_inserted_blocks
        self.ref_touch(req.tokens, req.salt, depth)
        self.tree.lock(result.node)
        self.ref_touch(req.tokens, req.salt, depth)
        self.tree.unlock(req.node)
        self.ref_touch(req.tokens, req.salt, req.depth)
        for block in range(result.num_existing_blocks):
            if result.pages[block] != req.pages[block]:
                # Our copy of an already cached block: adopt the tree's page, free ours.
                self.pool.release([req.pages[block]])
                self.pool.incref([result.pages[block]])
        req.pages[:depth] = result.pages
        req.node, req.depth = result.node, depth

    @precondition(lambda self: self.requests)
    @rule(i=index_st)
    def finish_request(self, i: int) -> None:
        self._finish(self.requests[i % len(self.requests)])

    @rule(tokens=tokens_st, salt=salt_st)
    def whole_request(self, tokens: list[int], salt: str | None) -> None:
        """Start, insert and finish in one step, so the cache grows fast enough to be evicted."""
        req = self._start(tokens, salt, precomputed=False, record=True)
        if req is not None:
            self._insert(req, precomputed=False)
            self._finish(req)

    @rule(tokens=tokens_st, salt=salt_st)
    def unmatched_request(self, tokens: list[int], salt: str | None) -> None:
        """A request that computed every block itself (it started in the same step as another
        with its prefix), then inserts: its path may run through unlocked leaves."""
        need = -(-len(tokens) // self.ps)
        if need > self.pool.num_free:
            self.ref_evict(need - self.pool.num_free)
        if need > self.pool.num_free:
            return
        req = Req(tokens, salt, self.pool.allocate(need), self.tree.match([], salt, record=False).node, 0)
        self.tree.lock(req.node)
        self.requests.append(req)
        self._insert(req, precomputed=True)
        self._finish(req)

    def _finish(self, req: Req) -> None:
        self.requests.remove(req)
        self.tree.unlock(req.node)
        self.ref_touch(req.tokens, req.salt, req.depth)
        self.pool.release(req.pages)

    @rule(tokens=tokens_st, salt=salt_st)
    def peek(self, tokens: list[int], salt: str | None) -> None:
        result = self.tree.match(tokens, salt, record=False)
        blocks, pages = self.ref_match(tokens, salt)
        assert (result.num_cached_tokens, result.pages) == (blocks * self.ps, pages)
        self.ref_matched(tokens, salt, blocks)
        self.ref_touch(tokens, salt, blocks)

    @rule(num_pages=st.integers(0, 8))
    def evict(self, num_pages: int) -> None:
        self.ref_evict(num_pages)

    @rule(n=st.integers(0, 5))
    def side_allocate(self, n: int) -> None:
        pages = allocate_checked(self.pool, n)
        if pages is not None:
            self.side.append(pages)

    @precondition(lambda self: self.side)
    @rule(i=index_st)
    def side_release(self, i: int) -> None:
        self.pool.release(self.side.pop(i % len(self.side)))

    @rule(tokens=tokens_st, salt=salt_st, ttl_s=st.sampled_from([1.0, 50.0, 300.0]), capped=st.booleans())
    def retain(self, tokens: list[int], salt: str | None, ttl_s: float, capped: bool) -> None:
        """Retain what is cached of a prefix: by a fresh owner (never capped, never replaced),
        or by one owner with a small cap, whose surviving retentions the tree then reports."""
        blocks, _ = self.ref_match(tokens + [0], salt)
        node = self.tree.match(tokens + [0], salt, record=False).node
        self.ref_matched(tokens, salt, blocks)
        self.ref_touch(tokens, salt, blocks)
        if capped:
            num = self.tree.retain(node, ttl_s, OWNER, OWNER_CAP_PAGES)
            assert num == (blocks if blocks <= OWNER_CAP_PAGES else 0)
            self.ref_retentions[OWNER] = self.tree_retentions(OWNER)
            assert sum(r.num_pages for r in self.tree.retentions(OWNER)) <= OWNER_CAP_PAGES
        else:
            self.owners += 1
            assert self.tree.retain(node, ttl_s, str(self.owners)) == blocks
            if blocks:
                covered = {self.key(tokens, salt, i) for i in range(1, blocks + 1)}
                self.ref_retentions[str(self.owners)] = [(self.now_s + ttl_s, covered)]

    @rule(dt_s=st.sampled_from([0.5, 1.0, 49.0, 120.0, 400.0]))
    def advance_clock(self, dt_s: float) -> None:
        self.now_s += dt_s

    @precondition(lambda self: self.ref_retentions.get(OWNER))
    @rule(i=index_st)
    def release(self, i: int) -> None:
        mine = self.tree.retentions(OWNER)  # as of the last expire: all may have ended since
        if mine:
            assert self.tree.release(mine[i % len(mine)].retention_id)
        self.ref_retentions[OWNER] = self.tree_retentions(OWNER)

    @rule()
    def reset(self) -> None:
        if any(r.depth for r in self.requests):
            with pytest.raises(RuntimeError):
                self.tree.reset()
        elif not self.requests:
            self.tree.reset()
            self.ref.clear()
            self.ref_time.clear()
            self.ref_hit.clear()
            self.ref_retentions.clear()

    # ------------------------------------------------------------ checks after every step

    @invariant()
    def tree_is_consistent(self) -> None:
        self.tree.check_invariants(check_hashes=True)
        self.pool.check_invariants()

    @invariant()
    def retention_is_counted_once_and_expires(self) -> None:
        self.tree.expire()
        live = [r for rs in self.ref_retentions.values() for r in rs if r[0] > self.now_s]
        assert self.tree.stats().num_retentions == len(live)
        assert self.tree.retained_pages == sum(1 for k in self.ref if self.retained_until(k))

    @invariant()
    def tree_holds_exactly_the_reference(self) -> None:
        cached: dict[Key, int] = {}
        for salt, root in self.tree._roots.items():
            stack = [(child, ()) for child in root.children.values()]
            while stack:
                node, prefix = stack.pop()
                for block, page in enumerate(node.pages):
                    cached[(salt, prefix + tuple(node.tokens[: (block + 1) * self.ps]))] = page
                prefix += tuple(node.tokens)
                stack.extend((child, prefix) for child in node.children.values())
        assert cached == self.ref

    @invariant()
    def every_page_counted_once(self) -> None:
        free = self.pool.free_pages()
        evictable = self.tree.evictable_page_set()
        held = [page for r in self.requests for page in r.pages] + [page for s in self.side for page in s]
        in_use = set(held)
        assert free.isdisjoint(evictable) and free.isdisjoint(in_use) and evictable.isdisjoint(in_use)
        assert free | evictable | in_use == set(range(self.pool.num_pages))
        assert self.pool.num_free + self.tree.evictable_pages + len(in_use) == self.pool.num_pages
        tree_pages = self.tree.cached_page_set()
        for page in range(self.pool.num_pages):
            assert self.pool.refcount(page) == held.count(page) + (page in tree_pages), f"page {page}"
        assert self.tree.stats().queries == self.queries


def _settings() -> settings:
    return settings(max_examples=200, stateful_step_count=60, deadline=None)


class RealHash(CacheMachine):
    hash_fn = None


class FewValuesHash(CacheMachine):
    hash_fn = staticmethod(_few_values_hash)
    eviction_policy = "lru"


class ConstantHash(CacheMachine):
    hash_fn = staticmethod(lambda data: 0)


TestRealHash = RealHash.TestCase
TestRealHash.settings = _settings()
TestFewValuesHash = FewValuesHash.TestCase
TestFewValuesHash.settings = _settings()
TestConstantHash = ConstantHash.TestCase
TestConstantHash.settings = _settings()


def test_over_cap_protected_eviction_then_an_exposed_older_parent():
    # Found by the machine above: 7 protected pages over a cap of 5. The newest protected leaf
    # goes first (over the cap), then a probation leaf, which exposes its older protected
    # parent; the reference must not call that a break of LRU order.
    state = RealHash()
    state.setup(page_size=2, num_pages=10, protected_fraction=0.5)
    state.unmatched_request(salt=None, tokens=list(PREFIXES[1]))
    state.peek(salt=None, tokens=list(PREFIXES[1]))
    state.unmatched_request(salt=None, tokens=list(PREFIXES[2]))
    state.unmatched_request(salt=None, tokens=[1, 1, 0, 0])
    state.peek(salt=None, tokens=[0, 1, 0])
    state.peek(salt=None, tokens=list(PREFIXES[2]) + [0])
    state.unmatched_request(salt=None, tokens=list(PREFIXES[1]))
    state.tree_holds_exactly_the_reference()
    state.tree_is_consistent()
    state.teardown()
