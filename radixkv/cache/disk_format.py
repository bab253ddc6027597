"""The byte layout of one KV block on disk: a fixed header (magic, version, model fingerprint,
tenant salt digest, the block's key and its parent's, sizes, checksum, MAC), then every token
of the prefix the block ends, then the block's KV bytes. Encoding and checking only; no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from array import array
from dataclasses import dataclass

import xxhash

MAGIC = b"RKVB"
# 2: the MAC. 3: int8 pages' scales in fp16 (radixkv.cache.kv_dtype.SCALE_DTYPE), not fp32. A
# file of an older version is a miss ("corrupt"), never read as this one.
VERSION = 3
# magic, version, page_size, num_prefix_tokens, payload_bytes, fingerprint, salt digest, key,
# parent key (0 for a first block), checksum (xxh3: damage) of the header before it and of
# everything after the header, MAC (BLAKE2b keyed with the directory's key: a block someone
# else made) of the header before it and of everything after the header.
_HEADER = struct.Struct("<4sHIIQ16s16s16s16s16s16s")
HEADER_BYTES = _HEADER.size
_CHECKED_HEADER_BYTES = HEADER_BYTES - 32
_MACED_HEADER_BYTES = HEADER_BYTES - 16
MAC_KEY_BYTES = 32
_TOKEN_BYTES = 4  # int32: token ids are vocabulary indices


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """What every block file of one open tier is written with and checked against: the model's
    fingerprint digest, the page size, one page's KV bytes (all layers), the directory's MAC key."""

    fingerprint: bytes
    page_size: int
    payload_bytes: int
    mac_key: bytes
    # Layer groups: a block may carry its window layers' KV too (this many bytes more), where
    # RAM still held it when the block was written; 0 for a model of one group.
    window_bytes: int = 0

    @property
    def payload_sizes(self) -> tuple[int, ...]:
        """The payload sizes a block of this format may have: full layers, then with windows."""
        return (self.payload_bytes, self.payload_bytes + self.window_bytes) if self.window_bytes else (self.payload_bytes,)


class BlockRejected(Exception):
    """A stored block that must not be used; `reason` names the metric it counts under."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class BlockHeader:
    page_size: int
    num_prefix_tokens: int
    payload_bytes: int
    fingerprint: bytes  # 16-byte digest of the model fingerprint
    salt_digest: bytes  # 16-byte digest of the tenant salt (None and "" differ)
    key: int
    parent_key: int
    checksum: bytes
    mac: bytes

    @property
    def file_bytes(self) -> int:
        return block_file_bytes(self.num_prefix_tokens, self.payload_bytes)


def block_file_bytes(num_prefix_tokens: int, payload_bytes: int) -> int:
    """The size of the file of a block that ends a prefix of `num_prefix_tokens` tokens: known
    before a file is opened, so one of another size is refused unread."""
    return HEADER_BYTES + num_prefix_tokens * _TOKEN_BYTES + payload_bytes


def digest(text: str) -> bytes:
    return xxhash.xxh3_128_digest(text.encode("utf-8"))


# A retention owner the disk named that is not live in this process yet (a previous process's
# key, read back by another): RAM counts it under this alias of the disk's name until the owner
# itself retains (RetentionBook.rehome), and the disk keeps the name it had.
DISK_OWNER_PREFIX = "disk:"


def owner_id(owner: str | None) -> str:
    """How the disk names a retention's owner: a digest, so no owner id is ever stored; the
    alias of a disk name (disk_owner) is that name again, never a name of its own."""
    if owner is not None and owner.startswith(DISK_OWNER_PREFIX):
        return owner[len(DISK_OWNER_PREFIX) :]
    return digest("" if owner is None else owner).hex()


def disk_owner(owner_id: str) -> str:
    """The RAM alias of an owner the disk names `owner_id` and this process has not seen."""
    return DISK_OWNER_PREFIX + owner_id


def salt_digest(salt: str | None) -> bytes:
    # Tagged, so the tenant "" and the tenant-less prompts stay apart.
    return digest("\x00none" if salt is None else "\x01" + salt)


def encode_block(
    fmt: BlockFormat, *, salt: str | None, key: int, parent_key: int, prefix_tokens: list[int], payload: bytes
) -> bytes:
    """One file's bytes. The whole prefix is stored, not only the block's own tokens: a load
    then compares every token the block's KV depends on, so no hash is ever trusted alone."""
    tokens = array("i", prefix_tokens)
    if tokens.itemsize != _TOKEN_BYTES:
        raise AssertionError("array('i') is not 32-bit on this platform")
    body = tokens.tobytes() + payload
    head = _HEADER.pack(
        MAGIC,
        VERSION,
        fmt.page_size,
        len(prefix_tokens),
        len(payload),
        fmt.fingerprint,
        salt_digest(salt),
        key.to_bytes(16, "little"),
        parent_key.to_bytes(16, "little"),
        b"\x00" * 16,
        b"\x00" * 16,
    )
    head = head[:_CHECKED_HEADER_BYTES] + _checksum(head[:_CHECKED_HEADER_BYTES], body)
    return head + _mac(fmt.mac_key, head, body) + body


def decode_header(data: bytes) -> BlockHeader:
    if len(data) < HEADER_BYTES:
        raise BlockRejected("truncated", f"{len(data)} bytes, a header needs {HEADER_BYTES}")
    magic, version, page_size, num_tokens, payload_bytes, fingerprint, salt, key, parent, checksum, mac = _HEADER.unpack(
        data[:HEADER_BYTES]
    )
    if magic != MAGIC or version != VERSION:
        raise BlockRejected("corrupt", f"magic {magic!r} version {version}")
    return BlockHeader(
        page_size,
        num_tokens,
        payload_bytes,
        fingerprint,
        salt,
        int.from_bytes(key, "little"),
        int.from_bytes(parent, "little"),
        checksum,
        mac,
    )


def check_header(data: bytes, fmt: BlockFormat, salt: str | None) -> BlockHeader:
    """The header at the start of `data` if it is of this model, layout and tenant, else
    BlockRejected: "fingerprint" (another model or layout), "salt" (another tenant), or
    "truncated" / "corrupt" where it is no header of this version."""
    header = decode_header(data)
    if header.fingerprint != fmt.fingerprint or header.page_size != fmt.page_size or header.payload_bytes not in fmt.payload_sizes:
        raise BlockRejected("fingerprint", "written by another model or layout")
    if header.salt_digest != salt_digest(salt):
        raise BlockRejected("salt", "written for another tenant")
    return header


def check_block(data: bytes, fmt: BlockFormat, *, salt: str | None, key: int, parent_key: int, prefix_tokens: list[int]) -> bytes:
    """The payload of a stored block if it is exactly the block asked for, else BlockRejected
    with the reason: another model's, another tenant's, truncated, corrupt (or damaged:
    "checksum"), not made with this directory's key ("mac"), or other tokens."""
    header = check_header(data, fmt, salt)
    if len(data) != header.file_bytes:
        raise BlockRejected("truncated", f"{len(data)} bytes, the header says {header.file_bytes}")
    if header.key != key or header.parent_key != parent_key:
        raise BlockRejected("corrupt", "the key in the header is not the file's")
    body = data[HEADER_BYTES:]
    if _checksum(data[:_CHECKED_HEADER_BYTES], body) != header.checksum:
        raise BlockRejected("checksum", "the bytes changed since they were written")
    if not hmac.compare_digest(_mac(fmt.mac_key, data[:_MACED_HEADER_BYTES], body), header.mac):
        raise BlockRejected("mac", "not written with this directory's key")
    split = header.num_prefix_tokens * _TOKEN_BYTES
    stored = array("i")
    stored.frombytes(body[:split])
    if stored.tolist() != prefix_tokens:
        raise BlockRejected("tokens", "another prefix under the same key")
    return body[split:]


def _checksum(head: bytes, body: bytes) -> bytes:
    hasher = xxhash.xxh3_128()
    hasher.update(head)
    hasher.update(body)
    return hasher.digest()


def _mac(key: bytes, head: bytes, body: bytes) -> bytes:
    hasher = hashlib.blake2b(key=key, digest_size=16)
    hasher.update(head)
    hasher.update(body)
    return hasher.digest()
