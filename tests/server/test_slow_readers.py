"""Streaming clients that stop reading: the server keeps only their unsent output, and aborts
them (freeing their pages) once they have read nothing for the send timeout."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from radixkv.engine.sampling_params import SamplingParams
from radixkv.server.limits import ServerLimits
from tests.helpers.engine import wait_until
from radixkv.server.app import create_app
from radixkv.server.thread import ServerThread
from tests.helpers.live_server import KEY_A, KEY_B, MODEL, LiveServer, make_async_engine, metric_values

ABORTS = ("radixkv_request_finished_total", (("finish_reason", "abort"),))


@pytest.fixture(scope="module")
def impatient_server(tiny_llama):
    """A live server with a 1 s send timeout whose sockets have small kernel send buffers
    (accepted sockets inherit the listener's), so a client that reads nothing blocks its
    sends after tens of kilobytes rather than megabytes."""
    async_engine = make_async_engine(tiny_llama)
    app = create_app(async_engine, api_keys=[KEY_A, KEY_B], model_name=MODEL, limits=ServerLimits(stream_send_timeout_s=1.0))
    thread = ServerThread(app)
    thread.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    try:
        with thread:
            yield LiveServer(thread.base_url, async_engine, app)
    finally:
        async_engine.shutdown()


def test_a_stalled_consumer_holds_one_backlog_joined_once(tiny_llama):
    """Deltas a consumer has not taken stay as they came (no per-step copies) and come out as
    one delta holding every token, in order."""
    async_engine = make_async_engine(tiny_llama)
    try:

        async def stall_then_read() -> tuple[int, list[int], list[int]]:
            stream = await async_engine.submit(list(range(10, 30)), SamplingParams(max_tokens=40, ignore_eos=True))

            async def backlog_complete() -> None:
                while stream.num_pending_tokens < 40:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(backlog_complete(), 30)  # the consumer read nothing meanwhile
            first = await stream.__anext__()
            return stream.num_pending_tokens, [t for c in first.completions for t in c.token_ids], first.output.token_ids

        left, tokens, final = asyncio.run(stall_then_read())
        assert left == 0 and len(tokens) == 40 and tokens == final
    finally:
        async_engine.shutdown()


def stalled_stream(base_url: str, body: dict) -> socket.socket:
    """A streaming request sent on a socket that then reads nothing (a tiny receive window,
    so the server's sends back up quickly)."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def test_a_client_that_stops_reading_is_aborted_and_its_pages_freed(impatient_server):
    live = impatient_server
    before = metric_values(live).get(ABORTS, 0.0)
    # Four greedy continuations that run their full length (the tiny model never stops early):
    # some 400 kB of events, several times what the socket buffers hold.
    body = {"model": MODEL, "prompt": [f"stall {i}" for i in range(4)], "max_tokens": 480, "stream": True, "temperature": 0}
    sock = stalled_stream(live.base_url, body)
    try:
        assert wait_until(lambda: metric_values(live).get(ABORTS, 0.0) - before == 4, 60)
        live.assert_idle_and_consistent()
        # Everyone else is served as before.
        ok = live.client().completions.create(model=MODEL, prompt="after", max_tokens=3)
        assert ok.choices[0].finish_reason in ("length", "stop")
    finally:
        sock.close()


def test_a_reader_within_the_timeout_gets_everything(impatient_server):
    with impatient_server.client().completions.create(
        model=MODEL, prompt="steady", max_tokens=60, stream=True, temperature=0
    ) as stream:
        chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    impatient_server.assert_idle_and_consistent()
