"""What ingest makes alike is exactly what renders the same ids: a content array of text parts
and its string, a call's arguments in other spacing, a tool-call turn's null content and "", an
Anthropic tool result as a string or text blocks. Each pair compared by ids through the routes'
own conversion, and the diagnostics agree (a hit, not a change); what changes the ids (argument
keys reordered) stays a change."""

from __future__ import annotations

import anthropic

from radixkv.prompts.tools import encode_conversation
from radixkv.server.anthropic import conversation as conv_mod
from radixkv.server.anthropic.protocol import MessagesRequest
from radixkv.server.openai import responses_convert as convert
from radixkv.server.openai.protocol import ChatCompletionRequest
from radixkv.server.openai.responses_protocol import ResponsesRequest
from tests.helpers.live_server import KEY_A, MODEL, LiveServer

TOOL = {"type": "function", "name": "weather", "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}
ASK = {"role": "user", "content": "What is the weather in Paris, in celsius?"}


def responses_input(arguments: str, content) -> list[dict]:
    return [
        ASK,
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees, clear."},
        {"role": "user", "content": content},
    ]


SPACED = '{"city": "Paris", "unit": "celsius"}'
COMPACT = '{"city":"Paris","unit":"celsius"}'
REORDERED = '{"unit": "celsius", "city": "Paris"}'
PARTS = [{"type": "input_text", "text": "Thanks. And "}, {"type": "input_text", "text": "tomorrow?"}]


def responses_ids(live: LiveServer, input: list[dict]) -> list[int]:
    body = ResponsesRequest.model_validate({"model": MODEL, "input": input, "tools": [TOOL]})
    messages = convert.conversation(body, [])
    return encode_conversation(live.async_engine.tokenizer, messages, convert.tool_list(body), body.choice())


def respond(live: LiveServer, input: list[dict], comparison: str | None = None):
    extra = {"prompt_cache_options": {"comparison_response_id": comparison}} if comparison else {}
    return live.client(KEY_A).responses.create(
        model=MODEL, input=input, tools=[TOOL], max_output_tokens=2, temperature=0, tool_choice="none", extra_body=extra
    )


def test_responses_argument_spacing_and_text_parts_render_the_same_ids(agent_server: LiveServer) -> None:
    base = responses_ids(agent_server, responses_input(SPACED, "Thanks. And tomorrow?"))
    assert responses_ids(agent_server, responses_input(COMPACT, "Thanks. And tomorrow?")) == base
    assert responses_ids(agent_server, responses_input(SPACED, PARTS)) == base
    # Keys in another order print otherwise: not lossless, never sorted back.
    assert responses_ids(agent_server, responses_input(REORDERED, "Thanks. And tomorrow?")) != base


def test_the_diagnosis_agrees_with_the_ids(agent_server: LiveServer) -> None:
    first = respond(agent_server, responses_input(SPACED, "Thanks. And tomorrow?"))
    alike = respond(agent_server, responses_input(COMPACT, PARTS), first.id)
    assert alike.prompt_cache_diagnostics.type == "cache_hit"
    assert alike.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 4  # all but the partial page
    changed = respond(agent_server, responses_input(REORDERED, PARTS), first.id)
    assert changed.prompt_cache_diagnostics.type == "cache_miss" and changed.prompt_cache_diagnostics.reason == "input_changed"


def test_chat_null_and_empty_content_and_argument_spacing_render_the_same_ids(agent_server: LiveServer) -> None:
    def ids(content, arguments: str, last) -> list[int]:
        body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [
            ASK,
            {"role": "assistant", "content": content, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, clear."},
            {"role": "user", "content": last},
        ]})  # fmt: skip
        return encode_conversation(agent_server.async_engine.tokenizer, [m.as_chat() for m in body.messages], [], "none")

    base = ids(None, SPACED, "Thanks. And tomorrow?")
    parts = [{"type": "text", "text": "Thanks. And "}, {"type": "text", "text": "tomorrow?"}]
    assert ids("", COMPACT, parts) == base
    assert ids(None, REORDERED, "Thanks. And tomorrow?") != base


def test_anthropic_tool_result_as_string_or_text_blocks_is_one_prompt(agent_server: LiveServer) -> None:
    def messages(result) -> list[dict]:
        return [
            {"role": "user", "content": ASK["content"]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result},
                                         {"type": "text", "text": "Thanks. And "}, {"type": "text", "text": "tomorrow?"}]},
        ]  # fmt: skip

    as_string = messages("18 degrees, clear.")
    as_blocks = messages([{"type": "text", "text": "18 degrees, "}, {"type": "text", "text": "clear."}])
    tools = [{"name": "weather", "description": TOOL["description"], "input_schema": TOOL["parameters"]}]
    tokenizer = agent_server.async_engine.tokenizer
    ids = [
        conv_mod.encode(tokenizer, conv_mod.conversation(MessagesRequest.model_validate({"model": MODEL, "max_tokens": 1, "messages": m, "tools": tools})))
        for m in (as_string, as_blocks)
    ]  # fmt: skip
    assert ids[0] == ids[1]
    claude = anthropic.Anthropic(base_url=agent_server.base_url, api_key=KEY_A, max_retries=0, timeout=60)
    first = claude.messages.create(model=MODEL, max_tokens=2, messages=as_string, tools=tools, diagnostics={"previous_message_id": None})
    second = claude.messages.create(model=MODEL, max_tokens=2, messages=as_blocks, tools=tools, diagnostics={"previous_message_id": first.id})
    assert second.diagnostics.cache_miss_reason is None
