"""ZmqEventPublisher: sends KV-event batches the way vLLM's ZmqEventPublisher does, so a vLLM
subscriber reads radixkv unchanged. A PUB socket sends each batch as the multipart message
`[topic, seq, payload]` (seq: 8 bytes, big-endian, from 0 up by one per batch; payload: the
msgpack EventBatch). A subscriber that sees seq jump knows it missed batches and asks the ROUTER
replay socket for them: it sends one frame, the first wanted seq (8 bytes, big-endian), as a REQ
(or a DEALER with an empty delimiter frame); the reply is one message `[b"", topic, seq, payload]`
per batch still buffered from there on, then the end marker `[b"", b"", seq -1, b""]` (the topic
frame in replies since vllm-project/vllm#45177, vLLM v0.26).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

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


class ZmqEventPublisher:
    """Publishes EventBatches from any thread: `publish` only queues; one background thread
    encodes, numbers, sends and buffers them (the last `buffer_steps` batches, for replay) and
    answers replay requests. ZMQ sockets belong to that thread once it runs."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        # Full only if the thread falls 100k batches behind; then publish waits, as vLLM's does.
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._cond = threading.Condition()
        self._num_queued = 0
        self._num_sent = 0
        self._closed = False
        context = zmq.Context.instance()  # shared, so inproc:// subscribers in this process work
        self._pub = context.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
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
        with self._cond:
            if self._closed:
                raise RuntimeError("the KV-event publisher is closed")
            self._num_queued += 1
        self._queue.put(batch)

    def drain(self, timeout_s: float = 5.0) -> bool:
        """Wait until every batch published so far has been sent (and can be replayed);
        False if that took longer than timeout_s."""
        with self._cond:
            return self._cond.wait_for(lambda: self._num_sent >= self._num_queued, timeout_s)

    @property
    def num_sent(self) -> int:
        """Batches sent so far; the next one carries this sequence number."""
        return self._num_sent

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued, stop the thread, close the sockets. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()

    # -- the publisher thread ----------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            self._serve_replays()
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:  # noqa: BLE001 - one bad batch must not silence the rest
                logger.exception("KV-event batch %d not sent; subscribers will see a gap", seq)
            seq += 1
            with self._cond:
                self._num_sent = seq
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
