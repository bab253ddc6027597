"""Clients that go away mid-request: their requests are aborted and their pages released."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.engine import wait_until
from tests.helpers.live_server import MODEL, metric_values

ABORTS = ("radixkv_request_finished_total", (("finish_reason", "abort"),))


def aborted(live_server) -> float:
    return metric_values(live_server).get(ABORTS, 0.0)


def long_request(i: int, stream: bool) -> dict:
    # Greedy on the tiny model runs the full length (checked by the abort count below), long
    # enough to still be generating when the client leaves.
    return {"model": MODEL, "prompt": f"Disconnect {i}: the quick brown fox", "max_tokens": 480, "temperature": 0, "stream": stream}


def generated(live_server) -> int:
    return live_server.async_engine.stats().counters.num_output_tokens


def test_dropped_streams_are_aborted_and_pages_released(live_server):
    before, tokens_before = aborted(live_server), generated(live_server)
    opened = []
    for i in range(3):
        client = live_server.http()
        context = client.stream("POST", "/v1/completions", json=long_request(i, stream=True))
        response = context.__enter__()
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # tokens are flowing
        opened.append((client, context))
    assert live_server.async_engine.stats().num_unfinished >= 1
    for client, context in opened:
        context.__exit__(None, None, None)
        client.close()
    assert wait_until(lambda: aborted(live_server) - before == 3), aborted(live_server) - before
    live_server.assert_idle_and_consistent()
    assert metric_values(live_server)[("radixkv_num_requests_unfinished", ())] == 0
    assert generated(live_server) - tokens_before < 3 * 480  # they were cut short, not run out
    ok = live_server.client().completions.create(model=MODEL, prompt="still alive?", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_dropped_non_streaming_request_is_aborted(live_server):
    before, tokens_before = aborted(live_server), generated(live_server)
    with live_server.http() as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json=long_request(9, stream=False), timeout=httpx.Timeout(30, read=0.2))
    assert wait_until(lambda: aborted(live_server) - before == 1), aborted(live_server) - before
    live_server.assert_idle_and_consistent()
    assert generated(live_server) - tokens_before < 480
    ok = live_server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.choices
