"""radixkv.server.tools and radixkv.prompts.tools without a server: tool definitions and
choices, the prompt through a template that takes tools and through the fallback, guides, and
replies whole and streamed."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixkv.errors import InvalidRequest
from radixkv.prompts import template_takes_tools
from radixkv.prompts.tools import encode_conversation, fallback_messages, tools_section
from radixkv.server.tools import (
    CALL_CLOSE,
    CALL_OPEN,
    Tool,
    ToolCallStream,
    guide_for,
    parse_reply,
    tool_choice_from_openai,
    tools_from_openai,
)
from tests.helpers.tiny_models import CHAT_TEMPLATE, tiny_tokenizer

WEATHER = Tool(
    "get_weather",
    "The weather in a city.",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TIME = Tool("get_time", "The time now.", {"type": "object", "properties": {}})
TOOLS = [WEATHER, TIME]
# A template in the style of those that take tools (Qwen's, Llama 3's): they print `tools`.
TOOLS_TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}[{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}]{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
HISTORY = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids)


def test_tools_and_choice_from_openai():
    raw = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}},
           {"type": "function", "name": "g"}]  # the Responses API's flat form
    f, g = tools_from_openai(raw)
    assert f == Tool("f", "d", {"type": "object"}, True) and g.name == "g" and g.parameters["type"] == "object"
    assert tool_choice_from_openai(None, [f]) == "auto" and tool_choice_from_openai(None, []) == "none"
    assert tool_choice_from_openai({"type": "function", "function": {"name": "g"}}, [f, g]) == "g"
    assert tool_choice_from_openai({"type": "function", "name": "f"}, [f, g]) == "f"
    for bad, tools in [("sometimes", [f]), ({"type": "function", "function": {"name": "nope"}}, [f]), ("required", []), (3, [f])]:
        with pytest.raises(InvalidRequest) as error:
            tool_choice_from_openai(bad, tools)
        assert error.value.param == "tool_choice"
    for bad in ([{"type": "retrieval"}], [{"type": "function", "function": {}}], raw + raw[:1]):
        with pytest.raises(InvalidRequest) as error:
            tools_from_openai(bad)
        assert error.value.param == "tools"


def test_fallback_prompt_lists_tools_and_replays_calls(tokenizer):
    assert not template_takes_tools(tokenizer)
    text = decode(tokenizer, encode_conversation(tokenizer, [{"role": "system", "content": "Be brief."}, *HISTORY], TOOLS, "auto"))
    assert text.startswith("<|system|>Be brief.\n\n# Tools")
    for tool in TOOLS:
        assert json.dumps({"name": tool.name, "description": tool.description, "parameters": tool.parameters}) in text
    assert f'<|assistant|>{CALL_OPEN}{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}{CALL_CLOSE}' in text
    assert '<|user|><tool_response>{"tool_call_id": "call_1", "content": "sunny"}</tool_response>' in text
    assert text.endswith("<|assistant|>")


def test_fallback_without_system_prompt_and_consecutive_results(tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "tool", "tool_call_id": "a", "content": "1"}, {"role": "tool", "tool_call_id": "b", "content": "2"}]
    text = decode(tokenizer, encode_conversation(tokenizer, messages, [TIME], "auto", add_generation_prompt=False))
    assert text.startswith(f"<|system|>{tools_section([TIME])}\n<|user|>hi\n<|user|><tool_response>")
    assert text.count("<|user|>") == 2 and text.count("<tool_response>") == 2
    assert fallback_messages([{"role": "user", "content": "x"}], []) == [{"role": "user", "content": "x"}]


def test_template_that_takes_tools_gets_them():
    tok = tiny_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    assert template_takes_tools(tok)
    text = tok.decode(encode_conversation(tok, HISTORY, TOOLS, "auto"))
    assert text.startswith("<|tools|>get_weather;get_time;<|user|>")
    assert '[get_weather {"city": "Paris"}]' in text  # arguments handed over as an object
    assert "# Tools" not in text


def test_encode_conversation_refuses_bad_input(tokenizer):
    for messages, choice in [([{"role": "robot", "content": "x"}], "auto"), ([{"role": "user", "content": 3}], "auto"),
                             ([{"role": "assistant", "tool_calls": [{"function": {}}]}], "auto"),
                             ([{"role": "user", "content": "x"}], "nope"), ([], "auto")]:
        with pytest.raises(InvalidRequest):
            encode_conversation(tokenizer, messages, TOOLS, choice)


def test_guides_match_the_calls_they_allow():
    assert guide_for(TOOLS, "auto", True) is None and guide_for(TOOLS, "none", False) is None
    named = json.loads(guide_for(TOOLS, "get_weather", False).schema)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Rome"}}, named)
    for wrong in ({"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}, {"name": "get_weather"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, named)
    required = json.loads(guide_for(TOOLS, "required", True).schema)
    jsonschema.validate([{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "X"}}], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], required)
    assert guide_for(TOOLS, "required", False).strict
    with pytest.raises(InvalidRequest):
        guide_for(TOOLS, "unknown", False)


def test_parse_reply_forms():
    content, [call] = parse_reply('{"name": "get_weather", "arguments": {"city": "Oslo"}}', TOOLS, "get_weather")
    assert content is None and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert call.id.startswith("call_") and len(call.id) > 10
    _, calls = parse_reply('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "A"}}]', TOOLS, "required")
    assert [c.name for c in calls] == ["get_time", "get_weather"] and len({c.id for c in calls}) == 2
    tagged = f'Let me check.\n{CALL_OPEN}{{"name": "get_time", "arguments": {{}}}}{CALL_CLOSE}\n'
    assert parse_reply(tagged, TOOLS, "auto")[0] == "Let me check." and len(parse_reply(tagged, TOOLS, "auto")[1]) == 1
    for plain in ("hello", f"{CALL_OPEN}not json{CALL_CLOSE}", '{"name": "unknown", "arguments": {}}', '{"a": 1}'):
        assert parse_reply(plain, TOOLS, "auto") == (plain, [])
    assert parse_reply(tagged, TOOLS, "none") == (tagged, [])
    # A call cut off by max_tokens that still parses counts; one that does not stays text.
    assert len(parse_reply(f'{CALL_OPEN}{{"name": "get_time", "arguments": {{}}}}', TOOLS, "auto")[1]) == 1


CUT_OFF = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "A"}}, {"name": "get_weather", "argu'


def test_a_guided_reply_cut_off_gives_the_calls_it_completed_never_grammar_text():
    # A forced call cut off by max_tokens: the calls that closed come back as calls, and the
    # cut-off JSON is never content (a client would show or parse it as the model's words).
    for choice in ("required", "get_weather"):
        content, calls = parse_reply(CUT_OFF, TOOLS, choice)
        assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {}), ("get_weather", {"city": "A"})]
    assert parse_reply('{"name": "get_weather", "arguments": {"ci', TOOLS, "get_weather") == (None, [])
    assert parse_reply('[{"name": "get_weather", "arguments": {"city": "A"}}, {"name": "nope", "arguments": {}}, {"na', TOOLS, "required")[0] is None
    # Unforced, the same text is the model's to say: it stays content.
    assert parse_reply(CUT_OFF, TOOLS, "auto") == (CUT_OFF, [])
    content, calls = stream_all(ToolCallStream(TOOLS, "required"), [CUT_OFF[:40], CUT_OFF[40:]])
    assert content == "" and [c.name for c in calls] == ["get_time", "get_weather"]


def test_a_parallel_call_repeated_word_for_word_is_given_once():
    same = '{"name": "get_weather", "arguments": {"city": "A"}}'
    other = '{"name": "get_weather", "arguments": {"city": "B"}}'
    reply = f"[{same}, {other}, {same}, {other}, {same}]"
    _, calls = parse_reply(reply, TOOLS, "required")
    assert [json.loads(c.arguments)["city"] for c in calls] == ["A", "B"]
    _, cut = parse_reply(f"[{same}, {other}, {same}, {{", TOOLS, "required")
    assert [json.loads(c.arguments)["city"] for c in cut] == ["A", "B"]


def stream_all(stream: ToolCallStream, pieces: list[str]) -> tuple[str, list]:
    content, calls = "", []
    for piece in pieces:
        text, ready = stream.feed(piece)
        content += text
        calls += ready
    text, ready = stream.finish()
    return content + text, calls + ready


def test_stream_passes_text_and_holds_calls():
    stream = ToolCallStream(TOOLS, "auto")
    assert stream.feed("Hello <") == ("Hello ", [])  # "<" may open a call
    assert stream.feed("b>") == ("<b>", [])
    assert stream.feed(f'{CALL_OPEN}{{"name": "get_ti') == ("", [])
    text, [call] = stream.feed(f'me", "arguments": {{}}}}{CALL_CLOSE} done')
    assert text == " done" and call.name == "get_time"
    assert stream.finish() == ("", []) and stream.num_calls == 1


def test_stream_of_a_guided_reply_is_held_to_the_end():
    stream = ToolCallStream(TOOLS, "required")
    reply = '[{"name": "get_weather", "arguments": {"city": "Lima"}}]'
    assert all(stream.feed(c) == ("", []) for c in reply)
    content, [call] = stream.finish()
    assert content == "" and json.loads(call.arguments) == {"city": "Lima"}


@given(st.lists(st.sampled_from(["a", " ", "<", "tool", "_call>", CALL_OPEN, CALL_CLOSE, '{"name": "get_time", "arguments": {}}', "{", "}"]), max_size=12),
       st.data())
def test_stream_agrees_with_parse_reply(parts, data):
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content, calls = stream_all(ToolCallStream(TOOLS, "auto"), pieces)
    expected_content, expected_calls = parse_reply(text, TOOLS, "auto")
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected_calls]
    if expected_calls:
        assert content.strip() == (expected_content or "")
    else:
        assert content == expected_content


def test_a_call_left_open_over_a_long_reply_is_scanned_once():
    # One character a delta inside an open call: each delta is searched with at most the
    # close marker's length of lookback, not the whole call again (quadratic: ~2e8 here).
    stream = ToolCallStream(TOOLS, "auto")
    pieces = ["Hi ", CALL_OPEN, '{"name": "get_time", "arguments": {"x": "', *("a" * 20_000), '"}}', *CALL_CLOSE, " bye"]
    content, calls = stream_all(stream, pieces)
    assert content == "Hi  bye" and [c.name for c in calls] == ["get_time"]
    assert json.loads(calls[0].arguments) == {"x": "a" * 20_000}
    total = sum(len(p) for p in pieces)
    assert stream.num_scanned_chars <= total + len(CALL_CLOSE) * len(pieces)


def test_a_long_space_prefix_and_a_long_json_reply_are_not_rescanned():
    stream = ToolCallStream(TOOLS, "auto")
    pieces = [" "] * 20_000 + ['{"name": "get_time", "arguments": {"x": "'] + ["b"] * 20_000 + ['"}}']
    content, calls = stream_all(stream, pieces)
    assert content == "" and json.loads(calls[0].arguments) == {"x": "b" * 20_000}
    assert stream.num_scanned_chars <= sum(len(p) for p in pieces)
