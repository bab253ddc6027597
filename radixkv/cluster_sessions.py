"""Sticky sessions for `radixkv cluster`: a request naming a session (the X-Radixkv-Session
header, or prompt_cache_key in an OpenAI body) goes to the worker that served that session last,
where its turn is retained; every other request goes through the router. Imports no server code.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping

import httpx
import uvicorn

SESSION_HEADER = "x-radixkv-session"
# Bodies that may carry prompt_cache_key (OpenAI's chat, completions and Responses).
SESSION_BODY_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
# A body is read whole to be forwarded; past this the proxy refuses it (413) before reading on.
# Above what a worker accepts by default, so the worker's own limit is the one a client meets.
MAX_BODY_BYTES = 64 << 20
MAX_SESSION_KEY_CHARS = 1024  # as the workers' (engine/sessions.py): a longer key is theirs to refuse
# Request headers that describe one hop, not the request: httpx sets its own.
_HOP_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade"})


def owner_of(headers: Mapping[str, str]) -> str:
    """The key space a session key lives in: a digest of the API key (Bearer or x-api-key), so
    tenant A's "s1" is not tenant B's and no key is kept in the clear; "" without one."""
    authorization = headers.get("authorization", "")
    key = authorization[7:] if authorization[:7].lower() == "bearer " else headers.get("x-api-key", "")
    return hashlib.sha256(key.encode()).hexdigest()[:32] if key else ""


def session_key(path: str, headers: Mapping[str, str], body: bytes) -> str | None:
    """The session a request names, if any: the header, else prompt_cache_key in a JSON body
    of an OpenAI endpoint. A malformed one is left for the worker to refuse."""
    header = headers.get(SESSION_HEADER)
    if header:
        return header[:MAX_SESSION_KEY_CHARS + 1]
    if path not in SESSION_BODY_PATHS or b"prompt_cache_key" not in body:
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    key = parsed.get("prompt_cache_key") if isinstance(parsed, dict) else None
    return key if isinstance(key, str) and key else None


class StickyMap:
    """(owner, session key) -> the worker that served it last; bounded, least recently used
    out first (a forgotten session is routed afresh, never refused)."""

    def __init__(self, max_entries: int = 65536) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self._workers: OrderedDict[tuple[str, str], str] = OrderedDict()

    def get(self, owner: str, key: str) -> str | None:
        worker = self._workers.get((owner, key))
        if worker is not None:
            self._workers.move_to_end((owner, key))
        return worker

    def put(self, owner: str, key: str, worker: str) -> None:
        self._workers[(owner, key)] = worker
        self._workers.move_to_end((owner, key))
        while len(self._workers) > self.max_entries:
            self._workers.popitem(last=False)

    def forget(self, owner: str, key: str) -> None:
        self._workers.pop((owner, key), None)

    def __len__(self) -> int:
        return len(self._workers)


def rendezvous(owner: str, key: str, workers: list[str]) -> str:
    """A session's first worker: the highest hash of (owner, key, worker), so a new session
    spreads evenly and a worker leaving moves only its own sessions."""
    return max(workers, key=lambda worker: hashlib.blake2b(f"{owner}\0{key}\0{worker}".encode(), digest_size=8).digest())


class SessionProxy:
    """The cluster's front door (an ASGI app): a request naming a session goes to its worker
    (the one that served it last, or a fresh choice if that one cannot be reached), any other
    to the router. Responses, streamed ones too, pass through as they come."""

    def __init__(self, router_url: str, worker_urls: list[str], *, max_sessions: int = 65536, timeout_s: float = 600.0) -> None:
        if not worker_urls:
            raise ValueError("a session proxy needs at least one worker")
        self.router_url = router_url
        self.worker_urls = list(worker_urls)
        self.sticky = StickyMap(max_sessions)
        self._timeout = httpx.Timeout(timeout_s, connect=5.0)
        self._client: httpx.AsyncClient | None = None

    def route(self, owner: str, key: str | None, down: frozenset[str] = frozenset()) -> str:
        """Where a request goes: its session's worker, or the router for a request with none."""
        if key is None:
            return self.router_url
        worker = self.sticky.get(owner, key)
        if worker is None or worker in down:
            live = [w for w in self.worker_urls if w not in down] or self.worker_urls
            worker = rendezvous(owner, key, live)
        return worker

    async def __call__(self, scope: dict, receive, send) -> None:  # noqa: ANN001 - ASGI
        if scope["type"] != "http":
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            await _plain(send, 413, b"request body too large")
            return
        body = await _read_body(receive)
        if body is None:
            await _plain(send, 413, b"request body too large")
            return
        path = scope["path"]
        owner, key = owner_of(headers), session_key(path, headers, body)
        forwarded = [(k, v) for k, v in headers.items() if k not in _HOP_HEADERS]
        query = scope.get("query_string", b"").decode("latin-1")
        down: set[str] = set()
        while True:
            target = self.route(owner, key, frozenset(down))
            url = f"{target}{path}" + (f"?{query}" if query else "")
            try:
                response = await self._send(scope["method"], url, forwarded, body)
            except httpx.ConnectError:
                if key is None or len(down) + 1 >= len(self.worker_urls):
                    await _plain(send, 502, b"no worker could be reached")
                    return
                down.add(target)  # gone: its sessions move to a live worker
                self.sticky.forget(owner, key)
                continue
            break
        if key is not None:
            self.sticky.put(owner, key, target)
        try:
            await send({
                "type": "http.response.start", "status": response.status_code,
                "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS],
            })  # fmt: skip
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    async def _send(self, method: str, url: str, headers: list[tuple[str, str]], body: bytes) -> httpx.Response:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout)
        request = self._client.build_request(method, url, headers=headers, content=body)
        return await self._client.send(request, stream=True)


async def _read_body(receive) -> bytes | None:  # noqa: ANN001 - ASGI
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(parts)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _plain(send, status: int, text: bytes) -> None:  # noqa: ANN001 - ASGI
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": text})


class ProxyThread:
    """A SessionProxy under uvicorn on a thread, on `host:port` (0: a free port)."""

    def __init__(self, proxy: SessionProxy, host: str = "127.0.0.1", port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.proxy = proxy
        config = uvicorn.Config(proxy, log_level="warning", lifespan="off", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> ProxyThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the session proxy did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()

