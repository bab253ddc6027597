"""DiskTier: the prefix cache's second tier, one file per KV block under a directory and a byte
budget (LRU, retained blocks last, each owner's retained bytes capped). Keys chain like block
hashes but with a seed kept in the directory, so they survive restarts; the index is rebuilt
from file names and sizes alone, and the retentions from one small manifest. Files are written
on the tier's own writer thread (cache/disk_writer.py), the manifest once per batch. The
directory is trusted only if private to this user and locked by one process
(cache/disk_directory.py); a file is read only if it is a regular file of the expected size
whose MAC was made with the directory's key (cache/disk_reads.py). Every failure (another model's
or tenant's block, a torn, planted or damaged file, a full disk, a vanished directory) is a
miss counted under its reason, never an exception and never a wrong block.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from radixkv.cache.disk_directory import DiskDirectory
from radixkv.cache.disk_format import BlockFormat, block_file_bytes, digest, encode_block, owner_id
from radixkv.cache.disk_index import DiskIndex, DiskRetention
from radixkv.cache.disk_reads import BlockReader, DiskRead
from radixkv.cache.disk_writer import DiskWriter, QueuedBlock, WriteRun
from radixkv.cache.events import BlocksDropped, BlocksStored, CacheEvents
from radixkv.cache.hashing import BlockHasher
from radixkv.cache.residency import Residency, TierResidency

logger = logging.getLogger(__name__)

# Why a stored block was a miss (DiskStats.rejected): another model's or layout's, another
# tenant's, shorter or longer than a block of its place, no block header of this format,
# damaged, not made with the directory's key, another prefix's; a link, pipe or folder where
# the file belongs; gone; an OS error.
REJECTED_REASONS = (
    "fingerprint", "salt", "truncated", "oversized", "corrupt", "checksum", "mac", "tokens",
    "symlink", "not_a_file", "missing", "unreadable",
)


@dataclass(frozen=True, slots=True)
class DiskStats:
    enabled: bool
    blocks: int
    bytes_used: int
    budget_bytes: int
    hit_blocks: int  # blocks loaded back into RAM
    written_blocks: int
    evicted_blocks: int  # deleted to stay within the budget
    rejected: dict[str, int]  # misses on a file that was there, by reason (then deleted)
    write_failures: int  # a full disk, a vanished directory, a permission: the block is not kept
    computed_instead: int = 0  # disk hits the engine recomputed, reading being the slower
    read_s_per_block: float | None = None
    retained_blocks: int = 0  # under a live retention (evicted only when nothing else is left)
    prefetched_blocks: int = 0  # of the hits, read on the background thread ahead of use


class DiskTier:
    """Blocks on local disk for one model fingerprint and page size. The engine's step loop
    owns it, as it owns the tree; read() may run on another thread (it reads files and the
    queued blocks and changes nothing in memory), the bookkeeping of what it read (accept) on
    the loop. Writes and deletions run on the tier's writer thread, in the order queued."""

    def __init__(
        self,
        directory: str | Path,
        budget_bytes: int,
        *,
        fingerprint: str,
        page_size: int,
        payload_bytes: int,
        max_owner_retained_bytes: int | None = None,
        max_queued_bytes: int = 256 << 20,
        events: CacheEvents | None = None,
        window_payload_bytes: int = 0,
    ):
        self.directory = Path(directory).expanduser()
        self.files = DiskDirectory(self.directory)
        self.page_size = page_size
        self.payload_bytes = payload_bytes  # one page's KV, all layers (the full layers' with layer groups)
        self.window_payload_bytes = window_payload_bytes  # a window page's, after it where a block has it
        self.fingerprint = digest(fingerprint)
        # Wall time, not monotonic: retention expiries and block ages must mean the same after
        # a restart.
        self.index = DiskIndex(budget_bytes, max_owner_bytes=max_owner_retained_bytes, clock=time.time)
        self.counters: Counter[str] = Counter()
        self.residency = Residency()
        self._times: dict[int, list[float]] = {}  # key -> [stored_s, last used_s] (wall time)
        self.enabled = False
        self.hasher: BlockHasher | None = None
        # Seconds to read and check one block, a moving average of the loads so far (None
        # before the first): the engine compares it with what computing a block costs.
        self.read_s_per_block: float | None = None
        self._format: BlockFormat | None = None  # once the directory is open (its MAC key)
        self._reader: BlockReader | None = None  # once the directory is open
        # Where the tier says, on the caller's thread, which keys it dropped to stay within the
        # budget and which it stored (the engine's ghost index: a later miss on a dropped block
        # reads as evicted, not never seen); the engine's bus, shared with the tree.
        self.events = events if events is not None else CacheEvents()
        # The index is the loop's; the writer reads it (the manifest) under this lock.
        self._index_lock = threading.RLock()
        self.writer = DiskWriter(
            self.files, encode=self._encode, manifest_bytes=self._manifest_bytes, enabled=lambda: self.enabled,
            max_queued_bytes=max_queued_bytes,
        )
        try:
            self._open()
        except OSError as error:
            # A directory that cannot be made or read leaves the engine without a disk tier,
            # not without a cache: every lookup is a miss.
            self.counters["unavailable"] += 1
            logger.warning("disk KV tier off: %s is unusable (%s)", self.directory, error)

    # ----------------------------------------------------------------- setup

    def _open(self) -> None:
        seed, mac_key = self.files.open()
        try:
            self.hasher = BlockHasher(self.page_size, seed=int.from_bytes(seed, "little"))
            self._format = BlockFormat(self.fingerprint, self.page_size, self.payload_bytes, mac_key, self.window_payload_bytes)
            self._reader = BlockReader(self.files, self.writer.pending, self._format)
            self._rebuild_index()
        except BaseException:
            self.files.unlock()
            raise
        self.writer.start()
        self.enabled = True

    def _rebuild_index(self) -> None:
        """Index every block file by its name and size, least recently used first (by mtime,
        which a hit refreshes), with the retentions the manifest lists that have not expired;
        no block file is read, and nothing but regular files is indexed. Torn temporary files
        are removed."""
        retained = self.files.read_manifest()
        found = self.files.scan()
        for mtime_ns, key, size in found:
            expires_at_s, owner = retained.get(key, (0.0, None))
            evicted = self.index.add(key, size, retention_expires_at_s=expires_at_s, owner=owner)
            # Over a budget that shrank since, the oldest go; one larger than all of it, itself.
            for victim in [key] if evicted is None else evicted:
                self._forget(victim)
                self.files.unlink_block(victim)
            if evicted is not None:
                self._times[key] = [mtime_ns / 1e9, mtime_ns / 1e9]

    def write_manifest(self) -> bool:
        """Write the live retentions beside the blocks now (atomically, owner-only), so a restart
        keeps them retained until their expiry; False on any OS error (counted)."""
        if not self.enabled:
            return False
        try:
            self.files.write_manifest(self._manifest_bytes())
            return True
        except OSError as error:
            self.counters["write_failures"] += 1
            logger.warning("disk KV retentions not written (%s)", error)
            return False

    def _manifest_bytes(self) -> bytes:
        with self._index_lock:
            entries = [[f"{key:032x}", retention.expires_at_s, retention.owner] for key, retention in self.index.retentions()]
        return json.dumps({"version": 1, "retained": entries}).encode()

    # ----------------------------------------------------------------- keys

    def keys(self, token_ids: Sequence[int], salt: str | None) -> list[int]:
        """The disk key of every full block of `token_ids`: a chained hash of the whole prefix."""
        assert self.hasher is not None
        return self.hasher.hash_blocks(token_ids, salt)

    def count_cached(self, keys: Sequence[int], start_block: int, max_blocks: int, *, touch: bool = True) -> int:
        """How many consecutive blocks from `start_block` the index holds (no file is read).
        With `touch` they count as used now, so the evictions that make room to load them
        spare them; a lookup that loads nothing passes touch=False."""
        if not self.enabled:
            return 0
        with self._index_lock:
            self._settle()
            found = self.index.touch if touch else self.index.__contains__
            num = 0
            while num < max_blocks and start_block + num < len(keys) and found(keys[start_block + num]):
                num += 1
            return num

    def holds_window(self, key: int, block: int) -> bool:
        """Whether the stored block `block` (its key) carries its window layers' KV (its size
        says so; no file is read)."""
        with_window = block_file_bytes((block + 1) * self.page_size, self.payload_bytes + self.window_payload_bytes)
        return self.window_payload_bytes > 0 and self.index.size_of(key) == with_window

    # ----------------------------------------------------------------- read

    def read(
        self,
        token_ids: Sequence[int],
        salt: str | None,
        keys: Sequence[int],
        start_block: int,
        num_blocks: int,
        *,
        on_block: Callable[[bytes], bool] | None = None,
        into: DiskRead | None = None,
    ) -> DiskRead:
        """Read and check blocks [start_block, start_block + num_blocks) (BlockReader.read);
        changes nothing in memory but `into`, so it may run off the step loop (accept() does
        the bookkeeping). Nothing is read while the tier is off."""
        if not self.enabled or self._reader is None:
            return DiskRead(start_block) if into is None else into
        return self._reader.read(token_ids, salt, keys, start_block, num_blocks, on_block=on_block, into=into)

    def accept(
        self,
        keys: Sequence[int],
        start_block: int,
        num_loaded: int,
        *,
        read_s_per_block: float | None,
        failure: str | None = None,
        prefetched: bool = False,
    ) -> None:
        """Account for blocks [start_block, start_block + num_loaded) loaded into RAM (hits,
        used now) and, with `failure`, for the block after them that a read stopped on:
        counted under its reason and, if it was refused, deleted."""
        now_s = time.time()
        with self._index_lock:
            for block in range(start_block, start_block + num_loaded):
                key = keys[block]
                self.index.touch(key)
                times = self._times.get(key)
                self.residency.hit(now_s - times[1] if times else None)
                if times:
                    times[1] = now_s
            self.counters["hit_blocks"] += num_loaded
            if prefetched:
                self.counters["prefetched_blocks"] += num_loaded
            if num_loaded and read_s_per_block is not None:
                old = self.read_s_per_block
                self.read_s_per_block = read_s_per_block if old is None else 0.8 * old + 0.2 * read_s_per_block
            if failure is not None:
                key = keys[start_block + num_loaded]
                self.counters[f"rejected_{failure}"] += 1
                if failure in ("missing", "unreadable"):
                    self._forget(key)
                    self.index.remove(key)
                else:
                    self._drop(key, "rejected")

    def load(
        self, token_ids: Sequence[int], salt: str | None, keys: Sequence[int], start_block: int, num_blocks: int
    ) -> list[bytes]:
        """The KV bytes of blocks [start_block, start_block + num_blocks), read and accounted
        for at once (the synchronous path: read() then accept(), a refused file deleted before
        it returns)."""
        read = self.read(token_ids, salt, keys, start_block, num_blocks)
        num = len(read.payloads)
        self.accept(keys, start_block, num, read_s_per_block=read.seconds / num if num else None, failure=read.failure)
        if read.failure is not None:
            self.drain()
        return read.payloads

    # ----------------------------------------------------------------- write

    def save(
        self,
        token_ids: Sequence[int],
        salt: str | None,
        keys: Sequence[int],
        start_block: int,
        num_blocks: int,
        payload_of: Callable[[int], bytes],
        *,
        retention_expires_at_s: float = 0.0,
        owner: str | None = None,
        wait: bool = True,
    ) -> int:
        """Store blocks [start_block, start_block + num_blocks) of `token_ids`, the KV of the
        i-th from payload_of(i) (asked only for blocks not stored yet, at once; a stored one is
        only marked used). With `retention_expires_at_s` (wall time) the blocks are retained until then,
        counted against `owner` (kept as a digest), and the manifest is rewritten (once per
        writer batch) so a restart keeps them retained. The files are written on the writer
        thread; with `wait` this returns once they are, else at once (the blocks are served
        from memory meanwhile). Returns blocks stored (with `wait`: written). A failed write
        keeps nothing of that block nor of the run's blocks after it."""
        if not self.enabled:
            return 0
        tokens = list(token_ids)  # a snapshot, the writer's own
        ps = self.page_size
        owner_name = owner_id(owner) if retention_expires_at_s else None
        run = WriteRun()
        stored = 0
        now_s = time.time()
        with self._index_lock:
            self._settle()
            for offset in range(num_blocks):
                block = start_block + offset
                key = keys[block]
                if key in self.index:
                    self.index.touch(key)
                    if retention_expires_at_s:
                        self.index.retain(key, retention_expires_at_s, owner_name)
                    continue
                payload = payload_of(offset)
                num_prefix_tokens = (block + 1) * ps
                evicted = self.index.add(
                    key, block_file_bytes(num_prefix_tokens, len(payload)), retention_expires_at_s=retention_expires_at_s, owner=owner_name
                )
                if evicted is None:
                    self.counters["too_large"] += 1
                    break
                for victim, reason in zip(evicted, self.index.reasons):
                    self._forget(victim, reason)
                    self.writer.delete(victim)
                self.counters["evicted_blocks"] += len(evicted)
                if evicted and self.events:
                    self.events.publish(BlocksDropped(evicted))
                parent_key = keys[block - 1] if block else 0
                self.writer.queue_block(QueuedBlock(key, parent_key, salt, tokens, num_prefix_tokens, payload, run))
                self._times[key] = [now_s, now_s]
                stored += 1
            self.counters["written_blocks"] += stored
            if retention_expires_at_s:
                self.writer.queue_manifest()
        if self.events:
            self.events.publish(BlocksStored("disk", keys[start_block : start_block + num_blocks]))
        if wait:
            self.drain()
            stored -= run.unwritten
        else:
            self._wait_for_room()
        return stored

    def _wait_for_room(self) -> None:
        """Bounded memory: past max_queued_bytes of blocks not yet written, the caller waits for
        the writer to catch up (counted). Never with the index lock held: the writer may need it."""
        if self.writer.wait_for_room():
            self.counters["write_waits"] += 1

    def drain(self) -> None:
        """Wait until every write and deletion queued so far is done, and account for them."""
        if not self.writer.running:
            return
        self.writer.barrier()
        with self._index_lock:
            self._settle()

    def _settle(self) -> None:
        """On the loop: forget the blocks the writer could not write, counting why."""
        unwritten, failures = self.writer.take_unwritten()
        self.counters["write_failures"] += failures
        for block, reason in unwritten:
            if reason != "dropped":
                self.counters[reason] += 1
            self.counters["written_blocks"] -= 1
            if not self.writer.is_queued(block.key):
                self._forget(block.key)
                self.index.remove(block.key)

    def _encode(self, block: QueuedBlock) -> bytes:
        """A queued block's file bytes (on the writer thread); OverflowError past int32 tokens."""
        assert self._format is not None, "the writer runs only once the directory is open"
        return encode_block(
            self._format, salt=block.salt, key=block.key, parent_key=block.parent_key,
            prefix_tokens=block.tokens[: block.num_prefix_tokens], payload=block.payload,
        )  # fmt: skip

    # ----------------------------------------------------------------- housekeeping

    def flush(self) -> int:
        """Delete every stored block (and so every retention on disk); returns how many."""
        num = 0
        with self._index_lock:
            self._settle()
            while (key := self.index.pop_victim()) is not None:
                self._forget(key, "flush")
                self.writer.delete(key)
                num += 1
        if self.enabled:
            self.writer.queue_manifest()
        return num

    def close(self) -> None:
        """Finish every queued write, write the manifest, stop the writer and release the
        directory for the next process; the tier is off after (every lookup a miss)."""
        self.drain()
        self.write_manifest()
        self.writer.stop()
        self.enabled = False
        self.files.unlock()

    def retention(self, key: int) -> DiskRetention | None:
        """The live retention of a stored block (expiry in wall time, owner digest)."""
        with self._index_lock:
            return self.index.retention(key)

    def residency_stats(self) -> TierResidency:
        return self.residency.snapshot(len(self.index), self.index.bytes_used)

    def stats(self) -> DiskStats:
        with self._index_lock:
            self._settle()
            rejected = {k.removeprefix("rejected_"): v for k, v in self.counters.items() if k.startswith("rejected_")}
            return DiskStats(
                enabled=self.enabled,
                blocks=len(self.index),
                bytes_used=self.index.bytes_used,
                budget_bytes=self.index.budget_bytes,
                hit_blocks=self.counters["hit_blocks"],
                written_blocks=self.counters["written_blocks"],
                evicted_blocks=self.counters["evicted_blocks"],
                rejected=rejected,
                write_failures=self.counters["write_failures"],
                computed_instead=self.counters["computed_instead"],
                read_s_per_block=self.read_s_per_block,
                retained_blocks=self.index.num_retained,
                prefetched_blocks=self.counters["prefetched_blocks"],
            )

    def _drop(self, key: int, reason: str) -> None:
        self._forget(key, reason)
        self.index.remove(key)
        self.writer.delete(key)

    def _forget(self, key: int, reason: str | None = None) -> None:
        """A block leaves the tier: its lifetime is observed when it left for `reason`."""
        times = self._times.pop(key, None)
        if reason is not None:
            self.residency.evicted_block(reason, time.time() - times[0] if times else None)
