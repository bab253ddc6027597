"""Who may reach the server: without API keys (a local server) requests a web page could forge
are refused (foreign Origin, non-loopback Host, non-JSON bodies); with keys, every route needs
one, as `Authorization: Bearer` or as `x-api-key` alike, the operator endpoints and the docs too
(unless the operator endpoints are made public); /health is always open."""

from __future__ import annotations

import httpx
import pytest

from radixkv.server.limits import ServerLimits
from tests.helpers.live_server import KEY_A, KEY_B, MODEL, make_async_engine, serve

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 1}


@pytest.fixture(scope="module")
def keyless_server(tiny_llama):
    limits = ServerLimits(allowed_origins=("https://app.example",))
    with serve(make_async_engine(tiny_llama), keys=(), limits=limits) as live:
        yield live


@pytest.fixture(scope="module")
def keyed_server(tiny_llama):
    with serve(make_async_engine(tiny_llama)) as live:
        yield live


def test_a_keyless_server_serves_plain_local_json(keyless_server):
    with keyless_server.http(key=None) as client:
        assert client.post("/v1/completions", json=BODY).status_code == 200
        same_site = client.post("/v1/completions", json=BODY, headers={"Origin": keyless_server.base_url})
        allowed = client.post("/v1/completions", json=BODY, headers={"Origin": "https://app.example"})
        localhost = client.get("/v1/models", headers={"Host": "localhost:8000"})
    assert same_site.status_code == 200 and allowed.status_code == 200 and localhost.status_code == 200


@pytest.mark.parametrize(
    "headers, status, code",
    [
        ({"Origin": "https://evil.example"}, 403, "origin_not_allowed"),
        ({"Host": "evil.example"}, 403, "host_not_allowed"),
        ({"Host": "rebound.evil.example:8000"}, 403, "host_not_allowed"),
    ],
)
def test_a_keyless_server_refuses_cross_site_requests(keyless_server, headers, status, code):
    with keyless_server.http(key=None) as client:
        response = client.post("/v1/completions", json=BODY, headers=headers)
    assert response.status_code == status and response.json()["error"]["code"] == code


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
def test_a_keyless_server_refuses_bodies_a_form_could_send(keyless_server, content_type):
    import json

    with keyless_server.http(key=None) as client:
        response = client.post("/v1/completions", content=json.dumps(BODY), headers={"Content-Type": content_type})
    assert response.status_code == 415 and response.json()["error"]["code"] == "unsupported_media_type"


def test_refusals_on_messages_are_in_anthropic_shape(keyless_server):
    with keyless_server.http(key=None) as client:
        response = client.post("/v1/messages", json={}, headers={"Origin": "https://evil.example"})
    assert response.status_code == 403 and response.json()["error"]["type"] == "permission_error"
    assert response.json()["type"] == "error"


OPERATOR_PATHS = ["/metrics", "/get_load", "/server_info", "/get_server_info", "/model_info", "/get_model_info"]


@pytest.mark.parametrize("path", [*OPERATOR_PATHS, "/docs", "/openapi.json", "/redoc"])
def test_operator_pages_need_the_key_when_keys_are_set(keyed_server, path):
    assert httpx.get(f"{keyed_server.base_url}{path}").status_code == 401
    assert httpx.get(f"{keyed_server.base_url}{path}", headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
    assert httpx.get(f"{keyed_server.base_url}{path}", headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 200
    assert httpx.get(f"{keyed_server.base_url}{path}", headers={"x-api-key": KEY_B}).status_code == 200
    assert httpx.get(f"{keyed_server.base_url}/health").status_code == 200


def test_operator_endpoints_can_be_made_public(tiny_llama):
    with serve(make_async_engine(tiny_llama), limits=ServerLimits(public_operator_endpoints=True)) as live:
        for path in OPERATOR_PATHS:
            assert httpx.get(f"{live.base_url}{path}").status_code == 200, path
        assert httpx.get(f"{live.base_url}/docs").status_code == 401
        assert httpx.get(f"{live.base_url}/v1/models").status_code == 401


# One request per kind of route: OpenAI, Anthropic, Responses, cache management, worker (admin).
ROUTES = [
    ("GET", "/v1/models", None, 200),
    ("POST", "/v1/completions", BODY, 200),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, 200),
    ("POST", "/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, 200),
    ("POST", "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 1, "store": False}, 200),
    ("POST", "/v1/cache/lookup", {"model": MODEL, "prompt": "hi"}, 200),
    ("GET", "/v1/cache/pin", None, 200),
    ("POST", "/v1/cache/pin", {"model": MODEL, "prompt": "a prompt to pin here"}, 200),
    ("POST", "/flush_cache", None, 403),  # a tenant's key, not an admin's: known, but not allowed
]


@pytest.mark.parametrize("method, path, body, status", ROUTES, ids=[f"{m} {p}" for m, p, _, _ in ROUTES])
def test_every_route_takes_the_key_either_way(keyed_server, method, path, body, status):
    """x-api-key (Anthropic's clients) and Authorization: Bearer (OpenAI's) are the same key on
    every route; neither, or a wrong one, is 401 on every route."""
    url = f"{keyed_server.base_url}{path}"
    for headers in ({"Authorization": f"Bearer {KEY_A}"}, {"x-api-key": KEY_A}):
        response = httpx.request(method, url, json=body, headers=headers, timeout=60)
        assert response.status_code == status, (headers, response.text)
    for headers in ({}, {"x-api-key": "sk-wrong"}, {"Authorization": "Bearer sk-wrong"}):
        assert httpx.request(method, url, json=body, headers=headers, timeout=60).status_code == 401, headers
