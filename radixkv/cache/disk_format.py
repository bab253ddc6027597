"""The byte layout of one KV block on disk: a fixed header (magic, version, model fingerprint,
tenant salt digest, the block's key and its parent's, sizes, checksum), then every token of
the prefix the block ends, then the block's KV bytes. Encoding and checking only; no I/O.
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass

import xxhash

MAGIC = b"RKVB"
VERSION = 1
# magic, version, page_size, num_prefix_tokens, payload_bytes, fingerprint, salt digest, key,
# parent key (0 for a first block), checksum of everything after the header and of the header
# before the checksum itself.
_HEADER = struct.Struct("<4sHIIQ16s16s16s16s16s")
HEADER_BYTES = _HEADER.size
_CHECKED_HEADER_BYTES = HEADER_BYTES - 16
_TOKEN_BYTES = 4  # int32: token ids are vocabulary indices


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

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.num_prefix_tokens * _TOKEN_BYTES + self.payload_bytes


def digest(text: str) -> bytes:
    return xxhash.xxh3_128_digest(text.encode("utf-8"))


def salt_digest(salt: str | None) -> bytes:
    # Tagged, so the tenant "" and the tenant-less prompts stay apart.
    return digest("\x00none" if salt is None else "\x01" + salt)


def encode_block(
    *,
    fingerprint: bytes,
    salt: str | None,
    key: int,
    parent_key: int,
    page_size: int,
    prefix_tokens: list[int],
    payload: bytes,
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
        page_size,
        len(prefix_tokens),
        len(payload),
        fingerprint,
        salt_digest(salt),
        key.to_bytes(16, "little"),
        parent_key.to_bytes(16, "little"),
        b"\x00" * 16,
    )
    checksum = _checksum(head[:_CHECKED_HEADER_BYTES], body)
    return head[:_CHECKED_HEADER_BYTES] + checksum + body


def decode_header(data: bytes) -> BlockHeader:
    if len(data) < HEADER_BYTES:
        raise BlockRejected("truncated", f"{len(data)} bytes, a header needs {HEADER_BYTES}")
    magic, version, page_size, num_tokens, payload_bytes, fingerprint, salt, key, parent, checksum = _HEADER.unpack(
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
    )


def check_block(
    data: bytes,
    *,
    fingerprint: bytes,
    salt: str | None,
    key: int,
    parent_key: int,
    page_size: int,
    prefix_tokens: list[int],
    payload_bytes: int,
) -> bytes:
    """The payload of a stored block if it is exactly the block asked for, else BlockRejected
    with the reason: another model's, another tenant's, truncated, corrupt, or other tokens."""
    header = decode_header(data)
    if header.fingerprint != fingerprint or header.page_size != page_size or header.payload_bytes != payload_bytes:
        raise BlockRejected("fingerprint", "written by another model or layout")
    if header.salt_digest != salt_digest(salt):
        raise BlockRejected("salt", "written for another tenant")
    if len(data) != header.file_bytes:
        raise BlockRejected("truncated", f"{len(data)} bytes, the header says {header.file_bytes}")
    if header.key != key or header.parent_key != parent_key:
        raise BlockRejected("corrupt", "the key in the header is not the file's")
    body = data[HEADER_BYTES:]
    if _checksum(data[:_CHECKED_HEADER_BYTES], body) != header.checksum:
        raise BlockRejected("checksum", "the bytes changed since they were written")
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
