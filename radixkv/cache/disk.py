"""DiskTier: the prefix cache's second tier, one file per KV block under a directory and a byte
budget (LRU, retained blocks last, each owner's retained bytes capped). Keys chain like block
hashes but with a seed kept in the directory, so they survive restarts; the index is rebuilt
from file names and sizes alone, and the retentions from one small manifest. Every failure
(another model's or tenant's block, a torn file, a full disk, a vanished directory) is a miss
counted under its reason, never an exception and never a wrong block.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from radixkv.cache.disk_format import BlockRejected, check_block, digest, encode_block
from radixkv.cache.disk_index import DiskIndex, Retention
from radixkv.cache.hashing import BlockHasher
from radixkv.cache.residency import Residency, TierResidency

logger = logging.getLogger(__name__)

_SUFFIX = ".kvb"
_SEED_FILE = "seed"
_RETAINED_FILE = "retained.json"  # key -> (expiry, owner digest) of the live retentions
_BLOCKS = "blocks"
_DIR_MODE = 0o700
_FILE_MODE = 0o600


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


class DiskTier:
    """Blocks on local disk for one model fingerprint and page size. The engine's step loop
    owns it, as it owns the tree; only read() may run on another thread (it reads files and
    changes nothing in memory), the bookkeeping of what it read (accept) on the loop."""

    def __init__(
        self,
        directory: str | Path,
        budget_bytes: int,
        *,
        fingerprint: str,
        page_size: int,
        payload_bytes: int,
        max_owner_retained_bytes: int | None = None,
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
        (self.directory / _BLOCKS).mkdir(mode=_DIR_MODE, exist_ok=True)
        os.chmod(self.directory / _BLOCKS, _DIR_MODE)
        self.hasher = BlockHasher(self.page_size, seed=self._seed())
        self._rebuild_index()
        self.enabled = True

    def _seed(self) -> int:
        """The key seed, made once per directory and kept owner-only: keys stay the same across
        restarts yet cannot be predicted (or made to collide) by anyone without the file."""
        path = self.directory / _SEED_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = b""
        if len(data) != 8:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, _FILE_MODE)
            with os.fdopen(fd, "wb") as out:
                out.write(secrets.token_bytes(8))
            data = path.read_bytes()
        return int.from_bytes(data, "little")

    def _rebuild_index(self) -> None:
        """Index every block file by its name and size, least recently used first (by mtime,
        which a hit refreshes), with the retentions the manifest lists that have not expired;
        no block file is read. Torn temporary files are removed."""
        retained = self._read_manifest()
        for entry in os.scandir(self.directory):
            if entry.name.startswith(".tmp"):
                _unlink(Path(entry.path))  # a manifest torn by a crash
        found = []
        for sub in (self.directory / _BLOCKS).iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if entry.name.startswith(".tmp"):
                    _unlink(Path(entry.path))
                    continue
                key = _key_of(entry.name)
                if key is None:
                    continue
                stat = entry.stat()
                found.append((stat.st_mtime_ns, key, stat.st_size))
        found.sort()
        for mtime_ns, key, size in found:
            until_s, owner = retained.get(key, (0.0, None))
            evicted = self.index.add(key, size, retain_until_s=until_s, owner=owner)
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
            entries = json.loads((self.directory / _RETAINED_FILE).read_text())["retained"]
            return {int(key, 16): (float(until_s), str(owner)) for key, until_s, owner in entries}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("disk KV retentions not restored (%s): the blocks stay, unretained", error)
            return {}

    def write_manifest(self) -> bool:
        """Write the live retentions beside the blocks (atomically, owner-only), so a restart
        keeps them retained until their expiry; False on any OS error (counted)."""
        if not self.enabled:
            return False
        entries = [[f"{key:032x}", retention.until_s, retention.owner] for key, retention in self.index.retentions()]
        data = json.dumps({"version": 1, "retained": entries}).encode()
        return self._atomic_write(self.directory / _RETAINED_FILE, data)

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
            path = self._path(key)
            try:
                data = path.read_bytes()
                payload = check_block(
                    data,
                    fingerprint=self.fingerprint,
                    salt=salt,
                    key=key,
                    parent_key=keys[block - 1] if block else 0,
                    page_size=ps,
                    prefix_tokens=tokens[: (block + 1) * ps],
                    payload_bytes=self.payload_bytes,
                )
            except FileNotFoundError:
                result.failure = "missing"
            except OSError as error:
                result.failure = "unreadable"
                logger.warning("disk KV block %s unreadable: %s", path, error)
            except BlockRejected as rejected:
                result.failure = rejected.reason
            if result.failure is not None:
                break
            _touch(path)
            result.seconds += time.perf_counter() - began
            result.payloads.append(payload)
            if on_block is not None and not on_block(payload):
                break
        return result

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
        for at once (the synchronous path: read() then accept())."""
        read = self.read(token_ids, salt, keys, start_block, num_blocks)
        num = len(read.payloads)
        self.accept(keys, start_block, num, read_s_per_block=read.seconds / num if num else None, failure=read.failure)
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
        retain_until_s: float = 0.0,
        owner: str | None = None,
    ) -> int:
        """Store blocks [start_block, start_block + num_blocks) of `token_ids`, the KV of the
        i-th from payload_of(i) (asked only for blocks not stored yet; a stored one is only
        marked used). With `retain_until_s` (wall time) the blocks are retained until then,
        counted against `owner` (kept as a digest), and the manifest is rewritten so a restart
        keeps them retained. Returns blocks written. A failed write keeps nothing of that block."""
        if not self.enabled:
            return 0
        tokens = list(token_ids)
        ps = self.page_size
        owner_id = digest("" if owner is None else owner).hex() if retain_until_s else None
        written = 0
        now_s = time.time()
        for offset in range(num_blocks):
            block = start_block + offset
            key = keys[block]
            if key in self.index:
                self.index.touch(key)
                if retain_until_s:
                    self.index.retain(key, retain_until_s, owner_id)
                continue
            try:
                data = encode_block(
                    fingerprint=self.fingerprint,
                    salt=salt,
                    key=key,
                    parent_key=keys[block - 1] if block else 0,
                    page_size=ps,
                    prefix_tokens=tokens[: (block + 1) * ps],
                    payload=payload_of(offset),
                )
            except OverflowError:  # a token id past int32: no vocabulary has one, so no model's
                self.counters["unstorable"] += 1
                break
            evicted = self.index.add(key, len(data), retain_until_s=retain_until_s, owner=owner_id)
            if evicted is None:
                self.counters["too_large"] += 1
                break
            for victim, reason in zip(evicted, self.index.reasons):
                self._forget(victim, reason)
                _unlink(self._path(victim))
            self.counters["evicted_blocks"] += len(evicted)
            if not self._write(key, data):
                self.index.remove(key)
                break  # the rest of a run is useless without this block
            self._times[key] = [now_s, now_s]
            written += 1
        self.counters["written_blocks"] += written
        if retain_until_s:
            self.write_manifest()
        return written

    def _write(self, key: int, data: bytes) -> bool:
        """Write a block atomically, owner-only; False on any OS error (a full disk above
        all), counted, with nothing left behind."""
        # Only the fan-out folder: a tier whose directory vanished stays without one (a
        # recreated parent would get the umask's permissions, not the owner's alone).
        path = self._path(key)
        try:
            path.parent.mkdir(mode=_DIR_MODE, exist_ok=True)
        except OSError as error:
            self.counters["write_failures"] += 1
            logger.warning("disk KV block not written (%s); it stays a miss", error)
            return False
        return self._atomic_write(path, data)

    def _atomic_write(self, path: Path, data: bytes) -> bool:
        """A temporary file renamed into place, owner-only; False on any OS error, counted."""
        tmp = path.parent / f".tmp{secrets.token_hex(6)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(tmp, path)
            return True
        except OSError as error:
            self.counters["write_failures"] += 1
            logger.warning("disk KV block not written (%s); it stays a miss", error)
            _unlink(tmp)
            return False

    # ----------------------------------------------------------------- housekeeping

    def flush(self) -> int:
        """Delete every stored block (and so every retention on disk); returns how many."""
        num = 0
        while (key := self.index.pop_victim()) is not None:
            self._forget(key, "flush")
            _unlink(self._path(key))
            num += 1
        self.write_manifest()
        return num

    def retention(self, key: int) -> Retention | None:
        """The live retention of a stored block (expiry in wall time, owner digest)."""
        return self.index.retention(key)

    def residency_stats(self) -> TierResidency:
        return self.residency.snapshot(len(self.index), self.index.bytes_used)

    def stats(self) -> DiskStats:
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
        _unlink(self._path(key))

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


def _touch(path: Path) -> None:
    # The mtime is the LRU time a restart rebuilds the order from.
    try:
        os.utime(path)
    except OSError:
        pass
