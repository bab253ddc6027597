"""The cluster's sticky-session front door (radixkv/cluster_sessions.py) over stand-in workers
and router that say who answered: a session goes to the worker that served it last, keyed by
(owner, key), the map is bounded, a worker that is gone hands its sessions on, and everything
else goes through the router."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from radixkv.cluster_sessions import ProxyThread, SessionProxy, StickyMap, owner_of, rendezvous, session_key


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
