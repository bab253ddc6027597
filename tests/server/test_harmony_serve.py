"""The real server over a test-size gpt-oss with a harmony tokenizer and gpt-oss's template: a
random model writes no chosen sequence (the parser's cases are tests/server/test_reply_format.py),
so this checks the path: harmony's stops are the engine's, every family answers with its own
shape, streamed chat equals the whole reply, and the pages all come back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest

from radixkv.config import EngineConfig
from radixkv.engine.async_engine import AsyncEngine
from radixkv.engine.engine import Engine
from radixkv.prompts.harmony import harmony_tokens
from tests.helpers.harmony import harmony_tokenizer
from tests.helpers.live_server import KEY_A, MODEL, LiveServer, serve
from tests.helpers.tiny_models import make_tiny_model

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-gpt-oss"), "gpt_oss", max_position_embeddings=2048)
    harmony_tokenizer().save_pretrained(folder)  # replaces the tiny tokenizer: same vocabulary size
    engine = Engine(EngineConfig(model=str(folder), dtype="float32", device="cpu", page_size=4, num_pages=1024, check_invariants=True))
    with serve(AsyncEngine(engine)) as live:
        yield live


def test_harmonys_stops_end_a_reply(harmony_server: LiveServer) -> None:
    marks = harmony_tokens(harmony_server.async_engine.tokenizer)
    assert marks is not None and marks.stops <= set(harmony_server.engine_call(lambda e: e.eos_token_ids))


def test_chat_streamed_equals_whole_and_pages_come_back(harmony_server: LiveServer) -> None:
    client = harmony_server.client()
    args = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=24, temperature=0)
    response = client.chat.completions.create(**args)
    whole = response.choices[0]
    assert whole.finish_reason in ("stop", "length", "tool_calls")
    # A harmony model reports its reasoning tokens, the same streamed (with usage) as whole.
    reasoning_tokens = response.usage.completion_tokens_details.reasoning_tokens
    assert 0 <= reasoning_tokens <= response.usage.completion_tokens
    content, reasoning, names, finish = "", "", [], None
    for chunk in client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            names += [c.function.name for c in choice.delta.tool_calls or [] if c.function and c.function.name]
            finish = choice.finish_reason or finish
    assert content == (whole.message.content or "")
    assert reasoning == (getattr(whole.message, "reasoning_content", None) or "")
    assert names == [c.function.name for c in whole.message.tool_calls or []]
    assert finish == whole.finish_reason
    harmony_server.assert_idle_and_consistent()


def test_messages_and_responses_answer_in_their_shapes(harmony_server: LiveServer) -> None:
    with harmony_server.http() as http:
        body = {"model": MODEL, "max_tokens": 24, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                "tools": [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER["function"]["parameters"]}]}  # fmt: skip
        message = http.post("/v1/messages", json=body, headers={"x-api-key": KEY_A})
        assert message.status_code == 200, message.text
        assert {b["type"] for b in message.json()["content"]} <= {"text", "tool_use"}
        assert message.json()["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
        streamed = http.post("/v1/messages", json={**body, "stream": True}, headers={"x-api-key": KEY_A})
        assert streamed.status_code == 200 and "event: message_stop" in streamed.text and "event: error" not in streamed.text
    tools = [{"type": "function", **WEATHER["function"]}]
    response = harmony_server.client().responses.create(model=MODEL, input="Weather in Paris?", tools=tools, max_output_tokens=24)
    assert response.status in ("completed", "incomplete")
    assert {item.type for item in response.output} <= {"message", "function_call"}
    chained = harmony_server.client().responses.create(
        model=MODEL, input="And in Rome?", previous_response_id=response.id, tools=tools, max_output_tokens=8
    )
    assert chained.status in ("completed", "incomplete")
    harmony_server.assert_idle_and_consistent()


def test_reasoning_goes_out_and_comes_back_on_responses_and_messages(harmony_server: LiveServer) -> None:
    """Each route's reply, reasoning items and thinking blocks included, handed back as the next
    request's history is taken (as the Agents SDK and Anthropic's clients resend them), streamed
    and whole alike; a handed-back reasoning item of our own making is taken too."""
    client = harmony_server.client()
    tools = [{"type": "function", **WEATHER["function"]}]
    reasoning = {"type": "reasoning", "id": "rs_x", "summary": [], "content": [{"type": "reasoning_text", "text": "Ask the tool."}]}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    first = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Weather in Paris?"}, reasoning, call,
                                    {"type": "function_call_output", "call_id": "c1", "output": "sunny"}], tools=tools, max_output_tokens=24)  # fmt: skip
    assert {item.type for item in first.output} <= {"reasoning", "message", "function_call"}
    assert first.usage.output_tokens_details.reasoning_tokens <= first.usage.output_tokens
    items = [item.model_dump(exclude_none=True) for item in first.output]
    items += [{"type": "function_call_output", "call_id": i["call_id"], "output": "sunny"} for i in items if i["type"] == "function_call"]
    again = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Weather in Paris?"}, *items], tools=tools, max_output_tokens=8)
    assert again.status in ("completed", "incomplete")
    # The client's own stream helper accumulates every event (reasoning text deltas included).
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=tools, max_output_tokens=24) as stream:
        last = [event for event in stream][-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert {item.type for item in last.response.output} <= {"reasoning", "message", "function_call"}
    # Anthropic's own client parses the thinking blocks, whole and as its stream accumulates them.
    claude = anthropic.Anthropic(base_url=harmony_server.base_url, api_key=KEY_A, max_retries=0, timeout=120)
    args = dict(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "Weather in Paris?"}], thinking={"type": "enabled", "budget_tokens": 1024},
                tools=[{"name": "get_weather", "description": "Weather", "input_schema": WEATHER["function"]["parameters"]}])  # fmt: skip
    message = claude.messages.create(**args)
    assert {b.type for b in message.content} <= {"thinking", "text", "tool_use"}
    assert all(b.signature for b in message.content if b.type == "thinking")
    content = [b.model_dump(exclude_none=True) for b in message.content]
    if content:
        results = [{"type": "tool_result", "tool_use_id": b["id"], "content": "sunny"} for b in content if b["type"] == "tool_use"]
        history = [*args["messages"], {"role": "assistant", "content": content}, {"role": "user", "content": results or "ok"}]
        assert claude.messages.create(**{**args, "messages": history}).stop_reason is not None
    with claude.messages.stream(**args) as stream:
        streamed = stream.get_final_message()
    assert {b.type for b in streamed.content} <= {"thinking", "text", "tool_use"}
    assert all(b.signature for b in streamed.content if b.type == "thinking")
    harmony_server.assert_idle_and_consistent()


def test_parallel_calls_results_name_their_own_calls_on_every_api(harmony_server: LiveServer) -> None:
    """A turn of two calls whose results come back in the other order, sent on each API through
    its official client: every prompt is the one where each result names its own call's function
    (paired by id; tests/server/test_reasoning_handback.py shows the text), and the pages come back."""
    from radixkv.prompts.tools import Tool, encode_conversation

    tools = [WEATHER, {"type": "function", "function": {"name": "get_time", "description": "The time now", "parameters": {"type": "object", "properties": {}}}}]
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]  # fmt: skip
    chat = [MESSAGES[1], {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c2", "content": "noon"}, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    records = [Tool(t["function"]["name"], t["function"]["description"], t["function"]["parameters"]) for t in tools]
    expected = encode_conversation(harmony_server.async_engine.tokenizer, chat, records, "auto")
    text = harmony_server.async_engine.tokenizer.decode(expected)
    assert "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>noon<|end|><|start|>functions.get_weather to=assistant" in text

    client = harmony_server.client()
    assert client.chat.completions.create(model=MODEL, messages=chat, tools=tools, max_tokens=2).usage.prompt_tokens == len(expected)
    items = [{"role": "user", "content": MESSAGES[1]["content"]}]
    items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
    items += [{"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]} for m in chat[2:]]
    flat = [{"type": "function", **t["function"]} for t in tools]
    assert client.responses.create(model=MODEL, input=items, tools=flat, max_output_tokens=2).usage.input_tokens == len(expected)
    claude = anthropic.Anthropic(base_url=harmony_server.base_url, api_key=KEY_A, max_retries=0, timeout=120)
    uses = [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": json.loads(c["function"]["arguments"])} for c in calls]
    results = [{"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]} for m in chat[2:]]
    message = claude.messages.create(
        model=MODEL, max_tokens=2, messages=[MESSAGES[1], {"role": "assistant", "content": uses}, {"role": "user", "content": results}],
        tools=[{"name": t["function"]["name"], "description": t["function"]["description"], "input_schema": t["function"]["parameters"]} for t in tools],
    )
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0) == len(expected)
    harmony_server.assert_idle_and_consistent()
