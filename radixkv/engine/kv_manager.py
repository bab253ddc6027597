"""The bridge between sequences and the prefix cache: pages in, pages out, blocks shared.

A running sequence holds one pool reference on every page of its page table and locks the
deepest tree node covering its cached blocks; this module is the only place that moves them,
between RAM and the disk tier too: blocks the tree evicts are written back there, and a match
that runs out in RAM continues there, the hit blocks read ahead on a background thread
(DiskPrefetcher) and loaded into pages chunk by chunk. It also keeps the RAM tier's residency.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from radixkv.cache.disk import DiskTier
from radixkv.cache.disk_prefetch import DiskPrefetcher
from radixkv.cache.hashing import BlockHasher
from radixkv.cache.pages import OutOfPages, PagePool
from radixkv.cache.radix import Node, PeekResult, RadixTree, path_tokens
from radixkv.cache.residency import Residency, TierResidency
from radixkv.engine.request import SequenceState

# (start token, number of tokens) -> seconds to compute them, None until measured
ComputeEstimate = Callable[[int, int], "float | None"]


class KVManager:
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
    ) -> None:
        self.pool = pool
        self.tree = tree
        self.hasher = hasher
        self.page_size = pool.page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.disk = disk if enable_prefix_caching else None
        self.compute_s = compute_s
        self.max_retained_pages_per_owner = max_retained_pages_per_owner  # for retentions found on disk
        self.prefetcher = DiskPrefetcher(self.disk, prefetch_bytes) if self.disk is not None else None
        self._disk_keys: dict[int, list[int]] = {}  # seq id -> disk keys of its blocks (a token to spare)
        self._recompute: set[int] = set()  # seq ids whose disk hit is computed: reading is the slower
        # The RAM tier's residency, per page (a page holds one cached block at a time):
        # when it entered the tree, when it last served a hit, whether it was ever retained.
        self.ram_residency = Residency()
        self._page_born_s = [0.0] * pool.num_pages
        self._page_used_s = [0.0] * pool.num_pages
        self._page_retained = [False] * pool.num_pages
        self._flushing = False
        self._write_back = self.disk is not None
        # Write-back: a block reaches the disk when RAM gives it up (or at close), not when it is
        # computed; most computed blocks are private tails never asked for again, and writing
        # each of them through would spend the disk's bandwidth and budget on them. Retained
        # prefixes are written through at retain time (retain()).
        self._next_on_evict = tree.on_evict
        tree.on_evict = self._on_evict

    # -- hashing -----------------------------------------------------------------------------

    def update_block_hashes(self, seq: SequenceState) -> list[int]:
        """Extend seq.block_hashes to every full block of its tokens (chained, incremental)."""
        num_full = seq.num_tokens // self.page_size
        if len(seq.block_hashes) < num_full:
            start = len(seq.block_hashes) * self.page_size
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = seq.all_token_ids[start : num_full * self.page_size]
            seq.block_hashes.extend(self.hasher.hash_blocks(tokens, seq.salt, parent=parent))
        return seq.block_hashes

    # -- admission ---------------------------------------------------------------------------

    def peek(self, token_ids: list[int], salt: str | None, block_hashes: list[int] | None = None) -> PeekResult:
        """What a match would serve now, changing nothing (no split, no LRU time, no stats)."""
        if not self.enable_prefix_caching:
            return PeekResult(0, [], 0)
        return self.tree.peek(token_ids, salt, block_hashes=block_hashes)

    def peek_seq(self, seq: SequenceState) -> PeekResult:
        """What the cache would serve seq now; a pure lookup (scheduling order, admission checks)."""
        if not self.enable_prefix_caching or seq.num_tokens <= self.page_size:
            return PeekResult(0, [], 0)
        return self.peek(seq.all_token_ids, seq.salt, self.update_block_hashes(seq))

    def pages_to_admit(self, peek: PeekResult, num_new_tokens: int) -> tuple[int, int]:
        """(pages a sequence needs for its first num_new_tokens past its cached prefix, pages
        that can be had once that prefix is locked: free ones plus what eviction could free)."""
        num_cached = peek.num_cached_tokens
        needed = -(-(num_cached + num_new_tokens) // self.page_size) - num_cached // self.page_size
        return needed, self.available_pages() - peek.num_unlocked_pages

    def admit(self, seq: SequenceState, max_new_tokens: int | None = None) -> int:
        """Match seq, lock the match and take a reference on its pages; then, with a disk tier,
        load the blocks that follow from disk, as many as lie inside the first
        `max_new_tokens` past the match (so the pages the admission check counted for computing
        them serve instead; never the block of the last token, whose logits are needed).
        Returns cached tokens, RAM and disk. Call it after the check (pages_to_admit): nothing
        here is undone."""
        assert not seq.page_table and seq.tree_node is None
        if not self.enable_prefix_caching:
            return 0
        match = self.tree.match(seq.all_token_ids, seq.salt, block_hashes=self.update_block_hashes(seq), record=False)
        self.tree.lock(match.node)
        self.tree.record_lookup(seq.num_tokens, match.num_cached_tokens)
        self.pool.incref(match.pages)
        self._ram_hits(match.pages)
        seq.tree_node = match.node
        seq.page_table = list(match.pages)
        seq.num_tree_blocks = len(match.pages)
        seq.num_computed_tokens = match.num_cached_tokens
        if self.disk is not None and max_new_tokens is not None:
            self._load_from_disk(seq, max_new_tokens // self.page_size)
        return seq.num_computed_tokens

    def _ram_hits(self, pages: list[int]) -> None:
        now_s = time.monotonic()
        used = self._page_used_s
        for page in pages:
            self.ram_residency.hit(now_s - used[page])
            used[page] = now_s

    # -- the disk tier -----------------------------------------------------------------------

    def prefetch(self, seq: SequenceState, chunk_tokens: int) -> bool:
        """For a waiting sequence: start reading its disk hit (the blocks right after its RAM
        match) on the background thread, unless computing them is the faster; returns whether
        its first chunk's blocks are read (or there are none to wait for), so the scheduler can
        admit it now or let other work compute while the disk is read."""
        if self.prefetcher is None or not self.disk.enabled or seq.seq_id in self._recompute:
            return True
        ps = self.page_size
        chunk_blocks = max(1, (chunk_tokens - 1) // ps)
        if self.prefetcher.get(seq.seq_id) is None:
            start = self.peek_seq(seq).num_cached_tokens // ps
            if self._start_prefetch(seq, start, min_blocks=0) is None:
                return True
        return self.prefetcher.ready(seq.seq_id, chunk_blocks)

    def loading(self, seq: SequenceState) -> bool:
        """Whether seq's disk hit goes on past what it has loaded (its next chunk loads on)."""
        return self.prefetcher is not None and self.prefetcher.get(seq.seq_id) is not None

    def continue_from_disk(self, seq: SequenceState, num_new_tokens: int) -> int:
        """For a sequence whose disk hit ran past its last chunk: load the blocks inside its
        next `num_new_tokens` from disk; returns the tokens loaded."""
        ps = self.page_size
        if self.prefetcher is None or self.prefetcher.get(seq.seq_id) is None:
            return 0
        if seq.num_computed_tokens % ps or len(seq.page_table) * ps != seq.num_computed_tokens:
            self.prefetcher.cancel(seq.seq_id)  # the chunk ended inside a block: the rest is computed
            return 0
        before = seq.num_computed_tokens
        self._load_from_disk(seq, num_new_tokens // ps)
        return seq.num_computed_tokens - before

    def _disk_keys_of(self, seq: SequenceState) -> tuple[list[int], int]:
        """The disk keys of seq's blocks up to the last full one before its last token, and
        how many blocks that is (cached per sequence: its prompt does not change)."""
        assert self.disk is not None
        end = (seq.num_tokens - 1) // self.page_size  # a token left to compute
        keys = self._disk_keys.get(seq.seq_id)
        if keys is None or len(keys) < end:
            keys = self.disk.keys(seq.all_token_ids[: end * self.page_size], seq.salt)
            self._disk_keys[seq.seq_id] = keys
        return keys, end

    def _start_prefetch(self, seq: SequenceState, start: int, min_blocks: int) -> bool | None:
        """Begin reading seq's disk run from block `start` (as much as the prefetch budget
        holds, at least `min_blocks`); None when there is none, or it is computed instead."""
        assert self.disk is not None and self.prefetcher is not None
        keys, end = self._disk_keys_of(seq)
        found = self.disk.count_cached(keys, start, end - start)  # touched: evictions spare them
        if found == 0:
            return None
        if not self._disk_pays(start, found):
            self._recompute.add(seq.seq_id)
            return None
        num = min(found, max(min_blocks, self.prefetcher.room_blocks()))
        if num == 0:
            return None
        self.prefetcher.start(seq.seq_id, seq.all_token_ids, seq.salt, keys, start, num, start + found)
        return True

    def _load_from_disk(self, seq: SequenceState, max_blocks: int) -> None:
        """Continue seq's match on disk: take up to `max_blocks` following blocks from its
        prefetch (starting one now if there is none: this chunk waits for its read, the next
        ones are read while it computes), load them into new pages, insert them into the tree
        and lock them as seq's (through commit)."""
        assert self.disk is not None and self.prefetcher is not None
        ps = self.page_size
        start = len(seq.page_table)
        limit = min(max_blocks, (seq.num_tokens - 1) // ps - start)
        if limit <= 0 or not self.disk.enabled or seq.seq_id in self._recompute:
            return
        prefetch = self.prefetcher.get(seq.seq_id)
        if prefetch is not None and prefetch.next_block != start:
            # RAM gained or lost blocks since the read began: read again from where it is now.
            self.prefetcher.cancel(seq.seq_id)
            prefetch = None
        if prefetch is None:
            if self._start_prefetch(seq, start, min_blocks=limit) is None:
                return
            prefetch = self.prefetcher.get(seq.seq_id)
            assert prefetch is not None
        keys, _ = self._disk_keys_of(seq)
        taken = self.prefetcher.take(seq.seq_id, limit)
        num = len(taken.payloads)
        if self.pool.num_free < num:
            self.tree.evict(num - self.pool.num_free)  # seq's match is locked: not its pages
        pages = self.pool.allocate(min(num, self.pool.num_free))
        used = len(pages)
        if used < num:
            self.prefetcher.cancel(seq.seq_id)  # no page for the rest: computed instead
        self.pool.load_pages(pages, taken.payloads[:used])
        self.disk.accept(
            keys,
            start,
            used,
            read_s_per_block=taken.read_s_per_block,
            failure=taken.failure if used == num else None,
            prefetched=taken.num_ready >= used,
        )
        if not used:
            return
        seq.page_table.extend(pages)
        seq.num_computed_tokens = (start + used) * ps
        self.commit(seq)
        self._retain_as_on_disk(seq, keys, start + used)
        if used == num and taken.failure is None and self.prefetcher.get(seq.seq_id) is None:
            if prefetch.end_block == start + used < prefetch.run_end_block:
                # The budget cut the read short of the run: read the next part while this chunk
                # computes (at least a chunk's worth, so a long hit never falls back to compute).
                self._start_prefetch(seq, start + used, min_blocks=limit)

    def _retain_as_on_disk(self, seq: SequenceState, keys: list[int], num_blocks: int) -> None:
        """Blocks that came back from disk under a live retention (one a previous process made,
        say) are retained in RAM again, until the same time: retention holds in both tiers. The
        owner is known there only by a digest, so it counts as its own owner in RAM's cap."""
        assert self.disk is not None
        for block in range(num_blocks - 1, -1, -1):  # a retention covers a prefix: the deepest says it all
            retention = self.disk.retention(keys[block])
            if retention is None:
                continue
            ttl_s = retention.expires_at_s - time.time()
            cap = self.max_retained_pages_per_owner
            if ttl_s > 0 and (cap is None or cap > 0):
                prefix = seq.all_token_ids[: (block + 1) * self.page_size]
                match = self.tree.match(prefix + [0], seq.salt, record=False)
                for page in match.pages[: self.tree.retain(match.node, ttl_s, f"disk:{retention.owner}", cap)]:
                    self._page_retained[page] = True
            return

    def _disk_pays(self, start_block: int, num_blocks: int) -> bool:
        """Whether reading blocks [start_block, start_block + num_blocks) beats computing them.
        Reading costs the same per block wherever it lies (read_s_per_block, measured on the
        loads so far); computing a block costs more the deeper it lies, attention reading the
        whole prefix (the engine's fitted cost at those positions). Either unmeasured: read,
        which measures it."""
        assert self.disk is not None
        ps = self.page_size
        read_s = self.disk.read_s_per_block
        compute_s = self.compute_s(start_block * ps, num_blocks * ps)
        if read_s is None or compute_s is None or read_s * num_blocks < compute_s:
            return True
        self.disk.counters["computed_instead"] += 1
        return False

    def _on_evict(self, node: Node) -> None:
        """The tree is evicting `node` (its pages still hold the KV): count why and how long
        its blocks stayed, and keep them on disk (write-back)."""
        now_s = time.monotonic()
        if self._flushing:
            reason = "flush"
        elif node.retains:
            reason = "retained"
        elif any(self._page_retained[page] for page in node.pages):
            reason = "retention_expired"
        else:
            reason = "capacity"
        for page in node.pages:
            self.ram_residency.evicted_block(reason, now_s - self._page_born_s[page])
            self._page_retained[page] = False
        if self._write_back:
            self._save_node(node)
        if self._next_on_evict is not None:
            self._next_on_evict(node)

    def _save_node(self, node: Node) -> int:
        disk = self.disk
        assert disk is not None
        if not disk.enabled:
            return 0
        tokens = path_tokens(node)
        first = len(tokens) // self.page_size - len(node.pages)
        keys = disk.keys(tokens, node.salt)
        pages = node.pages
        expires_at_s, owner = self._disk_retention(node)
        # Queued to the tier's writer thread: the step loop copies the pages' bytes, no more.
        return disk.save(
            tokens, node.salt, keys, first, len(pages), lambda i: self.pool.page_bytes(pages[i]),
            retention_expires_at_s=expires_at_s, owner=owner, wait=False,
        )

    def _disk_retention(self, node: Node) -> tuple[float, str | None]:
        """(wall-clock expiry, owner) of the retention on `node` that ends last, (0, None) if
        none: the disk keeps retentions on the wall clock, which a restart shares."""
        if not node.retains:
            return 0.0, None
        retention_id, expires_at_s = max(node.retains.items(), key=lambda item: item[1])
        retention = self.tree.retention(retention_id)
        return time.time() + (expires_at_s - self.tree.now_s()), retention.owner if retention is not None else None

    def lookup(self, token_ids: list[int], salt: str | None) -> tuple[int, int]:
        """(tokens of the prompt's full blocks cached in RAM, tokens cached on disk right after
        them), changing nothing: no LRU time, no hit counted, no file read."""
        if not self.enable_prefix_caching:
            return 0, 0
        tokens = list(token_ids)
        # As in pin: one more token lets peek count every full block of the prompt itself.
        ram = self.tree.peek(tokens + [0], salt).num_cached_tokens
        if self.disk is None:
            return ram, 0
        ps = self.page_size
        num_full = len(tokens) // ps
        keys = self.disk.keys(tokens[: num_full * ps], salt)
        return ram, self.disk.count_cached(keys, ram // ps, num_full - ram // ps, touch=False) * ps

    def flush(self, ram: bool, disk: bool) -> tuple[int, int]:
        """Drop what the cache holds: every unlocked RAM page (pages in use by requests or pins
        stay), every disk block. Returns (pages freed, blocks deleted). Flushing both drops RAM
        first without writing it back; RAM alone is written back as by any eviction."""
        pages = blocks = 0
        if ram:
            write_back, self._write_back = self._write_back, self._write_back and not disk
            self._flushing = True
            try:
                pages = self.tree.evict(self.tree.evictable_pages)
            finally:
                self._write_back, self._flushing = write_back, False
        if disk and self.disk is not None:
            blocks = self.disk.flush()
        return pages, blocks

    def persist(self) -> int:
        """Write every block cached in RAM to the disk tier (at close, so a restart finds what
        this process had); returns blocks written."""
        if self.disk is None:
            return 0
        written = sum(self._save_node(node) for node in self.tree.iter_nodes())
        self.disk.drain()
        self.disk.write_manifest()
        return written

    def residency(self) -> dict[str, TierResidency]:
        """Per tier ("ram", "disk" with a disk tier): hits, what it holds, evictions by reason,
        block lifetime and reuse gap histograms."""
        cached = self.tree.cached_pages
        tiers = {"ram": self.ram_residency.snapshot(cached, cached * self.pool.page_nbytes)}
        if self.disk is not None:
            tiers["disk"] = self.disk.residency_stats()
        return tiers

    def close(self) -> int:
        """Stop the background reads, write every block cached in RAM to the disk tier and close
        it (its directory is the next process's); returns blocks written. The engine stays
        usable, without the disk tier."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        written = self.persist()
        if self.disk is not None:
            self.disk.close()
        return written

    # -- pins --------------------------------------------------------------------------------

    def pin(self, prefix_token_ids: list[int], salt: str | None) -> tuple[Node, int]:
        """Lock the cached full blocks of a prefix; (the node to unpin, tokens pinned)."""
        # match() leaves the last token to compute; one more token lets it return every full
        # block of the prefix itself (a partial block never matches).
        match = self.tree.match(list(prefix_token_ids) + [0], salt, record=False)
        self.tree.lock(match.node)
        return match.node, match.num_cached_tokens

    def unpin(self, node: Node) -> None:
        self.tree.unlock(node)

    # -- retention ---------------------------------------------------------------------------

    def retain(self, prefix_token_ids: list[int], salt: str | None, ttl_s: float, owner: str | None, max_owner_pages: int) -> int:
        """Retain the cached full blocks of a prefix for ttl_s seconds (no lock: they go last,
        not never); returns tokens retained. A prefix longer than the owner's cap retains its
        first max_owner_pages pages, and the tree's cap over all owners may trim it further."""
        if not self.enable_prefix_caching or max_owner_pages <= 0:
            return 0
        prefix = list(prefix_token_ids[: max_owner_pages * self.page_size])
        # As in pin: one more token lets match return every full block of the prefix itself.
        match = self.tree.match(prefix + [0], salt, record=False)
        num_pages = self.tree.retain(match.node, ttl_s, owner, max_owner_pages)
        for page in match.pages[:num_pages]:
            self._page_retained[page] = True
        if num_pages and self.disk is not None:
            # Write-through for what a client asked to keep: it then survives a crash or a
            # restart, not only a clean close. Queued to the tier's writer (files and the
            # manifest are written off this thread, the manifest once per writer batch).
            node: Node | None = match.node
            while node is not None and node.parent is not None:
                self._save_node(node)
                node = node.parent
        return num_pages * self.page_size

    # -- growth ------------------------------------------------------------------------------

    def pages_needed(self, seq: SequenceState, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.page_size)
        return max(0, total - len(seq.page_table))

    def available_pages(self) -> int:
        """Pages that can be had now: free ones plus those eviction would free."""
        return self.pool.num_free + self.tree.evictable_pages

    def reserve(self, seq: SequenceState, num_new_tokens: int) -> bool:
        """Give seq pages for num_new_tokens more tokens, evicting if needed; False if short."""
        needed = self.pages_needed(seq, num_new_tokens)
        if needed == 0:
            return True
        if self.pool.num_free < needed:
            self.tree.evict(needed - self.pool.num_free)
        try:
            seq.page_table.extend(self.pool.allocate(needed))
        except OutOfPages:
            return False
        return True

    # -- after a step ------------------------------------------------------------------------

    def commit(self, seq: SequenceState) -> None:
        """Offer seq's newly computed full blocks to the tree; adopt the tree's duplicates."""
        num_full = seq.num_computed_tokens // self.page_size
        if not self.enable_prefix_caching or num_full <= seq.num_tree_blocks:
            return
        hashes = self.update_block_hashes(seq)
        tokens = seq.all_token_ids[: num_full * self.page_size]
        result = self.tree.insert(tokens, seq.page_table[:num_full], seq.salt, block_hashes=hashes[:num_full])
        if result.num_inserted_blocks:
            now_s = time.monotonic()
            for page in result.pages[result.num_existing_blocks :]:
                self._page_born_s[page] = self._page_used_s[page] = now_s
        # Blocks another sequence cached first: drop our copy and point at the tree's page,
        # so no page table keeps a page the pool may hand out again.
        for i in range(result.num_existing_blocks):
            canonical = result.pages[i]
            if seq.page_table[i] != canonical:
                self.pool.incref([canonical])
                self.pool.release([seq.page_table[i]])
                seq.page_table[i] = canonical
        self.tree.lock(result.node)
        if seq.tree_node is not None:
            self.tree.unlock(seq.tree_node)
        seq.tree_node = result.node
        # Blocks a hash collision kept out of the tree stay private; they are not offered again.
        seq.num_tree_blocks = num_full

    def release(self, seq: SequenceState) -> None:
        """Give back everything seq holds: its lock and one reference on each of its pages."""
        if seq.tree_node is not None:
            self.tree.unlock(seq.tree_node)
            seq.tree_node = None
        if self.prefetcher is not None:
            self.prefetcher.cancel(seq.seq_id)
            self._disk_keys.pop(seq.seq_id, None)
            self._recompute.discard(seq.seq_id)
        self.pool.release(seq.page_table)
        seq.page_table = []
        seq.num_tree_blocks = 0
        seq.num_computed_tokens = 0
