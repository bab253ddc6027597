"""GhostIndex: what the cache held and no longer holds, remembered in bounded memory so a miss
can say why. Block hashes evicted from RAM (or dropped by the disk tier) and the partial last
page each finished sequence left uncached, each capped and forgotten least recent first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from radixkv.cache.events import BlocksDropped, BlocksEvicted, BlocksStored, CacheEvent
from radixkv.cache.hashing import BlockHash


class GhostIndex:
    """Two bounded LRU maps, O(1) per block: evicted block hashes (tree hashes and disk keys,
    128-bit chained hashes of a whole prefix under its salt, so one partition's entry never
    answers another's lookup) and partial tails (the hash of the full block before a sequence's
    uncached partial last page, or of its partition's root, -> that page's length and a digest
    of its tokens). Nothing here holds KV; a lookup changes nothing."""

    __slots__ = ("capacity", "_evicted", "_tails")

    def __init__(self, capacity: int) -> None:
        assert capacity >= 1, "EngineConfig validates max_ghost_blocks"
        self.capacity = capacity
        self._evicted: OrderedDict[BlockHash, None] = OrderedDict()
        self._tails: OrderedDict[BlockHash, tuple[int, int]] = OrderedDict()

    # -- evicted blocks ------------------------------------------------------------------------

    def listen(self, event: CacheEvent) -> None:
        """A CacheEvents listener: blocks leaving RAM (evicted) or the disk tier (dropped) are
        ghosts from now on; blocks stored again in either are not."""
        if isinstance(event, BlocksStored):
            self.discard(event.hashes)
        elif isinstance(event, BlocksEvicted):
            self.add(event.node.hashes)
        elif isinstance(event, BlocksDropped):
            self.add(event.hashes)

    def add(self, hashes: Iterable[BlockHash]) -> None:
        """Remember blocks that just left a tier (most recent last); the oldest go past capacity."""
        evicted = self._evicted
        for block_hash in hashes:
            evicted[block_hash] = None
            evicted.move_to_end(block_hash)
        while len(evicted) > self.capacity:
            evicted.popitem(last=False)

    def discard(self, hashes: Iterable[BlockHash]) -> None:
        """Blocks cached again: no longer ghosts."""
        for block_hash in hashes:
            self._evicted.pop(block_hash, None)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._evicted

    def __len__(self) -> int:
        return len(self._evicted)

    # -- partial last pages --------------------------------------------------------------------

    def add_tail(self, parent: BlockHash, tail_tokens: Sequence[int]) -> None:
        """A sequence ended with `tail_tokens` (fewer than a page) after the block `parent`:
        computed, never cached, since only full blocks are."""
        if not tail_tokens:
            return
        self._tails[parent] = (len(tail_tokens), _digest(tail_tokens))
        self._tails.move_to_end(parent)
        while len(self._tails) > self.capacity:
            self._tails.popitem(last=False)

    def continues_tail(self, parent: BlockHash, block_tokens: Sequence[int]) -> bool:
        """Whether `block_tokens`, the block after `parent`, begins with the partial page a
        sequence left there; pure."""
        tail = self._tails.get(parent)
        if tail is None:
            return False
        length, digest = tail
        return length <= len(block_tokens) and _digest(block_tokens[:length]) == digest

    @property
    def num_tails(self) -> int:
        return len(self._tails)


def _digest(tokens: Sequence[int]) -> int:
    # A collision mislabels a miss (partial_page for never_seen) within one partition, no more.
    return hash(tuple(tokens))
