"""The bridge between sequences and the prefix cache: pages in, pages out, blocks shared. A
running sequence holds a pool reference on each page of its table and locks its deepest cached
node; only this module moves them. Admit and reserve extend a match from disk (its DiskLoader);
residency, the ghost index and the write-back follow the cache through its bus (cache/events.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from radixkv.cache.disk import DiskTier
from radixkv.cache.eviction import Liveness
from radixkv.cache.hashing import BlockHasher
from radixkv.cache.layer_groups import WindowHooks, WindowPages
from radixkv.cache.pages import OutOfPages, PagePool
from radixkv.cache.radix import PeekResult, RadixTree
from radixkv.cache.radix_node import MatchResult, path_pages
from radixkv.engine.cache_report import AdmissionMatch
from radixkv.engine.cache_view import CacheView
from radixkv.engine.disk_loader import ComputeEstimate, DiskLoader
from radixkv.engine.kv_keeps import KVKeeps
from radixkv.engine.request import Admitted, SequenceState

_Found = TypeVar("_Found", bound=PeekResult | MatchResult)


class KVManager(KVKeeps):
    """What the scheduler asks of the cache, in seven verbs: peek, can_admit, load_ready,
    admit, reserve, release, block_hashes. The engine adds commit, pins, retain and mark; its
    whole-cache reports (lookup, flush, close, residency, disk stats) go to the CacheView this
    builds over its parts (`cache_view`, engine/cache_view.py)."""

    def __init__(
        self,
        pool: PagePool,
        tree: RadixTree,
        hasher: BlockHasher,
        enable_prefix_caching: bool,
        disk: DiskTier | None = None,
        compute_s: ComputeEstimate = lambda start, num: None,
        prefetch_bytes: int = 256 << 20,
        max_retained_pages_per_owner: int | None = None,
        max_ghost_blocks: int | None = None,
        windows: WindowPages | None = None,
    ) -> None:
        # Nothing here is read from outside: callers use the verbs below.
        self._pool = pool
        self._tree = tree
        self._hasher = hasher
        self._page_size = pool.page_size
        self._caching = enable_prefix_caching
        # The window layers' pages (cache/layer_groups.py), None for a model of one group.
        self._windows = windows
        self._loader: DiskLoader | None = None
        if disk is not None and enable_prefix_caching:
            self._loader = DiskLoader(
                disk, pool, tree, commit=self.commit, peek_tokens=lambda seq: self.peek(seq).num_cached_tokens,
                retain_prefix=self._retain_prefix, compute_s=compute_s, prefetch_bytes=prefetch_bytes,
                max_retained_pages_per_owner=max_retained_pages_per_owner, windows=windows,
            )
        # One bus in an engine (the tree's, handed to its disk tier); a tier built apart has its own.
        buses = [tree.events] if disk is None or disk.events is tree.events else [tree.events, disk.events]
        self._view = CacheView.listening(tree, pool, hasher, self._loader, enable_prefix_caching, buses, max_ghost_blocks, windows)
        self._residency, self._misses = self._view.ram_residency, self._view.misses
        if windows is not None:
            # After the write-back: an evicted block's window pages are written with it first.
            # A leaf whose end lost its window KV holds full pages no hit there reads (priced in
            # bytes, its full pages are worth nothing to a request that comes back): first to go.
            windows.connect(WindowHooks(
                tree.events,
                retention_expiry=lambda retention_id: getattr(tree.retention(retention_id), "expires_at_s", None),
                end_lost=lambda node: self.mark(node, Liveness.DEAD, below_blocks=path_pages(node) - len(node.pages)),
            ))

    def cache_view(self) -> CacheView:
        """The whole cache over these same parts, for reports and flush/close (the engine holds it)."""
        return self._view

    # -- the scheduler's verbs ---------------------------------------------------------------

    def block_hashes(self, seq: SequenceState, start_token: int = 0) -> list[int]:
        """The hashes of seq's full blocks from the one holding `start_token` on (none without
        prefix caching): what the scheduler compares to put off a request a step."""
        return self._hashes(seq)[start_token // self._page_size :] if self._caching else []

    def peek(self, seq: SequenceState) -> PeekResult:
        """What RAM would serve seq now; pure (no split, no LRU time, no stats)."""
        if not self._caching or seq.num_tokens <= self._page_size:
            return PeekResult(0, [], 0)
        return self._within_windows(seq, lambda tokens, hashes: self._tree.peek(tokens, seq.salt, block_hashes=hashes))

    def _within_windows(self, seq: SequenceState, find: Callable[[list[int], list[int]], _Found]) -> _Found:
        """find(tokens, hashes) over seq, found again up to the cut where every group still holds
        what continuing needs (window layers: the W tokens before it) when the first stops later."""
        hashes, tokens = self._hashes(seq), seq.all_token_ids
        found = find(tokens, hashes)
        if self._windows is None:
            return found
        cut = self._windows.usable_tokens(found.pages, found.num_cached_tokens)
        return found if cut == found.num_cached_tokens else find(tokens[: cut + 1], hashes[: cut // self._page_size])

    def can_admit(self, peek: PeekResult, num_new_tokens: int, headroom_pages: int = 0) -> bool:
        """Whether the pages for the first num_new_tokens past peek's match, plus
        `headroom_pages`, can be had once the match is locked (free pages and what eviction
        could free outside it); pure."""
        num_cached = peek.num_cached_tokens
        needed = -(-(num_cached + num_new_tokens) // self._page_size) - num_cached // self._page_size
        available = self._pool.num_free + self._tree.evictable_pages  # free, or freed by eviction
        if needed + headroom_pages > available - peek.num_unlocked_pages:
            return False
        windows = self._windows
        if windows is None:
            return True
        held = windows.num_evictable_in(peek.pages[windows.first_block(num_cached) :])
        return needed + headroom_pages + held <= windows.pool.num_free + windows.evictable_pages

    def load_ready(self, seq: SequenceState, chunk_tokens: int) -> bool:
        """For a waiting sequence: whether its first chunk can be admitted without waiting on a
        read (True without a disk tier); starts reading its disk hit in the background if not."""
        return self._loader is None or self._loader.ready(seq, chunk_tokens)

    def admit(self, seq: SequenceState, num_new_tokens: int) -> Admitted:
        """Match seq, lock the match, take a reference on its pages; load the blocks that follow
        from the disk tier, as many as lie in the first num_new_tokens past the match (never the
        block of the last token, whose logits are needed); then allocate pages for the rest of
        the chunk unless the hit goes on past it. Call it after can_admit: nothing is undone."""
        assert not seq.page_table and seq.tree_node is None
        num_ram_tokens = self._lock_match(seq) if self._caching else 0
        loader, reporting = self._loader, seq.makes_cache_report
        # What the disk held past the RAM match, counted before loading takes it.
        held = loader.held_blocks(seq, num_ram_tokens // self._page_size) if reporting and loader is not None else 0
        if loader is not None:
            loader.load(seq, num_new_tokens // self._page_size)
        if reporting:
            self._report(seq, AdmissionMatch(num_ram_tokens, held, loader is not None and loader.read_skipped(seq)))
        admitted = self._admitted(seq, seq.num_computed_tokens - num_ram_tokens)
        rest = 0 if admitted.more_to_load else num_new_tokens - admitted.num_loaded_tokens
        reserved = self._allocate(seq, rest)
        assert reserved, "can_admit counted these pages a moment ago"
        if seq.first_run:
            seq.num_cached_tokens = seq.num_computed_tokens
        return admitted

    def reserve(self, seq: SequenceState, num_new_tokens: int) -> Admitted | None:
        """Give running seq what its next num_new_tokens need: the blocks its disk hit covers
        are loaded, pages allocated for the rest (evicting if needed) unless the hit goes on
        past them. None when short of pages (what was loaded stays: num_computed_tokens says)."""
        loaded = self._loader.continue_load(seq, num_new_tokens) if self._loader is not None else 0
        if seq.first_run:
            seq.num_cached_tokens += loaded  # served by the cache, as at admission
        admitted = self._admitted(seq, loaded)
        if not admitted.more_to_load and not self._allocate(seq, num_new_tokens - loaded):
            return None
        return admitted

    def release(self, seq: SequenceState) -> None:
        """Give back everything seq holds: its lock, its disk read and one reference on each of
        its pages."""
        if seq.tree_node is not None:
            self._tree.unlock(seq.tree_node)
            seq.tree_node = None
        if self._loader is not None:
            self._loader.forget(seq)
        if self._caching and seq.num_computed_tokens:
            self._misses.remember_tail(seq.all_token_ids, seq.salt, self._hashes(seq), seq.num_computed_tokens)
        if self._windows is not None:
            self._windows.release(seq.page_table, seq.window_table, seq.window_floor, len(seq.window_table))
            seq.window_table, seq.window_floor = [], 0
        self._pool.release(seq.page_table)
        seq.page_table = []
        seq.num_tree_blocks = 0
        seq.num_computed_tokens = 0

    def _lock_match(self, seq: SequenceState) -> int:
        """Match seq in RAM, lock the match and take a reference on its pages; its tokens."""
        match = self._within_windows(seq, lambda tokens, hashes: self._tree.match(tokens, seq.salt, block_hashes=hashes, record=False))
        self._tree.lock(match.node)
        self._tree.record_lookup(seq.num_tokens, match.num_cached_tokens)
        self._pool.incref(match.pages)
        self._residency.hit_pages(match.pages, time.monotonic())
        seq.tree_node = match.node
        seq.page_table = list(match.pages)
        seq.num_tree_blocks = len(match.pages)
        seq.num_computed_tokens = match.num_cached_tokens
        if self._windows is not None:
            seq.window_floor = self._windows.first_block(match.num_cached_tokens)
            seq.window_table = self._windows.hold(match.pages, seq.window_floor)
        return match.num_cached_tokens

    def _report(self, seq: SequenceState, match: AdmissionMatch) -> None:
        """seq's cache report, from what admission gave it (its RAM match, the disk's blocks
        after it, read or skipped as slower); counted by reason."""
        loader = self._loader
        seq.cache_report = self._misses.explain(
            seq.prompt_token_ids, seq.salt, self._hashes(seq) if self._caching else [], match,
            (lambda block: loader.disk_key(seq, block)) if loader is not None else (lambda block: None), seq.sibling_salts,
        )

    def _admitted(self, seq: SequenceState, num_loaded_tokens: int) -> Admitted:
        more = bool(num_loaded_tokens) and self._loader is not None and self._loader.loading(seq)
        return Admitted(seq.num_computed_tokens, num_loaded_tokens, more)

    def _hashes(self, seq: SequenceState) -> list[int]:
        """seq.block_hashes, extended to every full block of its tokens (chained, incremental)."""
        return self._hasher.extend(seq.block_hashes, seq.all_token_ids, seq.salt)

    def _allocate(self, seq: SequenceState, num_new_tokens: int) -> bool:
        """Pages for num_new_tokens more tokens of seq, evicting if needed; False if short.
        Window pages behind seq's next query go back first."""
        windows = self._windows
        self._release_behind(seq)
        needed = max(0, -(-(seq.num_computed_tokens + num_new_tokens) // self._page_size) - len(seq.page_table))
        if needed == 0:
            return True
        if self._pool.num_free < needed:
            self._tree.evict(needed - self._pool.num_free)
        window_pages = windows.allocate(needed) if windows is not None else []
        if window_pages is None:
            return False
        try:
            seq.page_table.extend(self._pool.allocate(needed))
        except OutOfPages:
            if windows is not None:
                windows.pool.release(window_pages)
            return False
        seq.window_table.extend(window_pages)
        return True

    def _release_behind(self, seq: SequenceState) -> None:
        """Give back seq's window pages of blocks its next query no longer reads."""
        if self._windows is not None:
            floor = self._windows.first_block(seq.num_computed_tokens)
            self._windows.release(seq.page_table, seq.window_table, seq.window_floor, floor)
            seq.window_floor = max(seq.window_floor, floor)

    # -- after a step ------------------------------------------------------------------------

    def commit(self, seq: SequenceState) -> None:
        """Offer seq's newly computed full blocks to the tree; adopt the tree's duplicates;
        then give back the window pages the step left behind (the tree keeps its own)."""
        num_full = seq.num_computed_tokens // self._page_size
        if self._caching and num_full > seq.num_tree_blocks:
            self._insert(seq, num_full)
        self._release_behind(seq)

    def _insert(self, seq: SequenceState, num_full: int) -> None:
        hashes = self._hashes(seq)
        tokens = seq.all_token_ids[: num_full * self._page_size]
        # The blocks it inserts reach residency and the ghost index through the bus (BlocksStored).
        result = self._tree.insert(tokens, seq.page_table[:num_full], seq.salt, block_hashes=hashes[:num_full])
        if self._windows is not None:
            stored = self._windows.take_stored()
            self._windows.commit(seq.page_table, seq.window_table, seq.num_tree_blocks, result.pages, stored)
        # Blocks another sequence cached first: drop our copy and point at the tree's page,
        # so no page table keeps a page the pool may hand out again.
        for i in range(result.num_existing_blocks):
            canonical = result.pages[i]
            if seq.page_table[i] != canonical:
                self._pool.incref([canonical])
                self._pool.release([seq.page_table[i]])
                seq.page_table[i] = canonical
        self._tree.lock(result.node)
        if seq.tree_node is not None:
            self._tree.unlock(seq.tree_node)
        seq.tree_node = result.node
        # Blocks a hash collision kept out of the tree stay private; they are not offered again.
        seq.num_tree_blocks = num_full
