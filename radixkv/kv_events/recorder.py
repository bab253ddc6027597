"""KVEventRecorder: the cache bus's listener that turns each change to its set of cached blocks
into a vLLM-schema event, kept until the engine flushes them as one batch (once per step, as
vLLM publishes once per scheduler step).
"""

from __future__ import annotations

import time
from typing import Protocol

from radixkv.cache.events import AllCleared, BlocksEvicted, BlocksStored, CacheEvent, WindowBlocks
from radixkv.cache.radix import Node
from radixkv.kv_events.schema import (
    GROUP_IDX,
    SPEC_KIND,
    WINDOW_GROUP_IDX,
    WINDOW_SPEC_KIND,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    wire_hash,
)


class BatchSink(Protocol):
    def publish(self, batch: EventBatch) -> None: ...

    def close(self) -> None: ...


class KVEventRecorder:
    """A CacheEvents listener (radixkv.cache.events, `listen`) for one tree's RAM tier. Runs on the engine's thread, like the
    tree; `sink.publish` must not block (the ZMQ publisher only queues).

    The events go to whoever can reach the socket, so by default a BlockStored carries hashes
    only: its token ids (the tenants' prompts) and extra keys (their cache salts) are sent only
    with `token_ids=True` (EngineConfig.kv_events_token_ids), for indexers that need them. Without
    them the event stays valid in vLLM's schema: token_ids is [] and extra_keys is None."""

    def __init__(
        self, sink: BatchSink, page_size: int, medium: str, data_parallel_rank: int = 0, *, token_ids: bool = False
    ) -> None:
        self.sink = sink
        self.token_ids = token_ids
        self.page_size = page_size
        self.medium = medium
        self.data_parallel_rank = data_parallel_rank
        self._pending: list[KVCacheEvent] = []

    def listen(self, event: CacheEvent) -> None:
        """Subscribe this to the tree's bus: RAM's stored, evicted and cleared blocks become
        events; the disk tier's are not published (vLLM's schema has one medium per producer)."""
        if event.tier != "ram":
            return
        if isinstance(event, BlocksStored) and event.node is not None:
            self.blocks_stored(event.node)
        elif isinstance(event, BlocksEvicted):
            self.blocks_removed(event.node)
        elif isinstance(event, AllCleared):
            self.all_cleared()
        elif isinstance(event, WindowBlocks):
            self.window_blocks(event)

    def blocks_stored(self, node: Node) -> None:
        # Copied now: a later split cuts node.hashes and node.tokens in place.
        parent = node.parent
        first_block = parent is None or parent.parent is None
        extra_keys: list[tuple[str, ...] | None] | None = None
        if self.token_ids:
            extra_keys = [None] * len(node.hashes)
            if first_block and node.salt is not None:
                extra_keys[0] = (node.salt,)  # the salt enters the chain at the first block only
        self._pending.append(
            BlockStored(
                block_hashes=[wire_hash(h) for h in node.hashes],
                parent_block_hash=None if first_block else wire_hash(parent.hashes[-1]),
                token_ids=list(node.tokens) if self.token_ids else [],
                block_size=self.page_size,
                lora_id=None,
                medium=self.medium,
                lora_name=None,
                extra_keys=extra_keys,
                group_idx=GROUP_IDX,
                kv_cache_spec_kind=SPEC_KIND,
            )
        )

    def blocks_removed(self, node: Node) -> None:
        self._pending.append(
            BlockRemoved(block_hashes=[wire_hash(h) for h in node.hashes], medium=self.medium, group_idx=GROUP_IDX)
        )

    def window_blocks(self, event: WindowBlocks) -> None:
        """The window group's own stores and removals (group 1, `sliding_window`): a stored run
        goes out as one chain per run of consecutive blocks; token ids are never repeated here
        (the full group's event carried them where they are sent)."""
        hashes = [wire_hash(block_hash) for block_hash, _ in event.blocks]
        if not event.stored:
            self._pending.append(BlockRemoved(block_hashes=hashes, medium=self.medium, group_idx=WINDOW_GROUP_IDX))
            return
        chain: list[int] = []
        parent: int | None = None
        for (block_hash, block_parent), wire in zip(event.blocks, hashes):
            if chain and block_parent is not None and wire_hash(block_parent) == chain[-1]:
                chain.append(wire)
                continue
            self._window_chain(chain, parent, event.window)
            chain, parent = [wire], None if block_parent is None else wire_hash(block_parent)
        self._window_chain(chain, parent, event.window)

    def _window_chain(self, chain: list[int], parent: int | None, window: int) -> None:
        if chain:
            self._pending.append(
                BlockStored(
                    block_hashes=chain, parent_block_hash=parent, token_ids=[], block_size=self.page_size, lora_id=None,
                    medium=self.medium, lora_name=None, group_idx=WINDOW_GROUP_IDX, kv_cache_spec_kind=WINDOW_SPEC_KIND,
                    kv_cache_spec_sliding_window=window,
                )
            )

    def all_cleared(self) -> None:
        self._pending.append(AllBlocksCleared())

    def flush(self) -> int:
        """Publish the events since the last flush as one batch (none when there are none);
        returns how many events it carried."""
        if not self._pending:
            return 0
        events, self._pending = self._pending, []
        self.sink.publish(EventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank))
        return len(events)

    def close(self) -> None:
        """Publish what is pending, then close the sink (the publisher's sockets)."""
        self.flush()
        self.sink.close()
