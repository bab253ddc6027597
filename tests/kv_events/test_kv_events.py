"""KV events end to end over real ZMQ sockets: a subscriber written from vLLM's schema (decoding
with the independent msgpack library) rebuilds exactly the blocks the radix tree holds, with
every block's prefix, after a seeded random run of inserts, evictions and resets and after real
engine steps; it detects the live messages it was made to lose by their sequence numbers and
recovers them through the replay socket.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from radixkv.cache import BlockHasher, PagePool, RadixTree
from radixkv.cache.radix import path_tokens
from radixkv.engine.request import SamplingParams
from radixkv.errors import ConfigError
from radixkv.kv_events.publisher import ZmqEventPublisher
from radixkv.kv_events.recorder import KVEventRecorder
from radixkv.kv_events.schema import EventBatch
from radixkv.attention.torch_backend import TorchBackend
from radixkv.model.loader import load_model
from tests.helpers.engine import make_engine, run_to_end, shared_prefix_prompts
from tests.helpers.kv_subscriber import SchemaSubscriber

PAGE = 4
MASK_64 = (1 << 64) - 1


def endpoints(tmp_path: Path) -> tuple[str, str]:
    return f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"


def tree_blocks(tree: RadixTree) -> dict[int, list[int]]:
    """Every cached block by its wire hash, with the tokens of its whole prefix."""
    blocks = {}
    for node in tree.iter_nodes():
        before = path_tokens(node.parent) if node.parent is not None else []
        for i, block_hash in enumerate(node.hashes):
            blocks[block_hash & MASK_64] = before + node.tokens[: (i + 1) * PAGE]
    return blocks


def assert_mirrors(subscriber: SchemaSubscriber, tree: RadixTree) -> None:
    expected = tree_blocks(tree)
    assert set(subscriber.blocks) == set(expected)
    for block_hash, prefix in expected.items():
        assert subscriber.prefix(block_hash) == prefix


def subscribe(publisher: ZmqEventPublisher, subscriber: SchemaSubscriber) -> None:
    """Publish empty batches until one arrives live: a SUB socket gets nothing sent before its
    subscription reached the publisher. Whatever was missed meanwhile is replayed."""
    while not subscriber.poll(50):
        publisher.publish(EventBatch(ts=time.time(), events=[], data_parallel_rank=0))
    assert publisher.drain()
    subscriber.catch_up(publisher.num_sent - 1)
    subscriber.gaps.clear()


def event_types(subscriber: SchemaSubscriber) -> set[str]:
    return {event["type"] for batch in subscriber.batches for event in batch[1]}


class Workload:
    """Requests as the engine makes them (match, lock, take pages, insert, adopt the tree's
    duplicates, unlock later), plus evictions and resets, from a seeded random generator."""

    PREFIXES = ([], [7] * 8, [1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6] * 3)

    def __init__(self, tree: RadixTree, pool: PagePool, seed: int) -> None:
        self.tree, self.pool, self.rng = tree, pool, random.Random(seed)
        self.running: list[tuple[object, list[int]]] = []  # (locked node, pages held)

    def step(self) -> None:
        roll = self.rng.random()
        if roll < 0.55:
            self.start()
        elif roll < 0.85 and self.running:
            self.finish(self.running.pop(self.rng.randrange(len(self.running))))
        elif roll < 0.98:
            self.tree.evict(self.rng.randint(1, 6))
        else:  # every request ends, then the cache is dropped whole
            while self.running:
                self.finish(self.running.pop())
            self.tree.reset()

    def start(self) -> None:
        rng, tree, pool = self.rng, self.tree, self.pool
        tokens = rng.choice(self.PREFIXES) + [rng.randrange(3) for _ in range(rng.randint(1, 14))]
        salt = rng.choice([None, None, None, "tenant"])
        match = tree.match(tokens, salt)
        tree.lock(match.node)
        pool.incref(match.pages)
        needed = len(tokens) // PAGE - len(match.pages)
        if pool.num_free < needed:
            tree.evict(needed - pool.num_free)
        if pool.num_free < needed:
            self.finish((match.node, match.pages))
            return
        pages = match.pages + pool.allocate(needed)
        result = tree.insert(tokens, pages, salt)
        for i in range(result.num_existing_blocks):
            if pages[i] != result.pages[i]:  # another request cached it first: use the tree's
                pool.incref([result.pages[i]])
                pool.release([pages[i]])
                pages[i] = result.pages[i]
        tree.lock(result.node)
        tree.unlock(match.node)
        self.running.append((result.node, pages))

    def finish(self, request: tuple[object, list[int]]) -> None:
        node, pages = request
        self.tree.unlock(node)
        self.pool.release(pages)


def test_subscriber_rebuilds_the_tree_and_repairs_injected_gaps(tmp_path):
    endpoint, replay = endpoints(tmp_path)
    publisher = ZmqEventPublisher(endpoint, replay, topic="kv@pod-0@tiny")
    subscriber = SchemaSubscriber(endpoint, replay, topic=b"kv@pod-0@tiny", drop_live={3, 10, 11, 40})
    pool = PagePool(24, PAGE)
    recorder = KVEventRecorder(publisher, PAGE, "CPU")
    tree = RadixTree(pool, BlockHasher(PAGE, seed=99), listener=recorder)
    workload = Workload(tree, pool, seed=5)
    try:
        subscribe(publisher, subscriber)
        last_seq = publisher.num_sent - 1
        for _ in range(400):
            workload.step()
            tree.check_invariants()
            if recorder.flush():  # one batch per operation, as the engine sends one per step
                last_seq += 1
                subscriber.catch_up(last_seq)
        assert publisher.drain() and publisher.num_sent == last_seq + 1
        assert_mirrors(subscriber, tree)
    finally:
        subscriber.close()
        publisher.close()
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= event_types(subscriber)
    # Every lost message was noticed at the next one (two lost in a row: one gap) and replayed.
    lost = subscriber.dropped_seqs
    assert len(lost) == 4
    injected = [(seq, seq + 1 + (seq + 1 in lost)) for seq in lost if seq - 1 not in lost]
    assert subscriber.gaps == injected  # (first lost, the one that showed it); nothing else lost
    assert subscriber.num_replayed >= len(lost)
    assert [b[0] for b in subscriber.batches] == sorted(b[0] for b in subscriber.batches)  # ts never go back


def test_wire_format_of_one_insert(tmp_path):
    """The exact shape an indexer decodes: [topic, seq, payload]; the payload a positional
    [ts, events, rank]; each event a map tagged under "type", in vLLM's field order."""
    endpoint, _ = endpoints(tmp_path)
    publisher = ZmqEventPublisher(endpoint)
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    pool = PagePool(8, PAGE)
    recorder = KVEventRecorder(publisher, PAGE, "CPU")
    tree = RadixTree(pool, BlockHasher(PAGE, seed=1), listener=recorder)
    try:
        tokens = list(range(10, 19))  # two full blocks and a partial one
        # Resend until the slow-joining SUB socket gets one (each send is a new seq).
        for _ in range(100):
            pages = pool.allocate(2)
            tree.insert(tokens, pages, "s")
            pool.release(pages)
            recorder.flush()
            if sub.poll(100):
                break
            tree.reset()
            recorder.flush()
        stored = None
        while stored is None:  # the first to arrive may be a reset's batch
            assert sub.poll(5000)
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"" and len(seq) == 8
            ts, events, rank = msgpack.unpackb(payload, raw=False)
            assert isinstance(ts, float) and rank == 0
            stored = next((e for e in events if e["type"] == "BlockStored"), None)
    finally:
        sub.close(linger=0)
        publisher.close()
    assert list(stored) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "extra_keys", "group_idx", "kv_cache_spec_kind",
    ]
    hashes = BlockHasher(PAGE, seed=1).hash_blocks(tokens, "s")
    assert stored["block_hashes"] == [h & MASK_64 for h in hashes]  # xxh3_128's low 64 bits
    assert stored["parent_block_hash"] is None
    assert stored["token_ids"] == tokens[:8] and stored["block_size"] == PAGE
    assert stored["extra_keys"] == [["s"], None]  # the cache salt on the prompt's first block
    assert (stored["medium"], stored["group_idx"], stored["kv_cache_spec_kind"]) == ("CPU", 0, "full_attention")
    assert stored["lora_id"] is None and stored["lora_name"] is None


@pytest.fixture(scope="module")
def loaded_tiny(tiny_llama):
    return load_model(str(tiny_llama), TorchBackend(), dtype="float32", device="cpu")


def test_engine_publishes_what_its_tree_holds(loaded_tiny, tmp_path):
    endpoint, replay = endpoints(tmp_path)
    # A pool of 40 pages: the prompts below need more, so the engine evicts as it runs.
    engine = make_engine(
        loaded_tiny, num_pages=40, kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay, kv_events_topic="t"
    )
    subscriber = SchemaSubscriber(endpoint, replay, topic=b"t")
    try:
        subscribe(engine.kv_events.sink, subscriber)
        prompts = shared_prefix_prompts(3, count=12)
        for wave in (prompts[:6], prompts[6:]):
            for prompt in wave:
                engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0))
            run_to_end(engine)
            subscriber.drain()
        publisher = engine.kv_events.sink
        assert publisher.drain()
        subscriber.catch_up(publisher.num_sent - 1)
        assert engine.stats().cache.evicted_pages > 0
        assert_mirrors(subscriber, engine.tree)
        assert {b.medium for b in subscriber.blocks.values()} == {"CPU"}
        engine.flush_cache()  # every unlocked block goes: each removal is published
        assert publisher.drain()
        subscriber.catch_up(publisher.num_sent - 1)
        assert subscriber.blocks == {} and engine.tree.cached_pages == 0
    finally:
        subscriber.close()
        engine.stop_kv_events()
    assert engine.kv_events is None and engine.tree.listener is None


def test_kv_event_options_are_checked(loaded_tiny, tmp_path):
    from radixkv.config import EngineConfig

    with pytest.raises(ConfigError) as error:
        EngineConfig(kv_events_endpoint="localhost:5557")
    assert error.value.param == "kv_events_endpoint"
    with pytest.raises(ConfigError) as error:
        EngineConfig(kv_events_replay_endpoint="tcp://*:5558")
    assert error.value.param == "kv_events_replay_endpoint"
    # An endpoint that cannot be bound fails the engine at start, naming the option.
    with pytest.raises(ConfigError) as error:
        make_engine(loaded_tiny, kv_events_endpoint=f"ipc://{tmp_path}/no-such-dir/events")
    assert error.value.param == "kv_events_endpoint"


def test_serve_takes_the_kv_events_option():
    from radixkv.cli import main

    # Checked with the engine's options, before any model loads: the flag reaches EngineConfig.
    assert main(["serve", "--model", "/nonexistent", "--kv-events", "not-an-endpoint", "--port", "1"]) == 2
