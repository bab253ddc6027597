"""What one request may carry (radixkv.server.guards.request_caps): every part past its cap is a 400
naming the part and the cap, in the shape of the API called, before the body is rendered or
tokenized; deeply nested arguments and out-of-range token ids are 400s too, never a 500."""

from __future__ import annotations

import json
from typing import Any

import pytest

from radixkv.server import tools as tool_layer
from radixkv.server.anthropic import conversation as conv_mod
from radixkv.server.anthropic.protocol import MessagesRequest
from radixkv.server.guards.request_caps import CAPS, json_depth_exceeds
from tests.helpers.live_server import MODEL, LiveServer
from tests.helpers.tiny_models import CHAT_TEMPLATE, tiny_tokenizer

HI = [{"role": "user", "content": "hi"}]


def _nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def _chat_tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}}


def _post(live: LiveServer, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    with live.http() as client:
        response = client.post(path, json=body)
    return response.status_code, response.json()


def _openai_refusal(live: LiveServer, path: str, body: dict[str, Any], param: str, limit: int) -> str:
    status, payload = _post(live, path, body)
    assert status == 400, payload
    error = payload["error"]
    assert error["param"] == param and str(limit) in error["message"], error
    return error["message"]


def _anthropic_refusal(live: LiveServer, body: dict[str, Any], param: str, limit: int) -> None:
    status, payload = _post(live, "/v1/messages", {"model": MODEL, "max_tokens": 4, **body})
    assert status == 400, payload
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error", payload
    message = payload["error"]["message"]
    assert message.startswith(f"{param}:") and str(limit) in message, message


# -- tools ----------------------------------------------------------------------------------


def test_30000_tools_are_refused_naming_tools_and_128(live_server: LiveServer) -> None:
    tools = [_chat_tool(f"tool_{i}") for i in range(30_000)]
    _openai_refusal(live_server, "/v1/chat/completions", {"model": MODEL, "messages": HI, "tools": tools}, "tools", CAPS.max_tools)
    live_server.assert_idle_and_consistent()


def test_129_tools_are_refused_on_responses_and_messages(live_server: LiveServer) -> None:
    tools = [{"type": "function", "name": f"tool_{i}"} for i in range(CAPS.max_tools + 1)]
    _openai_refusal(live_server, "/v1/responses", {"model": MODEL, "input": "hi", "tools": tools}, "tools", CAPS.max_tools)
    anthropic_tools = [{"name": f"tool_{i}", "input_schema": {"type": "object"}} for i in range(CAPS.max_tools + 1)]
    _anthropic_refusal(live_server, {"messages": HI, "tools": anthropic_tools}, "tools", CAPS.max_tools)


def test_a_tool_name_past_64_characters_is_refused(live_server: LiveServer) -> None:
    body = {"model": MODEL, "messages": HI, "tools": [_chat_tool("f" * (CAPS.max_tool_name_chars + 1))]}
    _openai_refusal(live_server, "/v1/chat/completions", body, "tools.0", CAPS.max_tool_name_chars)


def test_duplicate_tool_names_are_found_in_one_pass() -> None:
    # 128 distinct names then a repeat of the first: refused, naming it (a set, not list.count).
    tools = [_chat_tool(f"tool_{i}") for i in range(CAPS.max_tools)] + [_chat_tool("tool_0")]
    with pytest.raises(Exception, match="'tool_0' appears twice"):
        tool_layer.tools_from_openai(tools)


# -- Anthropic cache_control breakpoints ------------------------------------------------------


def _marked(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}


def test_five_breakpoints_are_refused_naming_4(live_server: LiveServer) -> None:
    body = {
        "system": [_marked("you are terse"), _marked("really")],
        "tools": [{"name": "f", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [_marked("a"), _marked("b")]}],
    }
    _anthropic_refusal(live_server, body, "cache_control", CAPS.max_cache_breakpoints)


def test_four_breakpoints_are_served(live_server: LiveServer) -> None:
    body = {"model": MODEL, "max_tokens": 2, "system": [_marked("s")], "messages": [{"role": "user", "content": [_marked(c) for c in "abc"]}]}
    status, payload = _post(live_server, "/v1/messages", body)
    assert status == 200, payload
    live_server.assert_idle_and_consistent()


class CountingTemplates:
    """The tiny tokenizer with the tiny chat template, counting what it renders."""

    def __init__(self) -> None:
        self._tokenizer = tiny_tokenizer()
        self._tokenizer.chat_template = CHAT_TEMPLATE
        self.num_renders = 0
        self.num_rendered_chars = 0

    def apply_chat_template(self, *args, **kwargs):
        text = self._tokenizer.apply_chat_template(*args, **kwargs)
        self.num_renders += 1
        self.num_rendered_chars += len(text)
        return text

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_breakpoints_cost_one_render_of_their_prefix_each() -> None:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 5} for i in range(199)]
    for i in (20, 60, 120, 198):
        messages[i] = {"role": messages[i]["role"], "content": [_marked(f"turn {i}")]}
    body = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 4, "messages": messages})
    tokenizer = CountingTemplates()
    conv = conv_mod.conversation(body)
    prompt = conv_mod.encode(tokenizer, conv)
    whole = tokenizer.num_rendered_chars
    marks = conv_mod.breakpoints(tokenizer, body, conv, prompt)
    assert len(marks) == 4 and [m.num_tokens for m in marks] == sorted(m.num_tokens for m in marks)
    assert tokenizer.num_renders == 1 + CAPS.max_cache_breakpoints
    assert tokenizer.num_rendered_chars <= (1 + CAPS.max_cache_breakpoints) * whole


# -- messages, content blocks, ids -----------------------------------------------------------


def test_too_many_messages_are_refused_naming_the_cap(live_server: LiveServer) -> None:
    messages = [{"role": "user", "content": "x"}] * (CAPS.max_messages + 1)
    _openai_refusal(live_server, "/v1/chat/completions", {"model": MODEL, "messages": messages}, "messages", CAPS.max_messages)
    _openai_refusal(live_server, "/v1/responses", {"model": MODEL, "input": messages}, "input", CAPS.max_messages)
    _anthropic_refusal(live_server, {"messages": messages}, "messages", CAPS.max_messages)


def test_too_many_content_blocks_are_refused_naming_the_cap(live_server: LiveServer) -> None:
    parts = [{"type": "text", "text": "x"}] * (CAPS.max_content_blocks + 1)
    body = {"model": MODEL, "messages": [{"role": "user", "content": parts}]}
    _openai_refusal(live_server, "/v1/chat/completions", body, "messages.0.content", CAPS.max_content_blocks)
    _anthropic_refusal(live_server, {"messages": [{"role": "user", "content": parts}]}, "messages.0.content", CAPS.max_content_blocks)


def test_a_call_id_past_256_characters_is_refused(live_server: LiveServer) -> None:
    long_id = "c" * (CAPS.max_id_chars + 1)
    messages = [*HI, {"role": "tool", "tool_call_id": long_id, "content": "ok"}]
    _openai_refusal(live_server, "/v1/chat/completions", {"model": MODEL, "messages": messages}, "messages.1.tool_call_id", CAPS.max_id_chars)


# -- JSON schemas ----------------------------------------------------------------------------


def _response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL, "messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}


def test_a_schema_nested_past_the_cap_is_refused(live_server: LiveServer) -> None:
    # 50 object levels are 100 containers: within what the JSON parser takes, past the cap.
    schema = _nested_schema(50)
    param = "response_format.json_schema.schema"
    _openai_refusal(live_server, "/v1/chat/completions", _response_format(schema), param, CAPS.max_json_depth)
    _openai_refusal(
        live_server,
        "/v1/responses",
        {"model": MODEL, "input": "hi", "text": {"format": {"type": "json_schema", "name": "r", "schema": schema}}},
        "text.format.schema",
        CAPS.max_json_depth,
    )
    _anthropic_refusal(live_server, {"messages": HI, "tools": [{"name": "f", "input_schema": schema}]}, "tools.0.input_schema", CAPS.max_json_depth)


def test_a_schema_nested_1000_deep_is_refused(live_server: LiveServer) -> None:
    schema_text = '{"items":' * 1000 + "{}" + "}" * 1000
    raw = '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": %s}}}'
    with live_server.http() as client:
        response = client.post("/v1/chat/completions", content=raw % (MODEL, schema_text), headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text


def test_1001_enum_values_are_refused(live_server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"a": {"enum": list(range(600))}, "b": {"enum": list(range(401))}}}
    _openai_refusal(live_server, "/v1/chat/completions", _response_format(schema), "response_format.json_schema.schema", CAPS.max_enum_values)


def test_a_schema_past_its_byte_cap_is_refused(live_server: LiveServer) -> None:
    properties = {f"field_{i}": {"type": "string", "description": "d" * 100} for i in range(2000)}
    schema = {"type": "object", "properties": properties}
    assert len(json.dumps(schema)) > CAPS.max_schema_bytes
    _openai_refusal(live_server, "/v1/chat/completions", {"model": MODEL, "messages": HI, "tools": [_chat_tool("f", schema)]}, "tools.0", CAPS.max_schema_bytes)


# -- nesting and token ids: 400, not 500 -----------------------------------------------------

DEEP_ARGUMENTS = "[" * 10_000 + "]" * 10_000


def test_deeply_nested_arguments_in_a_chat_history_are_a_400(live_server: LiveServer) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": DEEP_ARGUMENTS}}
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    body = {"model": MODEL, "messages": messages, "tools": [_chat_tool("f")], "max_tokens": 2}
    _openai_refusal(live_server, "/v1/chat/completions", body, "messages.1.tool_calls.0.function.arguments", CAPS.max_json_depth)


def test_deeply_nested_arguments_in_responses_input_are_a_400(live_server: LiveServer) -> None:
    items = [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP_ARGUMENTS},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ]
    body = {"model": MODEL, "input": items, "max_output_tokens": 2}
    message = _openai_refusal(live_server, "/v1/responses", body, "input.1.arguments", CAPS.max_json_depth)
    assert "nested" in message


def test_a_model_reply_nested_too_deep_for_json_is_content_not_a_crash() -> None:
    tools = [tool_layer.Tool("f", "", {"type": "object"})]
    reply = '{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"
    content, calls = tool_layer.parse_reply(reply, tools, "auto")
    assert (content, calls) == (reply, [])
    tagged = f"{tool_layer.CALL_OPEN}{reply}{tool_layer.CALL_CLOSE}"
    assert tool_layer.parse_reply(tagged, tools, "auto") == (tagged, [])
    stream = tool_layer.ToolCallStream(tools, "auto")
    sent, calls = stream.feed("ok " + tagged)
    rest, more = stream.finish()
    assert sent + rest == "ok " + tagged and calls + more == []


@pytest.mark.parametrize("token", [-1, 10**12, 10**30])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/cache/lookup", "/v1/cache/pin"])
def test_out_of_range_token_ids_are_a_400(live_server: LiveServer, path: str, token: int) -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7, token, 9, 10, 11, 12]
    status, payload = _post(live_server, path, {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert status == 400, payload
    assert payload["error"]["param"] == "prompt", payload
    live_server.assert_idle_and_consistent()


def test_json_depth_scan_ignores_brackets_in_strings() -> None:
    assert not json_depth_exceeds('{"a": "[[[[[[[[[["}', 2)
    assert json_depth_exceeds('{"a": [[1]]}', 2)
    assert not json_depth_exceeds('{"a": "\\"[[[["}', 1)


def test_responses_metadata_is_capped_as_openai_caps_it(live_server: LiveServer) -> None:
    metadata = {f"k{i}": "v" for i in range(17)}
    _openai_refusal(live_server, "/v1/responses", {"model": MODEL, "input": "hi", "metadata": metadata}, "metadata", 16)


def test_duplicate_tool_names_are_refused_on_responses(live_server: LiveServer) -> None:
    tools = [{"type": "function", "name": "f"}, {"type": "function", "name": "g"}, {"type": "function", "name": "f"}]
    status, payload = _post(live_server, "/v1/responses", {"model": MODEL, "input": "hi", "tools": tools})
    assert status == 400 and payload["error"]["param"] == "tools", payload
    assert "'f' appears twice" in payload["error"]["message"]
