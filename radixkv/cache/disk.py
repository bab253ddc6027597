"""DiskTier: the prefix cache's second tier, one file per KV block under a directory and a byte
budget (LRU, retained blocks last, each owner's retained bytes capped). Keys chain like block
hashes but with a seed kept in the directory, so they survive restarts; the index is rebuilt
from file names and sizes alone, and the retentions from one small manifest. Files are written
on the tier's own writer thread, the manifest once per batch. The directory is trusted only if
private to this user and locked by one process; a file is read only if it is a regular file of
the expected size whose MAC was made with the directory's key. Every failure (another model's
or tenant's block, a torn, planted or damaged file, a full disk, a vanished directory) is a
miss counted under its reason, never an exception and never a wrong block.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import queue
import secrets
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from radixkv.cache.disk_format import (
    HEADER_BYTES,
    MAC_KEY_BYTES,
    BlockRejected,
    block_file_bytes,
    check_block,
    check_header,
    digest,
    encode_block,
    owner_id,
    salt_digest,
)
from radixkv.cache.disk_index import DiskIndex, DiskRetention
from radixkv.cache.events import BlocksDropped, BlocksStored, CacheEvents
from radixkv.cache.hashing import BlockHasher
from radixkv.cache.residency import Residency, TierResidency
from radixkv.errors import ConfigError
from radixkv.private_files import check_private, private_secret, read_nofollow, write_atomic

logger = logging.getLogger(__name__)

_SUFFIX = ".kvb"
_SEED_FILE = "seed"
_KEY_FILE = "key"  # the blocks' MAC key: a block made without it is a miss
_OLD_TENANT_SECRET_FILE = "tenant_secret"  # removed at open (radixkv.cli.tenant_secret_for)
_LOCK_FILE = "lock"  # flock'ed while a process has the tier open
_RETAINED_FILE = "retained.json"  # key -> (expiry, owner digest) of the live retentions
_MAX_MANIFEST_BYTES = 256 << 20
_BLOCKS = "blocks"
_DIR_MODE = 0o700
_FILE_MODE = 0o600
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
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


@dataclass(slots=True)
class DiskRead:
    """What one read of a run of blocks found: the payloads of its first blocks, in order, and
    why it stopped early (None: it read every block asked for, or was cancelled)."""

    start_block: int
    payloads: list[bytes] = field(default_factory=list)
    failure: str | None = None  # "missing", "unreadable" or a BlockRejected reason
    seconds: float = 0.0  # spent reading and checking the payloads


@dataclass(slots=True, eq=False)
class _Run:
    """The blocks one save() queued: a block the writer could not write drops the rest (a run
    is useless past a missing block)."""

    failed: bool = False
    unwritten: int = 0


@dataclass(slots=True, eq=False)
class _Block:
    """A block queued for the writer; until written it is read from here (never missing)."""

    key: int
    parent_key: int
    salt: str | None
    tokens: list[int]  # the run's tokens (shared by its blocks); this block ends at num_prefix_tokens
    num_prefix_tokens: int
    payload: bytes
    run: _Run


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
    ):
        self.directory = Path(directory).expanduser()
        self.page_size = page_size
        self.payload_bytes = payload_bytes  # one page's KV, all layers
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
        self._mac_key = b""
        self._lock_handle = None  # the locked lock file, while the tier is open
        # Where the tier says, on the caller's thread, which keys it dropped to stay within the
        # budget and which it stored (the engine's ghost index: a later miss on a dropped block
        # reads as evicted, not never seen); the engine's bus, shared with the tree.
        self.events = events if events is not None else CacheEvents()
        # The index is the loop's; the writer reads it (the manifest) under this lock.
        self._index_lock = threading.RLock()
        # Blocks queued and not yet written (read from here meanwhile), and what the writer could
        # not write (settled on the loop: counted, forgotten).
        self._queued = threading.Condition()
        self._pending: dict[int, _Block] = {}
        self._pending_bytes = 0
        self.max_queued_bytes = max_queued_bytes  # past it, save() waits for the writer
        self._unwritten: list[tuple[_Block, str]] = []
        self._manifest_queued = False
        self._manifest_failures = 0
        self._jobs: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        try:
            self._open()
        except OSError as error:
            # A directory that cannot be made or read leaves the engine without a disk tier,
            # not without a cache: every lookup is a miss.
            self.counters["unavailable"] += 1
            logger.warning("disk KV tier off: %s is unusable (%s)", self.directory, error)

    # ----------------------------------------------------------------- setup

    def _open(self) -> None:
        self.directory.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        try:
            check_private(self.directory)
        except PermissionError as error:
            # Whoever else may write here could plant blocks, swap the seed or read the KV.
            raise ConfigError(
                f"kv_disk_dir must be private to this user (chmod go-w, or another directory): {error}", param="kv_disk_dir"
            ) from None
        self._lock_directory()
        try:
            (self.directory / _BLOCKS).mkdir(mode=_DIR_MODE, exist_ok=True)
            if not stat.S_ISDIR(os.lstat(self.directory / _BLOCKS).st_mode):
                raise NotADirectoryError(f"{self.directory / _BLOCKS} is not a folder")
            os.chmod(self.directory / _BLOCKS, _DIR_MODE)
            # The key seed: keys stay the same across restarts yet cannot be predicted (or made
            # to collide) by anyone without the file.
            seed = private_secret(self.directory / _SEED_FILE, 8)
            self.hasher = BlockHasher(self.page_size, seed=int.from_bytes(seed, "little"))
            self._mac_key = private_secret(self.directory / _KEY_FILE, MAC_KEY_BYTES)
            self._rebuild_index()
        except BaseException:
            self._unlock_directory()
            raise
        self._writer = threading.Thread(target=self._write_loop, name="radixkv-disk-writer", daemon=True)
        self._writer.start()
        self.enabled = True

    def _lock_directory(self) -> None:
        """Hold the directory's lock file, so a second process (or engine) on the same directory
        fails at once instead of both evicting and overwriting each other's blocks."""
        fd = os.open(self.directory / _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, _FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise ConfigError(
                f"kv_disk_dir {self.directory} is in use by another engine (its lock file is held); "
                "each process needs a directory of its own",
                param="kv_disk_dir",
            ) from None
        # A file object, so the lock goes with the tier even if close() is never called.
        self._lock_handle = open(fd, "rb", buffering=0)  # noqa: SIM115

    def _unlock_directory(self) -> None:
        handle, self._lock_handle = self._lock_handle, None
        if handle is not None:
            handle.close()  # closing the descriptor releases the flock

    def _rebuild_index(self) -> None:
        """Index every block file by its name and size, least recently used first (by mtime,
        which a hit refreshes), with the retentions the manifest lists that have not expired;
        no block file is read, and nothing but regular files is indexed. Torn temporary files
        are removed."""
        retained = self._read_manifest()
        for entry in os.scandir(self.directory):
            if entry.name.startswith(".tmp"):
                _unlink(Path(entry.path))  # a manifest torn by a crash
            elif entry.name == _OLD_TENANT_SECRET_FILE:
                # Earlier versions of `serve` kept the tenant secret here; it lives outside the
                # directory now, and a copy left here would tell anyone reading the directory
                # how to compute every key's cache salt.
                _unlink(Path(entry.path))
                logger.warning("removed %s: the tenant secret is kept outside kv_disk_dir now", entry.path)
        found = []
        for sub in os.scandir(self.directory / _BLOCKS):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                if entry.name.startswith(".tmp"):
                    _unlink(Path(entry.path))
                    continue
                key = _key_of(entry.name)
                if key is None:
                    continue
                info = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(info.st_mode):
                    continue  # planted: read() would refuse it anyway
                found.append((info.st_mtime_ns, key, info.st_size))
        found.sort()
        for mtime_ns, key, size in found:
            expires_at_s, owner = retained.get(key, (0.0, None))
            evicted = self.index.add(key, size, retention_expires_at_s=expires_at_s, owner=owner)
            # Over a budget that shrank since, the oldest go; one larger than all of it, itself.
            for victim in [key] if evicted is None else evicted:
                self._forget(victim)
                _unlink(self._path(victim))
            if evicted is not None:
                self._times[key] = [mtime_ns / 1e9, mtime_ns / 1e9]

    def _read_manifest(self) -> dict[int, tuple[float, str]]:
        """The retentions a previous process left (key -> (expiry, owner digest)); an absent
        or damaged manifest means none, never an error."""
        try:
            data = read_nofollow(self.directory / _RETAINED_FILE, _MAX_MANIFEST_BYTES)
            if data is None:
                return {}
            entries = json.loads(data)["retained"]
            return {int(key, 16): (float(expires_at_s), str(owner)) for key, expires_at_s, owner in entries}
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("disk KV retentions not restored (%s): the blocks stay, unretained", error)
            return {}

    def write_manifest(self) -> bool:
        """Write the live retentions beside the blocks now (atomically, owner-only), so a restart
        keeps them retained until their expiry; False on any OS error (counted)."""
        if not self.enabled:
            return False
        try:
            write_atomic(self.directory / _RETAINED_FILE, self._manifest_bytes())
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
        """Read and check blocks [start_block, start_block + num_blocks) against this model,
        this tenant and these tokens, stopping at the first that fails or is missing. Changes
        nothing in memory but `into` (the result, if given), so it may run off the step loop
        (accept() does the bookkeeping). `on_block` is called after each payload is added; it
        returns False to stop (cancelled)."""
        result = DiskRead(start_block) if into is None else into
        if not self.enabled:
            return result
        tokens = list(token_ids)
        ps = self.page_size
        for block in range(start_block, start_block + num_blocks):
            began = time.perf_counter()
            key = keys[block]
            prefix_tokens = tokens[: (block + 1) * ps]
            parent_key = keys[block - 1] if block else 0
            try:
                queued = self._queued_payload(key, salt, parent_key, prefix_tokens)
                if queued is not None:
                    payload = queued
                else:
                    data = self._read_file(key, block_file_bytes(len(prefix_tokens), self.payload_bytes), salt)
                    payload = check_block(
                        data,
                        fingerprint=self.fingerprint,
                        salt=salt,
                        key=key,
                        parent_key=parent_key,
                        page_size=ps,
                        prefix_tokens=prefix_tokens,
                        payload_bytes=self.payload_bytes,
                        mac_key=self._mac_key,
                    )
            except FileNotFoundError:
                result.failure = "missing"
            except OSError as error:
                result.failure = "unreadable"
                logger.warning("disk KV block %s unreadable: %s", self._path(key), error)
            except BlockRejected as rejected:
                result.failure = rejected.reason
            if result.failure is not None:
                break
            result.seconds += time.perf_counter() - began
            result.payloads.append(payload)
            if on_block is not None and not on_block(payload):
                break
        return result

    def _queued_payload(self, key: int, salt: str | None, parent_key: int, prefix_tokens: list[int]) -> bytes | None:
        """The payload of a block queued and not yet written, checked as its file would be;
        None when it is not queued (then its file is in place: the writer renames it in before
        it leaves the queue)."""
        with self._queued:
            block = self._pending.get(key)
        if block is None:
            return None
        if salt_digest(block.salt) != salt_digest(salt):
            raise BlockRejected("salt", "written for another tenant")
        if block.parent_key != parent_key:
            raise BlockRejected("corrupt", "the key in the header is not the file's")
        if block.tokens[: block.num_prefix_tokens] != prefix_tokens:
            raise BlockRejected("tokens", "another prefix under the same key")
        return block.payload

    def _read_file(self, key: int, expected_bytes: int, salt: str | None) -> bytes:
        """A block file's bytes, opened without following a symlink (neither the file nor its
        folder), and read only if it is a regular file of exactly the size a block of its
        place in the prefix has: a planted pipe, link or huge file is refused unread (but for
        its header, which says whether it is another model's or tenant's)."""
        name = f"{key:032x}"
        try:
            folder = os.open(self.directory / _BLOCKS / name[:2], _OPEN_DIR)
            try:
                fd = os.open(name + _SUFFIX, _OPEN_READ | os.O_NONBLOCK, dir_fd=folder)
            finally:
                os.close(folder)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENOTDIR):
                raise BlockRejected("symlink", "a link or other file where a block belongs") from None
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise BlockRejected("not_a_file", f"mode {info.st_mode:o}")
            if info.st_size != expected_bytes:
                check_header(
                    os.read(fd, HEADER_BYTES), fingerprint=self.fingerprint, salt=salt,
                    page_size=self.page_size, payload_bytes=self.payload_bytes,
                )
                reason = "truncated" if info.st_size < expected_bytes else "oversized"
                raise BlockRejected(reason, f"{info.st_size} bytes, a block here has {expected_bytes}")
            parts = []
            left = expected_bytes
            while left:
                part = os.read(fd, left)
                if not part:
                    break
                parts.append(part)
                left -= len(part)
            try:
                os.utime(fd)  # the mtime is the LRU time a restart rebuilds the order from
            except OSError:
                pass
            return b"".join(parts)
        finally:
            os.close(fd)

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
        run = _Run()
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
                    self._delete(victim)
                self.counters["evicted_blocks"] += len(evicted)
                if evicted and self.events:
                    self.events.publish(BlocksDropped(evicted))
                parent_key = keys[block - 1] if block else 0
                self._queue_block(_Block(key, parent_key, salt, tokens, num_prefix_tokens, payload, run))
                self._times[key] = [now_s, now_s]
                stored += 1
            self.counters["written_blocks"] += stored
            if retention_expires_at_s:
                self._queue_manifest()
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
        with self._queued:
            if self._pending_bytes > self.max_queued_bytes:
                self.counters["write_waits"] += 1
                self._queued.wait_for(lambda: self._pending_bytes <= self.max_queued_bytes)

    def _queue_block(self, block: _Block) -> None:
        with self._queued:
            old = self._pending.get(block.key)
            if old is not None:
                self._pending_bytes -= len(old.payload)
            self._pending[block.key] = block
            self._pending_bytes += len(block.payload)
        self._jobs.put(("block", block))

    def _queue_manifest(self) -> None:
        """Have the writer rewrite the manifest, once for however many changes queue up before
        it gets to it (it takes the retentions as they are then)."""
        with self._queued:
            if self._manifest_queued:
                return
            self._manifest_queued = True
        self._jobs.put(("manifest",))

    def _delete(self, key: int) -> None:
        """The block leaves the tier: no longer served from the queue, its file deleted by the
        writer (after any write of it queued before)."""
        with self._queued:
            block = self._pending.pop(key, None)
            if block is not None:
                self._pending_bytes -= len(block.payload)
                self._queued.notify_all()
        self._jobs.put(("unlink", key))

    def drain(self) -> None:
        """Wait until every write and deletion queued so far is done, and account for them."""
        if self._writer is None or not self._writer.is_alive():
            return
        done = threading.Event()
        self._jobs.put(("barrier", done))
        done.wait()
        with self._index_lock:
            self._settle()

    def _settle(self) -> None:
        """On the loop: forget the blocks the writer could not write, counting why."""
        with self._queued:
            unwritten, self._unwritten = self._unwritten, []
            failures, self._manifest_failures = self._manifest_failures, 0
        self.counters["write_failures"] += failures
        for block, reason in unwritten:
            if reason != "dropped":
                self.counters[reason] += 1
            self.counters["written_blocks"] -= 1
            with self._queued:
                requeued = block.key in self._pending
            if not requeued:
                self._forget(block.key)
                self.index.remove(block.key)

    # ----------------------------------------------------------------- the writer thread

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job[0] == "block":
                    self._write_block(job[1])
                elif job[0] == "unlink":
                    _unlink(self._path(job[1]))
                elif job[0] == "manifest":
                    with self._queued:
                        self._manifest_queued = False
                    if self.enabled:
                        self._write_manifest_queued()
                elif job[0] == "barrier":
                    job[1].set()
                else:  # "stop"
                    return
            except Exception:  # the writer must outlive any one job; what it lost is a miss
                logger.exception("disk KV writer: %s failed", job[0])

    def _write_block(self, block: _Block) -> None:
        with self._queued:
            if self._pending.get(block.key) is not block:
                return  # evicted (or queued again) since: nothing to write
        reason = "dropped" if block.run.failed else None
        if reason is None:
            try:
                data = encode_block(
                    fingerprint=self.fingerprint,
                    salt=block.salt,
                    key=block.key,
                    parent_key=block.parent_key,
                    page_size=self.page_size,
                    prefix_tokens=block.tokens[: block.num_prefix_tokens],
                    payload=block.payload,
                    mac_key=self._mac_key,
                )
            except OverflowError:  # a token id past int32: no vocabulary has one, so no model's
                reason = "unstorable"
            else:
                if not self._write(block.key, data):
                    reason = "write_failures"
        with self._queued:
            if self._pending.get(block.key) is block:
                del self._pending[block.key]
                self._pending_bytes -= len(block.payload)
                self._queued.notify_all()
            if reason is not None:
                block.run.failed = True
                block.run.unwritten += 1
                self._unwritten.append((block, reason))

    def _write_manifest_queued(self) -> None:
        try:
            write_atomic(self.directory / _RETAINED_FILE, self._manifest_bytes())
        except OSError as error:
            with self._queued:
                self._manifest_failures += 1  # counted on the loop (_settle)
            logger.warning("disk KV retentions not written (%s)", error)

    def _write(self, key: int, data: bytes) -> bool:
        """Write a block whole (a temporary file renamed into place), owner-only, never through
        a planted link; False on any OS error (a full disk above all), with nothing left
        behind."""
        name = f"{key:032x}"
        folder_path = self.directory / _BLOCKS / name[:2]
        tmp = f".tmp{secrets.token_hex(6)}"
        try:
            # Only the fan-out folder: a tier whose directory vanished stays without one (a
            # recreated parent would get the umask's permissions, not the owner's alone).
            try:
                folder_path.mkdir(mode=_DIR_MODE)
            except FileExistsError:
                pass
            folder = os.open(folder_path, _OPEN_DIR)
        except OSError as error:
            logger.warning("disk KV block not written (%s); it stays a miss", error)
            return False
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, _FILE_MODE, dir_fd=folder)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(tmp, name + _SUFFIX, src_dir_fd=folder, dst_dir_fd=folder)
            return True
        except OSError as error:
            logger.warning("disk KV block not written (%s); it stays a miss", error)
            try:
                os.unlink(tmp, dir_fd=folder)
            except OSError:
                pass
            return False
        finally:
            os.close(folder)

    # ----------------------------------------------------------------- housekeeping

    def flush(self) -> int:
        """Delete every stored block (and so every retention on disk); returns how many."""
        num = 0
        with self._index_lock:
            self._settle()
            while (key := self.index.pop_victim()) is not None:
                self._forget(key, "flush")
                self._delete(key)
                num += 1
        if self.enabled:
            self._queue_manifest()
        return num

    def close(self) -> None:
        """Finish every queued write, write the manifest, stop the writer and release the
        directory for the next process; the tier is off after (every lookup a miss)."""
        self.drain()
        self.write_manifest()
        if self._writer is not None and self._writer.is_alive():
            self._jobs.put(("stop",))
            self._writer.join()
        self._writer = None
        self.enabled = False
        self._unlock_directory()

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
        self._delete(key)

    def _forget(self, key: int, reason: str | None = None) -> None:
        """A block leaves the tier: its lifetime is observed when it left for `reason`."""
        times = self._times.pop(key, None)
        if reason is not None:
            self.residency.evicted_block(reason, time.time() - times[0] if times else None)

    def _path(self, key: int) -> Path:
        name = f"{key:032x}"
        return self.directory / _BLOCKS / name[:2] / (name + _SUFFIX)


def _key_of(name: str) -> int | None:
    if not name.endswith(_SUFFIX) or len(name) != 32 + len(_SUFFIX):
        return None
    try:
        return int(name[:32], 16)
    except ValueError:
        return None


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass  # already gone, or the directory with it

