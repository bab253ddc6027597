"""KV events end to end over real ZMQ sockets: a subscriber written from vLLM's schema (decoding
with the independent msgpack library) rebuilds exactly the blocks the radix tree holds, with
every block's prefix, after a seeded random run of inserts, evictions and resets and after real
engine steps; it detects the live messages it was made to lose by their sequence numbers and
recovers them through the replay socket.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from radixkv.cache import BlockHasher, PagePool, RadixTree
from radixkv.cache.radix import path_tokens
from radixkv.engine.sampling_params import SamplingParams
from radixkv.errors import ConfigError
from radixkv.kv_events.publisher import ZmqEventPublisher
from radixkv.kv_events.recorder import KVEventRecorder
from radixkv.kv_events.schema import EventBatch
from radixkv.attention.torch_backend import TorchBackend
from radixkv.model.loader import load_model
from tests.helpers.engine import make_engine, run_to_end, shared_prefix_prompts
from tests.helpers.kv_subscriber import SchemaSubscriber

PAGE = 4
SALT = "tenant-salt-7f3a"
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
    recorder = KVEventRecorder(publisher, PAGE, "CPU", token_ids=True)
    tree = RadixTree(pool, BlockHasher(PAGE, seed=99))
    tree.events.subscribe(recorder.listen)
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


def first_stored_event(tmp_path: Path, *, token_ids: bool) -> dict:
    """The BlockStored of one salted insert as a SUB socket receives it, checking the frames
    ([topic, seq, payload]) and the batch (a positional [ts, events, rank]) on the way."""
    endpoint, _ = endpoints(tmp_path)
    publisher = ZmqEventPublisher(endpoint)
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    pool = PagePool(8, PAGE)
    recorder = KVEventRecorder(publisher, PAGE, "CPU", token_ids=token_ids)
    tree = RadixTree(pool, BlockHasher(PAGE, seed=1))
    tree.events.subscribe(recorder.listen)
    try:
        tokens = list(range(10, 19))  # two full blocks and a partial one
        # Resend until the slow-joining SUB socket gets one (each send is a new seq).
        for _ in range(100):
            pages = pool.allocate(2)
            tree.insert(tokens, pages, SALT)
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
    hashes = BlockHasher(PAGE, seed=1).hash_blocks(tokens, SALT)
    assert stored["block_hashes"] == [h & MASK_64 for h in hashes]  # xxh3_128's low 64 bits
    assert stored["parent_block_hash"] is None and stored["block_size"] == PAGE
    assert (stored["medium"], stored["group_idx"], stored["kv_cache_spec_kind"]) == ("CPU", 0, "full_attention")
    assert stored["lora_id"] is None and stored["lora_name"] is None
    return stored


def test_wire_format_of_one_insert_with_token_ids(tmp_path):
    """The exact shape an indexer decodes: each event a map tagged under "type", in vLLM's
    field order; asked for, the tokens and the salt come too."""
    stored = first_stored_event(tmp_path, token_ids=True)
    assert list(stored) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "extra_keys", "group_idx", "kv_cache_spec_kind",
    ]
    assert stored["token_ids"] == list(range(10, 18))
    assert stored["extra_keys"] == [[SALT], None]  # the cache salt on the prompt's first block


def test_block_stored_carries_no_prompt_or_salt_by_default(tmp_path):
    """Whoever can reach the socket reads the events: by default they name blocks by hash only.
    token_ids stays in the map (vLLM's schema requires it) but empty; extra_keys, which would
    carry the tenant's salt, is left out (None, its default)."""
    stored = first_stored_event(tmp_path, token_ids=False)
    assert list(stored) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "group_idx", "kv_cache_spec_kind",
    ]
    assert stored["token_ids"] == []
    assert SALT not in repr(stored)


class StallablePublisher(ZmqEventPublisher):
    """A publisher whose thread can be held between batches, as one busy with a replay flood or
    starved of CPU would be (the thread calls _serve_replays before taking each batch)."""

    def __init__(self, *args, **kwargs) -> None:
        self.running = threading.Event()
        self.running.set()
        super().__init__(*args, **kwargs)

    def _serve_replays(self) -> None:
        self.running.wait()
        super()._serve_replays()


def test_publish_never_waits_for_a_stalled_thread_and_drops_show_as_gaps(tmp_path):
    endpoint, replay = endpoints(tmp_path)
    publisher = StallablePublisher(endpoint, replay, max_queue_size=4)
    subscriber = SchemaSubscriber(endpoint, replay)
    sub = subscriber.sub
    try:
        subscribe(publisher, subscriber)
        first = publisher.num_sent
        publisher.running.clear()
        publishing = threading.Thread(
            target=lambda: [publisher.publish(EventBatch(ts=time.time(), events=[], data_parallel_rank=0)) for _ in range(100)]
        )
        publishing.start()
        publishing.join(30)
        assert not publishing.is_alive(), "publish waited for the stalled publisher thread"
        assert publisher.num_dropped >= 100 - 4 - 1  # the queue, and the batch the thread held
        publisher.running.set()
        assert publisher.drain()  # the queue is empty again
        publisher.publish(EventBatch(ts=time.time(), events=[], data_parallel_rank=0))  # after the drops
        assert publisher.drain()
        assert publisher.num_sent == first + 101
        received = []
        while sub.poll(2000):
            _, seq, _ = sub.recv_multipart()
            received.append(int.from_bytes(seq, "big"))
            if received[-1] == first + 100:
                break
    finally:
        subscriber.close()
        publisher.close()
    # Every sequence number was either received or dropped; a drop is a jump a subscriber sees.
    assert received[-1] == first + 100 and received == sorted(received)
    assert len(received) + publisher.num_dropped == 101
    assert any(b - a > 1 for a, b in zip(received, received[1:]))


def test_a_replay_flood_from_one_peer_is_limited(tmp_path):
    endpoint, replay = endpoints(tmp_path)
    publisher = ZmqEventPublisher(endpoint, replay)
    context = zmq.Context.instance()
    flooder, other = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
    for dealer in (flooder, other):
        dealer.connect(replay)

    def replies(dealer: zmq.Socket, requests: int) -> list[int]:
        """The batches each replay request brought back (0: refused, the end marker alone)."""
        for _ in range(requests):
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        counts = []
        batches = 0
        while len(counts) < requests:
            assert dealer.poll(5000), "the replay socket did not answer"
            _, _, seq, _ = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                counts.append(batches)
                batches = 0
            else:
                batches += 1
        return counts

    try:
        for _ in range(3):
            publisher.publish(EventBatch(ts=time.time(), events=[], data_parallel_rank=0))
        assert publisher.drain()
        flood = replies(flooder, 200)
        served = [count for count in flood if count]
        assert all(count == 3 for count in served)
        # A burst of 10, then one a second: a run of a few seconds at most gets a few more.
        assert 10 <= len(served) <= 20, len(served)
        assert publisher.num_replays_refused == 200 - len(served)
        assert replies(other, 1) == [3]  # another peer is not refused for the flooder's requests
    finally:
        flooder.close(linger=0)
        other.close(linger=0)
        publisher.close()


def test_replay_limiter_refills_per_peer_and_caps_all_peers():
    from radixkv.kv_events.publisher import ReplayLimiter

    limiter = ReplayLimiter(per_peer_per_s=1.0, per_peer_burst=2, total_per_s=2.0, total_burst=3, max_peers=3)
    assert [limiter.allow(b"a", 0.0) for _ in range(3)] == [True, True, False]
    assert limiter.allow(b"b", 0.0) and not limiter.allow(b"c", 0.0)  # the shared bucket is empty
    assert limiter.allow(b"a", 1.0)  # one token a second per peer (and two shared)
    assert not limiter.allow(b"a", 1.0)
    assert not limiter.allow(b"a", 1.5) and limiter.allow(b"a", 2.0)
    limiter.allow(b"d", 2.0)
    assert len(limiter._peers) == 3  # the least recently seen peer was forgotten


@pytest.fixture(scope="module")
def loaded_tiny(tiny_llama):
    return load_model(str(tiny_llama), TorchBackend(), dtype="float32", device="cpu")


def test_engine_publishes_what_its_tree_holds(loaded_tiny, tmp_path):
    endpoint, replay = endpoints(tmp_path)
    # A pool of 40 pages: the prompts below need more, so the engine evicts as it runs.
    engine = make_engine(
        loaded_tiny, num_pages=40, kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay, kv_events_topic="t",
        kv_events_token_ids=True,
    )
    subscriber = SchemaSubscriber(endpoint, replay, topic=b"t")
    recorder = engine.kv_events
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
    assert engine.kv_events is None and recorder.listen not in engine.tree.events


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
    # --kv-events-token-ids is an option of serve (argparse would exit on an unknown one).
    assert main(["serve", "--model", "/nonexistent", "--kv-events", "not-an-endpoint", "--kv-events-token-ids", "--port", "1"]) == 2


def test_the_engine_sends_hashes_only_unless_asked(loaded_tiny, tmp_path):
    endpoint, replay = endpoints(tmp_path)
    engine = make_engine(loaded_tiny, kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay)
    assert engine.config.kv_events_token_ids is False
    subscriber = SchemaSubscriber(endpoint, replay)
    try:
        subscribe(engine.kv_events.sink, subscriber)
        engine.add_request(shared_prefix_prompts(1, count=1)[0], SamplingParams(max_tokens=3, temperature=0.0), salt="tenant-a")
        run_to_end(engine)
        publisher = engine.kv_events.sink
        assert publisher.drain()
        subscriber.catch_up(publisher.num_sent - 1)
        assert len(subscriber.blocks) == engine.tree.cached_pages > 0  # every block, by hash
        assert all(block.tokens is None and block.extra_keys is None for block in subscriber.blocks.values())
    finally:
        subscriber.close()
        engine.stop_kv_events()


def test_endpoints_reachable_beyond_this_machine_are_told_apart():
    """What start_kv_events warns about: an endpoint another machine could reach."""
    from radixkv.kv_events import _local_only

    for endpoint in ("ipc:///tmp/kv", "inproc://kv", "tcp://127.0.0.1:5557", "tcp://localhost:5557", "tcp://[::1]:5557"):
        assert _local_only(endpoint), endpoint
    for endpoint in ("tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557", "tcp://10.0.0.7:5557", "tcp://indexer:5557"):
        assert not _local_only(endpoint), endpoint


def test_the_server_reports_kv_event_losses_in_metrics(tiny_llama, tmp_path):
    import httpx

    from tests.helpers.live_server import KEY_A, make_async_engine, serve

    endpoint, replay = endpoints(tmp_path)
    async_engine = make_async_engine(tiny_llama, kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay)
    with serve(async_engine) as live:
        text = httpx.get(f"{live.base_url}/metrics", headers={"Authorization": f"Bearer {KEY_A}"}).text
    assert "radixkv_kv_events_dropped_batches_total 0.0" in text
    assert "radixkv_kv_events_replays_refused_total 0.0" in text
