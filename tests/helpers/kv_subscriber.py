"""A KV-event subscriber written from vLLM's published schema alone, as an indexer would be: it
reads the ZMQ frames and decodes the msgpack with the independent `msgpack` library (never
radixkv's encoder), keeps the set of cached blocks with each block's parent and tokens, and
when the sequence numbers jump asks the replay socket for what it missed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import zmq

END_SEQ = -1


@dataclass(slots=True)
class Block:
    parent: int | None
    tokens: list[int] | None  # None: the publisher sent hashes only (no kv_events_token_ids)
    extra_keys: list | None
    medium: str | None


@dataclass
class SchemaSubscriber:
    endpoint: str
    replay_endpoint: str | None = None
    topic: bytes = b""
    blocks: dict[int, Block] = field(default_factory=dict)
    next_seq: int = 0  # the seq of the next batch to apply
    last_seen: int = -1  # the highest seq received live
    gaps: list[tuple[int, int | None]] = field(default_factory=list)  # (expected seq, seq received; None: a stall)
    drop_live: set[int] = field(default_factory=set)  # nth new live messages to lose (1-based)
    dropped_seqs: list[int] = field(default_factory=list)
    num_live: int = 0  # live messages that were new when they came, lost ones included
    num_replayed: int = 0
    batches: list[list] = field(default_factory=list)  # every decoded batch, in seq order
    group_blocks: dict[int, set[int]] = field(default_factory=dict)  # another group's blocks, by group_idx

    def __post_init__(self) -> None:
        context = zmq.Context.instance()
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(self.endpoint)
        self.dealer = None
        if self.replay_endpoint is not None:
            self.dealer = context.socket(zmq.DEALER)
            self.dealer.connect(self.replay_endpoint)

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.dealer is not None:
            self.dealer.close(linger=0)

    # -- live ---------------------------------------------------------------------------------

    def poll(self, timeout_ms: int = 0) -> bool:
        """Take one live message if one comes within timeout_ms; False if none did."""
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_bytes, payload = self.sub.recv_multipart()
        assert topic == self.topic and len(seq_bytes) == 8
        seq = int.from_bytes(seq_bytes, "big")
        self.last_seen = max(self.last_seen, seq)
        if seq < self.next_seq:
            return True  # a replay brought it already
        self.num_live += 1
        if self.num_live in self.drop_live:
            self.dropped_seqs.append(seq)  # an injected loss: as if the network ate it
            return True
        if seq > self.next_seq:
            self.gaps.append((self.next_seq, seq))
            self.replay_from(self.next_seq)
        if seq == self.next_seq:
            self._apply(seq, payload)
        return True

    def drain(self) -> None:
        while self.poll(0):
            pass

    def catch_up(self, last_seq: int, stall_ms: int = 2000) -> None:
        """Read live messages until batch `last_seq` has come (applied, or lost). When none
        comes for stall_ms (batches sent before the subscription took hold never arrive), ask
        the replay socket from the next one wanted, as an indexer does on reconnecting."""
        while self.last_seen < last_seq:
            if not self.poll(stall_ms):
                self.gaps.append((self.next_seq, None))
                self.replay_from(self.next_seq)
                self.last_seen = max(self.last_seen, self.next_seq - 1)

    # -- replay -------------------------------------------------------------------------------

    def replay_from(self, start_seq: int) -> None:
        assert self.dealer is not None, "a gap without a replay socket cannot be repaired"
        self.dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        while True:
            assert self.dealer.poll(5000), "the replay socket did not answer"
            frames = self.dealer.recv_multipart()
            assert len(frames) == 4 and frames[0] == b"", frames  # delimiter, topic, seq, payload
            _, topic, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                return
            assert topic == self.topic
            if seq == self.next_seq:
                self.num_replayed += 1
                self._apply(seq, payload)

    # -- the schema ---------------------------------------------------------------------------

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        # EventBatch: a positional array [ts, events, data_parallel_rank].
        assert isinstance(batch, list) and len(batch) == 3, batch
        ts, events, rank = batch
        assert isinstance(ts, float) and isinstance(events, list) and rank == 0
        for event in events:
            assert isinstance(event, dict), "events are tagged maps (vLLM >= #42892)"
            kind = event["type"]
            if event.get("group_idx") not in (None, 0):  # another KV cache group (vLLM's hybrid models)
                self._group_event(event)
            elif kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                for block_hash in event["block_hashes"]:
                    assert block_hash in self.blocks, f"removal of unknown block {block_hash:#x}"
                    del self.blocks[block_hash]
            elif kind == "AllBlocksCleared":
                self.blocks.clear()
                self.group_blocks.clear()
            else:
                raise AssertionError(f"unknown event type {kind!r}")
        self.batches.append(batch)
        self.next_seq = seq + 1

    def _group_event(self, event: dict) -> None:
        """A block of another group (a window group: `sliding_window`, its window in tokens) is
        stored or removed on its own; a group only ever holds blocks group 0 holds."""
        held = self.group_blocks.setdefault(event["group_idx"], set())
        for block_hash in event["block_hashes"]:
            if event["type"] == "BlockStored":
                assert event["kv_cache_spec_kind"] == "sliding_window" and event["kv_cache_spec_sliding_window"] > 0
                assert block_hash in self.blocks, f"group {event['group_idx']} stored {block_hash:#x} before group 0"
                held.add(block_hash)
            else:
                assert block_hash in held, f"group {event['group_idx']} removed unknown block {block_hash:#x}"
                held.discard(block_hash)

    def _stored(self, event: dict) -> None:
        hashes, tokens, size = event["block_hashes"], event["token_ids"], event["block_size"]
        # vLLM's schema always has token_ids; a publisher that keeps prompts private sends [].
        assert len(tokens) in (0, size * len(hashes)), event
        extra_keys = event.get("extra_keys") or [None] * len(hashes)
        parent = event["parent_block_hash"]
        assert parent is None or parent in self.blocks, f"parent {parent:#x} is not cached"
        for i, block_hash in enumerate(hashes):
            assert 0 <= block_hash < 1 << 64
            block_tokens = tokens[i * size : (i + 1) * size] if tokens else None
            self.blocks[block_hash] = Block(parent, block_tokens, extra_keys[i], event["medium"])
            parent = block_hash

    def prefix(self, block_hash: int) -> list[int]:
        """Every token from the start of the prompt through this block, by parent links."""
        runs = []
        current: int | None = block_hash
        while current is not None:
            block = self.blocks[current]
            assert block.tokens is not None, "the publisher sent no token ids"
            runs.append(block.tokens)
            current = block.parent
        return [token for run in reversed(runs) for token in run]
