"""Block hashes: one 128-bit hash per full block of `page_size` tokens, chained from the first
block, so a single hash names a whole prefix. Owns the per-process seed and the byte layout
that is hashed; the radix tree never trusts a hash alone (it compares tokens too).
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

BlockHash = int  # 128-bit int from xxhash.xxh3_128_intdigest
HashFn = Callable[[bytes], int]

_MASK_128 = (1 << 128) - 1
_MASK_64 = (1 << 64) - 1
# Tags keep the first-block and chained-block layouts apart, so a parent hash can never be
# read as a seed/salt header and vice versa.
_TAG_FIRST = b"\x01"
_TAG_CHAINED = b"\x02"
_SALT_NONE = b"\x00"
_SALT_STR = b"\x01"
_INT64_BYTES = 8


def _default_hash(data: bytes) -> int:
    return xxhash.xxh3_128_intdigest(data)


class BlockHasher:
    """Hashes token blocks as `hash(header || token ids as little-endian int64)`.

    The header of the first block is (seed, salt); of every later block, (seed, parent hash).
    A salt of None and a salt of "" are different tenants.
    """

    __slots__ = ("page_size", "seed", "hash_fn", "_seed_bytes", "_block_struct", "_block_bytes")

    def __init__(self, page_size: int, seed: int | None = None, hash_fn: HashFn | None = None):
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
        # A random per-process seed makes collisions uncraftable by clients (CVE-2025-25183).
        self.seed: int = secrets.randbits(64) if seed is None else seed
        self.page_size: int = page_size
        self.hash_fn: HashFn = _default_hash if hash_fn is None else hash_fn
        self._seed_bytes = (self.seed & _MASK_64).to_bytes(8, "little")
        self._block_struct = struct.Struct(f"<{page_size}q")
        self._block_bytes = page_size * _INT64_BYTES

    def first_header(self, salt: str | None) -> bytes:
        """Bytes hashed before the tokens of a first block (seed and salt)."""
        if salt is None:
            return _TAG_FIRST + self._seed_bytes + _SALT_NONE
        salt_bytes = salt.encode("utf-8")
        # Length-prefixed so the salt cannot run into the token bytes.
        return _TAG_FIRST + self._seed_bytes + _SALT_STR + len(salt_bytes).to_bytes(8, "little") + salt_bytes

    def _chained_header(self, parent: BlockHash) -> bytes:
        return _TAG_CHAINED + self._seed_bytes + (parent & _MASK_128).to_bytes(16, "little")

    def _header(self, parent: BlockHash | None, salt: str | None) -> bytes:
        return self.first_header(salt) if parent is None else self._chained_header(parent)

    def hash_block(self, parent: BlockHash | None, block_tokens: Sequence[int], salt: str | None = None) -> BlockHash:
        """Hash of one full block; `parent` None means it is the first block (salt applies)."""
        if len(block_tokens) != self.page_size:
            raise ValueError(f"a block holds exactly page_size={self.page_size} tokens, got {len(block_tokens)}")
        return self.hash_fn(self._header(parent, salt) + self._token_bytes(block_tokens))

    def hash_blocks(
        self, token_ids: Sequence[int], salt: str | None = None, parent: BlockHash | None = None
    ) -> list[BlockHash]:
        """Hashes of the full blocks of `token_ids` (a partial tail is ignored), chained from
        `parent`; the salt only matters when `parent` is None (it is already in the chain)."""
        num_blocks = len(token_ids) // self.page_size
        if num_blocks == 0:
            return []
        data = self._token_bytes(token_ids[: num_blocks * self.page_size])
        fn, step = self.hash_fn, self._block_bytes
        hashes: list[BlockHash] = []
        header = self._header(parent, salt)
        for start in range(0, num_blocks * step, step):
            parent = fn(header + data[start : start + step])
            hashes.append(parent)
            header = self._chained_header(parent)
        return hashes

    def extend(self, hashes: list[BlockHash], token_ids: Sequence[int], salt: str | None) -> list[BlockHash]:
        """Extend `hashes` (those of the first blocks of `token_ids`) in place to every full
        block of `token_ids`, hashing only the new ones; returns it."""
        start = len(hashes) * self.page_size
        if start + self.page_size <= len(token_ids):
            hashes.extend(self.hash_blocks(token_ids[start:], salt, parent=hashes[-1] if hashes else None))
        return hashes

    def _token_bytes(self, token_ids: Sequence[int]) -> bytes:
        # numpy arrays convert in C; for Python lists struct.pack is faster than np.asarray.
        if isinstance(token_ids, np.ndarray):
            return np.ascontiguousarray(token_ids, dtype="<i8").tobytes()
        try:
            if len(token_ids) == self.page_size:
                return self._block_struct.pack(*token_ids)
            return struct.pack(f"<{len(token_ids)}q", *token_ids)
        except struct.error as exc:
            raise ValueError(f"token ids must be integers in the int64 range: {exc}") from None
