"""CacheEvents: the cache floor's one observer bus. RadixTree and DiskTier publish what they store,
evict and drop as typed records; the listeners (KV events, the ghost index, residency, the disk
write-back) subscribe, so no tier chains another's callbacks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from radixkv.cache.hashing import BlockHash

if TYPE_CHECKING:
    from radixkv.cache.radix_node import Node

Tier = Literal["ram", "disk"]


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Blocks a tier caches from now on. RAM: `node`, a new leaf under node.parent, with its
    hashes and pages (a later split shortens a node's runs in place: a listener copies what it
    keeps). Disk: the keys of a save, stored or stored again; no node, no pages."""

    tier: Tier
    hashes: Sequence[BlockHash]
    pages: Sequence[int] = ()
    node: Node | None = None


@dataclass(frozen=True, slots=True)
class BlocksEvicted:
    """RAM is evicting `node`, an unlocked leaf, whose pages still hold its KV (listeners run
    before they are freed, and must not change the tree). `flushing`: an admin flush, not a need
    for room; `write_back` False: every tier drops these blocks (RAM and disk flushed at once),
    so no listener keeps a copy below."""

    node: Node
    flushing: bool = False
    write_back: bool = True
    tier: Tier = "ram"


@dataclass(frozen=True, slots=True)
class BlocksDropped:
    """The disk tier deleted these blocks (keys) to stay within its byte budget."""

    hashes: Sequence[BlockHash]
    tier: Tier = "disk"


@dataclass(frozen=True, slots=True)
class AllCleared:
    """Every block a tier cached was dropped at once (RadixTree.reset)."""

    tier: Tier = "ram"


@dataclass(frozen=True, slots=True)
class WindowBlocks:
    """The window layers' group (cache/layer_groups.py) now holds (`stored`) or no longer holds
    the window KV of these RAM blocks, each a (hash, parent hash or None) pair. Dropped: the
    window pool needed room (the tree keeps the blocks' full KV) or the tree evicted the blocks
    (after their BlocksEvicted). KV events publish them as the window group's own."""

    blocks: Sequence[tuple[BlockHash, BlockHash | None]]
    stored: bool
    window: int
    tier: Tier = "ram"


CacheEvent = BlocksStored | BlocksEvicted | BlocksDropped | AllCleared | WindowBlocks
Listener = Callable[[CacheEvent], None]


class CacheEvents:
    """Listeners in subscription order, each told every event synchronously, on the thread that
    caused it (the engine's step loop). A listener may publish in turn (a write-back's save makes
    the disk tier drop blocks): nesting is allowed, changing the tree from one is not."""

    __slots__ = ("_listeners",)

    def __init__(self) -> None:
        self._listeners: tuple[Listener, ...] = ()

    def subscribe(self, listener: Listener) -> None:
        self._listeners = (*self._listeners, listener)

    def unsubscribe(self, listener: Listener) -> None:
        """Stop telling `listener` (one subscription of it); a listener not subscribed is ignored."""
        listeners = list(self._listeners)
        if listener in listeners:
            listeners.remove(listener)
            self._listeners = tuple(listeners)

    def publish(self, event: CacheEvent) -> None:
        for listener in self._listeners:  # a tuple: a listener subscribing meanwhile is told next time
            listener(event)

    def __len__(self) -> int:
        return len(self._listeners)

    def __contains__(self, listener: object) -> bool:
        return listener in self._listeners
