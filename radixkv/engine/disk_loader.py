"""DiskLoader: all traffic between RAM and the disk tier, held by KVManager alone. Evictions are
written back, retentions written through, RAM persisted at close; a match that runs out in RAM
continues on disk, read ahead on a thread and loaded chunk by chunk unless computing is faster.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from radixkv.cache.disk import DiskStats, DiskTier
from radixkv.cache.disk_format import disk_owner, owner_id
from radixkv.cache.disk_prefetch import DiskPrefetcher
from radixkv.cache.events import BlocksEvicted, CacheEvent, CacheEvents
from radixkv.cache.layer_groups import WindowPages
from radixkv.cache.pages import PagePool
from radixkv.cache.radix import Node, RadixTree, path_tokens
from radixkv.cache.residency import TierResidency
from radixkv.config import EngineConfig
from radixkv.engine.request import SequenceState

if TYPE_CHECKING:
    from radixkv.model.loader import LoadedModel

# (start token, number of tokens) -> seconds to compute them, None until measured
ComputeEstimate = Callable[[int, int], "float | None"]

# A read-ahead started on a hint (a session's resume, named in the headers before the body is
# read) waits this long for its request to take it over, and at most this many wait at once:
# past either the read is cancelled, so the budget it holds goes back to real sequences.
HINT_WAIT_S = 30.0
MAX_HINTS = 8


@dataclass(slots=True)
class _Hint:
    tokens: list[int]  # the prefix read (full blocks): a sequence takes the read only if it starts so
    salt: str | None
    start_block: int
    made_at_s: float


def open_disk_tier(
    config: EngineConfig,
    loaded: LoadedModel,
    payload_bytes: int,
    kv_dtype: torch.dtype | None = None,
    events: CacheEvents | None = None,
    window_payload_bytes: int = 0,
) -> DiskTier | None:
    """The disk tier `config` asks for (kv_disk_dir, with prefix caching on), None without one.
    Blocks hold the pages' bytes as RAM stores them (kv_dtype, scales included: payload_bytes),
    and the fingerprint names kv_dtype, so a block of another kv_dtype is a miss. It publishes
    on `events` (the tree's bus, so the cache has one)."""
    if not config.kv_disk_dir or not config.enable_prefix_caching:
        return None
    from radixkv.model.fingerprint import model_fingerprint

    return DiskTier(
        config.kv_disk_dir,
        config.kv_disk_bytes,
        fingerprint=model_fingerprint(loaded, kv_dtype),
        page_size=config.page_size,
        payload_bytes=payload_bytes,
        max_owner_retained_bytes=config.kv_disk_retained_bytes_per_owner,
        events=events,
        window_payload_bytes=window_payload_bytes,
    )


class DiskLoader:
    """Moves blocks between the tree's pages and the disk tier. The RAM side's own steps are
    KVManager's, handed in: `commit` (a sequence's new full blocks into the tree), `peek` (what
    RAM serves a sequence: where its disk run starts) and `retain_prefix` (a prefix retained in
    RAM, and so in RAM residency: the node its match ends at, the pages retained)."""

    def __init__(
        self,
        tier: DiskTier,
        pool: PagePool,
        tree: RadixTree,
        *,
        commit: Callable[[SequenceState], None],
        peek_tokens: Callable[[SequenceState], int],
        retain_prefix: Callable[[list[int], str | None, float, str | None, int | None], tuple[Node, int]],
        compute_s: ComputeEstimate,
        prefetch_bytes: int,
        max_retained_pages_per_owner: int | None,
        windows: WindowPages | None = None,
    ) -> None:
        self.tier = tier
        # Layer groups: a block's window layers' KV travels with it where RAM still held it, and
        # a disk hit ends at the last cut whose window is held (RAM's or the stored blocks').
        self.windows = windows
        self.pool = pool
        self.tree = tree
        self.page_size = pool.page_size
        self._commit = commit
        self._peek_tokens = peek_tokens
        self._retain_prefix = retain_prefix
        self.compute_s = compute_s
        self.max_retained_pages_per_owner = max_retained_pages_per_owner  # for retentions found on disk
        self.prefetcher = DiskPrefetcher(tier, prefetch_bytes)
        self._keys: dict[int, list[int]] = {}  # seq id -> disk keys of its blocks (a token to spare)
        self._recompute: set[int] = set()  # seq ids whose disk hit is computed: reading is the slower
        self._hints: OrderedDict[int, _Hint] = OrderedDict()  # read-aheads on a hint, oldest first
        self._hint_ids = itertools.count(-1, -1)  # below every sequence id

    # -- loading a sequence's hit --------------------------------------------------------------

    def ready(self, seq: SequenceState, chunk_tokens: int) -> bool:
        """For a waiting sequence: start reading its disk hit (the blocks right after its RAM
        match) on the background thread, unless computing them is the faster; returns whether
        its first chunk's blocks are read (or there are none to wait for), so it can be admitted
        now or let other work compute while the disk is read."""
        if not self.tier.enabled or seq.seq_id in self._recompute:
            return True
        ps = self.page_size
        chunk_blocks = max(1, (chunk_tokens - 1) // ps)
        if self.prefetcher.get(seq.seq_id) is None:
            start = self._peek_tokens(seq) // ps
            if self._start_prefetch(seq, start, min_blocks=0) is None:
                return True
        return self.prefetcher.ready(seq.seq_id, chunk_blocks)

    def held_blocks(self, seq: SequenceState, start_block: int) -> int:
        """Full blocks of seq the tier holds from `start_block` on (before its last token),
        changing nothing: what its cache report says the disk had at admission."""
        if not self.tier.enabled:
            return 0
        keys, end = self._keys_of(seq)
        return self._windowed(keys, start_block, self.tier.count_cached(keys, start_block, end - start_block, touch=False))

    def read_skipped(self, seq: SequenceState) -> bool:
        """Whether seq's disk hit is computed instead, reading being judged the slower."""
        return seq.seq_id in self._recompute

    def disk_key(self, seq: SequenceState, block: int) -> int | None:
        """The tier's key of seq's block `block` (one before its last token); None when off."""
        if not self.tier.enabled:
            return None
        keys, end = self._keys_of(seq)
        return keys[block] if block < end else None

    def loading(self, seq: SequenceState) -> bool:
        """Whether seq's disk hit goes on past what it has loaded (its next chunk loads on)."""
        return self.prefetcher.get(seq.seq_id) is not None

    def continue_load(self, seq: SequenceState, num_new_tokens: int) -> int:
        """For a sequence whose disk hit ran past its last chunk: load the blocks inside its
        next `num_new_tokens` from disk; returns the tokens loaded."""
        ps = self.page_size
        if self.prefetcher.get(seq.seq_id) is None:
            return 0
        if seq.num_computed_tokens % ps or len(seq.page_table) * ps != seq.num_computed_tokens:
            self.prefetcher.cancel(seq.seq_id)  # the chunk ended inside a block: the rest is computed
            return 0
        before = seq.num_computed_tokens
        self.load(seq, num_new_tokens // ps)
        return seq.num_computed_tokens - before

    def load(self, seq: SequenceState, max_blocks: int) -> None:
        """Continue seq's match on disk: take up to `max_blocks` following blocks from its
        prefetch (starting one now if there is none: this chunk waits for its read, the next
        ones are read while it computes), load them into new pages, insert them into the tree
        and lock them as seq's (through commit)."""
        ps = self.page_size
        start = len(seq.page_table)
        limit = min(max_blocks, (seq.num_tokens - 1) // ps - start)
        if limit <= 0 or not self.tier.enabled or seq.seq_id in self._recompute:
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
        keys, _ = self._keys_of(seq)
        taken = self.prefetcher.take(seq.seq_id, limit)
        num = len(taken.payloads)
        if self.pool.num_free < num:
            self.tree.evict(num - self.pool.num_free)  # seq's match is locked: not its pages
        pages = self.pool.allocate(min(num, self.pool.num_free))
        window_table, used = self._window_pages(seq, start, taken.payloads, len(pages))
        self.pool.release(pages[used:])
        pages = pages[:used]
        if used < num:
            self.prefetcher.cancel(seq.seq_id)  # no page for the rest (or no window): computed instead
        full = self.pool.page_nbytes
        self.pool.load_pages(pages, [payload[:full] if len(payload) > full else payload for payload in taken.payloads[:used]])
        self.tier.accept(
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
        if self.windows is not None:
            seq.window_table.extend(window_table)
        seq.num_computed_tokens = (start + used) * ps
        self._commit(seq)
        self._retain_as_on_disk(seq, keys, start + used)
        if used == num and taken.failure is None and self.prefetcher.get(seq.seq_id) is None:
            if prefetch.end_block == start + used < prefetch.run_end_block:
                # The budget cut the read short of the run: read the next part while this chunk
                # computes (at least a chunk's worth, so a long hit never falls back to compute).
                self._start_prefetch(seq, start + used, min_blocks=limit)

    def _window_pages(self, seq: SequenceState, start: int, payloads: list[bytes], num: int) -> tuple[list[int], int]:
        """Of `num` blocks read from block `start` on: how many to take (up to the last cut whose
        window is held, so what follows computes over every key it reads) and, with layer
        groups, their window pages, loaded from the payloads' tails (-1 where a block has none)."""
        windows = self.windows
        if windows is None:
            return [], num
        full = self.pool.page_nbytes
        held = [len(payload) > full for payload in payloads[:num]]
        behind = 0  # RAM's blocks right before `start` that hold their window pages
        while behind < start and seq.window_table[start - 1 - behind] >= 0:
            behind += 1
        num = self._cut(start, behind, held)
        with_window = [payload[full:] for payload, has in zip(payloads[:num], held) if has]
        window_pages = windows.allocate(len(with_window)) if with_window else []
        if window_pages is None:
            return [], 0  # no window page for them: the hit is computed
        windows.pool.load_pages(window_pages, with_window)
        pages = iter(window_pages)
        return [next(pages) if has else -1 for has in held[:num]], num

    def _windowed(self, keys: Sequence[int], start: int, found: int) -> int:
        """Of `found` stored blocks from `start`, how many a hit may take (all of them for a
        model of one group): up to the last cut whose window is held, RAM's blocks before
        `start` holding theirs (a RAM match ends at such a cut), stored ones where they carry
        their window KV. Reads no file."""
        if self.windows is None or not found:
            return found
        return self._cut(start, start, [self.tier.holds_window(keys[block], block) for block in range(start, start + found)])

    def _cut(self, start: int, behind: int, held: list[bool]) -> int:
        """Blocks from `start` to the last cut whose window is held: `behind` blocks before
        `start` hold theirs, and held[i] says whether block start + i does."""
        assert self.windows is not None
        best, run = 0, behind
        for offset, has in enumerate(held):
            run = run + 1 if has else 0
            end = start + offset + 1
            if run >= end - self.windows.first_block(end * self.page_size):
                best = offset + 1
        return best

    def forget(self, seq: SequenceState) -> None:
        """seq gave back its pages: stop its read and drop what was kept for it."""
        self.prefetcher.cancel(seq.seq_id)
        self._keys.pop(seq.seq_id, None)
        self._recompute.discard(seq.seq_id)

    def _keys_of(self, seq: SequenceState) -> tuple[list[int], int]:
        """The disk keys of seq's blocks up to the last full one before its last token, and
        how many blocks that is (cached per sequence: its prompt does not change)."""
        end = (seq.num_tokens - 1) // self.page_size  # a token left to compute
        keys = self._keys.get(seq.seq_id)
        if keys is None or len(keys) < end:
            keys = self.tier.keys(seq.all_token_ids[: end * self.page_size], seq.salt)
            self._keys[seq.seq_id] = keys
        return keys, end

    # -- reading ahead on a hint ----------------------------------------------------------------

    def read_ahead(self, token_ids: Sequence[int], salt: str | None) -> int:
        """Start reading the disk blocks of a prefix a request is about to send (a session's
        last turn, on its resume) before the request exists; the sequence that starts with that
        prefix takes the read over when it asks for its disk hit. Returns the blocks being read
        (0: no tier, nothing on disk past RAM, reading judged the slower, or no budget)."""
        self._drop_stale_hints()
        if not self.tier.enabled:
            return 0
        ps = self.page_size
        end = len(token_ids) // ps
        tokens = list(token_ids[: end * ps])
        start = self.tree.peek(tokens + [0], salt).num_cached_tokens // ps  # pure: RAM serves these
        keys = self.tier.keys(tokens, salt)
        found = self.tier.count_cached(keys, start, end - start)
        if found == 0 or not self.pays(start, found):
            return 0
        num = min(found, self.prefetcher.room_blocks())
        if num == 0:
            return 0
        while len(self._hints) >= MAX_HINTS:
            self.prefetcher.cancel(self._hints.popitem(last=False)[0])
        hint_id = next(self._hint_ids)
        self.prefetcher.start(hint_id, tokens, salt, keys, start, num, start + found)
        self._hints[hint_id] = _Hint(tokens[: (start + num) * ps], salt, start, time.monotonic())
        return num

    def _take_hint(self, seq: SequenceState, start: int) -> bool:
        """Hand a hint's read-ahead to seq if it reads the same blocks from the same start (its
        tokens compared, not only their keys); whether one was taken."""
        self._drop_stale_hints()
        for hint_id, hint in self._hints.items():
            if hint.start_block != start or hint.salt != seq.salt:
                continue
            if seq.all_token_ids[: len(hint.tokens)] != hint.tokens or seq.num_tokens <= len(hint.tokens):
                continue  # another prefix, or one that ends inside the read (its last block is computed)
            del self._hints[hint_id]
            return self.prefetcher.rekey(hint_id, seq.seq_id)
        return False

    def _drop_stale_hints(self) -> None:
        now_s = time.monotonic()
        for hint_id, hint in list(self._hints.items()):
            if now_s - hint.made_at_s > HINT_WAIT_S or self.prefetcher.get(hint_id) is None:
                self.prefetcher.cancel(hint_id)
                del self._hints[hint_id]

    def _start_prefetch(self, seq: SequenceState, start: int, min_blocks: int) -> bool | None:
        """Begin reading seq's disk run from block `start` (as much as the prefetch budget
        holds, at least `min_blocks`), or take over a hint's read of it; None when there is
        none, or it is computed instead."""
        if self._hints and self._take_hint(seq, start):
            return True
        keys, end = self._keys_of(seq)
        found = self._windowed(keys, start, self.tier.count_cached(keys, start, end - start))  # touched: evictions spare them
        if found == 0:
            return None
        if not self.pays(start, found):
            self._recompute.add(seq.seq_id)
            return None
        num = min(found, max(min_blocks, self.prefetcher.room_blocks()))
        if num == 0:
            return None
        self.prefetcher.start(seq.seq_id, seq.all_token_ids, seq.salt, keys, start, num, start + found)
        return True

    def _retain_as_on_disk(self, seq: SequenceState, keys: list[int], num_blocks: int) -> None:
        """Blocks that came back from disk under a live retention (one a previous process made,
        say) are retained in RAM again, until the same time: retention holds in both tiers, and
        counts in its owner's one cap (ram_owner)."""
        for block in range(num_blocks - 1, -1, -1):  # a retention covers a prefix: the deepest says it all
            retention = self.tier.retention(keys[block])
            if retention is None:
                continue
            ttl_s = retention.expires_at_s - time.time()
            cap = self.max_retained_pages_per_owner
            if ttl_s > 0 and (cap is None or cap > 0):
                prefix = seq.all_token_ids[: (block + 1) * self.page_size]
                self._retain_prefix(prefix, seq.salt, ttl_s, self.ram_owner(str(retention.owner), seq.owner), cap)
            return

    def ram_owner(self, disk_name: str, reader: str | None) -> str | None:
        """Whose cap in RAM a retention the disk names `disk_name` (a digest) counts in: the
        live owner of that name, the reading sequence's or one retaining in RAM now, so no key
        gains a second cap by a round trip through disk; an owner not live in this process
        counts under an alias until it retains (claim). Changes only the retention book."""
        for owner in (reader, *self.tree.retention_owners()):
            if owner_id(owner) == disk_name:
                self.claim(owner)
                return owner
        return disk_owner(disk_name)

    def claim(self, owner: str | None) -> None:
        """`owner` is live: what RAM retained under its disk alias counts in its cap from now on."""
        alias = disk_owner(owner_id(owner))
        if alias != owner:
            self.tree.rehome(alias, owner, self.max_retained_pages_per_owner)

    def pays(self, start_block: int, num_blocks: int) -> bool:
        """Whether reading blocks [start_block, start_block + num_blocks) beats computing them.
        Reading costs the same per block wherever it lies (read_s_per_block, measured on the
        loads so far); computing a block costs more the deeper it lies, attention reading the
        whole prefix (the engine's fitted cost at those positions). Either unmeasured: read,
        which measures it."""
        ps = self.page_size
        read_s = self.tier.read_s_per_block
        compute_s = self.compute_s(start_block * ps, num_blocks * ps)
        if read_s is None or compute_s is None or read_s * num_blocks < compute_s:
            return True
        self.tier.counters["computed_instead"] += 1
        return False

    # -- writing RAM's blocks ------------------------------------------------------------------

    def listen(self, event: CacheEvent) -> None:
        """A CacheEvents listener: a leaf RAM evicts (its pages still hold the KV) is kept on
        disk, unless the flush that evicts it drops the disk too."""
        # Write-back: a block reaches the disk when RAM gives it up (or at close), not when it is
        # computed; most computed blocks are private tails never asked for again, and writing
        # each of them through would spend the disk's bandwidth and budget on them. Retained
        # prefixes are written through at retain time (write_through).
        if isinstance(event, BlocksEvicted) and event.write_back:
            self.save(event.node)

    def write_through(self, node: Node | None) -> None:
        """Write a retained prefix (node and its ancestors) now: what a client asked to keep
        then survives a crash or a restart, not only a clean close. Queued to the tier's writer
        (files and the manifest are written off this thread, the manifest once per batch)."""
        while node is not None and node.parent is not None:
            self.save(node)
            node = node.parent

    def save(self, node: Node) -> int:
        """Queue node's blocks to the tier's writer thread (this thread copies the pages' bytes,
        no more); returns blocks queued."""
        tier = self.tier
        if not tier.enabled:
            return 0
        tokens = path_tokens(node)
        first = len(tokens) // self.page_size - len(node.pages)
        keys = tier.keys(tokens, node.salt)
        pages = node.pages
        expires_at_s, owner = self._retention_of(node)
        return tier.save(
            tokens, node.salt, keys, first, len(pages), lambda i: self._payload(pages[i]),
            retention_expires_at_s=expires_at_s, owner=owner, wait=False,
        )

    def _payload(self, page: int) -> bytes:
        """A cached block's bytes for the disk: its full layers' page, then its window layers'
        page where the tree still holds it (layer groups)."""
        data = self.pool.page_bytes(page)
        window_page = self.windows.window_page_of(page) if self.windows is not None else None
        return data if window_page is None else data + self.windows.pool.page_bytes(window_page)  # type: ignore[union-attr]

    def _retention_of(self, node: Node) -> tuple[float, str | None]:
        """(wall-clock expiry, owner) of the retention on `node` that ends last, (0, None) if
        none: the disk keeps retentions on the wall clock, which a restart shares."""
        if not node.retains:
            return 0.0, None
        retention_id, expires_at_s = max(node.retains.items(), key=lambda item: item[1])
        retention = self.tree.retention(retention_id)
        return time.time() + (expires_at_s - self.tree.now_s()), retention.owner if retention is not None else None

    # -- the tier as a whole -------------------------------------------------------------------

    def lookup(self, token_ids: list[int], salt: str | None, ram_tokens: int) -> int:
        """Tokens of the prompt's full blocks cached on disk right after its first `ram_tokens`,
        changing nothing: no LRU time, no hit counted, no file read."""
        ps = self.page_size
        num_full = len(token_ids) // ps
        keys = self.tier.keys(token_ids[: num_full * ps], salt)
        start = ram_tokens // ps
        return self._windowed(keys, start, self.tier.count_cached(keys, start, num_full - start, touch=False)) * ps

    def flush(self) -> int:
        """Delete every block on disk; returns how many."""
        return self.tier.flush()

    def persist(self) -> int:
        """Write every block cached in RAM to the tier (at close, so a restart finds what this
        process had); returns blocks written."""
        written = sum(self.save(node) for node in self.tree.iter_nodes())
        self.tier.drain()
        self.tier.write_manifest()
        return written

    def close(self) -> int:
        """Stop the background reads, persist RAM and close the tier (its directory is the next
        process's); returns blocks written."""
        self.prefetcher.close()
        self._hints.clear()
        written = self.persist()
        self.tier.close()
        return written

    def directory(self) -> Path | None:
        """The tier's directory while it is in use; None once it is off."""
        return self.tier.directory if self.tier.enabled else None

    def residency(self) -> TierResidency:
        return self.tier.residency_stats()

    def stats(self) -> DiskStats:
        return self.tier.stats()
