"""DiskTier: the prefix cache's second tier, one file per KV block under a directory and a byte
budget (LRU, retained blocks last). Keys chain like block hashes but with a seed kept in the
directory, so they survive restarts; the index is rebuilt from file names and sizes alone.
Every failure (another model's or tenant's block, a torn file, a full disk, a vanished
directory) is a miss counted under its reason, never an exception and never a wrong block.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from radixkv.cache.disk_format import BlockRejected, check_block, digest, encode_block
from radixkv.cache.disk_index import DiskIndex
from radixkv.cache.hashing import BlockHasher

logger = logging.getLogger(__name__)

_SUFFIX = ".kvb"
_SEED_FILE = "seed"
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


class DiskTier:
    """Blocks on local disk for one model fingerprint and page size. Not thread-safe: the
    engine's step loop owns it, as it owns the tree."""

    def __init__(self, directory: str | Path, budget_bytes: int, *, fingerprint: str, page_size: int, payload_bytes: int):
        self.directory = Path(directory).expanduser()
        self.page_size = page_size
        self.payload_bytes = payload_bytes  # one page's KV, all layers
        self.fingerprint = digest(fingerprint)
        self.index = DiskIndex(budget_bytes)
        self.counters: Counter[str] = Counter()
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
        which a hit refreshes); no file is read. Torn temporary files are removed."""
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
        for _, key, size in found:
            evicted = self.index.add(key, size)
            # Over a budget that shrank since, the oldest go; one larger than all of it, itself.
            for victim in [key] if evicted is None else evicted:
                _unlink(self._path(victim))

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

    def load(
        self, token_ids: Sequence[int], salt: str | None, keys: Sequence[int], start_block: int, num_blocks: int
    ) -> list[bytes]:
        """The KV bytes of blocks [start_block, start_block + num_blocks), each checked against
        this model, this tenant and these tokens; stops at the first block that fails (counted
        by reason, its file deleted) or is missing."""
        payloads: list[bytes] = []
        if not self.enabled:
            return payloads
        tokens = list(token_ids)
        ps = self.page_size
        start_s = time.perf_counter()
        for block in range(start_block, start_block + num_blocks):
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
                self.counters["rejected_missing"] += 1
                self.index.remove(key)
                break
            except OSError as error:
                self.counters["rejected_unreadable"] += 1
                logger.warning("disk KV block %s unreadable: %s", path, error)
                self.index.remove(key)
                break
            except BlockRejected as rejected:
                self.counters[f"rejected_{rejected.reason}"] += 1
                self._drop(key)
                break
            payloads.append(payload)
            self.index.touch(key)
            _touch(path)
        self.counters["hit_blocks"] += len(payloads)
        if payloads:
            per_block = (time.perf_counter() - start_s) / len(payloads)
            old = self.read_s_per_block
            self.read_s_per_block = per_block if old is None else 0.8 * old + 0.2 * per_block
        return payloads

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
        retained: bool = False,
    ) -> int:
        """Store blocks [start_block, start_block + num_blocks) of `token_ids`, the KV of the
        i-th from payload_of(i) (asked only for blocks not stored yet; a stored one is only
        marked used). Returns blocks written. A failed write keeps nothing of that block."""
        if not self.enabled:
            return 0
        tokens = list(token_ids)
        ps = self.page_size
        written = 0
        for offset in range(num_blocks):
            block = start_block + offset
            key = keys[block]
            if key in self.index:
                self.index.touch(key)
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
            evicted = self.index.add(key, len(data), retained=retained)
            if evicted is None:
                self.counters["too_large"] += 1
                break
            for victim in evicted:
                _unlink(self._path(victim))
            self.counters["evicted_blocks"] += len(evicted)
            if not self._write(key, data):
                self.index.remove(key)
                break  # the rest of a run is useless without this block
            written += 1
        self.counters["written_blocks"] += written
        return written

    def _write(self, key: int, data: bytes) -> bool:
        """Write atomically (a temporary file renamed into place), owner-only; False on any
        OS error (a full disk above all), counted, with nothing left behind."""
        path = self._path(key)
        tmp = path.parent / f".tmp{secrets.token_hex(6)}"
        try:
            # Only the fan-out folder: a tier whose directory vanished stays without one (a
            # recreated parent would get the umask's permissions, not the owner's alone).
            path.parent.mkdir(mode=_DIR_MODE, exist_ok=True)
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
        """Delete every stored block; returns how many."""
        num = 0
        while (key := self.index.pop_victim()) is not None:
            _unlink(self._path(key))
            num += 1
        return num

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
        )

    def _drop(self, key: int) -> None:
        self.index.remove(key)
        _unlink(self._path(key))

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
