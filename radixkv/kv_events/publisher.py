"""ZmqEventPublisher: sends KV-event batches the way vLLM's ZmqEventPublisher does, so a vLLM
subscriber reads radixkv unchanged. A PUB socket sends each batch as the multipart message
`[topic, seq, payload]` (seq: 8 bytes, big-endian, from 0 up by one per batch; payload: the
msgpack EventBatch). A subscriber that sees seq jump knows it missed batches and asks the ROUTER
replay socket for them: it sends one frame, the first wanted seq (8 bytes, big-endian), as a REQ
(or a DEALER with an empty delimiter frame); the reply is one message `[b"", topic, seq, payload]`
per batch still buffered from there on, then the end marker `[b"", b"", seq -1, b""]` (the topic
frame in replies since vllm-project/vllm#45177, vLLM v0.26). Replays are rate-limited per peer
(a refused request gets the end marker alone), and a batch the publisher had to drop leaves its
seq unsent: a gap that replay cannot fill, so the subscriber knows it lost it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque

import msgspec
import zmq

from radixkv.errors import ConfigError
from radixkv.kv_events.schema import EventBatch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05  # how long the thread waits for a batch before it looks at replay requests again


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host, IPv6 '::', ipc:// and inproc:// bind (the stable side);
    any other address connects to a subscriber that binds it."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ReplayLimiter:
    """Token buckets for replay requests: one per peer (its ROUTER identity), refilled at
    `per_peer_per_s` up to `per_peer_burst`, and one shared by all peers (a peer can reconnect
    under a fresh identity, so the shared bucket is what bounds the replay work in the end).
    At most `max_peers` buckets are kept; the least recently seen go first."""

    def __init__(
        self, per_peer_per_s: float, per_peer_burst: float, total_per_s: float, total_burst: float, max_peers: int = 1024
    ) -> None:
        self.per_peer_per_s, self.per_peer_burst = per_peer_per_s, per_peer_burst
        self.total_per_s, self.total_burst = total_per_s, total_burst
        self.max_peers = max_peers
        self._peers: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # identity -> (tokens, at_s)
        self._total = (total_burst, time.monotonic())

    def allow(self, peer: bytes, now_s: float | None = None) -> bool:
        """Whether `peer` may have one replay now; takes a token from both buckets if so."""
        now_s = time.monotonic() if now_s is None else now_s
        peer_tokens = _refill(self._peers.pop(peer, (self.per_peer_burst, now_s)), self.per_peer_per_s, self.per_peer_burst, now_s)
        total_tokens = _refill(self._total, self.total_per_s, self.total_burst, now_s)
        allowed = peer_tokens >= 1.0 and total_tokens >= 1.0
        if allowed:
            peer_tokens -= 1.0
            total_tokens -= 1.0
        self._peers[peer] = (peer_tokens, now_s)
        self._total = (total_tokens, now_s)
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)
        return allowed


def _refill(bucket: tuple[float, float], per_s: float, burst: float, now_s: float) -> float:
    tokens, at_s = bucket
    return min(burst, tokens + max(0.0, now_s - at_s) * per_s)


class ZmqEventPublisher:
    """Publishes EventBatches from any thread: `publish` numbers the batch and queues it, never
    waiting; one background thread encodes, sends and buffers them (the last `buffer_steps`
    batches, for replay) and answers replay requests. ZMQ sockets belong to that thread once it
    runs. When the queue is full (the thread fell `max_queue_size` batches behind) the batch is
    dropped and counted: its sequence number is never sent, so subscribers see the gap."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 10_000,
        replay_limiter: ReplayLimiter | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[tuple[int, EventBatch] | None] = queue.Queue(maxsize=max_queue_size)
        # A subscriber may ask for a replay of the whole buffer: rate-limited per peer, so one
        # peer's requests cannot keep the thread from the live stream.
        self._replays = replay_limiter or ReplayLimiter(per_peer_per_s=1.0, per_peer_burst=10, total_per_s=20.0, total_burst=50)
        self._cond = threading.Condition()
        self._next_seq = 0  # given out by publish, dropped batches included
        self._num_done = 0  # batches the thread has sent (or failed to send), in seq order
        self._num_dropped = 0
        self._num_replays_refused = 0
        self._closed = False
        context = zmq.Context.instance()  # shared, so inproc:// subscribers in this process work
        self._pub = context.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            # PUB never blocks a send: past a subscriber's high-water mark ZMQ drops for it alone.
            self._pub.set_hwm(hwm)
            (self._pub.bind if binds(endpoint) else self._pub.connect)(endpoint)
            if replay_endpoint is not None:
                self._replay = context.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as error:
            self._close_sockets()
            param = "kv_events_replay_endpoint" if self._replay is not None else "kv_events_endpoint"
            raise ConfigError(f"cannot open the KV-event socket {param}: {error}", param=param) from error
        self._thread = threading.Thread(target=self._run, name="radixkv-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        """Queue `batch` under the next sequence number; never waits (called on the engine's
        thread). A full queue drops it: counted in num_dropped, a gap for subscribers."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the KV-event publisher is closed")
            seq = self._next_seq
            self._next_seq += 1
            try:
                self._queue.put_nowait((seq, batch))
            except queue.Full:
                self._num_dropped += 1
                self._num_done += 1
                if self._num_dropped == 1 or self._num_dropped % 1000 == 0:
                    logger.warning("KV-event queue full: %d batches dropped so far (subscribers see gaps)", self._num_dropped)

    def drain(self, timeout_s: float = 5.0) -> bool:
        """Wait until every batch published so far has been sent (and can be replayed) or
        dropped; False if that took longer than timeout_s."""
        with self._cond:
            return self._cond.wait_for(lambda: self._num_done >= self._next_seq, timeout_s)

    @property
    def num_sent(self) -> int:
        """Sequence numbers given out so far (sent batches and dropped ones): once drained, the
        next batch carries this one."""
        return self._next_seq

    @property
    def num_dropped(self) -> int:
        """Batches dropped because the queue was full (their sequence numbers are gaps)."""
        return self._num_dropped

    @property
    def num_replays_refused(self) -> int:
        """Replay requests answered with the end marker alone because their peer (or all peers
        together) asked too often."""
        return self._num_replays_refused

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued, stop the thread, close the sockets. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass  # the thread is stuck; the sockets stay with it (a daemon thread)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()

    # -- the publisher thread ----------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            self._serve_replays()
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, batch = item
            try:
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:  # noqa: BLE001 - one bad batch must not silence the rest
                logger.exception("KV-event batch %d not sent; subscribers will see a gap", seq)
            with self._cond:
                self._num_done += 1
                self._cond.notify_all()

    def _serve_replays(self) -> None:
        replay = self._replay
        while replay is not None and replay.poll(0):
            try:
                frames = replay.recv_multipart()
                if len(frames) != 3:
                    logger.warning("KV-event replay request of %d frames ignored (expected 3)", len(frames))
                    continue
                client_id, _, start_bytes = frames
                if not self._replays.allow(client_id):
                    # The end marker alone: the peer is not left waiting, and costs no work.
                    self._num_replays_refused += 1
                    replay.send_multipart((client_id, b"", b"", END_SEQ, b""))
                    continue
                start_seq = int.from_bytes(start_bytes, "big")
                for seq, payload in list(self._buffer):
                    if seq >= start_seq:
                        replay.send_multipart((client_id, b"", self._topic, seq.to_bytes(8, "big"), payload))
                replay.send_multipart((client_id, b"", b"", END_SEQ, b""))
            except Exception:  # noqa: BLE001 - a broken client must not stop the live stream
                logger.exception("KV-event replay request failed")

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
