"""Tool calling through the official openai client against the live server: forced calls
(required, named, parallel) that parse and match their schemas, streamed calls reassembled by
the client, tool results in the history, "auto", and bad tool input as 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.helpers.live_server import MODEL

# Small, closed schemas: a tiny random model fills an enum or a boolean in a few tokens.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]},
    },
}
LIGHTS = {
    "type": "function",
    "function": {
        "name": "set_lights",
        "description": "Lights on or off.",
        "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]},
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, LIGHTS)}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def create(client, **kwargs):
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", 400)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, **kwargs)


def assert_valid_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_choice_gives_calls_that_parse(agent_server, parallel):
    response = create(agent_server.client(), tools=[WEATHER, LIGHTS], tool_choice="required", parallel_tool_calls=parallel)
    [choice] = response.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert_valid_calls(choice.message.tool_calls)
    if not parallel:
        assert len(choice.message.tool_calls) == 1


def test_named_tool_choice_calls_that_function(agent_server):
    choice = {"type": "function", "function": {"name": "set_lights"}}
    response = create(agent_server.client(), tools=[WEATHER, LIGHTS], tool_choice=choice, parallel_tool_calls=False)
    [call] = response.choices[0].message.tool_calls
    assert_valid_calls([call], names=("set_lights",))


def test_streamed_tool_calls_are_reassembled_by_the_client(agent_server):
    stream = create(agent_server.client(), tools=[WEATHER, LIGHTS], tool_choice="required", stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert call["id"] is None and delta.function.name  # the first chunk of a call names it
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls and sorted(calls) == list(range(len(calls)))
    for call in calls.values():
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_the_clients_stream_helper_reassembles_calls(agent_server):
    client = agent_server.client()
    with client.chat.completions.stream(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=400, temperature=0
    ) as stream:
        final = stream.get_final_completion()
    assert_valid_calls(final.choices[0].message.tool_calls)


def test_tool_results_in_the_history_and_cache_reuse(agent_server):
    client = agent_server.client()
    first = create(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    [call] = first.choices[0].message.tool_calls
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."}]
    second = create(client, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert second.choices[0].message.tool_calls is None and isinstance(second.choices[0].message.content, str)
    # The system prompt with the tools and the first turn are the next turn's cached prefix.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 2


def test_auto_gives_text_or_valid_calls(agent_server):
    response = create(agent_server.client(), tools=[WEATHER], max_tokens=16)
    message = response.choices[0].message
    if message.tool_calls:
        assert response.choices[0].finish_reason == "tool_calls"
        assert_valid_calls(message.tool_calls)
    else:
        assert isinstance(message.content, str)
    streamed = "".join(
        c.choices[0].delta.content or "" for c in create(agent_server.client(), tools=[WEATHER], max_tokens=16, stream=True) if c.choices
    )
    assert isinstance(streamed, str)


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "no-such-type"}}}}}],
          "tool_choice": "required"}, "tools"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"arguments": "{}"}}]}]}, None),
    ],
)
def test_bad_tool_input_is_a_400_and_the_server_stays_up(agent_server, kwargs, param):
    client = agent_server.client()
    with pytest.raises(openai.BadRequestError) as error:
        create(client, **kwargs)
    body = error.value.body
    assert body["type"] == "invalid_request_error" and body["message"]
    if param is not None:
        assert body["param"] == param
    assert create(client, max_tokens=2).choices[0].message.content is not None
    agent_server.assert_idle_and_consistent()


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_off_by_max_tokens_is_never_content(agent_server, stream):
    # Eight tokens cannot finish a call: the reply ends "length", with no content and only
    # the calls that closed before the cut (none here), streamed or not.
    kwargs = dict(tools=[WEATHER, LIGHTS], tool_choice="required", parallel_tool_calls=True, max_tokens=8)
    if not stream:
        [choice] = create(agent_server.client(), **kwargs).choices
        assert choice.finish_reason == "length" and choice.message.content is None
        assert not choice.message.tool_calls
        return
    chunks = list(create(agent_server.client(), stream=True, **kwargs))
    assert all(not c.delta.content and not c.delta.tool_calls for chunk in chunks for c in chunk.choices)
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["length"]
