"""Layer groups in the KV pool (DESIGN.md (d)): which layers keep every token's KV (full) and which
only the last W tokens (window), and WindowPages, the window layers' own page pool with its book
of which tree blocks still hold their window KV and which of those may go first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from radixkv.cache.events import AllCleared, BlocksEvicted, BlocksStored, CacheEvent
from radixkv.cache.pages import OutOfPages, PagePool

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


class WindowPages:
    """The window layers' pages. A running sequence holds one reference on the window page of
    each block in its window (SequenceState.window_table); the tree one on the window page of a
    cached block (keyed by the block's full page) until it drops it. A window page only the tree
    holds is evictable: blocks inside a node's run first, then blocks that end a node (where a
    request stopped or a later one parted: the cuts a later hit needs), least recently let go
    first within each. Dropping one leaves the tree's full block: a match then stops where a
    window lacks pages (usable_tokens)."""

    def __init__(self, pool: PagePool, window: int) -> None:
        self.pool = pool
        self.window = window
        self.page_size = pool.page_size
        self._tree: dict[int, int] = {}  # the tree's full page -> its window page
        # Full pages whose window page only the tree holds, least recently let go first:
        # inside a node's run, then those ending a node (a branch point or a leaf's end, where
        # requests are known to stop or part: the cuts a later match needs).
        self._inner: dict[int, None] = {}
        self._ends: dict[int, None] = {}
        self._end_pages: set[int] = set()  # full pages that end a tree node
        self._stored: list[int] = []  # full pages the tree adopted since take_stored
        # Pins (KVManager.pin): by the pinned node's identity, the (full pages, window table)
        # each pin of it holds, so a pinned prefix keeps its last window too.
        self._pins: dict[int, list[tuple[list[int], list[int]]]] = {}

    # -- the tree's bus -----------------------------------------------------------------------

    def listen(self, event: CacheEvent) -> None:
        if event.tier != "ram":
            return
        if isinstance(event, BlocksStored):
            self._stored.extend(event.pages)
            node = event.node
            if node is not None and node.pages:
                self._mark_end(node.pages[-1])
                if node.parent is not None and node.parent.pages:  # the new leaf parts from its parent there
                    self._mark_end(node.parent.pages[-1])
        elif isinstance(event, BlocksEvicted):
            for page in event.node.pages:
                self._drop(page)
        elif isinstance(event, AllCleared):
            for page in list(self._tree):
                self._drop(page)
            self._end_pages.clear()

    def _mark_end(self, full_page: int) -> None:
        self._end_pages.add(full_page)
        if full_page in self._inner:  # evictable already: it moves to the later tier
            del self._inner[full_page]
            self._ends[full_page] = None

    def take_stored(self) -> set[int]:
        stored, self._stored = set(self._stored), []
        return stored

    def _drop(self, full_page: int) -> None:
        window_page = self._tree.pop(full_page, None)
        if window_page is not None:
            self._inner.pop(full_page, None)
            self._ends.pop(full_page, None)
            self.pool.release([window_page])
        self._end_pages.discard(full_page)

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
        return sum(1 for page in pages if page in self._inner or page in self._ends)

    @property
    def evictable_pages(self) -> int:
        return len(self._inner) + len(self._ends)

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
        self._inner.pop(full_page, None)
        self._ends.pop(full_page, None)
        return window_page

    def allocate(self, num_pages: int) -> list[int] | None:
        """num_pages window pages, evicting tree-only ones if needed; None if short."""
        if self.pool.num_free < num_pages:
            self.evict(num_pages - self.pool.num_free)
        try:
            return self.pool.allocate(num_pages)
        except OutOfPages:
            return None

    def evict(self, num_pages: int) -> int:
        """Drop the tree's window pages, passed ones first; returns pages freed."""
        freed = 0
        for tier in (self._inner, self._ends):
            while freed < num_pages and tier:
                full_page = next(iter(tier))
                del tier[full_page]
                freed += self.pool.release([self._tree.pop(full_page)])
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
                (self._ends if full_page in self._end_pages else self._inner)[full_page] = None

    def commit(self, full_pages: Sequence[int], table: list[int], start: int, canonical: Sequence[int], stored: set[int]) -> None:
        """After the tree took blocks [start, len(canonical)) of a sequence: where the tree had
        the block already (canonical page differs), use its window page, or give it ours if it
        had dropped its own; where it adopted our page, it takes a reference on our window page."""
        for i in range(start, len(canonical)):
            page, ours = canonical[i], table[i]
            if page != full_pages[i]:
                if page in self._tree:
                    if ours >= 0:
                        self.pool.release([ours])
                        table[i] = self._take(page)
                elif ours >= 0:
                    self._adopt(page, ours)
            elif page in stored and ours >= 0:
                self._adopt(page, ours)

    def _adopt(self, full_page: int, window_page: int) -> None:
        self._tree[full_page] = window_page
        self.pool.incref([window_page])

    # -- checks -------------------------------------------------------------------------------

    def check_accounting(self, tables: Sequence[Sequence[int]], cached_full_pages: set[int]) -> None:
        """free + evictable + in use == total; every refcount is the tree's and the sequences'."""
        assert set(self._tree) <= cached_full_pages, "a window page kept for a block the tree no longer caches"
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
        evictable = {self._tree[p] for p in (*self._inner, *self._ends)}
        assert len(evictable) == self.evictable_pages and all(expected[w] == 1 for w in evictable)
        only_tree = {w for w in self._tree.values() if expected[w] == 1}
        assert only_tree == evictable, "a window page only the tree holds is not evictable"
        free = self.pool.free_pages()
        assert not free & evictable
        in_use = sum(1 for count in expected if count) - len(evictable)
        assert len(free) + len(evictable) + in_use == self.pool.num_pages
