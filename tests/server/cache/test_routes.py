"""POST /v1/cache/lookup and /v1/cache/flush on a live server with a disk tier: a lookup counts
RAM and disk tokens in the caller's own partition only, a flush needs an admin key and reports
what it freed, the disk tier's metrics are exported, and a restart with the same tenant secret
is warm for the same tenant."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from radixkv.server.app import create_app
from radixkv.server.guards.tenants import persistent_secret
from radixkv.server.thread import ServerThread
from tests.helpers.engine import VOCAB
from tests.helpers.live_server import KEY_A, KEY_B, MODEL, LiveServer, make_async_engine, metric_values

ADMIN = "sk-test-admin"


@contextmanager
def disk_server(model: Path, directory: Path, **overrides) -> Iterator[LiveServer]:
    engine = make_async_engine(model, kv_disk_dir=str(directory), **overrides)
    secret = persistent_secret(directory.parent / "tenant_secret")  # never inside the KV directory
    app = create_app(engine, api_keys=[KEY_A, KEY_B], model_name=MODEL, tenant_secret=secret, admin_keys=[ADMIN])
    try:
        with ServerThread(app) as thread:
            yield LiveServer(thread.base_url, engine, app)
    finally:
        engine.shutdown()  # writes the RAM cache to disk


def complete(live: LiveServer, prompt: list[int], key: str = KEY_A) -> dict:
    with live.http(key) as http:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def lookup(live: LiveServer, prompt: list[int], key: str = KEY_A) -> dict:
    with live.http(key) as http:
        response = http.post("/v1/cache/lookup", json={"prompt": prompt})
    assert response.status_code == 200, response.text
    return response.json()


def test_lookup_flush_metrics_and_a_warm_restart(tiny_llama: Path, tmp_path: Path) -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(1, VOCAB) for _ in range(41)]  # 10 full blocks of 4
    with disk_server(tiny_llama, tmp_path / "kv") as live:
        assert lookup(live, prompt) == {
            "object": "cache.lookup", "prompt_tokens": 41, "cached_tokens": 0, "ram_tokens": 0, "disk_tokens": 0
        }
        complete(live, prompt)
        assert lookup(live, prompt)["ram_tokens"] == 40
        assert lookup(live, prompt, key=KEY_B)["cached_tokens"] == 0  # another tenant sees nothing
        with live.http(KEY_A) as http:
            refused = http.post("/v1/cache/flush", json={"tier": "ram"})
        assert refused.status_code == 403
        with live.http(ADMIN) as http:
            flushed = http.post("/v1/cache/flush", json={"tier": "ram"})
        assert flushed.status_code == 200 and flushed.json()["freed_ram_pages"] >= 10
        # A RAM flush is an eviction: the blocks were written back to disk.
        assert lookup(live, prompt) == {
            "object": "cache.lookup", "prompt_tokens": 41, "cached_tokens": 40, "ram_tokens": 0, "disk_tokens": 40
        }
        metrics = metric_values(live)
        assert metrics[("radixkv_disk_cache_enabled", ())] == 1.0
        assert metrics[("radixkv_disk_cache_written_blocks_total", ())] >= 10
        assert metrics[("radixkv_disk_cache_rejected_blocks_total", (("reason", "checksum"),))] == 0
        # Residency: the flushed pages left RAM under "flush", each with its lifetime observed.
        ram = (("tier", "ram"),)
        assert metrics[("radixkv_cache_evicted_blocks_total", (("reason", "flush"), ("tier", "ram")))] >= 10
        assert metrics[("radixkv_cache_block_lifetime_seconds_count", ram)] >= 10
        assert metrics[("radixkv_cache_block_lifetime_seconds_bucket", (("le", "+Inf"), ("tier", "ram")))] >= 10
        assert metrics[("radixkv_cache_bytes", (("tier", "disk"),))] > 0
        live.assert_idle_and_consistent()

    with disk_server(tiny_llama, tmp_path / "kv") as live:  # a restart: same directory, same secret
        assert lookup(live, prompt)["disk_tokens"] == 40
        assert lookup(live, prompt, key=KEY_B)["cached_tokens"] == 0
        assert complete(live, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
        metrics = metric_values(live)
        assert metrics[("radixkv_disk_cache_hit_blocks_total", ())] == 10
        assert metrics[("radixkv_cache_hit_blocks_total", (("tier", "disk"),))] == 10
        # Ages carry over a restart (the files' times): each hit's reuse gap is observed.
        assert metrics[("radixkv_cache_block_reuse_gap_seconds_count", (("tier", "disk"),))] == 10
        with live.http(ADMIN) as http:
            flushed = http.post("/v1/cache/flush", json={"tier": "all"})
        assert flushed.status_code == 200 and flushed.json()["freed_disk_blocks"] >= 10
        assert lookup(live, prompt)["cached_tokens"] == 0
        live.assert_idle_and_consistent()


def test_a_prompt_past_the_context_is_refused_for_a_pin_by_the_engine(live_server: LiveServer) -> None:
    """The pin route does not check the context: the engine refuses a pin's prompt (its warming
    request), in the request's own names. (A lookup's is refused in its parse slot: below.)"""
    too_long = [1 + i % (VOCAB - 1) for i in range(600)]  # the tiny Llama's context is 512
    with live_server.http(KEY_A) as http:
        refused = http.post("/v1/cache/pin", json={"prompt": too_long})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
        assert "maximum context length is 512" in error["message"]
        messages = [{"role": "user", "content": "x " * 600}]
        refused = http.post("/v1/cache/pin", json={"messages": messages})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
    live_server.assert_idle_and_consistent()


def test_a_lookup_past_the_context_is_refused_in_its_parse_slot_without_engine_work(live_server: LiveServer, monkeypatch) -> None:
    """Nothing longer than the context is cached, so a lookup is refused past it (a 400 naming
    the limit, in the request's names) before anything reaches the engine thread: a key sending
    millions of ids spends its own parse slots, not the thread every stream waits on."""
    engine = live_server.async_engine
    context = engine.max_context_tokens
    engine_calls = []
    call_async = engine.call_async
    monkeypatch.setattr(engine, "call_async", lambda fn: engine_calls.append(fn) or call_async(fn))
    with live_server.http(KEY_A) as http:
        for num_ids in (context + 1, 200_000):
            refused = http.post("/v1/cache/lookup", json={"prompt": [1 + i % (VOCAB - 1) for i in range(num_ids)]})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
            assert f"maximum context length is {context}" in error["message"] and str(num_ids) in error["message"]
        messages = [{"role": "user", "content": "x " * context}]
        refused = http.post("/v1/cache/lookup", json={"messages": messages})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
        assert engine_calls == []  # refused without the engine thread
        answered = http.post("/v1/cache/lookup", json={"prompt": [1] * context})  # the context's length is looked up
        assert answered.status_code == 200 and answered.json()["prompt_tokens"] == context
        assert len(engine_calls) == 1
    live_server.assert_idle_and_consistent()
