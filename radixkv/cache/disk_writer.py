"""DiskWriter: the disk tier's writer thread. Block writes, deletions and manifest rewrites run on
it in the order queued; a queued block is served from memory until its file is in place, and
what could not be written waits for the step loop to settle it (DiskTier._settle).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from radixkv.cache.disk_directory import DiskDirectory

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class WriteRun:
    """The blocks one save() queued: a block the writer could not write drops the rest (a run
    is useless past a missing block)."""

    failed: bool = False
    unwritten: int = 0


@dataclass(slots=True, eq=False)
class QueuedBlock:
    """A block queued for the writer; until written it is read from here (never missing)."""

    key: int
    parent_key: int
    salt: str | None
    tokens: list[int]  # the run's tokens (shared by its blocks); this block ends at num_prefix_tokens
    num_prefix_tokens: int
    payload: bytes
    run: WriteRun


class DiskWriter:
    """The queue and the thread that empties it. `encode` makes a block's file bytes (raising
    OverflowError for a block no file can hold), `manifest_bytes` the manifest's, `enabled` says
    whether the tier is still open."""

    def __init__(
        self,
        directory: DiskDirectory,
        *,
        encode: Callable[[QueuedBlock], bytes],
        manifest_bytes: Callable[[], bytes],
        enabled: Callable[[], bool],
        max_queued_bytes: int,
    ) -> None:
        self.directory = directory
        self._encode = encode
        self._manifest_bytes = manifest_bytes
        self._enabled = enabled
        self.max_queued_bytes = max_queued_bytes  # past it, the saver waits for the writer
        # Blocks queued and not yet written (read from here meanwhile), and what could not be
        # written (settled on the loop: counted, forgotten).
        self._queued = threading.Condition()
        self._pending: dict[int, QueuedBlock] = {}
        self._pending_bytes = 0
        self._unwritten: list[tuple[QueuedBlock, str]] = []
        self._manifest_queued = False
        self._manifest_failures = 0
        self._jobs: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="radixkv-disk-writer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish what is queued, then end the thread."""
        if self.running:
            assert self._thread is not None
            self._jobs.put(("stop",))
            self._thread.join()
        self._thread = None

    # -- on the loop -----------------------------------------------------------------------------

    def pending(self, key: int) -> QueuedBlock | None:
        """The block queued under `key` and not yet written; None when its file is in place."""
        with self._queued:
            return self._pending.get(key)

    def queue_block(self, block: QueuedBlock) -> None:
        with self._queued:
            old = self._pending.get(block.key)
            if old is not None:
                self._pending_bytes -= len(old.payload)
            self._pending[block.key] = block
            self._pending_bytes += len(block.payload)
        self._jobs.put(("block", block))

    def queue_manifest(self) -> None:
        """Have the writer rewrite the manifest, once for however many changes queue up before
        it gets to it (it takes the retentions as they are then)."""
        with self._queued:
            if self._manifest_queued:
                return
            self._manifest_queued = True
        self._jobs.put(("manifest",))

    def delete(self, key: int) -> None:
        """The block leaves the tier: no longer served from the queue, its file deleted by the
        writer (after any write of it queued before)."""
        with self._queued:
            block = self._pending.pop(key, None)
            if block is not None:
                self._pending_bytes -= len(block.payload)
                self._queued.notify_all()
        self._jobs.put(("unlink", key))

    def wait_for_room(self) -> bool:
        """Bounded memory: past max_queued_bytes of blocks not yet written, wait for the writer
        to catch up; whether it waited. Never with the index lock held: the writer may need it."""
        with self._queued:
            if self._pending_bytes <= self.max_queued_bytes:
                return False
            self._queued.wait_for(lambda: self._pending_bytes <= self.max_queued_bytes)
            return True

    def barrier(self) -> None:
        """Wait until every job queued so far is done."""
        if not self.running:
            return
        done = threading.Event()
        self._jobs.put(("barrier", done))
        done.wait()

    def take_unwritten(self) -> tuple[list[tuple[QueuedBlock, str]], int]:
        """What the writer could not write since the last call, with why, and how many manifest
        writes failed."""
        with self._queued:
            unwritten, self._unwritten = self._unwritten, []
            failures, self._manifest_failures = self._manifest_failures, 0
        return unwritten, failures

    def is_queued(self, key: int) -> bool:
        with self._queued:
            return key in self._pending

    # -- on the writer thread --------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job[0] == "block":
                    self._write_block(job[1])
                elif job[0] == "unlink":
                    self.directory.unlink_block(job[1])
                elif job[0] == "manifest":
                    with self._queued:
                        self._manifest_queued = False
                    if self._enabled():
                        self._write_manifest()
                elif job[0] == "barrier":
                    job[1].set()
                else:  # "stop"
                    return
            except Exception:  # the writer must outlive any one job; what it lost is a miss
                logger.exception("disk KV writer: %s failed", job[0])

    def _write_block(self, block: QueuedBlock) -> None:
        with self._queued:
            if self._pending.get(block.key) is not block:
                return  # evicted (or queued again) since: nothing to write
        reason = "dropped" if block.run.failed else None
        if reason is None:
            try:
                data = self._encode(block)
            except OverflowError:  # a token id past int32: no vocabulary has one, so no model's
                reason = "unstorable"
            else:
                if not self.directory.write_block(block.key, data):
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

    def _write_manifest(self) -> None:
        try:
            self.directory.write_manifest(self._manifest_bytes())
        except OSError as error:
            with self._queued:
                self._manifest_failures += 1  # counted on the loop (DiskTier._settle)
            logger.warning("disk KV retentions not written (%s)", error)
