"""Usage's prompt_cache_kept echoes a session's turn, kept when the reply ends (the prompt and
the reply, until the idle time runs out), and a Responses request's prompt_cache_retention,
mapped to the same keep record chat's is."""

from __future__ import annotations

import time

from tests.helpers.live_server import KEY_A, MODEL, LiveServer

PAGE_SIZE = 4


def test_a_session_turn_is_echoed_as_kept(live_server: LiveServer) -> None:
    before_s = time.time()
    reply = live_server.client(KEY_A).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A session's first turn, kept for the next one."}],
        max_tokens=6, extra_body={"ignore_eos": True},
        extra_headers={"X-Radixkv-Session": "kept-echo", "X-Radixkv-Session-Idle-S": "120"},
    )  # fmt: skip
    kept = reply.model_dump()["usage"]["prompt_cache_kept"]
    # The prompt and the reply, in full pages, but for the reply's last token (never computed).
    assert kept["tokens"] == (reply.usage.prompt_tokens + 6 - 1) // PAGE_SIZE * PAGE_SIZE
    assert kept["tokens"] > reply.usage.prompt_tokens
    assert before_s + 120 - 5 <= kept["expires_at"] <= time.time() + 120 + 1
    with live_server.http(KEY_A) as http:
        http.delete("/v1/cache/sessions/kept-echo")


def test_responses_prompt_cache_retention_keeps_the_prompt(live_server: LiveServer) -> None:
    before_s = time.time()
    response = live_server.client(KEY_A).responses.create(
        model=MODEL, input="Keep this prompt for a day, as chat would.", max_output_tokens=1, prompt_cache_retention="24h"
    )
    kept = response.model_dump()["usage"]["prompt_cache_kept"]
    assert kept["tokens"] == response.usage.input_tokens // PAGE_SIZE * PAGE_SIZE > 0
    assert before_s + 86400 - 5 <= kept["expires_at"] <= time.time() + 86400 + 1
    assert response.prompt_cache_retention == "24h"
    plain = live_server.client(KEY_A).responses.create(model=MODEL, input="Not kept.", max_output_tokens=1)
    assert plain.model_dump()["usage"]["prompt_cache_kept"] == {"tokens": 0, "expires_at": None}
    with live_server.http(KEY_A) as http:
        bad = http.post("/v1/responses", json={"model": MODEL, "input": "x", "prompt_cache_retention": "forever"})
    assert bad.status_code == 400 and "prompt_cache_retention" in bad.text
