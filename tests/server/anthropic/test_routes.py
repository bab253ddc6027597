"""The `anthropic` client, unchanged, against a live server: messages with a cache_control
system prompt (cache reads on the second call, usage that adds up, the prefix retained),
streaming through the client's helper, x-api-key auth, and Anthropic-shaped errors."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.helpers.live_server import KEY_A, MODEL, LiveServer

SYSTEM = "You are a careful assistant for radixkv tests. " * 12


def client(live: LiveServer, key: str = KEY_A) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.base_url, api_key=key, max_retries=0, timeout=60)


def prompt_tokens(live: LiveServer, usage: anthropic.types.Usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_cache_control_system_prompt_is_read_back_and_usage_adds_up(live_server: LiveServer) -> None:
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    messages = [{"role": "user", "content": "Say hi."}]
    c = client(live_server)
    first = c.messages.create(model=MODEL, max_tokens=4, system=system, messages=messages, extra_body={"temperature": 0})
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert first.stop_reason in ("end_turn", "max_tokens")
    assert first.usage.cache_creation_input_tokens > 0  # computed now, retained now
    second = c.messages.create(model=MODEL, max_tokens=4, system=system, messages=[{"role": "user", "content": "Bye."}])
    assert second.usage.cache_read_input_tokens > 0
    assert prompt_tokens(live_server, second.usage) > second.usage.cache_read_input_tokens
    assert live_server.async_engine.stats().cache.retained_pages > 0
    live_server.assert_idle_and_consistent()


def test_usage_sums_to_the_prompt(live_server: LiveServer) -> None:
    system = [{"type": "text", "text": SYSTEM + " v2", "cache_control": {"type": "ephemeral"}}]
    raw = client(live_server).messages.with_raw_response.create(
        model=MODEL, max_tokens=3, system=system, messages=[{"role": "user", "content": "Count."}]
    )
    usage = raw.parse().usage
    with live_server.http() as http:
        plain = http.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 1,
            "messages": [{"role": "system", "content": SYSTEM + " v2"}, {"role": "user", "content": "Count."}],
        }).json()
    assert prompt_tokens(live_server, usage) == plain["usage"]["prompt_tokens"]


def test_streaming_reassembled_by_the_client(live_server: LiveServer) -> None:
    c = client(live_server)
    kwargs = dict(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "Tell me."}], extra_body={"temperature": 0})
    with c.messages.stream(**kwargs) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    whole = c.messages.create(**kwargs)
    assert "".join(texts) == "".join(b.text for b in final.content if b.type == "text")
    assert [b.text for b in final.content] == [b.text for b in whole.content] and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    live_server.assert_idle_and_consistent()


def test_x_api_key_and_bearer_share_one_partition(live_server: LiveServer) -> None:
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": SYSTEM + "partition"}]}
    with httpx.Client(base_url=live_server.base_url, timeout=60) as http:
        first = http.post("/v1/messages", json=body, headers={"x-api-key": KEY_A, "anthropic-version": "2023-06-01"})
        second = http.post("/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY_A}"})
        wrong = http.post("/v1/messages", json=body, headers={"x-api-key": "sk-wrong"})
    assert first.status_code == second.status_code == 200
    assert second.json()["usage"]["cache_read_input_tokens"] > 0
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        client(live_server, "sk-wrong").messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "body, status",
    [
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, 400),  # no max_tokens
        ({"model": MODEL, "max_tokens": 2, "messages": []}, 400),
        ({"model": MODEL, "max_tokens": 2, "messages": [{"role": "robot", "content": "x"}]}, 400),
        ({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400),
        ({"model": MODEL, "max_tokens": 2, "temperature": 3, "messages": [{"role": "user", "content": "x"}]}, 400),
        ({"model": MODEL, "max_tokens": 10**9, "messages": [{"role": "user", "content": "x"}]}, 400),
        ({"model": MODEL, "max_tokens": 2, "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "x"}]}, 400),
        ({"model": "nope", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}, 404),
        ("not json", 400),
    ],
)
def test_bad_input_is_an_anthropic_shaped_error(live_server: LiveServer, body: object, status: int) -> None:
    with live_server.http() as http:
        reply = http.post("/v1/messages", content=body if isinstance(body, str) else None, json=None if isinstance(body, str) else body)
    assert reply.status_code == status, reply.text
    data = reply.json()
    assert data["type"] == "error" and data["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert data["error"]["message"]


def test_client_raises_bad_request(live_server: LiveServer) -> None:
    with pytest.raises(anthropic.BadRequestError):
        client(live_server).messages.create(model=MODEL, max_tokens=2, messages=[])


WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]},
}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_any_gives_a_tool_use_block_the_client_parses(agent_server: LiveServer, stream: bool) -> None:
    import jsonschema

    c = client(agent_server)
    kwargs = dict(
        model=MODEL, max_tokens=200, tools=[WEATHER_TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )  # fmt: skip
    if stream:
        with c.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = c.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    [use] = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER_TOOL["input_schema"])
    # The result goes back as a tool_result block, and the conversation goes on.
    reply = c.messages.create(
        model=MODEL, max_tokens=8, tools=[WEATHER_TOOL],
        messages=[*kwargs["messages"], {"role": "assistant", "content": [use.model_dump()]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny."}]}],
    )  # fmt: skip
    assert reply.type == "message" and reply.usage.cache_read_input_tokens > 0
    agent_server.assert_idle_and_consistent()


def test_cache_creation_splits_the_written_tokens_by_ttl_and_the_lifetime_is_echoed(live_server: LiveServer) -> None:
    import time

    system = [
        {"type": "text", "text": SYSTEM + " ttl split", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"type": "text", "text": "Then a shorter-lived part of the system prompt.", "cache_control": {"type": "ephemeral", "ttl": "5m"}},
    ]
    before_s = time.time()
    raw = client(live_server).messages.with_raw_response.create(
        model=MODEL, max_tokens=2, system=system, messages=[{"role": "user", "content": "Go."}]
    )
    usage = raw.parse().usage
    split = usage.cache_creation
    assert split is not None and split.ephemeral_1h_input_tokens > 0 and split.ephemeral_5m_input_tokens > 0
    assert split.ephemeral_1h_input_tokens + split.ephemeral_5m_input_tokens == usage.cache_creation_input_tokens
    kept = raw.http_response.json()["usage"]["prompt_cache_kept"]
    assert kept["tokens"] >= usage.cache_creation_input_tokens and before_s + 3600 - 5 <= kept["expires_at"] <= time.time() + 3601
    again = client(live_server).messages.create(model=MODEL, max_tokens=2, system=system, messages=[{"role": "user", "content": "Go."}])
    assert again.usage.cache_creation is not None and again.usage.cache_creation.ephemeral_1h_input_tokens == 0  # read, not written
