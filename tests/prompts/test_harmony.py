"""Harmony at the token level: which tokenizers speak it, the reader over known replies and
over every split of their ids, and gpt-oss's own template rendering conversations with tools,
calls and results as the harmony format (OpenAI's cookbook) writes them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from radixkv.prompts.harmony import HarmonyReader, HarmonyTokens, harmony_tokens, split_reply
from radixkv.prompts.tools import Tool, encode_conversation, render_conversation
from tests.helpers.harmony import harmony_tokenizer
from tests.helpers.tiny_models import tiny_tokenizer

TOKENIZER = harmony_tokenizer()
MARKS = harmony_tokens(TOKENIZER)
WEATHER = Tool("get_weather", "Weather of a city", {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}}, "required": ["city"]})
TIME = Tool("get_time", "The time now", {"type": "object", "properties": {}})


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False).input_ids


def read(token_ids: list[int], cuts: list[int] = ()) -> tuple[HarmonyReader, list[tuple[str | None, str | None, str, bool]]]:
    """The reader over token_ids fed in pieces at cuts; its events as (channel, recipient, text, closed)."""
    reader = HarmonyReader(TOKENIZER, MARKS)
    bounds = [0, *sorted(set(cuts)), len(token_ids)]
    events = [e for a, b in zip(bounds, bounds[1:]) for e in reader.feed(token_ids[a:b])]
    events += reader.finish()
    return reader, [(e.message.channel, e.message.recipient, e.text, e.closed) for e in events]


def summary(reader: HarmonyReader) -> list[tuple]:
    return [(m.channel, m.recipient, m.content_type, m.text, m.ended) for m in reader.messages]


REPLIES = {
    "final": ("<|channel|>final<|message|>It is sunny.<|return|>", [("final", None, None, "It is sunny.", "return")]),
    "analysis_final": (
        "<|channel|>analysis<|message|>The user asks.<|end|><|start|>assistant<|channel|>final<|message|>Paris.<|return|>",
        [("analysis", None, None, "The user asks.", "end"), ("final", None, None, "Paris.", "return")],
    ),
    "analysis_call": (
        '<|channel|>analysis<|message|>Call the tool.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
        [("analysis", None, None, "Call the tool.", "end"), ("commentary", "functions.get_weather", "json", '{"city":"Paris"}', "call")],
    ),
    "recipient_in_role": (  # the template's form: the recipient before the channel
        ' to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>',
        [("commentary", "functions.get_time", "json", "{}", "call")],
    ),
    "cut": ("<|channel|>analysis<|message|>The user asks about", [("analysis", None, None, "The user asks about", None)]),
}


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_reader_reads_known_replies(name: str) -> None:
    text, expected = REPLIES[name]
    reader, _ = read(ids(text))
    assert reader.plain is False
    assert summary(reader) == expected


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(REPLIES)), cuts=st.lists(st.integers(0, 60), max_size=8))
def test_reader_gives_the_same_messages_however_the_ids_come(name: str, cuts: list[int]) -> None:
    token_ids = ids(REPLIES[name][0])
    whole, whole_events = read(token_ids)
    split, split_events = read(token_ids, [c for c in cuts if c <= len(token_ids)])
    assert summary(split) == summary(whole) == REPLIES[name][1]
    # Each message's streamed text adds up to its text, and each closes once.
    for message in whole.messages:
        pieces = [e for e in split_events if e[:2] == (message.channel, message.recipient)]
        assert "".join(p[2] for p in pieces) == message.text
        assert sum(p[3] for p in pieces) == 1


def test_a_character_split_over_tokens_is_held_until_whole() -> None:
    reader = HarmonyReader(TOKENIZER, MARKS)
    head = ids("<|channel|>final<|message|>")
    body = ids("café ☃")
    events = reader.feed(head)
    texts = [e.text for token in body for e in reader.feed([token])]
    assert "\ufffd" not in "".join(texts) and "".join(texts) == "café ☃"
    assert len(body) > len("café ☃")  # the test splits characters: byte tokens


def test_a_reply_that_does_not_open_as_harmony_is_plain() -> None:
    """A guided reply (a forced call's JSON) never writes a header: the server reads its text."""
    reader, events = read(ids('{"name": "get_time", "arguments": {}}'))
    assert reader.plain is True and events == [] and reader.messages == []


def test_only_a_tokenizer_with_every_marker_speaks_harmony() -> None:
    assert isinstance(MARKS, HarmonyTokens) and MARKS.stops == {MARKS.return_, MARKS.call}
    assert harmony_tokens(tiny_tokenizer()) is None


# -- rendering: as openai-harmony writes the conversation (tests/prompts/test_harmony_reference.py) --


def system_header(tools: bool) -> str:
    from datetime import date

    calls = "\nCalls to these tools must go to the commentary channel: 'functions'." if tools else ""
    return (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n"
        f"Current date: {date.today():%Y-%m-%d}\n\nReasoning: medium\n\n"
        f"# Valid channels: analysis, commentary, final. Channel must be included for every message.{calls}<|end|>"
    )


DEVELOPER_WITH_TOOLS = (
    "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\nnamespace functions {\n\n"
    "// Weather of a city\ntype get_weather = (_: {\n// the city\ncity: string,\n}) => any;\n\n"
    "// The time now\ntype get_time = (_: {\n}) => any;\n\n} // namespace functions<|end|>"
)


def call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def test_tools_render_as_the_functions_namespace_in_the_developer_message() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    text = render_conversation(TOKENIZER, messages, [WEATHER, TIME])
    assert text == system_header(True) + DEVELOPER_WITH_TOOLS + "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"


def test_calls_and_results_render_back_as_harmony_messages() -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "content": "", "tool_calls": [call("c1", "get_weather", {"city": "Paris"}), call("c2", "get_time", {})]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "assistant", "content": "Sunny, at noon."},
        {"role": "user", "content": "Thanks"},
    ]
    text = render_conversation(TOKENIZER, messages, [WEATHER, TIME])
    assert text.startswith(system_header(True) + DEVELOPER_WITH_TOOLS)
    assert text[len(system_header(True) + DEVELOPER_WITH_TOOLS) :] == (
        "<|start|>user<|message|>Weather and time?<|end|>"
        # every call its own message, its arguments as the client sent them back
        '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
        "<|start|>assistant to=functions.get_time<|channel|>commentary <|constrain|>json<|message|>{}<|call|>"
        # each result named after its own call, its text as it is
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
        "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>noon<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Sunny, at noon.<|end|>"
        "<|start|>user<|message|>Thanks<|end|><|start|>assistant"
    )


def test_reasoning_handed_back_renders_before_its_call_within_the_tool_loop() -> None:
    """An assistant turn's reasoning_content (chat's field, a Responses reasoning item, an
    Anthropic thinking block) is gpt-oss's `thinking`: printed before the turn's call while the
    tool loop runs, dropped once a final answer follows, and never beside the turn's own text
    (the template refuses both; the text is printed as the analysis then)."""
    head = [{"role": "user", "content": "Weather?"}]
    calling = {"role": "assistant", "content": None, "reasoning_content": "Call the tool.", "tool_calls": [call("c1", "get_weather", {"city": "Paris"})]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    loop = render_conversation(TOKENIZER, [*head, calling, result], [WEATHER])
    analysis = "<|start|>assistant<|channel|>analysis<|message|>Call the tool.<|end|>"
    assert analysis + '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}<|call|>' in loop
    answered = render_conversation(TOKENIZER, [*head, calling, result, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}], [WEATHER])
    assert "Call the tool." not in answered
    with_text = render_conversation(TOKENIZER, [*head, {**calling, "content": "Checking."}, result], [WEATHER])
    assert "<|channel|>analysis<|message|>Checking.<|end|>" in with_text and "Call the tool." not in with_text
    # Reasoning on a turn without calls is not printed for inference, as the template decides.
    plain = render_conversation(TOKENIZER, [*head, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Easy."}, {"role": "user", "content": "Ok"}], [WEATHER])
    assert "Easy." not in plain


def test_the_next_turn_keeps_the_previous_prompt_as_its_prefix() -> None:
    """What the prefix cache can reuse across an agent's turns: the template drops an earlier
    turn's reasoning and writes `<|end|>` for the `<|return|>` the model wrote, so turn k+1's
    prompt starts with turn k's prompt, and with the reply's final text but not its analysis."""
    turn1 = [{"role": "user", "content": "Weather in Paris?"}]
    prompt1 = encode_conversation(TOKENIZER, turn1, [WEATHER], "auto")
    reply = ids("<|channel|>analysis<|message|>Call the tool.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>")
    turn2 = turn1 + [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}]
    prompt2 = encode_conversation(TOKENIZER, turn2, [WEATHER], "auto")
    assert prompt2[: len(prompt1)] == prompt1
    assert prompt2[len(prompt1) : len(prompt1) + 3] != reply[:3]  # the analysis is not in turn 2's prompt
    final_only = ids("<|channel|>final<|message|>Sunny.")
    assert prompt2[len(prompt1) : len(prompt1) + len(final_only)] == final_only


def test_a_harmony_reply_continues_as_it_was_generated() -> None:
    """Exact continuation (the Responses API's previous_response_id): the next turn's prompt is
    the stored prompt and reply ids, reasoning and markers included, then the template's text
    after the reply; a final answer's `<|return|>` becomes `<|end|>`, a call's `<|call|>` stays."""
    from radixkv.prompts.continuation import continue_after_harmony
    from radixkv.prompts.tools import normalize_messages

    tools = [WEATHER]

    def continued(messages: list[dict], reply_index: int, prefix: list[int], reply: list[int]) -> list[int] | None:
        render = lambda ms: render_conversation(TOKENIZER, ms, tools)  # noqa: E731
        through = lambda ms: render_conversation(TOKENIZER, ms, tools, add_generation_prompt=False)  # noqa: E731
        return continue_after_harmony(TOKENIZER, render, through, normalize_messages(messages), reply_index, prefix + reply, len(reply), MARKS)

    turn1 = [{"role": "user", "content": "Weather in Paris?"}]
    prompt1 = encode_conversation(TOKENIZER, turn1, tools, "auto")
    reply1 = ids('<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>')
    turn2 = turn1 + [
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "get_weather", {"city": "Paris"})]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    prompt2 = continued(turn2, 1, prompt1, reply1)
    result = "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|><|start|>assistant"
    assert prompt2 == prompt1 + reply1 + ids(result)

    reply2 = ids("<|channel|>final<|message|>Sunny.<|return|>")
    turn3 = turn2 + [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}]
    prompt3 = continued(turn3, 3, prompt2, reply2)
    assert prompt3 == prompt2 + reply2[:-1] + [MARKS.end] + ids("<|start|>user<|message|>Thanks<|end|><|start|>assistant")

    # Not the stored reply: another answer, another function, a reply cut before its stop.
    assert continued([*turn3[:3], {"role": "assistant", "content": "Cloudy."}, turn3[4]], 3, prompt2, reply2) is None
    other = [*turn2[:1], {"role": "assistant", "content": None, "tool_calls": [call("c1", "get_time", {})]}, turn2[2]]
    assert continued(other, 1, prompt1, reply1) is None
    assert continued(turn3, 3, prompt2, reply2[:-1]) is None


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("<|channel|>final<|message|>Sunny.<|return|>", ("Sunny.", "")),
        ("<|channel|>analysis<|message|>The user asks.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>",
         ("Sunny.", "The user asks.")),
        ("<|channel|>analysis<|message|>The user", ("", "The user")),  # cut off in its reasoning
        ("Sunny.", None),  # not harmony: left as the engine's text
        ("", None),
    ],
)  # fmt: skip
def test_a_finished_reply_splits_into_content_and_reasoning(reply: str, expected: tuple[str, str] | None) -> None:
    assert split_reply(TOKENIZER, MARKS, ids(reply)) == expected
