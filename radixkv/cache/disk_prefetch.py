"""DiskPrefetcher: reads a sequence's disk hit on a background thread ahead of its use, so the
files are read and checked while the step loop computes other work (or the sequence's own
earlier chunks). It holds bytes only; pages are taken on the loop when the blocks are used.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from radixkv.cache.disk import DiskTier
from radixkv.cache.disk_reads import DiskRead


@dataclass(slots=True, eq=False)
class Prefetch:
    """One sequence's run of disk blocks [start_block, end_block), being read in order."""

    keys: list[int]
    start_block: int
    end_block: int
    run_end_block: int  # where the run on disk ended when the read began (past end_block: read in parts)
    read: DiskRead | None = None  # set by the worker as it starts; payloads grow block by block
    taken: int = 0  # payloads handed out so far (their blocks are start_block + 0..taken-1)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    progress: threading.Condition = field(default_factory=threading.Condition)

    @property
    def next_block(self) -> int:
        return self.start_block + self.taken

    def num_read(self) -> int:
        return 0 if self.read is None else len(self.read.payloads)


@dataclass(frozen=True, slots=True)
class Taken:
    payloads: list[bytes]
    failure: str | None  # why the run stopped right after these payloads; None: it did not (yet)
    read_s_per_block: float | None  # read and check time per block, on the worker
    num_ready: int  # of the payloads, those read before they were asked for (no wait)


class DiskPrefetcher:
    """One worker thread (a disk is read faster in order than in parallel, and the loop needs
    the first sequence's blocks first), at most `max_bytes` of payloads read and not yet taken."""

    def __init__(self, disk: DiskTier, max_bytes: int) -> None:
        self.disk = disk
        self.max_bytes = max_bytes
        self._pending: dict[int, Prefetch] = {}
        self._executor: ThreadPoolExecutor | None = None

    def get(self, seq_id: int) -> Prefetch | None:
        return self._pending.get(seq_id)

    def room_blocks(self) -> int:
        """How many more blocks may be asked for now within the byte budget."""
        held = sum(p.end_block - p.next_block for p in self._pending.values())
        return max(0, self.max_bytes // max(1, self.disk.payload_bytes) - held)

    def start(
        self, seq_id: int, token_ids: Sequence[int], salt: str | None, keys: list[int], start: int, num: int, run_end: int
    ) -> Prefetch:
        """Begin reading blocks [start, start + num) of the sequence's prefix, part of a run
        on disk that ends at block `run_end`."""
        assert seq_id not in self._pending
        prefetch = Prefetch(keys, start, start + num, run_end)
        self._pending[seq_id] = prefetch
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixkv-disk-prefetch")
        tokens = list(token_ids[: (start + num) * self.disk.page_size])  # a snapshot: the worker's own
        self._executor.submit(self._read, prefetch, tokens, salt)
        return prefetch

    def _read(self, prefetch: Prefetch, tokens: list[int], salt: str | None) -> None:
        def on_block(_: bytes) -> bool:
            with prefetch.progress:
                prefetch.progress.notify_all()
            return not prefetch.cancelled

        try:
            if not prefetch.cancelled:
                # read() appends to the DiskRead it returns; publish it first so the loop can take
                # the first blocks while later ones are still being read.
                prefetch.read = DiskRead(prefetch.start_block)
                result = self.disk.read(
                    tokens, salt, prefetch.keys, prefetch.start_block, prefetch.end_block - prefetch.start_block,
                    on_block=on_block, into=prefetch.read,
                )
                prefetch.read = result
        finally:
            prefetch.done.set()
            with prefetch.progress:
                prefetch.progress.notify_all()

    def ready(self, seq_id: int, num_blocks: int) -> bool:
        """Whether the sequence's next `num_blocks` blocks (or all its run has) are read."""
        prefetch = self._pending.get(seq_id)
        if prefetch is None or prefetch.done.is_set():
            return True
        return prefetch.num_read() - prefetch.taken >= min(num_blocks, prefetch.end_block - prefetch.next_block)

    def take(self, seq_id: int, num_blocks: int) -> Taken:
        """The next up to `num_blocks` payloads of the sequence's run, waiting for them to be
        read. Fewer than asked: the block after them failed (Taken.failure) or the run ended.
        The record goes once its run is used up or stopped."""
        prefetch = self._pending[seq_id]
        want = min(num_blocks, prefetch.end_block - prefetch.next_block)
        ready = prefetch.num_read() - prefetch.taken
        with prefetch.progress:
            prefetch.progress.wait_for(lambda: prefetch.num_read() - prefetch.taken >= want or prefetch.done.is_set())
        read = prefetch.read
        if read is None:  # cancelled before it began
            self._pending.pop(seq_id, None)
            return Taken([], None, None, 0)
        num = min(want, len(read.payloads) - prefetch.taken)
        payloads = read.payloads[prefetch.taken : prefetch.taken + num]
        for i in range(prefetch.taken, prefetch.taken + num):
            read.payloads[i] = b""  # handed out: the budget counts untaken blocks only
        prefetch.taken += num
        stopped = prefetch.done.is_set() and prefetch.taken == len(read.payloads)
        per_block = read.seconds / len(read.payloads) if read.payloads else None
        if stopped or prefetch.next_block >= prefetch.end_block:
            self._pending.pop(seq_id, None)
        return Taken(payloads, read.failure if stopped else None, per_block, min(ready, num))

    def rekey(self, old_id: int, new_id: int) -> bool:
        """Hand the read under `old_id` (a hint's) to `new_id` (the sequence it was read for);
        False if there is none, or `new_id` has one already."""
        if old_id not in self._pending or new_id in self._pending:
            return False
        self._pending[new_id] = self._pending.pop(old_id)
        return True

    def cancel(self, seq_id: int) -> None:
        prefetch = self._pending.pop(seq_id, None)
        if prefetch is not None:
            prefetch.cancelled = True

    def close(self) -> None:
        for seq_id in list(self._pending):
            self.cancel(seq_id)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
