"""The prefix cache: block hashes, the reference-counted KV page pool, and the radix tree that
maps cached full-block prefixes onto pages. Knows nothing of models or the scheduler.
"""

from __future__ import annotations

from radixkv.cache.events import AllCleared, BlocksDropped, BlocksEvicted, BlocksStored, CacheEvent, CacheEvents
from radixkv.cache.eviction import Liveness
from radixkv.cache.hashing import BlockHash, BlockHasher, HashFn
from radixkv.cache.pages import OutOfPages, PagePool
from radixkv.cache.radix import CacheStats, InsertResult, MatchResult, Node, RadixTree

__all__ = [
    "BlockHash",
    "BlockHasher",
    "AllCleared",
    "BlocksDropped",
    "BlocksEvicted",
    "BlocksStored",
    "CacheEvent",
    "CacheEvents",
    "CacheStats",
    "HashFn",
    "InsertResult",
    "Liveness",
    "MatchResult",
    "Node",
    "OutOfPages",
    "PagePool",
    "RadixTree",
]
