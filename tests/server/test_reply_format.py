"""A reply split by the model's format: harmony's known id sequences into OpenAI's chat shapes
(message, and the streamed chunks merged) and Anthropic's content blocks (whole, and the stream's
events merged), every way of splitting the ids into deltas giving what the whole reply gives;
malformed calls are content, a cut-off reply is content and reasoning so far."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from hypothesis import given, settings, strategies as st
from pydantic import TypeAdapter

from radixkv.engine.request_output import CompletionDelta, CompletionOutput
from radixkv.prompts.tools import Tool
from radixkv.server.anthropic.routes import _Blocks, _content, _stream_parts
from radixkv.server.logprobs import TokenTexts
from radixkv.server.openai.outputs import ChatTools, _ChatChoiceStream, _chat_choice
from radixkv.server.openai.protocol import ChatCompletionRequest
from radixkv.server.openai.responses_convert import output_items
from radixkv.server.openai.responses_events import ResponseEvents
from radixkv.server.openai.responses_protocol import ResponseObject, response_usage
from radixkv.server.openai.responses_routes import _emit
from radixkv.server.reply_format import ReplyFormat
from tests.helpers.harmony import harmony_tokenizer
from tests.helpers.tiny_models import tiny_tokenizer

TOKENIZER = harmony_tokenizer()
# The official clients' own types for what goes over the wire.
ANTHROPIC_EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)
ANTHROPIC_BLOCK = TypeAdapter(anthropic.types.ContentBlock)
OPENAI_EVENT = TypeAdapter(openai.types.responses.ResponseStreamEvent)
OPENAI_ITEM = TypeAdapter(openai.types.responses.ResponseOutputItem)
FORMAT = ReplyFormat(TOKENIZER)
TOOLS = [
    Tool("get_weather", "Weather of a city", {"type": "object", "properties": {"city": {"type": "string"}}}),
    Tool("get_time", "The time", {"type": "object", "properties": {}}),
]
ANALYSIS = "<|channel|>analysis<|message|>The user asks.<|end|><|start|>assistant"
WEATHER_CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>'
TIME_CALL = "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>"

# reply -> (content, reasoning, [(name, arguments)], finish_reason)
CASES = {
    "final": ("<|channel|>final<|message|>Sunny.<|return|>", "Sunny.", None, [], "stop"),
    "analysis_final": (ANALYSIS + "<|channel|>final<|message|>Sunny.<|return|>", "Sunny.", "The user asks.", [], "stop"),
    "analysis_call": (ANALYSIS + WEATHER_CALL, None, "The user asks.", [("get_weather", {"city": "Paris"})], "tool_calls"),
    "two_calls": (WEATHER_CALL + TIME_CALL, None, None, [("get_weather", {"city": "Paris"}), ("get_time", {})], "tool_calls"),
    "bad_json": (ANALYSIS + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": Par<|call|>',
                 '{"city": Par', "The user asks.", [], "stop"),
    "unknown_function": ("<|channel|>commentary to=functions.launch <|constrain|>json<|message|>{}<|call|>", "{}", None, [], "stop"),
    "commentary_preamble": ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant" + WEATHER_CALL,
                            "Checking.", None, [("get_weather", {"city": "Paris"})], "tool_calls"),
    "cut_in_analysis": ("<|channel|>analysis<|message|>The user", "", "The user", [], "length"),
    "cut_in_call": (WEATHER_CALL[: WEATHER_CALL.index("Paris")], '{"city":"', None, [], "length"),
}  # fmt: skip


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False).input_ids


def output(name: str) -> CompletionOutput:
    text, *_, finish = CASES[name]
    token_ids = ids(text)
    # The engine's text drops special tokens; harmony's replies are read from the ids.
    engine_text = TOKENIZER.decode(token_ids, skip_special_tokens=True)
    return CompletionOutput(0, engine_text, token_ids, "length" if finish == "length" else "stop")


def chat_tools(choice: str = "auto") -> ChatTools:
    return ChatTools(TOOLS, choice, True, FORMAT)


def openai_message(name: str, choice: str = "auto") -> dict:
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    whole = output(name)
    reply = FORMAT.parse(whole.text, whole.token_ids, TOOLS, choice)
    choice_ = _chat_choice(TokenTexts(TOKENIZER), body, whole, reply)
    message = choice_.model_dump()["message"]
    for call in message.get("tool_calls") or []:
        call["id"] = "id"
    return {"message": message, "finish_reason": choice_.finish_reason}


def openai_streamed(name: str, cuts: list[int], choice: str = "auto") -> dict:
    """The chat chunks of the reply fed in deltas cut at `cuts`, merged as a client merges them."""
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    whole = output(name)
    stream = _ChatChoiceStream(TokenTexts(TOKENIZER), body, chat_tools(choice), 0)
    bounds = [0, *sorted({c for c in cuts if c < len(whole.token_ids)}), len(whole.token_ids)]
    content, reasoning, calls, finish = "", "", {}, None
    for a, b in zip(bounds, bounds[1:]):
        part = whole.token_ids[a:b]
        last = b == len(whole.token_ids)
        delta = CompletionDelta(0, TOKENIZER.decode(part, skip_special_tokens=True), part, whole.finish_reason if last else None)
        for chunk in stream.choices(delta):
            d = chunk.delta
            content += d.content or ""
            reasoning += d.reasoning_content or ""
            for call in d.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": "id", "type": "function", "function": {"name": None, "arguments": ""}})
                entry["function"]["name"] = call.function.name or entry["function"]["name"]
                entry["function"]["arguments"] += call.function.arguments or ""
            finish = chunk.finish_reason or finish
    message = {"role": "assistant", "content": content or (None if calls else ""), "tool_calls": [calls[k] for k in sorted(calls)] or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    return {"message": message, "finish_reason": finish}


@pytest.mark.parametrize("name", sorted(CASES))
def test_known_replies_become_openai_messages(name: str) -> None:
    _, content, reasoning, calls, finish = CASES[name]
    got = openai_message(name)
    assert got["finish_reason"] == finish
    message = got["message"]
    assert message["content"] == (content if content or not calls else None)
    assert message.get("reasoning_content") == reasoning
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"] or []] == calls


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(CASES)), cuts=st.lists(st.integers(1, 40), max_size=6))
def test_streamed_chunks_add_up_to_the_whole_reply(name: str, cuts: list[int]) -> None:
    assert openai_streamed(name, cuts) == openai_message(name)


# The reply's analysis messages as written (the `<|start|>assistant` after one opens the next message).
REASONING_TEXT = {"analysis_final": ANALYSIS, "analysis_call": ANALYSIS, "bad_json": ANALYSIS, "cut_in_analysis": CASES["cut_in_analysis"][0]}


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(sorted(CASES)), st.lists(st.integers(1, 40), max_size=6))
def test_reasoning_tokens_count_the_analysis_messages_whole_or_streamed(name: str, cuts: list[int]) -> None:
    text = REASONING_TEXT.get(name, "")
    expected = len(ids(text.removesuffix("<|start|>assistant")))
    whole = output(name)
    assert FORMAT.parse(whole.text, whole.token_ids, TOOLS, "auto").reasoning_tokens == expected
    stream = FORMAT.stream(TOOLS, "auto")
    bounds = [0, *sorted({c for c in cuts if c < len(whole.token_ids)}), len(whole.token_ids)]
    for a, b in zip(bounds, bounds[1:]):
        stream.feed(TOKENIZER.decode(whole.token_ids[a:b], skip_special_tokens=True), whole.token_ids[a:b])
    stream.finish()
    assert stream.reasoning_tokens == expected
    assert bool(expected) == bool(CASES[name][2]), "a reply with reasoning text counts its tokens, one without none"


def test_tool_choice_none_leaves_calls_as_content() -> None:
    assert openai_message("analysis_call", "none")["message"] == {
        "role": "assistant", "content": '{"city":"Paris"}', "tool_calls": None, "reasoning_content": "The user asks.",
    }  # fmt: skip


def test_a_forced_call_the_guide_wrote_as_json_is_read_from_its_text() -> None:
    """A guide for a forced call keeps the reply off harmony's markers: bare JSON, read as text."""
    token_ids = ids('{"name": "get_time", "arguments": {}}')
    reply = FORMAT.parse(TOKENIZER.decode(token_ids), token_ids, TOOLS, "get_time")
    assert reply.content is None and [(c.name, c.arguments) for c in reply.calls] == [("get_time", "{}")]


def anthropic_streamed(name: str, cuts: list[int], thinking: bool) -> list[dict]:
    whole = output(name)
    stream, blocks, events = FORMAT.stream(TOOLS, "auto"), _Blocks(), []
    bounds = [0, *sorted({c for c in cuts if c < len(whole.token_ids)}), len(whole.token_ids)]
    for a, b in zip(bounds, bounds[1:]):
        piece = stream.feed("", whole.token_ids[a:b])
        events += _stream_parts(blocks, piece.content, piece.calls, piece.reasoning if thinking else "")
    piece = stream.finish()
    events += _stream_parts(blocks, piece.content, piece.calls, piece.reasoning if thinking else "") + blocks.close()
    content: list[dict] = []
    for event in events:
        data = json.loads(event.split("data: ", 1)[1])
        parsed = ANTHROPIC_EVENT.validate_python(data)  # the client's own types parse it
        assert parsed.type == data["type"] and getattr(getattr(parsed, "delta", None), "type", None) == data.get("delta", {}).get("type")
        delta = data.get("delta", {})
        if data["type"] == "content_block_start":
            content.append(dict(data["content_block"]))
        elif delta.get("type") == "text_delta":
            content[data["index"]]["text"] += delta["text"]
        elif delta.get("type") == "thinking_delta":
            content[data["index"]]["thinking"] += delta["thinking"]
        elif delta.get("type") == "signature_delta":
            content[data["index"]]["signature"] = delta["signature"]
        elif delta.get("type") == "input_json_delta":
            content[data["index"]]["input"] = json.loads(delta["partial_json"])
    return content


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(CASES)), cuts=st.lists(st.integers(1, 40), max_size=6), thinking=st.booleans())
def test_known_replies_become_anthropic_blocks_whole_or_streamed(name: str, cuts: list[int], thinking: bool) -> None:
    _, content, reasoning, calls, _ = CASES[name]
    whole = output(name)
    reply = FORMAT.parse(whole.text, whole.token_ids, TOOLS, "auto")
    blocks = _content(reply.content, reply.calls, reply.reasoning if thinking else None)
    # Reasoning is a thinking block (first) only where the request asked for thinking.
    thoughts = [b["thinking"] for b in blocks if b["type"] == "thinking"]
    assert thoughts == ([reasoning] if thinking and reasoning else [])
    assert all(b["signature"] for b in blocks if b["type"] == "thinking")
    assert [b["type"] for b in blocks][: len(thoughts)] == ["thinking"] * len(thoughts)
    assert [b["text"] for b in blocks if b["type"] == "text"] == ([content] if content else [])
    assert [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"] == calls
    streamed = anthropic_streamed(name, cuts, thinking)
    strip = lambda bs: [{k: v for k, v in b.items() if k != "id"} for b in bs]  # noqa: E731
    assert strip(streamed) == strip(blocks)
    assert [ANTHROPIC_BLOCK.validate_python(b).type for b in blocks] == [b["type"] for b in blocks]


def responses_whole(name: str) -> list[dict]:
    whole = output(name)
    reply = FORMAT.parse(whole.text, whole.token_ids, TOOLS, "auto")
    return [item.model_dump() for item in output_items(reply.content, reply.calls, whole.finish_reason != "length", reply.reasoning)]


def responses_streamed(name: str, cuts: list[int]) -> list[dict]:
    """The output items a client rebuilds from the stream's events (added, deltas, done)."""
    whole = output(name)
    stream = FORMAT.stream(TOOLS, "auto")
    events = ResponseEvents(ResponseObject(id="resp_1", created_at=0, status="in_progress", model="m"))
    raw = events.start()
    bounds = [0, *sorted({c for c in cuts if c < len(whole.token_ids)}), len(whole.token_ids)]
    for a, b in zip(bounds, bounds[1:]):
        piece = stream.feed("", whole.token_ids[a:b])
        raw += _emit(events, piece)
    raw += _emit(events, stream.finish())
    raw += events.finish(response_usage(1, 1, 0), whole.finish_reason != "length")
    items: list[dict] = []
    for event in raw:
        data = json.loads(event.split("data: ", 1)[1])
        kind = data["type"]
        assert type(OPENAI_EVENT.validate_python(data)).__name__.startswith("Response")  # the client's own event types
        if kind == "response.output_item.added":
            items.append(data["item"])
        elif kind in ("response.reasoning_text.delta", "response.output_text.delta"):
            item = items[data["output_index"]]
            if not item["content"]:
                item["content"].append({"text": ""})
            item["content"][data["content_index"]]["text"] += data["delta"]
        elif kind == "response.output_item.done":
            done = data["item"]
            if done["type"] != "function_call":  # the deltas add up to what the item says it holds
                assert "".join(p["text"] for p in items[data["output_index"]]["content"]) == "".join(p["text"] for p in done["content"])
            items[data["output_index"]] = done
    return items


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(CASES)), cuts=st.lists(st.integers(1, 40), max_size=6))
def test_known_replies_become_responses_items_whole_or_streamed(name: str, cuts: list[int]) -> None:
    _, content, reasoning, calls, _ = CASES[name]
    items = responses_whole(name)
    # The reasoning is an item of its own, first; then the text, then each call.
    assert [p["text"] for i in items if i["type"] == "reasoning" for p in i["content"]] == ([reasoning] if reasoning else [])
    assert [i["type"] for i in items][:1] == (["reasoning"] if reasoning else [items[0]["type"]])
    assert [(i["name"], json.loads(i["arguments"])) for i in items if i["type"] == "function_call"] == calls
    strip = lambda xs: [{k: v for k, v in x.items() if k not in ("id", "call_id")} for x in xs]  # noqa: E731
    assert strip(responses_streamed(name, cuts)) == strip(items)
    assert [OPENAI_ITEM.validate_python(i).type for i in items] == [i["type"] for i in items]


def test_a_model_without_harmony_keeps_the_text_format() -> None:
    plain = ReplyFormat(tiny_tokenizer())
    assert plain.name == "text" and FORMAT.name == "harmony"
    reply = plain.parse('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', [], TOOLS, "auto")
    assert reply.content is None and reply.reasoning is None and [c.name for c in reply.calls] == ["get_time"]
