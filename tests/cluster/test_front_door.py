"""The cluster's sticky-session front door (radixkv/cluster/front_door.py) over stand-in workers
and router that say who answered: a session goes to the worker that served it last, keyed by
(owner, key), the map is bounded, a worker that is gone hands its sessions on, and everything
else goes through the router. The front door refuses what a worker would, as early (counted in
body bytes read and map entries), and remembers a worker only after a 2xx."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from radixkv.cluster.front_door import (
    ProxyThread,
    SessionProxy,
    StickyMap,
    front_door_guards,
    owner_of,
    rendezvous,
    session_key,
)
from radixkv.engine.sessions import MAX_SESSION_KEY_CHARS
from radixkv.server.guards.tenants import Tenants
from radixkv.server.limits import ServerLimits


def stand_in(name: str):
    """An ASGI app answering every request with its name (streamed in three chunks)."""

    async def app(scope, receive, send) -> None:
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        for part in (b'{"served_by": ', json.dumps(name).encode(), b"}"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


class Cluster:
    def __init__(self) -> None:
        self.workers = [ProxyThreadOf(stand_in(f"worker{i}")) for i in range(3)]
        self.router = ProxyThreadOf(stand_in("router"))
        self.proxy = SessionProxy(self.router.url, [w.url for w in self.workers], max_sessions=4)
        self.front = ProxyThread(self.proxy).start()
        self.names = {w.url: f"worker{i}" for i, w in enumerate(self.workers)}

    def post(self, path: str = "/v1/chat/completions", key: str = "sk-a", body: dict | None = None, **headers: str) -> str:
        response = httpx.post(
            self.front.url + path, json=body or {"messages": []}, headers={"Authorization": f"Bearer {key}", **headers}, timeout=10
        )
        assert response.status_code == 200, response.text
        return response.json()["served_by"]

    def stop(self) -> None:
        self.front.stop()
        for member in [*self.workers, self.router]:
            member.stop()


class ProxyThreadOf(ProxyThread):
    """A stand-in app on a uvicorn thread (ProxyThread serves any ASGI app)."""

    def __init__(self, app) -> None:
        super().__init__(app)  # type: ignore[arg-type]
        self.start()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    made = Cluster()
    try:
        yield made
    finally:
        made.stop()


def test_a_session_goes_to_one_worker_and_other_requests_to_the_router(cluster: Cluster) -> None:
    first = cluster.post(**{"X-Radixkv-Session": "s1"})
    assert first.startswith("worker")
    assert {cluster.post(**{"X-Radixkv-Session": "s1"}) for _ in range(5)} == {first}
    assert cluster.post(body={"prompt_cache_key": "s1", "messages": []}) == first  # the body's key is the same session
    assert cluster.post() == "router"
    assert cluster.post(path="/v1/messages", body={"prompt_cache_key": "s1"}) == "router"  # Anthropic's body has no such field


def test_a_session_goes_back_to_the_worker_that_served_it_last(cluster: Cluster) -> None:
    owner = owner_of({"authorization": "Bearer sk-a"})
    chosen = rendezvous(owner, "s2", cluster.proxy.worker_urls)
    elsewhere = next(url for url in cluster.proxy.worker_urls if url != chosen)
    cluster.proxy.sticky.put(owner, "s2", elsewhere)  # served there last (before a worker joined, say)
    assert cluster.post(**{"X-Radixkv-Session": "s2"}) == cluster.names[elsewhere]


def test_the_same_key_of_two_tenants_is_two_sessions(cluster: Cluster) -> None:
    cluster.post(key="sk-a", **{"X-Radixkv-Session": "same"})
    cluster.post(key="sk-b", **{"X-Radixkv-Session": "same"})
    assert len(cluster.proxy.sticky) == 2
    owner_a = owner_of({"authorization": "Bearer sk-a"})
    owner_b = owner_of({"x-api-key": "sk-b"})  # Anthropic's header names the same owner as Bearer
    assert owner_b == owner_of({"authorization": "Bearer sk-b"}) != owner_a
    assert "sk-a" not in owner_a  # no key kept in the clear


def test_a_gone_worker_hands_its_sessions_to_a_live_one(cluster: Cluster) -> None:
    served = cluster.post(**{"X-Radixkv-Session": "s3"})
    gone = next(w for w in cluster.workers if cluster.names[w.url] == served)
    gone.stop()
    moved = cluster.post(**{"X-Radixkv-Session": "s3"})
    assert moved != served and moved.startswith("worker")
    assert cluster.post(**{"X-Radixkv-Session": "s3"}) == moved


def test_the_sticky_map_is_bounded_least_recently_used_out() -> None:
    sticky = StickyMap(max_entries=2)
    sticky.put("a", "1", "w0")
    sticky.put("a", "2", "w1")
    assert sticky.get("a", "1") == "w0"  # now the more recent
    sticky.put("b", "1", "w2")
    assert len(sticky) == 2 and sticky.get("a", "2") is None and sticky.get("a", "1") == "w0"
    with pytest.raises(ValueError):
        StickyMap(0)


def test_session_keys_are_read_from_the_header_or_an_openai_body() -> None:
    assert session_key("/v1/completions", {"x-radixkv-session": "h"}, b'{"prompt_cache_key": "b"}') == "h"
    assert session_key("/v1/responses", {}, b'{"prompt_cache_key": "b"}') == "b"
    assert session_key("/v1/responses", {}, b"not json prompt_cache_key") is None
    assert session_key("/v1/responses", {}, b'{"prompt_cache_key": 5}') is None
    assert session_key("/v1/cache/pin", {}, b'{"prompt_cache_key": "b"}') is None


# -- the workers' guards at the front door ------------------------------------------------------


def answering(status: int):
    """An ASGI app answering every request with `status` (a worker refusing, or failing)."""

    async def app(scope, receive, send) -> None:
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})

    return app


@dataclass
class Served:
    status: int
    body_bytes_read: int  # what the front door pulled of the request's body
    body: bytes


def drive(proxy: SessionProxy, body: bytes, headers: dict[str, str], *, chunk_bytes: int | None = None, declare: bool = True) -> Served:
    """One POST /v1/chat/completions straight into the proxy's ASGI app, counting the body
    bytes it reads: sent whole with its Content-Length, or in chunks without one."""
    chunk_bytes = chunk_bytes or max(1, len(body))
    chunks = [body[i : i + chunk_bytes] for i in range(0, len(body), chunk_bytes)] or [b""]
    sent_headers = {"content-type": "application/json", "host": "127.0.0.1", **headers}
    sent_headers |= {"content-length": str(len(body))} if declare else {"transfer-encoding": "chunked"}
    scope = {
        "type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in sent_headers.items()],
    }  # fmt: skip
    read, messages = 0, []

    async def receive() -> dict:
        nonlocal read
        if read >= len(body) and read > 0:
            return {"type": "http.disconnect"}
        chunk = chunks[read // chunk_bytes] if body else b""
        read += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": read < len(body)}

    async def send(message: dict) -> None:
        messages.append(message)

    asyncio.run(proxy(scope, receive, send))
    return Served(messages[0]["status"], read, b"".join(m.get("body", b"") for m in messages[1:]))


def keyed_proxy(**limits) -> SessionProxy:
    # Nothing listens on the workers' or the router's port: a request forwarded would be a 502.
    return SessionProxy("http://127.0.0.1:9", ["http://127.0.0.1:9"], tenants=Tenants(["sk-a"]), limits=ServerLimits(**limits))


HUGE_KEY_BODY = json.dumps({"messages": [], "prompt_cache_key": "k" * (4 << 20)}).encode()


def test_an_unauthenticated_request_is_refused_unread_and_remembered_nowhere() -> None:
    proxy = keyed_proxy()
    for headers in ({}, {"authorization": "Bearer sk-wrong"}, {"x-api-key": "sk-wrong"}):
        for declare in (True, False):
            served = drive(proxy, HUGE_KEY_BODY, headers, chunk_bytes=64 << 10, declare=declare)
            assert (served.status, served.body_bytes_read) == (401, 0)
    assert len(proxy.sticky) == 0


def test_an_oversized_body_is_refused_before_it_is_read_in_full() -> None:
    proxy = keyed_proxy(max_body_bytes=1 << 20)
    key = {"authorization": "Bearer sk-a"}
    declared = drive(proxy, HUGE_KEY_BODY, key)
    assert (declared.status, declared.body_bytes_read) == (413, 0)
    chunked = drive(proxy, HUGE_KEY_BODY, key, chunk_bytes=64 << 10, declare=False)
    assert chunked.status == 413 and chunked.body_bytes_read <= (1 << 20) + (64 << 10)
    assert len(proxy.sticky) == 0


def test_a_session_key_past_the_workers_bound_is_refused_unforwarded() -> None:
    proxy = keyed_proxy()
    too_long = json.dumps({"messages": [], "prompt_cache_key": "k" * (MAX_SESSION_KEY_CHARS + 1)}).encode()
    served = drive(proxy, too_long, {"authorization": "Bearer sk-a"})
    assert served.status == 400  # not the 502 of a forward to the port nothing listens on
    error = json.loads(served.body)["error"]
    assert error["param"] == "prompt_cache_key" and str(MAX_SESSION_KEY_CHARS) in error["message"]
    header = drive(proxy, b"{}", {"authorization": "Bearer sk-a", "x-radixkv-session": "k" * (MAX_SESSION_KEY_CHARS + 1)})
    assert header.status == 400 and json.loads(header.body)["error"]["param"] == "x-radixkv-session"
    assert len(proxy.sticky) == 0


@pytest.mark.parametrize("status", [400, 401, 429, 500, 503])
def test_a_worker_is_remembered_for_a_session_only_after_a_2xx(status: int) -> None:
    refusing, router = ProxyThreadOf(answering(status)), ProxyThreadOf(stand_in("router"))
    proxy = SessionProxy(router.url, [refusing.url])
    front = ProxyThread(proxy).start()
    try:
        for session in ({"X-Radixkv-Session": "s1"}, {}):
            body = {"messages": []} if session else {"messages": [], "prompt_cache_key": "s2"}
            response = httpx.post(f"{front.url}/v1/chat/completions", json=body, headers=session, timeout=10)
            assert response.status_code == status
        assert len(proxy.sticky) == 0
    finally:
        for member in (front, refusing, router):
            member.stop()


def test_the_sticky_map_is_bounded_per_owner_and_keeps_digests() -> None:
    sticky = StickyMap(max_entries=8, max_entries_per_owner=2)
    for i in range(5):
        sticky.put("a", f"k{i}", "w0")
    sticky.put("b", "k0", "w1")
    assert sticky.owned_by("a") == 2 and len(sticky) == 3  # a's own oldest went, not b's
    assert sticky.get("a", "k4") == "w0" and sticky.get("a", "k0") is None and sticky.get("b", "k0") == "w1"
    sticky.put("c", "x" * 100_000, "w2")
    assert all(len(digest) == 16 for _, digest in sticky._workers)  # an entry's size is fixed
    sticky.forget("c", "x" * 100_000)
    assert sticky.owned_by("c") == 0 and len(sticky) == 3
    with pytest.raises(ValueError):
        StickyMap(8, max_entries_per_owner=0)


def test_the_front_door_takes_the_workers_keys_and_limits() -> None:
    tenants, limits = front_door_guards(["--api-key", "sk-x", "--max-body-bytes=4096", "--body-read-timeout-s", "3", "--threads", "2"], "127.0.0.1")
    assert tenants.auth_required and (limits.max_body_bytes, limits.body_read_timeout_s) == (4096, 3.0)
    assert not limits.public_operator_endpoints  # the workers' are opened for the router, not the front door's
    tenants, limits = front_door_guards([], "0.0.0.0")
    assert not tenants.auth_required and limits.allowed_hosts == ("*",)  # as a keyless worker on that host
    with pytest.raises(ValueError, match="max-body-bytes"):  # a ConfigError, as `radixkv cluster` reports one
        front_door_guards(["--max-body-bytes", "lots"], "127.0.0.1")


def test_the_front_door_reads_both_spellings_of_the_parse_share() -> None:
    for flag in ("--max-parse-cpu-share-per-key", "--parse-cpu-share-per-key"):
        _, limits = front_door_guards([flag, "0.5"], "127.0.0.1")
        assert limits.parse_cpu_share_per_key == 0.5


def test_a_child_session_goes_to_its_parents_worker_of_the_same_owner(cluster: Cluster) -> None:
    owner_a = owner_of({"authorization": "Bearer sk-a"})
    # The parent was served by a worker no fresh choice of the children would pick for all of them.
    children = [f"child-{i}" for i in range(8)]
    fresh = {rendezvous(owner_a, child, cluster.proxy.worker_urls) for child in children}
    parent_worker = next(url for url in cluster.proxy.worker_urls if url in fresh)
    cluster.proxy.sticky = StickyMap(64)  # room for the parent and its 8 children
    cluster.proxy.sticky.put(owner_a, "parent", parent_worker)
    assert len(fresh) > 1  # so the test could fail: rendezvous alone spreads the children
    for child in children:
        served = cluster.post(**{"X-Dynamo-Session-ID": child, "X-Dynamo-Parent-Session-ID": "parent"})
        assert served == cluster.names[parent_worker]
    # Each child is now sticky on its own: it stays where it was served, wherever the parent goes.
    elsewhere = next(url for url in cluster.proxy.worker_urls if url != parent_worker)
    cluster.proxy.sticky.put(owner_a, "parent", elsewhere)
    assert cluster.post(**{"X-Dynamo-Session-ID": "child-0", "X-Dynamo-Parent-Session-ID": "parent"}) == cluster.names[parent_worker]
    # Another key naming the same parent: not its parent, a fresh choice by its own owner.
    owner_b = owner_of({"authorization": "Bearer sk-b"})
    assert any(rendezvous(owner_b, child, cluster.proxy.worker_urls) != parent_worker for child in children)
    for child in children:
        served = cluster.post(key="sk-b", **{"X-Dynamo-Session-ID": child, "X-Dynamo-Parent-Session-ID": "parent"})
        assert served == cluster.names[rendezvous(owner_b, child, cluster.proxy.worker_urls)]
    # A parent the map does not know: the child's own fresh choice.
    served = cluster.post(**{"X-Dynamo-Session-ID": "orphan", "X-Dynamo-Parent-Session-ID": "unknown"})
    assert served == cluster.names[rendezvous(owner_a, "orphan", cluster.proxy.worker_urls)]
