"""radixkv on Ray Serve at the smallest size that runs here: a local Ray with two radixkv
replicas of the tiny model behind the prefix-aware router and the HTTP ingress on 127.0.0.1.
Requests that share a long prefix all land on the replica that cached it (each after the first
reports cached tokens; a router blind to prefixes would send each to the other replica half
the time, so six hits in a row would be a 1-in-64 chance), and the
OpenAI endpoints work through the ingress, streaming included. Skipped without Ray Serve.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'radixkv[ray]'")

import httpx  # noqa: E402
import openai  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from radixkv.cluster.ray_serve import ForwardedRequest, build_app, routing_text  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_routing_text_names_the_prompt():
    chat = b'{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}'
    assert routing_text(chat, "POST", "/v1/chat/completions") == "Be brief.Hi"
    assert routing_text(b'{"prompt": "abc"}', "POST", "/v1/completions") == "abc"
    assert routing_text(b'{"system": "S", "messages": [{"role": "user", "content": "U"}]}', "POST", "/v1/messages") == "SU"
    assert routing_text(b"", "GET", "/v1/models") == "GET /v1/models"  # never empty: the router divides by it
    assert routing_text(b"not json", "POST", "/v1/completions") == "POST /v1/completions"
    assert ForwardedRequest("GET", "/", b"", [], b"", "x").prompt == "x"


@pytest.fixture(scope="module")
def ray_serve_url(tiny_llama):
    port = free_port()
    # Workers import radixkv from this checkout, as the driver does; logical CPUs only (the
    # replicas ask for none, so two fit on a 2-core machine beside Serve's own actors).
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}},
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine_options = dict(model=str(tiny_llama), dtype="float32", device="cpu", page_size=4, num_pages=256)
        app = build_app(engine_options, num_replicas=2, model_name=MODEL, replica_actor_options={"num_cpus": 0})
        serve.run(app, name="radixkv", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_prefix_affinity_through_the_ingress(ray_serve_url):
    client = openai.OpenAI(base_url=f"{ray_serve_url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [MODEL]
    system = "You are a helpful assistant. Answer briefly and precisely. " * 3
    cached = []
    questions = ["What is the capital of France?", "def add(a, b):", "The quick brown fox", "Prefix caching", "Why?", "How?", "Who?"]
    for question in questions:
        response = client.completions.create(model=MODEL, prompt=system + question, max_tokens=2, temperature=0)
        details = response.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details else 0)
    assert cached[0] == 0 and all(tokens >= 40 for tokens in cached[1:]), cached
    # A stream comes through event by event, ending in [DONE].
    with httpx.stream(
        "POST", f"{ray_serve_url}/v1/completions", timeout=60,
        json={"model": MODEL, "prompt": system + "Stream", "max_tokens": 3, "temperature": 0, "stream": True},
    ) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2
    # Errors keep radixkv's status and OpenAI's error format.
    bad = httpx.post(f"{ray_serve_url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
