"""Connections against a real uvicorn server over raw sockets, as a slowloris client would hold
them: a keyed server refuses a chunked body without a key before reading it; a body or headers
that do not arrive within their deadline get 408 and the connection closes (trickling bytes
does not extend it); past max_connections a new connection gets 503. The same guards (key, then
body) in front of any app, as the Ray Serve ingress installs them."""

from __future__ import annotations

import socket
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from radixkv.server.app import install_guards
from radixkv.server.guards.tenants import Tenants
from radixkv.server.limits import ServerLimits
from radixkv.server.thread import ServerThread
from tests.helpers.live_server import KEY_A, make_async_engine, serve

READ_S = 30.0  # a generous bound for "the server answered": the deadlines under test are 1 s


def connect(base_url: str) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=READ_S)
    return sock


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """The status and everything the server sent until it closed the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    assert data.startswith(b"HTTP/1.1 "), data
    return int(data[9:12]), data


def read_health(sock: socket.socket) -> bytes:
    """One /health response on a kept-alive connection (its body ends it)."""
    data = b""
    while not data.endswith(b'{"status":"ok"}'):
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data
    return data


def request_head(method: str, path: str, *headers: str) -> bytes:
    return ("\r\n".join([f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *headers]) + "\r\n\r\n").encode()


@pytest.fixture(scope="module")
def tight_server(tiny_llama):
    limits = ServerLimits(header_read_timeout_s=1.0, body_read_timeout_s=1.0)
    with serve(make_async_engine(tiny_llama), limits=limits) as live:
        yield live


@pytest.mark.parametrize("auth", [None, "Authorization: Bearer sk-wrong", "x-api-key: sk-wrong"])
def test_a_chunked_body_without_a_valid_key_is_refused_before_it_is_read(tight_server, auth):
    """Only the first chunk is sent, and the body never ends: the 401 comes anyway (before, the
    server waited to buffer up to 8 MiB of it before any route checked the key)."""
    with connect(tight_server.base_url) as sock:
        headers = ["Transfer-Encoding: chunked", "Content-Type: application/json"] + ([auth] if auth else [])
        sock.sendall(request_head("POST", "/v1/chat/completions", *headers) + b"5\r\n{\"a\":\r\n")
        sock.settimeout(0.9)  # before the body deadline (1 s): the refusal is the key's, not the clock's
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 401"), head


@pytest.mark.parametrize("framing", ["Content-Length: 100", "Transfer-Encoding: chunked"])
def test_a_body_that_does_not_arrive_in_time_gets_408(tight_server, framing):
    with connect(tight_server.base_url) as sock:
        head = request_head("POST", "/v1/completions", f"Authorization: Bearer {KEY_A}", "Content-Type: application/json", framing)
        sock.sendall(head + (b"a\r\n{\"model\": \r\n" if "chunked" in framing else b'{"model": '))
        # A byte now and then does not reset the deadline: it covers the whole body.
        for _ in range(3):
            time.sleep(0.3)
            sock.sendall(b"1\r\n \r\n" if "chunked" in framing else b" ")
        status, data = read_response(sock)
    assert status == 408 and b"body_read_timeout_s" in data and b"request_timeout" in data


def test_headers_that_do_not_arrive_in_time_get_408_and_a_closed_connection(tight_server):
    with connect(tight_server.base_url) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sock.settimeout(0.2)
        data = b""
        deadline = time.monotonic() + READ_S
        while time.monotonic() < deadline:  # one header byte at a time, as slowloris sends them
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                sock.sendall(b"X")
                continue
            if not chunk:
                break
            data += chunk
    assert data.startswith(b"HTTP/1.1 408") and b"header_read_timeout_s" in data


def test_the_header_deadline_holds_for_the_next_request_on_a_kept_alive_connection(tight_server):
    with connect(tight_server.base_url) as sock:
        sock.sendall(request_head("GET", "/health"))
        read_health(sock)
        # uvicorn's keep-alive timer stops at the first byte of the next request: the header
        # deadline does not.
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(0.5)
        sock.sendall(b"X-Slow: 1\r\n")
        status, data = read_response(sock)
    assert status == 408


def test_connections_past_the_cap_get_503(tiny_llama):
    limits = ServerLimits(max_connections=3, header_read_timeout_s=60.0)
    with serve(make_async_engine(tiny_llama), limits=limits) as live:
        held = [connect(live.base_url) for _ in range(3)]
        try:
            for sock in held:  # each served once, then idle in the middle of its next request's headers
                sock.sendall(request_head("GET", "/health"))
                read_health(sock)
                sock.sendall(b"GET /health HTTP/1.1\r\n")
            with connect(live.base_url) as extra:
                extra.sendall(request_head("GET", "/health"))
                status, data = read_response(extra)
            assert status == 503 and b"max_connections" in data
            held.pop().close()
            deadline = time.monotonic() + READ_S
            while True:  # the server sees the close soon after: then a new connection is served
                with connect(live.base_url) as again:
                    again.sendall(request_head("GET", "/health", "Connection: close"))
                    status, _ = read_response(again)
                if status == 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert status == 200
        finally:
            for sock in held:
                sock.close()


def test_the_guards_refuse_before_any_app_reads_the_body():
    """install_guards, as the Ray Serve ingress uses it in front of its forwarding route: no key,
    no body read and no route; an oversized body is refused; a good request goes through."""
    seen: list[bytes] = []
    app = FastAPI()

    @app.post("/{path:path}")
    async def forward(request: Request) -> JSONResponse:
        seen.append(await request.body())
        return JSONResponse({"ok": True})

    limits = ServerLimits(max_body_bytes=1024, body_read_timeout_s=1.0, header_read_timeout_s=5.0)
    install_guards(app, Tenants([KEY_A]), limits)
    with ServerThread(app, limits=limits) as server:
        with connect(server.base_url) as sock:
            sock.sendall(request_head("POST", "/v1/completions", "Transfer-Encoding: chunked") + b"5\r\nhello\r\n")
            sock.settimeout(0.9)
            assert sock.recv(65536).startswith(b"HTTP/1.1 401")
        with connect(server.base_url) as sock:
            sock.sendall(request_head("POST", "/v1/completions", f"x-api-key: {KEY_A}", "Content-Length: 2048"))
            assert read_response(sock)[0] == 413
        with connect(server.base_url) as sock:
            body = b'{"prompt": "hi"}'
            sock.sendall(
                request_head("POST", "/v1/completions", f"Authorization: Bearer {KEY_A}", f"Content-Length: {len(body)}", "Connection: close")
                + body
            )
            assert read_response(sock)[0] == 200
    assert seen == [b'{"prompt": "hi"}']
