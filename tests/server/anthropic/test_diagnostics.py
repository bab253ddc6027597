"""Anthropic's cache diagnostics through the `anthropic` client: `diagnostics.previous_message_id`
answers null when nothing diverged and each cache_miss_reason when something did (system, tools
reordered or their keys reordered, a message changed mid-conversation with the missed tokens),
previous_message_not_found for an unknown id and, alike, for another key's; a content array of
one text part and the same text as a string are one prompt."""

from __future__ import annotations

import anthropic
import pytest

from radixkv.server.anthropic import conversation as conv_mod
from radixkv.server.anthropic.protocol import MessagesRequest
from tests.helpers.live_server import KEY_A, KEY_B, MODEL, LiveServer

SYSTEM = "You answer questions about the weather in short sentences."
PAGE_SIZE = 4  # the live servers' page size (tests/helpers/live_server.make_async_engine)
TOOL_A = {"name": "weather", "description": "Weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOL_B = {"name": "clock", "description": "Time in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def client(live: LiveServer, key: str = KEY_A) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.base_url, api_key=key, max_retries=0, timeout=60)


def total(usage: anthropic.types.Usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def create(live: LiveServer, messages: list, previous: str | None = None, key: str = KEY_A, **kwargs) -> anthropic.types.Message:
    kwargs.setdefault("system", SYSTEM)
    return client(live, key).messages.create(
        model=MODEL, max_tokens=2, messages=messages, diagnostics={"previous_message_id": previous},
        extra_body={"temperature": 0}, **kwargs,
    )  # fmt: skip


TURN1 = [{"role": "user", "content": "What is the weather in Paris today?"}]


def test_nothing_diverged_is_null_and_a_first_message_is_null(agent_server: LiveServer) -> None:
    first = create(agent_server, TURN1)
    assert first.diagnostics is not None and first.diagnostics.cache_miss_reason is None
    turn2 = TURN1 + [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And tomorrow?"}]
    # With the beta header as Anthropic's docs send it, or without: the same answer.
    second = create(agent_server, turn2, first.id, extra_headers={"anthropic-beta": "cache-diagnosis-2026-04-07"})
    assert isinstance(second.diagnostics, anthropic.types.Diagnostics)
    assert second.diagnostics.cache_miss_reason is None
    third = create(agent_server, turn2, second.id)
    assert third.diagnostics.cache_miss_reason is None


def test_no_diagnostics_field_without_asking(agent_server: LiveServer) -> None:
    plain = client(agent_server).messages.create(model=MODEL, max_tokens=2, messages=TURN1)
    assert plain.diagnostics is None
    with agent_server.http() as http:
        raw = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": TURN1}).json()
    assert "diagnostics" not in raw


def test_system_changed_misses_the_whole_previous_prompt(agent_server: LiveServer) -> None:
    first = create(agent_server, TURN1)
    second = create(agent_server, TURN1, first.id, system=SYSTEM + " Today is 2026-04-07.")
    reason = second.diagnostics.cache_miss_reason
    assert isinstance(reason, anthropic.types.CacheMissSystemChanged)
    assert reason.cache_missed_input_tokens == total(first.usage)


@pytest.mark.parametrize("change", ["reordered", "keys_reordered"])
def test_tools_changed_is_named_not_rewritten(agent_server: LiveServer, change: str) -> None:
    first = create(agent_server, TURN1, tools=[TOOL_A, TOOL_B])
    if change == "reordered":
        tools = [TOOL_B, TOOL_A]
    else:  # the same schema, its keys in another order: another prompt, so named, never sorted back
        tools = [{**TOOL_A, "input_schema": dict(reversed(list(TOOL_A["input_schema"].items())))}, TOOL_B]
    second = create(agent_server, TURN1, first.id, tools=tools)
    reason = second.diagnostics.cache_miss_reason
    assert isinstance(reason, anthropic.types.CacheMissToolsChanged)
    assert 0 < reason.cache_missed_input_tokens <= total(first.usage)
    # Not rewritten: the prompt as sent was rendered, so the cache did not serve all of the
    # first one (the count is from where the tools start; their common text may still hit).
    assert second.usage.cache_read_input_tokens < total(first.usage) - 2 * PAGE_SIZE
    same = create(agent_server, TURN1, second.id, tools=tools)
    assert same.diagnostics.cache_miss_reason is None


def test_a_message_changed_mid_conversation_counts_the_missed_tokens(agent_server: LiveServer) -> None:
    turn = [
        {"role": "user", "content": "Plan a trip to Rome for three days, please."},
        {"role": "assistant", "content": "Day one: the Forum. Day two: the Vatican."},
        {"role": "user", "content": "Add a day for Florence."},
    ]
    first = create(agent_server, turn)
    edited = [turn[0], {"role": "assistant", "content": "Day one: the Colosseum. Day two: the Vatican."}, turn[2]]
    second = create(agent_server, edited, first.id)
    reason = second.diagnostics.cache_miss_reason
    assert isinstance(reason, anthropic.types.CacheMissMessagesChanged)
    reusable = total(first.usage) - reason.cache_missed_input_tokens
    assert 0 < reason.cache_missed_input_tokens < total(first.usage)
    # The engine agrees: it served the prefix before the changed message (to within a page; the
    # message's own text before the edit may hit too), not the whole first prompt.
    assert reusable - PAGE_SIZE <= second.usage.cache_read_input_tokens < total(first.usage) - PAGE_SIZE
    # A conversation cut short of the compared one changed its messages too.
    shorter = create(agent_server, turn[:1], first.id)
    assert isinstance(shorter.diagnostics.cache_miss_reason, anthropic.types.CacheMissMessagesChanged)


def test_streamed_message_carries_its_diagnostics(agent_server: LiveServer) -> None:
    first = create(agent_server, TURN1)
    with client(agent_server).messages.stream(
        model=MODEL, max_tokens=2, messages=TURN1, system=SYSTEM + " v2", diagnostics={"previous_message_id": first.id}
    ) as stream:
        final = stream.get_final_message()
    assert isinstance(final.diagnostics.cache_miss_reason, anthropic.types.CacheMissSystemChanged)
    again = create(agent_server, TURN1, final.id, system=SYSTEM + " v2")  # a streamed message is kept too
    assert again.diagnostics.cache_miss_reason is None


def test_unknown_and_another_keys_ids_are_not_found_alike(agent_server: LiveServer) -> None:
    mine = create(agent_server, TURN1, key=KEY_A)
    unknown = create(agent_server, TURN1, "msg_000000000000000000000000", key=KEY_B)
    theirs = create(agent_server, TURN1, mine.id, key=KEY_B)
    for answer in (unknown, theirs):
        assert isinstance(answer.diagnostics.cache_miss_reason, anthropic.types.CacheMissPreviousMessageNotFound)
    assert unknown.diagnostics.model_dump() == theirs.diagnostics.model_dump()
    assert create(agent_server, TURN1, mine.id, key=KEY_A).diagnostics.cache_miss_reason is None


def test_previous_message_id_is_capped_before_any_work(agent_server: LiveServer) -> None:
    with pytest.raises(anthropic.BadRequestError):
        create(agent_server, TURN1, "msg_" + "x" * 300)


def test_one_text_part_and_the_same_string_are_one_prompt(agent_server: LiveServer, tiny_llama) -> None:
    as_string = [{"role": "user", "content": "Hello there."}]
    as_part = [{"role": "user", "content": [{"type": "text", "text": "Hello there."}]}]
    tokenizer = agent_server.async_engine.tokenizer
    bodies = [MessagesRequest(model=MODEL, max_tokens=1, system=s, messages=m) for m, s in
              [(as_string, SYSTEM), (as_part, [{"type": "text", "text": SYSTEM}])]]
    ids = [conv_mod.encode(tokenizer, conv_mod.conversation(body)) for body in bodies]
    assert ids[0] == ids[1]
    first = create(agent_server, as_string)
    second = create(agent_server, as_part, first.id, system=[{"type": "text", "text": SYSTEM}])
    assert second.diagnostics.cache_miss_reason is None
    assert total(second.usage) == total(first.usage)
