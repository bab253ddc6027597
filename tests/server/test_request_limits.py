"""Request bodies a client can make as large as it likes: refused past the size limit (413, in
the shape of the API called) before they are read, and parsed and tokenized off the event loop
so /health and everyone else keep being answered meanwhile."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from radixkv.server.limits import ServerLimits
from tests.helpers.live_server import KEY_A, MODEL, make_async_engine, serve

LIMIT_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def small_body_server(tiny_llama):
    with serve(make_async_engine(tiny_llama), limits=ServerLimits(max_body_bytes=LIMIT_BYTES)) as live:
        yield live


def test_a_body_past_the_limit_gets_413_in_openai_shape(small_body_server):
    with small_body_server.http() as client:
        response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x" * LIMIT_BYTES}]})
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and str(LIMIT_BYTES) in error["message"]


def test_a_body_past_the_limit_gets_413_in_anthropic_shape_on_messages(small_body_server):
    with small_body_server.http() as client:
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * LIMIT_BYTES}]}
        response = client.post("/v1/messages", json=body)
    assert response.status_code == 413
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "request_too_large"


def test_a_chunked_body_past_the_limit_gets_413(small_body_server):
    def chunks():
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(2 * LIMIT_BYTES // 1024):
            yield b"y" * 1024
        yield b'"}'

    with small_body_server.http() as client:
        response = client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_a_body_within_the_limit_is_served(small_body_server):
    ok = small_body_server.client().completions.create(model=MODEL, prompt="small " * 10, max_tokens=2)
    assert ok.choices
    small_body_server.assert_idle_and_consistent()


@pytest.fixture(scope="module")
def default_server(tiny_llama):
    with serve(make_async_engine(tiny_llama)) as live:
        yield live


def health_stays_prompt(base_url: str, busy: threading.Thread) -> int:
    """/health polled while `busy` runs: each answer must come within 1 s; how many came."""
    answered = 0
    with httpx.Client(base_url=base_url, timeout=1.0) as client:
        while busy.is_alive():
            assert client.get("/health").status_code == 200
            answered += 1
            time.sleep(0.05)
    return answered


def test_health_answers_while_a_20mb_body_is_refused(default_server):
    host, port = default_server.base_url.removeprefix("http://").split(":")
    statuses: list[bytes] = []

    def upload() -> None:
        with socket.create_connection((host, int(port))) as sock:
            size = 20 * 1024 * 1024
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY_A}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
            )
            # The first 64 kB of it: the answer comes from the declared length, before the body
            # (a client sending on while the server closes would only see a reset).
            sock.sendall(head.encode() + b'{"prompt": "' + b"z" * (64 << 10))
            statuses.append(sock.recv(4096).split(b"\r\n")[0])

    busy = threading.Thread(target=upload)
    busy.start()
    health_stays_prompt(default_server.base_url, busy)
    busy.join()
    assert statuses and b" 413 " in statuses[0]


def test_health_answers_while_a_large_prompt_is_tokenized(default_server):
    """A 2 MB prompt (within the body limit, far past the context) takes seconds to tokenize;
    it is refused for its length, and the event loop answers /health throughout."""
    results: list[httpx.Response] = []

    def post() -> None:
        with default_server.http() as client:
            results.append(client.post("/v1/completions", json={"model": MODEL, "prompt": "hello world " * 170_000}))

    busy = threading.Thread(target=post)
    busy.start()
    answered = health_stays_prompt(default_server.base_url, busy)
    busy.join()
    assert results[0].status_code == 400 and results[0].json()["error"]["code"] == "context_length_exceeded"
    assert answered >= 2  # the prompt was still being handled while /health answered


def test_a_stop_string_past_the_length_limit_is_refused_naming_it(small_body_server):
    from radixkv.engine.sampling_params import MAX_STOP_CHARS

    with small_body_server.http() as client:
        too_long = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stop": ["s" * (MAX_STOP_CHARS + 1)]})
        at_limit = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stop": ["s" * MAX_STOP_CHARS]})
    assert too_long.status_code == 400
    error = too_long.json()["error"]
    assert error["param"] == "stop" and str(MAX_STOP_CHARS) in error["message"]
    assert at_limit.status_code == 200
