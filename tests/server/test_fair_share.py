"""Fair share per API key: a key flooding the server gets 429 with Retry-After while another
key keeps being served; pins are capped per key, refused when they would lock nothing, listed
per key and released after their ttl."""

from __future__ import annotations

import pytest

from radixkv.server.limits import ServerLimits
from tests.helpers.engine import wait_until
from tests.helpers.live_server import KEY_A, KEY_B, MODEL, make_async_engine, serve

PAGE_SIZE = 4  # make_async_engine's pages


@pytest.fixture(scope="module")
def shared_server(tiny_llama):
    limits = ServerLimits(max_requests_per_key=2, max_seqs_per_key=4, pin_ttl_s=2.0)
    with serve(make_async_engine(tiny_llama, max_pinned_pages_per_owner=8), limits=limits) as live:
        yield live


def open_stream(live, key: str, i: int, n: int = 1):
    """A long streamed completion that is generating when this returns (first event read)."""
    client = live.http(key)
    body = {"model": MODEL, "prompt": f"Disconnect {i}: the quick brown fox", "max_tokens": 480, "temperature": 0, "stream": True, "n": n}
    context = client.stream("POST", "/v1/completions", json=body)
    response = context.__enter__()
    assert response.status_code == 200
    lines = response.iter_lines()  # kept: a collected line iterator closes the connection
    assert next(line for line in lines if line.startswith("data: "))
    return client, context, lines


def test_a_flooding_key_gets_429_while_another_key_gets_200(shared_server):
    live = shared_server
    opened = [open_stream(live, KEY_A, i) for i in range(2)]
    try:
        with live.http(KEY_A) as client:
            refused = client.post("/v1/completions", json={"model": MODEL, "prompt": "one more", "max_tokens": 2})
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        with live.http(KEY_B) as client:
            served = client.post("/v1/completions", json={"model": MODEL, "prompt": "me too", "max_tokens": 2})
        assert served.status_code == 200
    finally:
        for client, context, _ in opened:
            context.__exit__(None, None, None)
            client.close()
    live.assert_idle_and_consistent()
    quotas = live.app.state.radixkv.quotas
    assert wait_until(lambda: quotas.in_flight(KEY_A.encode()) == (0, 0), 10)
    with live.http(KEY_A) as client:  # its share is back once its requests ended
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "again", "max_tokens": 2}).status_code == 200


def test_sequences_count_against_the_key(shared_server):
    live = shared_server
    opened = [open_stream(live, KEY_A, 0, n=3)]  # 3 of the key's 4 sequences
    try:
        with live.http(KEY_A) as client:
            refused = client.post("/v1/completions", json={"model": MODEL, "prompt": "two", "n": 2, "max_tokens": 2, "temperature": 1})
            served = client.post("/v1/completions", json={"model": MODEL, "prompt": "one", "max_tokens": 2})
        assert refused.status_code == 429 and served.status_code == 200
    finally:
        for client, context, _ in opened:
            context.__exit__(None, None, None)
            client.close()
    with live.http(KEY_A) as client:  # more than a key's whole share can never run: 400, not 429
        too_many = client.post("/v1/completions", json={"model": MODEL, "prompt": "many", "n": 5, "max_tokens": 2, "temperature": 1})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    live.assert_idle_and_consistent()


def test_pins_are_listed_per_key_capped_per_key_and_refused_when_empty(shared_server):
    with shared_server.http(KEY_A) as a, shared_server.http(KEY_B) as b:
        empty = a.post("/v1/cache/pin", json={"prompt": [5, 6, 7]})  # less than a page
        assert empty.status_code == 400 and empty.json()["error"]["code"] == "nothing_to_pin"
        first = a.post("/v1/cache/pin", json={"prompt": list(range(10, 10 + 6 * PAGE_SIZE))})  # 6 pages
        assert first.status_code == 200, first.text
        over = a.post("/v1/cache/pin", json={"prompt": list(range(100, 100 + 3 * PAGE_SIZE))})  # 6 + 3 > 8
        assert over.status_code == 429 and over.json()["error"]["code"] == "pin_limit_exceeded"
        other = b.post("/v1/cache/pin", json={"prompt": list(range(100, 100 + 3 * PAGE_SIZE))})  # B's own share
        assert other.status_code == 200, other.text
        listed_a = a.get("/v1/cache/pin").json()["data"]
        listed_b = b.get("/v1/cache/pin").json()["data"]
        assert [p["pin_id"] for p in listed_a] == [first.json()["pin_id"]]
        assert [p["pin_id"] for p in listed_b] == [other.json()["pin_id"]]
        assert 0 < listed_a[0]["expires_in_s"] <= 2.0
        # After the ttl both are released without anyone asking.
        locked = shared_server.engine_call(lambda engine: engine.tree.locked_pages)
        assert locked >= 9
        assert wait_until(lambda: shared_server.engine_call(lambda engine: engine.tree.locked_pages) == 0, 10)
        assert a.get("/v1/cache/pin").json()["data"] == []
        assert a.delete(f"/v1/cache/pin/{first.json()['pin_id']}").status_code == 404
    shared_server.assert_idle_and_consistent()


def test_a_request_larger_than_a_keys_whole_share_is_refused_as_such(shared_server):
    """Three prompts where a key may have two requests in flight: 400 (split it), not a 429
    that no amount of waiting would fix."""
    with shared_server.http(KEY_B) as client:
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 2})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and error["param"] == "prompt"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_a_key_at_its_share_is_refused_before_its_body_is_read(shared_server, path):
    # The 429 comes back while the body has not been sent at all: a flooding key's excess costs
    # no parse, template or tokenizer (before, the server read, parsed and tokenized it first).
    import socket

    live = shared_server
    opened = [open_stream(live, KEY_A, 100 + i) for i in range(2)]
    try:
        host, port = live.base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(
                f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {KEY_A}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n".encode()
            )
            answer = sock.recv(4096).decode(errors="replace")
        assert answer.startswith("HTTP/1.1 429"), answer[:200]
    finally:
        for client, context, _ in opened:
            context.__exit__(None, None, None)
            client.close()
    live.assert_idle_and_consistent()
