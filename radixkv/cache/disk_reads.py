"""BlockReader: the disk tier's reads. A run of blocks is read from the writer's queue or from its
files and checked against the model, the tenant and the tokens before a payload is trusted;
reads change nothing in memory, so they may run off the step loop (the prefetch thread).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from radixkv.cache.disk_directory import DiskDirectory
from radixkv.cache.disk_format import (
    HEADER_BYTES, BlockFormat, BlockRejected, block_file_bytes, check_block, check_header, salt_digest,
)  # fmt: skip
from radixkv.cache.disk_writer import QueuedBlock

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DiskRead:
    """What one read of a run of blocks found: the payloads of its first blocks, in order, and
    why it stopped early (None: it read every block asked for, or was cancelled)."""

    start_block: int
    payloads: list[bytes] = field(default_factory=list)
    failure: str | None = None  # "missing", "unreadable" or a BlockRejected reason
    seconds: float = 0.0  # spent reading and checking the payloads


class BlockReader:
    """Reads for one open tier: its directory, the writer's queue (`pending`), and what a block
    must match (fingerprint digest, page size, payload size, the directory's MAC key)."""

    def __init__(
        self,
        directory: DiskDirectory,
        pending: Callable[[int], QueuedBlock | None],
        fmt: BlockFormat,
    ) -> None:
        self.directory = directory
        self.pending = pending
        self.format = fmt

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
        tokens = list(token_ids)
        ps = self.format.page_size
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
                    sizes = [block_file_bytes(len(prefix_tokens), size) for size in self.format.payload_sizes]
                    data = self._read_file(key, sizes, salt)
                    payload = check_block(data, self.format, salt=salt, key=key, parent_key=parent_key, prefix_tokens=prefix_tokens)
            except FileNotFoundError:
                result.failure = "missing"
            except OSError as error:
                result.failure = "unreadable"
                logger.warning("disk KV block %s unreadable: %s", self.directory.block_path(key), error)
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
        block = self.pending(key)
        if block is None:
            return None
        if salt_digest(block.salt) != salt_digest(salt):
            raise BlockRejected("salt", "written for another tenant")
        if block.parent_key != parent_key:
            raise BlockRejected("corrupt", "the key in the header is not the file's")
        if block.tokens[: block.num_prefix_tokens] != prefix_tokens:
            raise BlockRejected("tokens", "another prefix under the same key")
        return block.payload

    def _read_file(self, key: int, sizes: list[int], salt: str | None) -> bytes:
        """A block file's bytes, opened without following a symlink (neither the file nor its
        folder), and read only if it is a regular file of exactly the size a block of its
        place in the prefix has: a planted pipe, link or huge file is refused unread (but for
        its header, which says whether it is another model's or tenant's)."""
        fd = self.directory.open_block(key)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise BlockRejected("not_a_file", f"mode {info.st_mode:o}")
            if info.st_size not in sizes:
                check_header(os.read(fd, HEADER_BYTES), self.format, salt)
                reason = "truncated" if info.st_size < max(sizes) else "oversized"
                raise BlockRejected(reason, f"{info.st_size} bytes, a block here has {' or '.join(map(str, sizes))}")
            expected_bytes = info.st_size
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
