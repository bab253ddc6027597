"""Layer groups in the KV pool (DESIGN.md (d)): which layers keep every token's KV (full) and which
only the last W tokens (window), and WindowPages, the window layers' own page pool with its book
of which tree blocks still hold their window KV and which of those may go first.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from sortedcontainers import SortedList

from radixkv.cache.events import AllCleared, BlocksEvicted, BlocksStored, CacheEvent, CacheEvents, WindowBlocks
from radixkv.cache.hashing import BlockHash
from radixkv.cache.pages import OutOfPages, PagePool
from radixkv.cache.radix_node import Node

T = TypeVar("T")


class LayerGroups:
    """A model's layers split by what KV they keep: `full_layers` every token's, `window_layers`
    the last `window` tokens' (the widest window among them). A model of one kind (dense, or a
    window on every layer) is one group: `grouped` is False and the pool works as before."""

    __slots__ = ("full_layers", "window_layers", "window", "num_layers")

    def __init__(self, layer_windows: Sequence[int | None], num_layers: int) -> None:
        windows = list(layer_windows) if layer_windows else [None] * num_layers
        full = tuple(i for i, w in enumerate(windows) if w is None)
        slid = tuple(i for i, w in enumerate(windows) if w is not None)
        self.num_layers = num_layers
        if not full or not slid:
            self.full_layers, self.window_layers, self.window = tuple(range(num_layers)), (), None
        else:
            self.full_layers, self.window_layers = full, slid
            self.window = max(w for w in windows if w is not None)

    @property
    def grouped(self) -> bool:
        return self.window is not None

    def per_layer(self, full: Sequence[T], window: Sequence[T]) -> list[T]:
        """One entry per layer, in layer order, from each group's own per-layer lists."""
        out: list[T | None] = [None] * self.num_layers
        for j, layer in enumerate(self.full_layers):
            out[layer] = full[j]
        for j, layer in enumerate(self.window_layers):
            out[layer] = window[j]
        return out  # type: ignore[return-value]

    def min_window_pages(self, page_size: int, chunk_tokens: int) -> int:
        """Window pages one sequence may hold at once: its window behind a chunk, and the chunk."""
        assert self.window is not None
        return -(-(self.window - 1) // page_size) + 1 + -(-chunk_tokens // page_size)

    def auto_window_pages(self, page_size: int, chunk_tokens: int, max_num_seqs: int) -> int:
        """num_window_pages=None: every running sequence's window and a chunk, twice over (the
        second half keeps finished prefixes' last windows, what a later hit needs)."""
        assert self.window is not None
        per_seq = -(-(self.window - 1) // page_size) + 2
        return 2 * (max_num_seqs * per_seq + -(-chunk_tokens // page_size))


@dataclass(frozen=True)
class WindowHooks:
    """What the window pool asks of the cache it serves (KVManager connects the tree's): the bus
    it follows and tells what it holds on, a retention's expiry on the tree's clock (None once
    it ended), and who to tell when a leaf's end lost its window (KVManager marks it dead)."""

    events: CacheEvents | None = None
    retention_expiry: Callable[[int], float | None] = lambda retention_id: None
    end_lost: Callable[[Node], object] | None = None


class WindowPages:
    """The window layers' pages. A running sequence holds one reference on the window page of
    each block in its window (SequenceState.window_table); the tree one on the window page of a
    cached block (keyed by the block's full page) until it drops it. A window page only the tree
    holds is evictable, in one order with the tree's leaves (evict); a retention keeps the
    window before its cut last (keep: what a Keep ttl, cache_control or a session's turn needs
    to stay a full hit at its cut). Dropping one leaves the tree's full block: a match then
    stops where a window lacks pages (usable_tokens)."""

    def __init__(self, pool: PagePool, window: int) -> None:
        self.pool = pool
        self.window = window
        self.page_size = pool.page_size
        self._tree: dict[int, int] = {}  # the tree's full page -> its window page
        # Full pages whose window page only the tree holds, least recently let go first:
        # inside a node's run, and those in the window before a node's end (a branch point or
        # a leaf's end, where requests are known to stop or part: the cuts a later match needs).
        self._inner: dict[int, None] = {}
        self._ends: dict[int, None] = {}
        self._end_pages: set[int] = set()  # full pages in the window before a tree node's end
        self._end_of: dict[int, Node] = {}  # ... and the node whose end that is
        # The cache this serves (connect); until then, a pool apart: no bus, no retentions.
        self._hooks = WindowHooks()
        self._stored: list[int] = []  # full pages the tree adopted since take_stored
        self._window_blocks = -(-(window - 1) // self.page_size)  # blocks a cut's window reaches back
        # Window pages dropped in the window before a node's end while its full pages stay, and
        # of those, pages a live retention's cut needed.
        self.num_end_drops = self.num_kept_drops = 0
        # Each cached full page's (block hash, parent hash), so what this group holds can be told
        # by hash (KV events).
        self._blocks: dict[int, tuple[BlockHash, BlockHash | None]] = {}
        # Pins (KVManager.pin): by the pinned node's identity, the (full pages, window table)
        # each pin of it holds, so a pinned prefix keeps its last window too.
        self._pins: dict[int, list[tuple[list[int], list[int]]]] = {}
        # Retained cuts (keep): full page -> the retention ids whose cut's window it is in, and
        # the evictable ones among them, met while evicting, taken only after every other: by
        # their key in _last_order, (latest live expiry or 0.0, when they came), kept current as
        # retentions keep and are forgotten, so eviction takes the front (O(log n) a page).
        self._kept: dict[int, set[int]] = {}
        self._kept_by: dict[int, list[int]] = {}  # retention id -> its full pages
        self._last: dict[int, tuple[float, int]] = {}
        self._last_order = SortedList()  # (expiry or 0.0, arrival, full page)
        self._arrivals = itertools.count()
        self._sweep_at = 64

    def connect(self, hooks: WindowHooks) -> None:
        """Serve the cache behind `hooks`: follow its bus (subscribed after its earlier
        listeners), tell it what this holds, ask it for retentions' expiries."""
        self._hooks = hooks
        if hooks.events is not None:
            hooks.events.subscribe(self.listen)

    # -- the tree's bus -----------------------------------------------------------------------

    def listen(self, event: CacheEvent) -> None:
        if event.tier != "ram":
            return
        if isinstance(event, BlocksStored):
            self._stored.extend(event.pages)
            node = event.node
            if node is not None and node.pages:
                parent = node.parent.hashes[-1] if node.parent is not None and node.parent.hashes else None
                for page, block_hash in zip(node.pages, node.hashes):
                    self._blocks[page] = (block_hash, parent)
                    parent = block_hash
                self._mark_ends(node, node.pages)
                if node.parent is not None and node.parent.pages:  # the new leaf parts from its parent there
                    self._mark_ends(node.parent, node.parent.pages)
        elif isinstance(event, BlocksEvicted):
            dropped = [self._blocks[page] for page in event.node.pages if page in self._tree]
            for page in event.node.pages:
                self._drop(page)
                self._blocks.pop(page, None)
            self._tell(dropped, stored=False)
        elif isinstance(event, AllCleared):
            for page in list(self._tree):
                self._drop(page)
            self._end_pages.clear()
            self._end_of.clear()
            self._kept_by.clear()
            self._blocks.clear()

    def _tell(self, blocks: list[tuple[BlockHash, BlockHash | None]], *, stored: bool) -> None:
        if blocks and self._hooks.events:
            self._hooks.events.publish(WindowBlocks(blocks, stored, self.window))

    def _mark_ends(self, node: Node, run: Sequence[int]) -> None:
        """The blocks of the window before the end of a node's run: what a hit at that end needs."""
        for full_page in run[-self._window_blocks :]:
            self._end_pages.add(full_page)
            self._end_of[full_page] = node
            if full_page in self._inner:  # evictable already: it moves to the later tier
                del self._inner[full_page]
                self._ends[full_page] = None

    def take_stored(self) -> set[int]:
        stored, self._stored = set(self._stored), []
        return stored

    def _drop(self, full_page: int) -> None:
        window_page = self._tree.pop(full_page, None)
        if window_page is not None:
            self._unlist(full_page)
            self.pool.release([window_page])
        self._end_pages.discard(full_page)
        self._end_of.pop(full_page, None)
        self._kept.pop(full_page, None)

    def _unlist(self, full_page: int) -> None:
        """No longer evictable (taken, or gone): out of whichever tier it was in."""
        self._inner.pop(full_page, None)
        self._ends.pop(full_page, None)
        key = self._last.pop(full_page, None)
        if key is not None:
            self._last_order.remove((*key, full_page))

    # -- retained cuts ------------------------------------------------------------------------

    def keep(self, retention_id: int, full_pages: Sequence[int], cut_tokens: int) -> None:
        """A retention keeps the prefix over `full_pages` to cut_tokens: the window pages of the
        W tokens before its usable cut go last while it lives (no lock); changes only the order."""
        cut = self.usable_tokens(full_pages, cut_tokens)
        pages = [page for page in full_pages[self.first_block(cut) : cut // self.page_size] if page in self._tree]
        if len(self._kept_by) >= self._sweep_at:  # ended retentions forgotten, amortized
            self._forget_ended()
            self._sweep_at = max(64, 2 * len(self._kept_by))
        self._kept_by[retention_id] = pages
        for page in pages:
            self._kept.setdefault(page, set()).add(retention_id)
            self._rekey(page)

    def _kept_until(self, full_page: int) -> float | None:
        """The latest expiry among the live retentions keeping this page (None: not kept); pure."""
        expiries = (self._hooks.retention_expiry(retention_id) for retention_id in self._kept.get(full_page, ()))
        return max((expiry for expiry in expiries if expiry is not None), default=None)

    def _forget_ended(self) -> None:
        for old in [r for r in self._kept_by if self._hooks.retention_expiry(r) is None]:
            self._forget(old)

    def _forget(self, retention_id: int) -> None:
        for page in self._kept_by.pop(retention_id, ()):
            ids = self._kept.get(page)
            if ids is not None:
                ids.discard(retention_id)
                if not ids:
                    del self._kept[page]
                self._rekey(page)

    def _to_last(self, full_page: int) -> None:
        key = (self._kept_until(full_page) or 0.0, next(self._arrivals))
        self._last[full_page] = key
        self._last_order.add((*key, full_page))

    def _rekey(self, full_page: int) -> None:
        """A page of the last tier whose retentions changed moves to its new expiry."""
        key = self._last.get(full_page)
        if key is None:
            return
        expiry = self._kept_until(full_page) or 0.0
        if key[0] != expiry:
            self._last_order.remove((*key, full_page))
            self._last[full_page] = key = (expiry, key[1])
            self._last_order.add((*key, full_page))

    def kept_pages(self) -> int:
        """Window pages of the tree under a live retention's cut; pure."""
        return sum(1 for page in self._kept if self._kept_until(page) is not None)

    # -- matching -----------------------------------------------------------------------------

    def first_block(self, num_tokens: int) -> int:
        """The first block a query at position num_tokens reads (its window's oldest key)."""
        return max(0, num_tokens - self.window + 1) // self.page_size

    def usable_tokens(self, pages: Sequence[int], num_tokens: int) -> int:
        """The longest block-aligned cut <= num_tokens of a match over `pages` (full pages, in
        order) at which the window before the cut still has its window pages; pure."""
        run = best = 0
        tree, size = self._tree, self.page_size
        for block, page in enumerate(pages[: num_tokens // size]):
            run = run + 1 if page in tree else 0
            end = (block + 1) * size
            if run >= block + 1 - self.first_block(end):
                best = end
        return best

    def num_evictable_in(self, pages: Sequence[int]) -> int:
        """Of these full pages, how many have a window page only the tree holds; pure."""
        return sum(1 for page in pages if page in self._inner or page in self._ends or page in self._last)

    def window_page_of(self, full_page: int) -> int | None:
        """The window page the tree holds for a cached block (its full page), None if dropped; pure."""
        return self._tree.get(full_page)

    @property
    def tree_pages(self) -> int:
        """Window pages the tree holds (shared with sequences or not)."""
        return len(self._tree)

    def held_blocks(self) -> list[BlockHash]:
        """The hashes of the cached blocks whose window KV the tree still holds; pure."""
        return [self._blocks[page][0] for page in self._tree]

    @property
    def evictable_pages(self) -> int:
        return len(self._inner) + len(self._ends) + len(self._last)

    # -- sequences ----------------------------------------------------------------------------

    def hold(self, full_pages: Sequence[int], first: int) -> list[int]:
        """A matched prefix's window table: a reference on the tree's window page of each block
        from `first` on (usable_tokens said they are there), -1 before."""
        table = [-1] * len(full_pages)
        for i in range(first, len(full_pages)):
            page = full_pages[i]
            table[i] = self._take(page)
        return table

    def pin(self, node: object, full_pages: Sequence[int], first: int) -> None:
        """Hold the window pages a pinned prefix needs (hold), until unpin(node)."""
        self._pins.setdefault(id(node), []).append((list(full_pages), self.hold(full_pages, first)))

    def unpin(self, node: object) -> None:
        held = self._pins[id(node)]
        full_pages, table = held.pop()
        if not held:
            del self._pins[id(node)]
        self.release(full_pages, table, 0, len(table))

    def _take(self, full_page: int) -> int:
        window_page = self._tree[full_page]
        self.pool.incref([window_page])
        self._unlist(full_page)
        return window_page

    def allocate(self, num_pages: int) -> list[int] | None:
        """num_pages window pages, evicting tree-only ones if needed; None if short."""
        if self.pool.num_free + self.evictable_pages < num_pages:
            return None  # short whatever goes: nothing is evicted for a refusal
        if self.pool.num_free < num_pages:
            self.evict(num_pages - self.pool.num_free)
        try:
            return self.pool.allocate(num_pages)
        except OutOfPages:
            return None

    def evict(self, num_pages: int) -> int:
        """Free num_pages window pages from what only the tree holds; returns pages freed. The
        window pool's own order (the tree's leaves, with both groups' pages, go by the tree's):
        first the pages of blocks more than a window before any node's end (no hit at a node's
        end, where requests stop or part, reads them), then those in the window before a node's
        end, least recently let go first within each, and last the window a live retention's
        cut needs, earliest expiry first."""
        num_pages = min(num_pages, self.evictable_pages)
        dropped = self._take_tier(self._inner, num_pages)
        ends = self._take_tier(self._ends, num_pages - len(dropped))
        self.num_end_drops += len(ends)
        dropped += ends
        if len(dropped) < num_pages and self._last:
            self._forget_ended()  # a retention released early leaves its pages' keys stale
            ordered = [full_page for _, _, full_page in self._last_order[: num_pages - len(dropped)]]
            for full_page in ordered:
                self._unlist(full_page)
            self.num_end_drops += len(ordered)
            self.num_kept_drops += len(ordered)
            dropped += ordered
        return self._evict_pages(dropped)

    def _take_tier(self, tier: dict[int, None], num_pages: int) -> list[int]:
        """Up to num_pages of a tier's pages, oldest first, taken out of it; a page a live
        retention keeps moves to the last tier instead."""
        taken: list[int] = []
        while len(taken) < num_pages and tier:
            full_page = next(iter(tier))
            del tier[full_page]
            if self._kept_until(full_page) is not None:
                self._to_last(full_page)
            else:
                taken.append(full_page)
        return taken

    def _evict_pages(self, full_pages: list[int]) -> int:
        """Drop the tree's window pages of these blocks (taken out of their tiers); pages freed."""
        lost: dict[int, Node] = {}
        for full_page in full_pages:
            self._kept.pop(full_page, None)
            node = self._end_of.get(full_page)
            if node is not None and not node.children and not node.removed:
                lost[node.node_id] = node
        freed = self.pool.release([self._tree.pop(page) for page in full_pages])
        if self._hooks.end_lost is not None:
            for node in lost.values():
                self._hooks.end_lost(node)
        self._tell([self._blocks[page] for page in full_pages], stored=False)
        return freed

    def release(self, full_pages: Sequence[int], table: list[int], start: int, end: int) -> None:
        """Drop a sequence's references on blocks [start, end) of its window table (set to -1);
        a page the tree then holds alone becomes evictable."""
        for i in range(start, min(end, len(table))):
            window_page = table[i]
            if window_page < 0:
                continue
            table[i] = -1
            self.pool.release([window_page])
            full_page = full_pages[i]
            if self._tree.get(full_page) == window_page and self.pool.refcount(window_page) == 1:
                (self._ends if full_page in self._end_pages else self._inner)[full_page] = None  # kept: met in evict

    def commit(self, full_pages: Sequence[int], table: list[int], start: int, canonical: Sequence[int], stored: set[int]) -> None:
        """After the tree took blocks [start, len(canonical)) of a sequence: where the tree had
        the block already (canonical page differs), use its window page, or give it ours if it
        had dropped its own; where it adopted our page, it takes a reference on our window page."""
        adopted = []
        for i in range(start, len(canonical)):
            page, ours = canonical[i], table[i]
            if page != full_pages[i]:
                if page in self._tree:
                    if ours >= 0:
                        self.pool.release([ours])
                        table[i] = self._take(page)
                elif ours >= 0:
                    adopted.append(self._adopt(page, ours))
            elif page in stored and ours >= 0:
                adopted.append(self._adopt(page, ours))
        self._tell(adopted, stored=True)

    def _adopt(self, full_page: int, window_page: int) -> tuple[BlockHash, BlockHash | None]:
        self._tree[full_page] = window_page
        self.pool.incref([window_page])
        return self._blocks[full_page]

    # -- checks -------------------------------------------------------------------------------

    def check_accounting(self, tables: Sequence[Sequence[int]], cached_full_pages: set[int]) -> None:
        """free + evictable + in use == total; every refcount is the tree's and the sequences'."""
        assert set(self._tree) <= cached_full_pages, "a window page kept for a block the tree no longer caches"
        assert set(self._kept) <= set(self._tree), "a retained cut's page the tree dropped"
        assert set(self._blocks) == cached_full_pages, "every cached block's hash known"
        expected = [0] * self.pool.num_pages
        for window_page in self._tree.values():
            expected[window_page] += 1
        pinned = [table for held in self._pins.values() for _, table in held]
        for table in (*tables, *pinned):
            for window_page in table:
                if window_page >= 0:
                    expected[window_page] += 1
        actual = self.pool.refcounts()
        if list(actual) != expected:
            page = next(p for p in range(self.pool.num_pages) if actual[p] != expected[p])
            raise AssertionError(f"window page {page}: refcount {actual[page]}, expected {expected[page]}")
        evictable = {self._tree[p] for p in (*self._inner, *self._ends, *self._last)}
        assert len(evictable) == self.evictable_pages and all(expected[w] == 1 for w in evictable)
        only_tree = {w for w in self._tree.values() if expected[w] == 1}
        assert only_tree == evictable, "a window page only the tree holds is not evictable"
        free = self.pool.free_pages()
        assert not free & evictable
        in_use = sum(1 for count in expected if count) - len(evictable)
        assert len(free) + len(evictable) + in_use == self.pool.num_pages
