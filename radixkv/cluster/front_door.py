"""The cluster's front door, sticky sessions for `radixkv cluster`: a request naming a session
(the X-Radixkv-Session header, or prompt_cache_key in an OpenAI body) goes to the worker that
served that session last, where its turn is retained (a subagent's new session, the worker of
the parent it names); every other request goes through the router. Behind the workers' own guards (server/guards/: access.py, body_limit.py,
connections.py, parse_slots.py), with their limits (`front_door_guards`, read from the workers'
options).
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import json
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping

import httpx
import uvicorn

from radixkv.engine.sessions import MAX_SESSION_KEY_CHARS
from radixkv.errors import ConfigError
from radixkv.server.errors import APIError
from radixkv.server.guards.access import AccessGuard
from radixkv.server.guards.body_limit import LimitBody
from radixkv.server.guards.connections import uvicorn_options
from radixkv.server.guards.parse_slots import ParseSlots
from radixkv.server.guards.tenants import ADMIN_KEYS_ENV, Tenants, load_api_keys
from radixkv.server.limits import ServerLimits
from radixkv.server.sessions import DYNAMO_SESSION_HEADER, PARENT_SESSION_HEADER, SESSION_HEADER, session_ref

# Bodies that may carry prompt_cache_key (OpenAI's chat, completions and Responses).
SESSION_BODY_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
# Where a worker reads a session (and refuses a malformed one); elsewhere the header only routes.
SESSION_PATHS = SESSION_BODY_PATHS | {"/v1/messages"}
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
    of an OpenAI endpoint. Where a worker reads sessions, APIError 400 for a key it would
    refuse as malformed (session_ref: empty or past MAX_SESSION_KEY_CHARS), unforwarded; a body
    that is no JSON object, or disagrees with the header, is left for the worker to refuse."""
    header = headers.get(SESSION_HEADER, headers.get(DYNAMO_SESSION_HEADER))
    if path not in SESSION_PATHS:
        return header if header and len(header) <= MAX_SESSION_KEY_CHARS else None
    body_key = _body_session_key(body) if header is None and path in SESSION_BODY_PATHS else None
    ref = session_ref(headers, "", body_key)
    return ref.key if ref is not None else None


def _body_session_key(body: bytes) -> str | None:
    if b"prompt_cache_key" not in body:
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    key = parsed.get("prompt_cache_key") if isinstance(parsed, dict) else None
    return key if isinstance(key, str) else None


class StickyMap:
    """(owner, session key) -> the worker that served it last; bounded overall and per owner,
    least recently used out first (an owner past its own bound loses its own oldest, so one key
    cannot push out everyone else's; a forgotten session is routed afresh, never refused). A
    session key is kept as a 16-byte digest, so an entry costs the same whatever its length."""

    def __init__(self, max_entries: int = 65536, max_entries_per_owner: int = 4096) -> None:
        for name, value in (("max_entries", max_entries), ("max_entries_per_owner", max_entries_per_owner)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.max_entries = max_entries
        self.max_entries_per_owner = max_entries_per_owner
        self._workers: OrderedDict[tuple[str, bytes], str] = OrderedDict()
        self._owned: dict[str, OrderedDict[bytes, None]] = {}  # each owner's digests, oldest first

    def get(self, owner: str, key: str) -> str | None:
        slot = (owner, _digest(key))
        worker = self._workers.get(slot)
        if worker is not None:
            self._workers.move_to_end(slot)
            self._owned[owner].move_to_end(slot[1])
        return worker

    def put(self, owner: str, key: str, worker: str) -> None:
        digest = _digest(key)
        self._workers[(owner, digest)] = worker
        self._workers.move_to_end((owner, digest))
        owned = self._owned.setdefault(owner, OrderedDict())
        owned[digest] = None
        owned.move_to_end(digest)
        if len(owned) > self.max_entries_per_owner:
            self._drop(owner, next(iter(owned)))
        while len(self._workers) > self.max_entries:
            self._drop(*next(iter(self._workers)))

    def forget(self, owner: str, key: str) -> None:
        if (owner, _digest(key)) in self._workers:
            self._drop(owner, _digest(key))

    def owned_by(self, owner: str) -> int:
        owned = self._owned.get(owner)
        return len(owned) if owned else 0

    def _drop(self, owner: str, digest: bytes) -> None:
        del self._workers[(owner, digest)]
        owned = self._owned[owner]
        del owned[digest]
        if not owned:
            del self._owned[owner]  # nothing kept for an owner that has no session left

    def __len__(self) -> int:
        return len(self._workers)


def _digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(errors="surrogatepass"), digest_size=16).digest()


def rendezvous(owner: str, key: str, workers: list[str]) -> str:
    """A session's first worker: the highest hash of (owner, key, worker), so a new session
    spreads evenly and a worker leaving moves only its own sessions."""
    return max(workers, key=lambda worker: hashlib.blake2b(f"{owner}\0{key}\0{worker}".encode(), digest_size=8).digest())


class SessionProxy:
    """The cluster's front door (an ASGI app): a request naming a session goes to its worker
    (the one that served it last, or a fresh choice if that one cannot be reached), any other
    to the router. Responses, streamed ones too, pass through as they come.

    It refuses what a worker would, as early: AccessGuard (the API key, before a byte of the
    body is read), LimitBody (size and read deadline), a session key past the workers' bound
    (400); the body is parsed for prompt_cache_key in the caller's parse slots. A worker is
    remembered for a session only once it answered 2xx, so a refused request leaves nothing."""

    def __init__(
        self,
        router_url: str,
        worker_urls: list[str],
        *,
        max_sessions: int = 65536,
        max_sessions_per_owner: int = 4096,
        timeout_s: float = 600.0,
        tenants: Tenants | None = None,
        limits: ServerLimits | None = None,
    ) -> None:
        if not worker_urls:
            raise ValueError("a session proxy needs at least one worker")
        self.router_url = router_url
        self.worker_urls = list(worker_urls)
        self.sticky = StickyMap(max_sessions, max_sessions_per_owner)
        self.tenants = tenants or Tenants(None)  # keyless: the same-site checks of a keyless worker
        self.limits = limits or ServerLimits()
        self.parse_slots = ParseSlots(
            self.limits.max_parses_per_key, self.limits.max_requests_per_key,
            cpu_share=self.limits.parse_cpu_share_per_key, cpu_burst_s=self.limits.parse_cpu_burst_s,
        )  # fmt: skip
        self._timeout = httpx.Timeout(timeout_s, connect=5.0)
        self._client: httpx.AsyncClient | None = None
        # As create_app's install_guards: the key first, then the body, unread until both pass.
        limited = LimitBody(self._forward, self.limits.max_body_bytes, self.limits.body_read_timeout_s)
        self._guarded = AccessGuard(limited, self.tenants, self.limits)

    def route(self, owner: str, key: str | None, down: frozenset[str] = frozenset(), parent: str | None = None) -> str:
        """Where a request goes: its session's worker; for a session no worker has served yet
        that names a parent (a subagent's), the parent's worker, where the prefix it starts
        with is cached (the same owner's parent only: the map is keyed by owner); a fresh
        choice otherwise; the router for a request with no session."""
        if key is None:
            return self.router_url
        worker = self.sticky.get(owner, key)
        if worker is None and parent is not None:
            worker = self.sticky.get(owner, parent)
        if worker is None or worker in down:
            live = [w for w in self.worker_urls if w not in down] or self.worker_urls
            worker = rendezvous(owner, key, live)
        return worker

    async def __call__(self, scope: dict, receive, send) -> None:  # noqa: ANN001 - ASGI
        if scope["type"] == "http":
            await self._guarded(scope, receive, send)

    async def _forward(self, scope: dict, receive, send) -> None:  # noqa: ANN001 - ASGI
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        body = await _read_body(receive)  # LimitBody has read it within the limits already
        path = scope["path"]
        try:
            key = await self._session_key(path, headers, body)
        except APIError as error:
            await error.response_for(path)(scope, receive, send)
            return
        owner = owner_of(headers)
        parent = headers.get(PARENT_SESSION_HEADER) if key is not None else None
        if parent is not None and not 0 < len(parent) <= MAX_SESSION_KEY_CHARS:
            parent = None  # the worker refuses it; it routes nothing here
        response, target = await self._send_routed(scope, owner, key, headers, body, parent)
        if response is None:
            await _plain(send, 502, b"no worker could be reached")
            return
        if key is not None and 200 <= response.status_code < 300:
            self.sticky.put(owner, key, target)
        await _pass_through(response, send)

    async def _session_key(self, path: str, headers: dict[str, str], body: bytes) -> str | None:
        """session_key, its JSON parse off the event loop in the caller's parse slots (a
        body may be up to max_body_bytes)."""
        if SESSION_HEADER in headers or path not in SESSION_BODY_PATHS or b"prompt_cache_key" not in body:
            return session_key(path, headers, body)
        caller = self.tenants.authenticate_headers(headers)
        return await self.parse_slots.run(caller, lambda: session_key(path, headers, body))

    async def _send_routed(
        self, scope: dict, owner: str, key: str | None, headers: dict[str, str], body: bytes, parent: str | None = None
    ) -> tuple[httpx.Response | None, str]:
        """The first answer of the session's worker, moving on from workers that cannot be
        reached (their sessions with them); None when no worker can be."""
        forwarded = [(k, v) for k, v in headers.items() if k not in _HOP_HEADERS]
        query = scope.get("query_string", b"").decode("latin-1")
        down: set[str] = set()
        while True:
            target = self.route(owner, key, frozenset(down), parent)
            url = f"{target}{scope['path']}" + (f"?{query}" if query else "")
            try:
                return await self._send(scope["method"], url, forwarded, body), target
            except httpx.ConnectError:
                if key is None or len(down) + 1 >= len(self.worker_urls):
                    return None, target
                down.add(target)  # gone: its sessions move to a live worker
                self.sticky.forget(owner, key)

    async def _send(self, method: str, url: str, headers: list[tuple[str, str]], body: bytes) -> httpx.Response:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout)
        request = self._client.build_request(method, url, headers=headers, content=body)
        return await self._client.send(request, stream=True)


async def _pass_through(response: httpx.Response, send) -> None:  # noqa: ANN001 - ASGI
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


async def _read_body(receive) -> bytes:  # noqa: ANN001 - ASGI
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(parts)
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


async def _plain(send, status: int, text: bytes) -> None:  # noqa: ANN001 - ASGI
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": text})


class ProxyThread:
    """A SessionProxy under uvicorn on a thread, on `host:port` (0: a free port), with the
    workers' connection guards (server/guards/connections.py) under the proxy's limits."""

    def __init__(self, proxy: SessionProxy, host: str = "127.0.0.1", port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.proxy = proxy
        limits = proxy.limits if isinstance(proxy, SessionProxy) else ServerLimits()
        config = uvicorn.Config(proxy, log_level="warning", lifespan="off", timeout_graceful_shutdown=5, **uvicorn_options(limits))
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


def front_door_guards(worker_args: list[str], host: str) -> tuple[Tenants, ServerLimits]:
    """The keys and limits the workers get from `worker_args` (and the environment, as they
    do), for the front door: it refuses what they would, before reading or parsing a body."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    for option in ("--api-key", "--admin-key", "--allowed-origin"):
        parser.add_argument(option, action="append", default=None)
    for option in ("--api-key-file", "--admin-key-file"):
        parser.add_argument(option, default=None)
    for option in ("--max-body-bytes", "--max-connections", "--max-requests-per-key", "--max-parses-per-key"):
        parser.add_argument(option, type=int, default=None)
    for option in ("--header-read-timeout-s", "--body-read-timeout-s"):
        parser.add_argument(option, type=float, default=None)
    parser.add_argument("--max-parse-cpu-share-per-key", "--parse-cpu-share-per-key", type=float, default=None, dest="parse_cpu_share_per_key")
    parser.add_argument("--public-operator-endpoints", "--public-metrics", action="store_true", dest="public_operator_endpoints")
    try:
        args, _ = parser.parse_known_args(worker_args)
    except argparse.ArgumentError as error:
        raise ConfigError(f"worker option {error}", param=error.argument_name) from None
    api_keys = load_api_keys(args.api_key, args.api_key_file)
    admin_keys = load_api_keys(args.admin_key, args.admin_key_file, env_name=ADMIN_KEYS_ENV)
    given = {name: value for name, value in vars(args).items() if value is not None and name.startswith(("max_", "header_", "body_", "parse_"))}
    keyless_remote = not api_keys and not admin_keys and not _is_loopback(host)
    limits = ServerLimits(
        allowed_origins=tuple(args.allowed_origin or ()), allowed_hosts=("*",) if keyless_remote else (),
        public_operator_endpoints=args.public_operator_endpoints, **given,
    )  # fmt: skip
    return Tenants(api_keys, admin_keys=admin_keys), limits


def _is_loopback(host: str) -> bool:
    """As `radixkv serve` judges its own --host: served beyond loopback without a key, any Host name."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
