"""The bridge between sequences and the prefix cache: pages in, pages out, blocks shared.

A running sequence holds one pool reference on every page of its page table and locks the
deepest tree node covering its cached blocks; this module is the only place that moves them,
between RAM and the disk tier too: blocks the tree evicts are written back there, and a match
that runs out in RAM continues there, loading the hit blocks into pages.
"""

from __future__ import annotations

from collections.abc import Callable

from radixkv.cache.disk import DiskTier
from radixkv.cache.hashing import BlockHasher
from radixkv.cache.pages import OutOfPages, PagePool
from radixkv.cache.radix import Node, PeekResult, RadixTree, path_tokens
from radixkv.engine.request import SequenceState


class KVManager:
    def __init__(
        self,
        pool: PagePool,
        tree: RadixTree,
        hasher: BlockHasher,
        enable_prefix_caching: bool,
        disk: DiskTier | None = None,
        compute_s_per_token: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.pool = pool
        self.tree = tree
        self.hasher = hasher
        self.page_size = pool.page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.disk = disk if enable_prefix_caching else None
        self.compute_s_per_token = compute_s_per_token  # None until the engine has measured it
        # Disk keys of the sequences whose disk hit runs past the chunk that loaded it: their
        # next chunks continue loading (continue_from_disk) instead of computing.
        self._disk_runs: dict[int, list[int]] = {}
        if self.disk is not None:
            # Write-back: a block reaches the disk when RAM gives it up (or at close), not when
            # it is computed; most computed blocks are private tails never asked for again,
            # and writing each of them through would spend the disk's bandwidth and budget on
            # them. Retained prefixes are written through at retain time (retain()).
            tree.on_evict = self._write_back

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
        `max_new_tokens` past the match with a token to spare (so the pages the admission check
        counted for computing them serve instead). Returns cached tokens, RAM and disk. Call it
        after the check (pages_to_admit): nothing here is undone."""
        assert not seq.page_table and seq.tree_node is None
        if not self.enable_prefix_caching:
            return 0
        match = self.tree.match(seq.all_token_ids, seq.salt, block_hashes=self.update_block_hashes(seq), record=False)
        self.tree.lock(match.node)
        self.tree.record_lookup(seq.num_tokens, match.num_cached_tokens)
        self.pool.incref(match.pages)
        seq.tree_node = match.node
        seq.page_table = list(match.pages)
        seq.num_tree_blocks = len(match.pages)
        seq.num_computed_tokens = match.num_cached_tokens
        if self.disk is not None and max_new_tokens is not None:
            self._load_from_disk(seq, (max_new_tokens - 1) // self.page_size)
        return seq.num_computed_tokens

    # -- the disk tier -----------------------------------------------------------------------

    def continue_from_disk(self, seq: SequenceState, num_new_tokens: int) -> int:
        """For a sequence whose disk hit ran past its last chunk: load the blocks inside its
        next `num_new_tokens` from disk (a token to spare); returns the tokens loaded."""
        keys = self._disk_runs.pop(seq.seq_id, None)
        ps = self.page_size
        if keys is None or seq.num_computed_tokens % ps or len(seq.page_table) * ps != seq.num_computed_tokens:
            return 0  # no run, or the chunk ended inside a block: the rest is computed
        before = seq.num_computed_tokens
        self._load_from_disk(seq, (num_new_tokens - 1) // ps, keys)
        return seq.num_computed_tokens - before

    def _load_from_disk(self, seq: SequenceState, max_blocks: int, keys: list[int] | None = None) -> None:
        """Continue seq's match on disk: load up to `max_blocks` following blocks into new
        pages, insert them into the tree and lock them as seq's (through commit). When the
        run goes on past `max_blocks`, remember it for the next chunk."""
        assert self.disk is not None
        ps = self.page_size
        start = len(seq.page_table)
        end = (seq.num_tokens - 1) // ps  # a token left to compute
        limit = min(max_blocks, end - start)
        if limit <= 0 or not self.disk.enabled or not self._disk_pays():
            return
        tokens = seq.all_token_ids
        if keys is None:
            keys = self.disk.keys(tokens[: end * ps], seq.salt)
        num = self.disk.count_cached(keys, start, limit)
        if num == 0:
            return
        if self.pool.num_free < num:
            self.tree.evict(num - self.pool.num_free)  # seq's match is locked: not its pages
        pages = self.pool.allocate(min(num, self.pool.num_free))
        payloads = self.disk.load(tokens, seq.salt, keys, start, len(pages))
        for page, payload in zip(pages, payloads):
            self.pool.load_page(page, payload)
        self.pool.release(pages[len(payloads) :])  # past the first block that failed: computed instead
        if not payloads:
            return
        seq.page_table.extend(pages[: len(payloads)])
        seq.num_computed_tokens = (start + len(payloads)) * ps
        self.commit(seq)
        if len(payloads) == limit < end - start:
            self._disk_runs[seq.seq_id] = keys

    def _disk_pays(self) -> bool:
        """Whether reading a block beats computing it, on what both have cost so far (either
        unmeasured: try the disk). Per block both grow linearly with the run's length, and
        computing grows faster (attention reads the whole prefix), so one comparison decides."""
        assert self.disk is not None
        read_s, compute_s = self.disk.read_s_per_block, self.compute_s_per_token()
        if read_s is None or compute_s is None or read_s < compute_s * self.page_size:
            return True
        self.disk.counters["computed_instead"] += 1
        return False

    def _write_back(self, node: Node) -> None:
        """The tree is evicting `node`: keep its blocks on disk (their pages still hold them)."""
        assert self.disk is not None
        self._save_node(node)

    def _save_node(self, node: Node) -> int:
        disk = self.disk
        assert disk is not None
        if not disk.enabled:
            return 0
        tokens = path_tokens(node)
        first = len(tokens) // self.page_size - len(node.pages)
        keys = disk.keys(tokens, node.salt)
        pages = node.pages
        return disk.save(
            tokens, node.salt, keys, first, len(pages), lambda i: self.pool.page_bytes(pages[i]), retained=bool(node.retains)
        )

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
        hook = self.tree.on_evict
        pages = blocks = 0
        if ram:
            if disk:
                self.tree.on_evict = None
            try:
                pages = self.tree.evict(self.tree.evictable_pages)
            finally:
                self.tree.on_evict = hook
        if disk and self.disk is not None:
            blocks = self.disk.flush()
        return pages, blocks

    def persist(self) -> int:
        """Write every block cached in RAM to the disk tier (at close, so a restart finds what
        this process had); returns blocks written."""
        if self.disk is None:
            return 0
        return sum(self._save_node(node) for node in self.tree.iter_nodes())

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
        first max_owner_pages pages."""
        if not self.enable_prefix_caching or max_owner_pages <= 0:
            return 0
        prefix = list(prefix_token_ids[: max_owner_pages * self.page_size])
        # As in pin: one more token lets match return every full block of the prefix itself.
        match = self.tree.match(prefix + [0], salt, record=False)
        num_pages = self.tree.retain(match.node, ttl_s, owner, max_owner_pages)
        if num_pages and self.disk is not None:
            # Write-through for what a client asked to keep: it then survives a crash or a
            # restart, not only a clean close.
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
        self._disk_runs.pop(seq.seq_id, None)
        self.pool.release(seq.page_table)
        seq.page_table = []
        seq.num_tree_blocks = 0
        seq.num_computed_tokens = 0
