"""gpt-oss's prompts against openai-harmony, the format's reference encoder: the same conversation
(system and developer text, tools with any parameter schema, reasoning, calls, results, final
answers) rendered by radixkv and by openai-harmony gives the same text.

openai-harmony reads OpenAI's o200k_base vocabulary, which `make setup` puts in the venv
(tools/o200k_vocab.py) since harmony cannot download it here.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from radixkv.prompts.harmony_render import render_harmony, schema_type
from radixkv.prompts.tools import Tool, render_conversation
from tests.helpers.harmony import harmony_tokenizer

harmony = pytest.importorskip("openai_harmony")
VOCAB = Path(sys.prefix) / "share" / "o200k"
if not (VOCAB / "o200k_base.tiktoken").exists():
    pytest.skip(f"openai-harmony's vocabulary is not at {VOCAB} (make setup writes it: tools/o200k_vocab.py)", allow_module_level=True)
os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(VOCAB)
ENCODING = harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
TOKENIZER = harmony_tokenizer()
H = harmony
TODAY = datetime.date.today().isoformat()


def reference(messages: list, tools: list[Tool], instructions: str | None) -> str:
    """openai-harmony's text for a conversation, with the system and developer messages that the
    gpt-oss template writes (today's date, medium reasoning)."""
    head = [H.Message.from_role_and_content(H.Role.SYSTEM, H.SystemContent.new().with_conversation_start_date(TODAY))]
    if instructions or tools:
        developer = H.DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if tools:
            developer = developer.with_function_tools([H.ToolDescription.new(t.name, t.description, parameters=t.parameters) for t in tools])
        head.append(H.Message.from_role_and_content(H.Role.DEVELOPER, developer))
    tokens = ENCODING.render_conversation_for_completion(H.Conversation.from_messages(head + messages), H.Role.ASSISTANT)
    return ENCODING.decode(tokens)


def call(name: str, arguments: str) -> H.Message:
    message = H.Message.from_role_and_content(H.Role.ASSISTANT, arguments).with_channel("commentary")
    return message.with_recipient(f"functions.{name}").with_content_type("<|constrain|>json")


def result(name: str, text: str) -> H.Message:
    author = H.Author.new(H.Role.TOOL, f"functions.{name}")
    return H.Message.from_author_and_content(author, text).with_channel("commentary").with_recipient("assistant")


def said(channel: str, text: str) -> H.Message:
    return H.Message.from_role_and_content(H.Role.ASSISTANT, text).with_channel(channel)


WEATHER = Tool("get_weather", "Weather of a city", {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}}, "required": ["city"]})
TIME = Tool("get_time", "The time now\nin UTC", {"type": "object", "properties": {}})
NOTHING = Tool("ping", "", None)


def test_a_tool_loop_and_the_next_turn_match_harmony():
    system = {"role": "system", "content": "Be brief."}
    asked = {"role": "user", "content": "Weather and time?"}
    calls = {"role": "assistant", "content": "", "reasoning_content": "Need both tools.", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
        {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]}  # fmt: skip
    results = [{"role": "tool", "tool_call_id": "a", "content": '{"temp": 20}'}, {"role": "tool", "tool_call_id": "b", "content": "noon"}]
    loop = [H.Message.from_role_and_content(H.Role.USER, "Weather and time?"), said("analysis", "Need both tools."),
            call("get_weather", '{"city":"Paris"}'), call("get_time", "{}"), result("get_weather", '{"temp": 20}'), result("get_time", "noon")]  # fmt: skip
    tools = [WEATHER, TIME, NOTHING]
    assert render_conversation(TOKENIZER, [system, asked, calls, *results], tools) == reference(loop, tools, "Be brief.")
    answered = [system, asked, calls, *results, {"role": "assistant", "content": "20 degrees at noon."}, {"role": "user", "content": "Thanks"}]
    after = [m for m in loop if m.channel != "analysis"] + [said("final", "20 degrees at noon."), H.Message.from_role_and_content(H.Role.USER, "Thanks")]
    assert render_conversation(TOKENIZER, answered, tools) == reference(after, tools, "Be brief.")


def test_instructions_without_tools_and_no_system_at_all_match_harmony():
    user = {"role": "user", "content": "Hi"}
    assert render_conversation(TOKENIZER, [{"role": "developer", "content": "Rhyme."}, user], []) == reference([H.Message.from_role_and_content(H.Role.USER, "Hi")], [], "Rhyme.")
    assert render_conversation(TOKENIZER, [user], []) == reference([H.Message.from_role_and_content(H.Role.USER, "Hi")], [], None)


def test_a_result_with_no_call_before_it_is_refused():
    from radixkv.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="tool message"):
        render_harmony([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}], None)


# Parameter schemas as agent frameworks write them: nested objects, arrays, enums, unions
# (oneOf, type lists, nullable), with descriptions, titles, examples and defaults.
NAMES = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
WORDS = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=12)
DEFAULTS = st.none() | st.booleans() | st.integers(-1000, 1000) | WORDS | st.lists(st.integers(0, 9), max_size=3)


def annotated(schema: st.SearchStrategy) -> st.SearchStrategy:
    notes = st.fixed_dictionaries(
        {},
        optional={"description": WORDS, "title": WORDS, "default": DEFAULTS, "examples": st.lists(WORDS, max_size=2), "nullable": st.booleans()},
    )
    return st.tuples(schema, notes).map(lambda pair: {**pair[0], **pair[1]})


LEAVES = annotated(
    st.sampled_from([{"type": "string"}, {"type": "number"}, {"type": "integer"}, {"type": "boolean"}, {"type": ["string", "null"]}, {}])
    | st.lists(WORDS, min_size=1, max_size=3).map(lambda values: {"type": "string", "enum": values})
)


def objects(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.dictionaries(NAMES, children, max_size=4).flatmap(
        lambda properties: st.lists(st.sampled_from(sorted(properties) or ["x"]), max_size=3).map(
            lambda required: {"type": "object", "properties": properties, "required": required}
        )
    )


SCHEMAS = st.recursive(
    LEAVES,
    lambda children: annotated(
        objects(children) | children.map(lambda items: {"type": "array", "items": items}) | st.lists(children, min_size=1, max_size=3).map(lambda v: {"oneOf": v})
    ),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(objects(SCHEMAS) | SCHEMAS, WORDS)
def test_any_parameter_schema_is_written_as_harmony_writes_it(schema, description):
    tool = Tool("f", description, schema)
    ours = render_conversation(TOKENIZER, [{"role": "user", "content": "Hi"}], [tool])
    assert ours == reference([H.Message.from_role_and_content(H.Role.USER, "Hi")], [tool], None)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["final", "call", "calls"]), WORDS, WORDS, st.booleans()), min_size=1, max_size=4), WORDS)
def test_any_conversation_of_calls_results_and_answers_matches_harmony(turns, instructions):
    """Turns of a user question then a final answer, one call, or two calls; each call's result;
    reasoning on call turns printed until a final answer follows them."""
    ours: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    theirs: list = []
    for i, (kind, text, reasoning, with_reasoning) in enumerate(turns):
        ours.append({"role": "user", "content": text})
        theirs.append(H.Message.from_role_and_content(H.Role.USER, text))
        if kind == "final":
            ours.append({"role": "assistant", "content": text})
            theirs.append(said("final", text))
            continue
        names = ["get_weather", "get_time"][: 1 if kind == "call" else 2]
        arguments = [json.dumps({"city": text}), "{}"]
        message = {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"{i}{n}", "type": "function", "function": {"name": n, "arguments": a}} for n, a in zip(names, arguments)
        ]}  # fmt: skip
        if with_reasoning and reasoning:
            message["reasoning_content"] = reasoning
            later_final = any(k == "final" for k, *_ in turns[i + 1 :])
            theirs += [] if later_final else [said("analysis", reasoning)]
        ours.append(message)
        theirs += [call(n, a) for n, a in zip(names, arguments)]
        for n in names:
            ours.append({"role": "tool", "tool_call_id": f"{i}{n}", "content": f"{n} says {text}"})
            theirs.append(result(n, f"{n} says {text}"))
    assert render_conversation(TOKENIZER, ours, [WEATHER, TIME]) == reference(theirs, [WEATHER, TIME], instructions or None)


def test_nested_objects_and_unions_indent_as_harmony_indents_them():
    inner = {"type": "object", "properties": {"lat": {"type": "number"}, "at": {"oneOf": [{"type": "string"}, {"type": "object", "properties": {"t": {"type": "integer"}}}]}}, "required": ["lat"]}
    schema = {"type": "object", "properties": {"loc": {"type": "object", "properties": {"inner": inner}}}}
    assert schema_type({"type": "object", "properties": {"lat": {"type": "number"}}}, "    ") == "{\n    lat?: number,\n    }"
    tool = Tool("f", "nested", schema)
    assert render_conversation(TOKENIZER, [{"role": "user", "content": "Hi"}], [tool]) == reference([H.Message.from_role_and_content(H.Role.USER, "Hi")], [tool], None)


def test_a_call_keeps_its_text_through_a_second_normalization() -> None:
    from radixkv.prompts.tools import normalize_messages

    sent = [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a":  1}'}}]}]
    once = normalize_messages(sent)
    assert normalize_messages(once) == once and once[0]["tool_calls"][0]["function"]["arguments_text"] == '{"a":  1}'
    assert "arguments_text" not in normalize_messages(sent, argument_text=False)[0]["tool_calls"][0]["function"]
