"""The Responses API through the official openai client and the OpenAI Agents SDK: text and item
input, instructions, function calls and outputs, previous_response_id over the prefix cache,
streaming, text.format, bad input as 400s in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Literal

import openai
import pytest

from tests.helpers.live_server import KEY_A, KEY_B, MODEL, LiveServer, make_async_engine, serve
from tests.helpers.tiny_models import make_tiny_model

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
LONG_INPUT = "The quick brown fox jumps over the lazy dog. " * 6


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The tiny Llama with a longer context than the shared one's 512 positions: its byte-level
    tokenizer spends ~1 token per 2 characters, and tool definitions are JSON."""
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-llama-2k"), "llama", max_position_embeddings=2048)
    with serve(make_async_engine(model, num_pages=1024)) as live:
        yield live


def respond(client, input, **kwargs):
    kwargs.setdefault("max_output_tokens", 8)
    kwargs.setdefault("temperature", 0)
    return client.responses.create(model=MODEL, input=input, **kwargs)


def cached(response) -> int:
    return response.usage.input_tokens_details.cached_tokens


def test_text_input(live_server):
    response = respond(live_server.client(), "Prefix caching shares the KV cache.")
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.status in ("completed", "incomplete")
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"]
    assert response.output_text == message.content[0].text
    usage = response.usage
    assert 1 <= usage.output_tokens <= 8 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.temperature == 0 and response.tools == [] and response.tool_choice == "auto"
    openai.types.responses.Response.model_validate(response.model_dump())  # strict: as the client types every field


def test_instructions_go_first_and_are_echoed(live_server):
    client = live_server.client()
    plain = respond(client, "What is the capital of France?")
    instructed = respond(client, "What is the capital of France?", instructions="Answer briefly and precisely.")
    assert instructed.instructions == "Answer briefly and precisely."
    assert instructed.usage.input_tokens > plain.usage.input_tokens


def test_items_with_a_function_call_and_its_output(live_server):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C."},
    ]
    response = respond(live_server.client(), items, tools=[WEATHER], tool_choice="none")
    assert response.output and response.output[0].type == "message"
    assert response.tools[0].name == "get_weather" and response.tool_choice == "none"


def test_previous_response_id_reuses_the_cache(live_server):
    client = live_server.client()
    first = respond(client, LONG_INPUT, instructions="Answer briefly.")
    second = respond(client, "And then?", previous_response_id=first.id, instructions="Answer briefly.")
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens // 2
    assert cached(second) > 0  # the first call's prompt is the second's prefix
    # Another tenant cannot chain onto it.
    with pytest.raises(openai.BadRequestError) as error:
        respond(live_server.client(KEY_B), "And then?", previous_response_id=first.id)
    assert error.value.body["code"] == "previous_response_not_found"


def test_store_false_is_not_kept(live_server):
    client = live_server.client()
    unstored = respond(client, "Hello there.", store=False)
    with pytest.raises(openai.BadRequestError):
        respond(client, "Again.", previous_response_id=unstored.id)


def test_stream_reassembles_to_the_whole_response(live_server):
    client = live_server.client()
    prompt = "Streaming test: the quick brown fox jumps over the lazy dog."
    whole = respond(client, prompt, max_output_tokens=12)
    with client.responses.stream(model=MODEL, input=prompt, max_output_tokens=12, temperature=0) as stream:
        events = list(stream)
        # get_final_response() wants response.completed; a reply cut by max_output_tokens
        # ends with response.incomplete instead, as OpenAI's does.
        final = stream.get_final_response() if whole.status == "completed" else events[-1].response
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and cached(final) > 0


def test_stream_true_on_create_is_stored_for_chaining(live_server):
    client = live_server.client()
    events = list(respond(client, "Hello.", stream=True))
    assert events[0].type == "response.created" and events[0].response.status == "in_progress"
    assert events[-1].response.usage.output_tokens >= 1
    chained = respond(client, "More.", previous_response_id=events[-1].response.id)
    assert cached(chained) > 0


def test_store_bound_and_expiry():
    from radixkv.server.openai.responses_store import ResponseStore

    now = [0.0]
    store = ResponseStore(max_responses=2, ttl_s=10.0, clock=lambda: now[0])
    for i in range(3):
        store.put(f"resp_{i}", "tenant", [{"role": "user", "content": str(i)}])
    assert store.get("resp_0", "tenant") is None and len(store) == 2  # the oldest went first
    assert store.get("resp_2", "tenant") == [{"role": "user", "content": "2"}]
    assert store.get("resp_2", "other") is None
    now[0] = 11.0
    assert store.get("resp_2", "tenant") is None and len(store) == 0


def test_store_caps_per_owner_and_over_all_owners():
    """Per owner a count and a byte cap (its own oldest go); over all owners a global bound
    that takes from the largest holder, so an owner within its share keeps everything."""
    from radixkv.server.openai.responses_store import ResponseStore, conversation_bytes

    message = [{"role": "user", "content": "x" * 100}]
    size = conversation_bytes(message)
    store = ResponseStore(max_responses_per_owner=3, max_bytes_per_owner=10 * size, max_responses=8, max_bytes=1 << 20)
    store.put("small_0", "small", message)
    for i in range(10):  # the flooder: over its own count cap, its own oldest go
        store.put(f"flood_{i}", "flood", message)
    assert store.held_by("flood") == (3, 3 * size)
    assert store.get("flood_6", "flood") is None and store.get("flood_9", "flood") == message
    for owner in ("b", "c"):
        for i in range(3):
            store.put(f"{owner}_{i}", owner, message)
    # 1 + 3 + 3 + 3 = 10 > 8: the holders of the most went down by one each, never "small".
    assert len(store) == 8 and store.get("small_0", "small") == message
    assert store.held_by("small") == (1, size)
    assert sorted(store.held_by(o)[0] for o in ("flood", "b", "c")) == [2, 2, 3]
    # The byte cap per owner: its own oldest make room; a conversation over it alone is not kept.
    store = ResponseStore(max_responses_per_owner=100, max_bytes_per_owner=10 * size)
    store.put("other_0", "other", message)
    big = [{"role": "user", "content": "y" * (4 * size)}]
    for i in range(3):
        assert store.put(f"big_{i}", "mine", big)
    assert store.get("big_0", "mine") is None and store.get("big_2", "mine") == big
    assert store.held_by("mine") == (2, 2 * conversation_bytes(big))
    assert not store.put("huge", "mine", [{"role": "user", "content": "z" * (11 * size)}])
    assert store.get("huge", "mine") is None and store.held_by("mine")[0] == 2
    assert store.get("other_0", "other") == message


def test_text_format_json_schema(live_server):
    # Bounded values only: a random tiny model fills free strings until max_output_tokens.
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}}
    response = respond(live_server.client(), "Pick a colour as JSON.", text=text, max_output_tokens=60)
    assert response.text.format.type == "json_schema" and response.status == "completed"
    value = json.loads(response.output_text)
    assert value["color"] in ("red", "green") and isinstance(value["ok"], bool) and set(value) == {"color", "ok"}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input.0"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, "input.0.call_id"),
        ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 7}}}}, "text.format.schema"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "temperature": -1}, "temperature"),
    ],
)
def test_bad_input_is_a_400_in_openai_shape(live_server, body, param):
    with live_server.http() as http:
        reply = http.post("/v1/responses", json={"model": MODEL, **body})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
        assert http.post("/v1/responses", json={"model": MODEL, "input": "still up", "max_output_tokens": 2}).status_code == 200
    live_server.assert_idle_and_consistent()


# -- the OpenAI Agents SDK ---------------------------------------------------------------------


def _agent_run(base_url: str, streamed: bool) -> tuple[list[dict], object]:
    from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_api, set_default_openai_client
    from agents import set_tracing_disabled

    calls: list[dict] = []

    # An enum keeps the guided arguments short: a random tiny model fills free strings to the limit.
    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append({"city": city})
        return f"Sunny in {city}."

    async def run() -> object:
        set_default_openai_client(openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=KEY_A, max_retries=0), use_for_tracing=False)
        set_default_openai_api("responses")
        set_tracing_disabled(True)
        agent = Agent(
            name="weather",
            instructions="You answer questions about the weather with the get_weather tool.",
            model=MODEL,
            tools=[get_weather],
            # A tiny model would not call the tool unasked; the SDK resets this after the call.
            model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=60),
            # The tool's result is the answer: a random model's free reply after it would run to
            # max_output_tokens, which the SDK refuses (the replay of calls is tested above).
            tool_use_behavior="stop_on_first_tool",
        )
        if not streamed:
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    return calls, asyncio.run(run())


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_agents_sdk_runs_a_function_tool(live_server, streamed):
    calls, result = _agent_run(live_server.base_url, streamed)
    assert len(calls) >= 1 and all(isinstance(c["city"], str) for c in calls)
    assert isinstance(result.final_output, str)
    assert result.final_output.startswith("Sunny in ")
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]


def test_streamed_tool_call_events_parse_in_the_client():
    """The events of a reply with text and a call, through the openai client's own stream
    state and its strict types (a tiny random model calls no tool without a guide)."""
    from openai._models import construct_type
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import Response, ResponseStreamEvent

    from radixkv.server.openai.responses_events import ResponseEvents
    from radixkv.server.openai.responses_protocol import ResponseObject, response_usage
    from radixkv.server.tools import ToolCall

    events = ResponseEvents(ResponseObject(id="resp_1", created_at=0, status="in_progress", model=MODEL, tools=[WEATHER]))
    call = ToolCall(id="call_abc", name="get_weather", arguments='{"city": "Paris"}')
    lines = events.start() + events.text("Let me look.") + events.call(call) + events.finish(response_usage(10, 5, 4), True)
    state = ResponseStreamState(input_tools=[WEATHER], text_format=openai.omit)
    payloads = [json.loads(line.split("data: ", 1)[1]) for line in lines]
    for payload in payloads:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=payload))
    final = state._completed_response
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output_text == "Let me look." and final.output[1].call_id == "call_abc"
    assert json.loads(final.output[1].arguments) == {"city": "Paris"}
    completed = Response.model_validate(payloads[-1]["response"])  # strict: every field as the client types it
    assert completed.usage.input_tokens_details.cached_tokens == 4
    kinds = [p["type"] for p in payloads]
    assert kinds.index("response.function_call_arguments.done") > kinds.index("response.output_item.done")
