"""A reply's reasoning handed back by the client, on each API: chat's `reasoning_content` (or
`reasoning`), a Responses `reasoning` item (as the Agents SDK resends the items it was given), an
Anthropic `thinking` block; each lands on its assistant turn, which gpt-oss's template prints
before the turn's call; misplaced or oversized parts are 400s naming what is wrong."""

from __future__ import annotations

import json

import pytest

from radixkv.errors import InvalidRequest
from radixkv.prompts.tools import Tool, render_conversation
from radixkv.server.anthropic import conversation as anthropic_conversation
from radixkv.server.anthropic.protocol import MessagesRequest
from radixkv.server.errors import APIError, parse_body
from radixkv.server.guards.request_caps import CAPS
from radixkv.server.openai import responses_convert
from radixkv.server.openai.protocol import ChatMessage
from radixkv.server.openai.responses_protocol import ResponsesRequest
from tests.helpers.harmony import harmony_tokenizer

TOKENIZER = harmony_tokenizer()
WEATHER = Tool("get_weather", "Weather of a city", {"type": "object", "properties": {"city": {"type": "string"}}})
ANALYSIS_THEN_CALL = (
    "<|start|>assistant<|channel|>analysis<|message|>Call the tool.<|end|>"
    '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)
USER = {"role": "user", "content": "Weather in Paris?"}
REASONING = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call the tool."}], "status": "completed"}
CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}


def responses_messages(items: list[dict]) -> list[dict]:
    return responses_convert.conversation(ResponsesRequest(input=items), [])


def test_a_responses_reasoning_item_goes_with_the_call_after_it() -> None:
    messages = responses_messages([USER, REASONING, CALL, OUTPUT])
    assert messages[1]["reasoning_content"] == "Call the tool." and messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert ANALYSIS_THEN_CALL in render_conversation(TOKENIZER, messages, [WEATHER])


def test_a_responses_reasoning_item_goes_with_the_text_after_it_or_nowhere() -> None:
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}
    messages = responses_messages([USER, REASONING, answer, {"role": "user", "content": "Thanks"}])
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1] == {"role": "assistant", "content": "Sunny.", "reasoning_content": "Call the tool."}
    # Reasoning nothing followed is dropped, not a turn of its own with no text.
    assert responses_messages([USER, REASONING]) == [USER]
    # An item without its text (summaries only) hands back the summary.
    summary = {**REASONING, "content": None, "summary": [{"type": "summary_text", "text": "Use the tool."}]}
    assert responses_messages([USER, summary, CALL])[1]["reasoning_content"] == "Use the tool."


def test_a_reasoning_items_parts_are_capped_and_named() -> None:
    many = {**REASONING, "summary": [{"type": "summary_text", "text": "x"}] * (CAPS.max_content_blocks + 1)}
    with pytest.raises(APIError) as caught:
        responses_messages([USER, many, CALL])
    assert str(CAPS.max_content_blocks) in caught.value.message and caught.value.param.startswith("input.1")


def test_chat_takes_reasoning_content_or_reasoning_on_assistant_turns() -> None:
    for field in ("reasoning_content", "reasoning"):
        message = ChatMessage.model_validate({"role": "assistant", "content": None, field: "Call the tool.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]})  # fmt: skip
        chat = [USER, message.as_chat(), {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
        assert ANALYSIS_THEN_CALL in render_conversation(TOKENIZER, chat, [WEATHER])
    assert "reasoning_content" not in ChatMessage.model_validate({"role": "user", "content": "hi", "reasoning_content": "x"}).as_chat()


def anthropic_body(assistant: list[dict], **extra: object) -> bytes:
    messages = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": assistant},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]  # fmt: skip
    tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER.parameters}]
    return json.dumps({"model": "m", "max_tokens": 8, "messages": messages, "tools": tools, **extra}).encode()


THINKING = {"type": "thinking", "thinking": "Call the tool.", "signature": "abc"}
TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}


def test_an_anthropic_thinking_block_goes_with_its_turns_call() -> None:
    body = parse_body(MessagesRequest, anthropic_body([THINKING, TOOL_USE], thinking={"type": "enabled", "budget_tokens": 2048}))
    conv = anthropic_conversation.conversation(body)
    assert conv.messages[1]["reasoning_content"] == "Call the tool."
    assert ANALYSIS_THEN_CALL in render_conversation(TOKENIZER, conv.messages, conv.tools)
    # Redacted thinking cannot be read here: dropped, the rest of the turn kept.
    redacted = parse_body(MessagesRequest, anthropic_body([{"type": "redacted_thinking", "data": "opaque"}, TOOL_USE]))
    assert "reasoning_content" not in anthropic_conversation.conversation(redacted).messages[1]


def test_misplaced_or_oversized_thinking_is_refused_naming_why() -> None:
    body = json.loads(anthropic_body([TOOL_USE]))
    body["messages"][0]["content"] = [THINKING, {"type": "text", "text": "hi"}]
    with pytest.raises(InvalidRequest, match="thinking blocks belong in assistant messages"):
        anthropic_conversation.conversation(parse_body(MessagesRequest, json.dumps(body).encode()))
    with pytest.raises(APIError) as caught:
        parse_body(MessagesRequest, anthropic_body([{**THINKING, "signature": "s" * (CAPS.max_opaque_chars + 1)}, TOOL_USE]))
    assert str(CAPS.max_opaque_chars) in caught.value.message
    with pytest.raises(APIError) as caught:  # Anthropic's own floor on the budget
        parse_body(MessagesRequest, anthropic_body([TOOL_USE], thinking={"type": "enabled", "budget_tokens": 10}))
    assert "budget_tokens" in (caught.value.param or caught.value.message)


TIME = Tool("get_time", "The time now", {"type": "object", "properties": {}})
PARALLEL = (  # the calls, then the results as they came back, each named after its own call
    '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    "<|start|>assistant to=functions.get_time<|channel|>commentary <|constrain|>json<|message|>{}<|call|>"
    "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>noon<|end|>"
    "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
)


def parallel_conversations() -> dict[str, tuple[list[dict], list[Tool]]]:
    """One turn of two calls with its reasoning, the results back in the other order, on each API."""
    chat = [USER, ChatMessage.model_validate({"role": "assistant", "content": None, "reasoning_content": "Call the tool.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}).as_chat(),
        {"role": "tool", "tool_call_id": "c2", "content": "noon"}, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    responses = responses_messages([USER, REASONING, CALL, {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
                                    {"type": "function_call_output", "call_id": "c2", "output": "noon"}, OUTPUT])  # fmt: skip
    body = json.loads(anthropic_body([THINKING, TOOL_USE, {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}}]))
    body["messages"][2]["content"] = [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "noon"}, body["messages"][2]["content"][0]]
    body["tools"].append({"name": "get_time", "description": "The time now", "input_schema": TIME.parameters})
    conv = anthropic_conversation.conversation(parse_body(MessagesRequest, json.dumps(body).encode()))
    return {"chat": (chat, [WEATHER, TIME]), "responses": (responses, [WEATHER, TIME]), "messages": (conv.messages, conv.tools)}


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_parallel_calls_results_each_name_their_own_call_on_every_api(api: str) -> None:
    """Each result names its own call's function (paired by id, whatever order the results came
    back in: not the latest call's, as gpt-oss's template would), the turn's reasoning once
    before the first call, as a single call's is."""
    messages, tools = parallel_conversations()[api]
    text = render_conversation(TOKENIZER, messages, tools)
    assert "<|start|>assistant<|channel|>analysis<|message|>Call the tool.<|end|>" + PARALLEL in text
