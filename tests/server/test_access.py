"""Who may reach the server: without API keys (a local server) requests a web page could forge
are refused (foreign Origin, non-loopback Host, non-JSON bodies); with keys, /metrics and the
docs need one too (unless metrics are made public); /health is always open."""

from __future__ import annotations

import httpx
import pytest

from radixkv.server.limits import ServerLimits
from tests.helpers.live_server import KEY_A, MODEL, make_async_engine, serve

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


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/openapi.json", "/redoc"])
def test_operator_pages_need_the_key_when_keys_are_set(keyed_server, path):
    assert httpx.get(f"{keyed_server.base_url}{path}").status_code == 401
    assert httpx.get(f"{keyed_server.base_url}{path}", headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 200
    assert httpx.get(f"{keyed_server.base_url}/health").status_code == 200


def test_metrics_can_be_made_public(tiny_llama):
    with serve(make_async_engine(tiny_llama), limits=ServerLimits(public_metrics=True)) as live:
        assert httpx.get(f"{live.base_url}/metrics").status_code == 200
        assert httpx.get(f"{live.base_url}/docs").status_code == 401
