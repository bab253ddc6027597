"""OpenAI's prompt-cache options on a live server: prompt_cache_breakpoint markers retain the
prefix up to their part (the latest four written, three beside the implicit one), past 80
markers a request is refused, and prewarm computes and retains a prompt, generates nothing and
answers with what is cached now, in the caller's partition only."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from radixkv.server.encode import chat_prompt
from radixkv.server.openai import prompt_cache
from radixkv.server.openai.protocol import ChatCompletionRequest
from tests.helpers.live_server import KEY_A, KEY_B, MAX_QUEUE_LEN, MODEL, LiveServer, make_async_engine, serve



@pytest.fixture(scope="module")
def live_server(tiny_llama) -> Iterator[LiveServer]:
    """This module's own server: its tenant B caches prompts that the shared server's tests
    expect B never to have sent."""
    with serve(make_async_engine(tiny_llama, max_queue_len=MAX_QUEUE_LEN)) as live:
        yield live


SYSTEM = "You are the agent of a long, stable system prompt that every turn shares. " * 2


def marked(text: str, ttl: str | None = None) -> dict:
    mark = {"mode": "explicit", **({"ttl": ttl} if ttl else {})}
    return {"type": "text", "text": text, "prompt_cache_breakpoint": mark}


def owner(live: LiveServer, key: str) -> str:
    return live.app.state.radixkv.tenants.owner(key.encode())


def retentions(live: LiveServer, key: str, since: int = 0) -> list[tuple[int, float]]:
    """(pages, seconds left) of each of the key's live retentions made after retention `since`."""
    who = owner(live, key)

    def read(engine) -> list[tuple[int, float]]:
        engine.tree.expire()
        now = engine.tree.now_s()
        return [(r.num_pages, r.expires_at_s - now) for r in engine.tree.retentions(who) if r.retention_id > since]

    return live.engine_call(read)


def newest_retention(live: LiveServer) -> int:
    """The id of the newest retention of any owner (ids only grow)."""
    return live.engine_call(lambda engine: max((r.retention_id for r in engine.tree._book), default=0))


def lookup(live: LiveServer, messages: list[dict], key: str = KEY_A) -> int:
    with live.http(key) as http:
        response = http.post("/v1/cache/lookup", json={"messages": messages})
    assert response.status_code == 200, response.text
    return response.json()["cached_tokens"]


def test_a_breakpoint_retains_its_prefix_for_its_ttl(live_server: LiveServer) -> None:
    before = newest_retention(live_server)
    messages = [
        {"role": "system", "content": [marked(SYSTEM + "Breakpoint test.", ttl="12h")]},
        {"role": "user", "content": "What is the first step?"},
    ]
    reply = live_server.client(KEY_B).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body={"prompt_cache_options": {"mode": "explicit"}}
    )
    written = reply.usage.prompt_tokens_details.cache_write_tokens
    [(pages, left_s)] = retentions(live_server, KEY_B, since=before)  # the 12h breakpoint, not the whole prompt (explicit mode)
    assert 43000 < left_s <= 43200
    assert written == pages * 4 - reply.usage.prompt_tokens_details.cached_tokens
    assert pages * 4 < reply.usage.prompt_tokens  # the system part only


def test_the_latest_breakpoints_are_written_three_beside_the_implicit_one(live_server: LiveServer) -> None:
    parts = [marked(f"Part {k} of a conversation that keeps its markers. ") for k in range(6)]
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})
    state = live_server.app.state.radixkv
    prompt = chat_prompt(state, [m.as_chat() for m in body.messages])
    implicit = prompt_cache.chat_writes(state, body, [], "none", list(prompt))
    assert len(implicit) == 4 and implicit[-1].num_tokens == len(prompt)
    lengths = [w.num_tokens for w in implicit[:-1]]
    assert lengths == sorted(lengths) and lengths[0] > len(prompt) // 2  # parts 3, 4 and 5: the latest
    body.prompt_cache_options = prompt_cache.PromptCacheOptions(mode="explicit")
    explicit = prompt_cache.chat_writes(state, body, [], "none", list(prompt))
    assert len(explicit) == 4 and explicit[-1].num_tokens < len(prompt)  # parts 2 to 5, no implicit one
    assert [w.num_tokens for w in explicit[1:]] == lengths


def test_more_than_80_markers_are_refused_naming_the_cap(live_server: LiveServer) -> None:
    parts = [marked(f"p{k}") for k in range(81)]
    with live_server.http() as http:
        response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt_cache_breakpoint" and "80" in error["message"]


def test_prewarm_caches_a_prompt_generates_nothing_and_says_how_much(live_server: LiveServer) -> None:
    messages = [{"role": "system", "content": "Prewarm test. " + SYSTEM}, {"role": "user", "content": "Ready?"}]
    client = live_server.client()
    steps_before = live_server.engine_call(lambda engine: engine.counters.num_output_tokens)
    warmed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=50, extra_body={"prompt_cache_options": {"prewarm": True}})
    assert warmed.choices == [] and warmed.usage.completion_tokens == 0
    details = warmed.usage.prompt_tokens_details
    assert details.cached_tokens == 0 and details.cache_write_tokens > 0
    assert live_server.engine_call(lambda engine: engine.counters.num_output_tokens) - steps_before <= 1  # one dropped token
    assert [p for p, left_s in retentions(live_server, KEY_A) if 1700 < left_s <= 1800]  # its 30m implicit breakpoint
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert reply.usage.prompt_tokens_details.cached_tokens >= details.cache_write_tokens - 4  # all but the last token's block
    again = client.chat.completions.create(model=MODEL, messages=messages, extra_body={"prompt_cache_options": {"prewarm": True}})
    assert again.usage.prompt_tokens_details.cached_tokens + again.usage.prompt_tokens_details.cache_write_tokens == (
        details.cache_write_tokens
    )
    # Another tenant's identical prompt finds only what it cached itself (the template's opening,
    # which every chat shares), never A's prewarm.
    own = lookup(live_server, messages[:1], KEY_B)
    assert own < 16
    other = live_server.client(KEY_B).chat.completions.create(
        model=MODEL, messages=messages, extra_body={"prompt_cache_options": {"prewarm": True}}
    )
    assert other.usage.prompt_tokens_details.cached_tokens <= own


def test_prewarm_on_completions(live_server: LiveServer) -> None:
    with live_server.http() as http:
        response = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": SYSTEM + "A completion prompt to warm.", "prompt_cache_options": {"prewarm": True}},
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"] == [] and body["object"] == "text_completion"
        assert body["usage"]["prompt_tokens_details"]["cache_write_tokens"] == body["usage"]["prompt_tokens"] // 4 * 4


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt_cache_options": {"prewarm": True}, "stream": True}, "prompt_cache_options.prewarm"),
        ({"prompt_cache_options": {"prewarm": True}, "n": 2}, "prompt_cache_options.prewarm"),
        ({"prompt_cache_options": {"ttl": "30m"}, "prompt_cache_retention": "24h"}, "prompt_cache_options.ttl"),
    ],
)
def test_prompt_cache_options_openai_refuses_are_refused_before_any_work(live_server: LiveServer, extra: dict, param: str) -> None:
    before = live_server.engine_call(lambda engine: engine.counters.num_steps)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    with httpx.Client(base_url=live_server.base_url, headers={"Authorization": f"Bearer {KEY_A}"}) as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert live_server.engine_call(lambda engine: engine.counters.num_steps) == before


def test_prewarm_on_the_responses_api_with_the_clients_own_field(live_server: LiveServer) -> None:
    client = live_server.client()
    text = "Responses prewarm. " + SYSTEM
    warmed = client.responses.create(model=MODEL, input=text, prompt_cache_options={"prewarm": True, "ttl": "12h"})
    assert warmed.status == "completed" and warmed.output == []
    details = warmed.usage.input_tokens_details
    assert details.cached_tokens == 0 and details.cache_write_tokens >= warmed.usage.input_tokens - 4
    assert [p for p, left_s in retentions(live_server, KEY_A) if 43000 < left_s <= 43200]
    reply = client.responses.create(model=MODEL, input=text, max_output_tokens=2)
    assert reply.usage.input_tokens_details.cached_tokens >= details.cache_write_tokens - 4
    with live_server.http() as http:
        refused = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": True, "prompt_cache_options": {"prewarm": True}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_cache_options.prewarm"


def test_a_breakpoint_in_a_responses_input_part(live_server: LiveServer) -> None:
    before = newest_retention(live_server)
    mark = {"mode": "explicit", "ttl": "12h"}
    parts = [{"type": "input_text", "text": "Responses marker. " + SYSTEM, "prompt_cache_breakpoint": mark}, {"type": "input_text", "text": "Go on."}]
    reply = live_server.client(KEY_B).responses.create(
        model=MODEL, input=[{"role": "user", "content": parts}], max_output_tokens=2, prompt_cache_options={"mode": "explicit"}
    )
    [(pages, left_s)] = retentions(live_server, KEY_B, since=before)
    assert 43000 < left_s <= 43200 and 0 < pages * 4 < reply.usage.input_tokens - 4  # the marked part only
    with live_server.http(KEY_B) as http:
        bad = http.post("/v1/responses", json={"model": MODEL, "input": [{"role": "user", "content": [{**parts[0], "prompt_cache_breakpoint": {"mode": "sometimes"}}]}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("input.0.content.0.prompt_cache_breakpoint")


def test_usage_echoes_what_of_the_prompt_is_kept_and_until_when(live_server: LiveServer) -> None:
    import time

    messages = [{"role": "system", "content": SYSTEM + "Echo test."}, {"role": "user", "content": "Go."}]
    before_s = time.time()
    kept = live_server.client(KEY_B).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body={"prompt_cache_retention": "24h"}
    ).model_dump()["usage"]["prompt_cache_kept"]
    assert kept["tokens"] > 0 and kept["tokens"] % 4 == 0  # its full pages
    assert before_s + 86400 - 5 <= kept["expires_at"] <= time.time() + 86400 + 1
    plain = live_server.client(KEY_B).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Plain."}], max_tokens=1)
    assert plain.model_dump()["usage"]["prompt_cache_kept"] == {"tokens": 0, "expires_at": None}
    with live_server.http(KEY_B) as http:
        response = http.post("/v1/responses", json={"model": MODEL, "input": SYSTEM + "Echo.", "max_output_tokens": 1,
                                                   "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}})  # fmt: skip
    assert response.status_code == 200, response.text
    echoed = response.json()["usage"]["prompt_cache_kept"]
    assert echoed["tokens"] > 0 and before_s + 1800 - 5 <= echoed["expires_at"] <= time.time() + 1800 + 1


@pytest.mark.parametrize("ttl", ["1h", "24h", "5m", "", 1800])
def test_a_ttl_openai_does_not_document_is_a_400_before_any_work(live_server: LiveServer, ttl: object) -> None:
    """prompt_cache_options.ttl takes what OpenAI documents ("30m", "12h"), a breakpoint's ttl too."""
    before = live_server.engine_call(lambda engine: engine.counters.num_steps)
    with live_server.http() as http:
        for body, param in (
            ({"prompt_cache_options": {"ttl": ttl}, "messages": [{"role": "user", "content": "hi"}]}, "prompt_cache_options"),
            ({"messages": [{"role": "user", "content": [{**marked("hi"), "prompt_cache_breakpoint": {"mode": "explicit", "ttl": ttl}}]}]}, "messages"),
        ):
            response = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, **body})
            assert response.status_code == 400, response.text
            assert (response.json()["error"]["param"] or "").startswith(param)
    assert live_server.engine_call(lambda engine: engine.counters.num_steps) == before
