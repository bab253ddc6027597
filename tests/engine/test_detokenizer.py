"""The incremental detokenizer: what it hands out adds up to the final text, is never taken back
by a stop string, and holds back only a tail that could still become one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.engine.detokenizer import ContentStops, TextState, _suffix_prefix_overlap
from radixkv.prompts.harmony import harmony_tokens
from tests.helpers.harmony import harmony_tokenizer
from tests.helpers.tiny_models import tiny_tokenizer

TOKENIZER = tiny_tokenizer()
ALPHABET = "ab Sé€\n"  # multi-byte characters split across byte-level tokens


def feed(text: str, stop: tuple[str, ...]) -> tuple[TextState, list[str], bool]:
    state, sent, stopped = TextState(stop), [], False
    token_ids: list[int] = []
    for token in TOKENIZER(text, add_special_tokens=False).input_ids:
        token_ids.append(token)
        stopped = state.append(TOKENIZER, token_ids)
        sent.append(state.pending(finished=stopped))
        assert state.text.startswith("".join(sent))  # nothing handed out is ever cut
        if stopped:
            break
    sent.append(state.pending(finished=True))
    return state, sent, stopped


@settings(max_examples=150, deadline=None)
@given(text=st.text(ALPHABET, max_size=40), stop=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3))
def test_deltas_add_up_to_the_text_cut_at_the_first_stop(text, stop):
    state, sent, stopped = feed(text, tuple(stop))
    assert "".join(sent) == state.text
    # The reference: whole decodes after each token; the first in which a stop string appears
    # is cut at the earliest one (a stop completes with a token, as the engine sees it).
    token_ids = TOKENIZER(text, add_special_tokens=False).input_ids
    expected, expected_stop = TOKENIZER.decode(token_ids), False
    for k in range(1, len(token_ids) + 1):
        prefix = TOKENIZER.decode(token_ids[:k])
        cuts = [p for p in (prefix.find(s) for s in stop) if p >= 0]
        if cuts and not prefix.endswith("\ufffd"):
            expected, expected_stop = prefix[: min(cuts)], True
            break
    assert (state.text, stopped) == (expected, expected_stop)


@pytest.mark.parametrize(
    ("text", "stop", "held"),
    [("abc ST", "STOP", 2), ("abc STO", "STOP", 3), ("abc STx", "STOP", 0), ("aaa", "aab", 2), ("", "ab", 0), ("x", "x", 0)],
)
def test_held_back_tail(text, stop, held):
    assert _suffix_prefix_overlap(text, stop) == held


class CountingTokenizer:
    """The tiny tokenizer, counting the tokens it is asked to decode (the detokenizer's work)."""

    def __init__(self) -> None:
        self.num_decoded = 0

    def decode(self, token_ids, **kwargs):
        self.num_decoded += len(token_ids)
        return TOKENIZER.decode(token_ids, **kwargs)


def feed_ids(token_ids: list[int], tokenizer) -> str:
    state, sent, so_far = TextState(), [], []
    for token in token_ids:
        so_far.append(token)
        state.append(tokenizer, so_far)
        sent.append(state.pending(finished=False))
    sent.append(state.pending(finished=True))
    assert "".join(sent) == state.text
    return state.text


def test_a_run_of_invalid_bytes_is_decoded_in_linear_work():
    # A lone UTF-8 continuation byte never completes a character: before the bound, every
    # token decoded the whole run again (n^2 / 2 tokens, ~4.5 million here).
    continuation = TOKENIZER("é", add_special_tokens=False).input_ids[-1]
    tail = TOKENIZER("ok é€ done", add_special_tokens=False).input_ids
    token_ids = [continuation] * 3000 + tail
    counting = CountingTokenizer()
    text = feed_ids(token_ids, counting)
    assert text == TOKENIZER.decode(token_ids) and text.endswith("ok é€ done")
    assert counting.num_decoded <= 64 * len(token_ids)


def test_characters_split_across_tokens_still_wait_for_their_last_byte():
    token_ids = TOKENIZER("a€é€b" * 50, add_special_tokens=False).input_ids
    text = feed_ids(token_ids, TOKENIZER)
    assert text == TOKENIZER.decode(token_ids) and "\ufffd" not in text


# -- a harmony chat reply: its stop strings match its content alone -------------------------

HARMONY = harmony_tokenizer()
MARKS = harmony_tokens(HARMONY)
ANSWER = "The quick brown fox jumps over the lazy dog."
REPLY = (  # reasoning, a message to a tool written as content (no tools), then the final answer
    "<|channel|>analysis<|message|>The user wants the fox. Say jumps over, not final.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>" + ANSWER + "<|return|>"
)


def harmony_ids(text: str) -> list[int]:
    return HARMONY(text, add_special_tokens=False).input_ids


def read_cut(token_ids: list[int], stop: tuple[str, ...], cuts: list[int] = ()) -> tuple[ContentStops, list[tuple[str | None, str, bool]]]:
    """ContentStops over token_ids fed in pieces at cuts, stopping where it says (as the engine
    does); its events as (channel, text, closed)."""
    reader, events = ContentStops(HARMONY, MARKS, stop), []
    bounds = [0, *sorted({c for c in cuts if c <= len(token_ids)}), len(token_ids)]
    for a, b in zip(bounds, bounds[1:]):
        for token in token_ids[a:b]:
            events += reader.feed([token])
            if reader.stop_string is not None:
                break
        if reader.stop_string is not None:
            break
    events += reader.finish()
    return reader, [(e.message.channel, e.text, e.closed) for e in events]


def content(events: list[tuple[str | None, str, bool]]) -> str:
    return "".join(text for channel, text, _ in events if channel != "analysis")


@settings(max_examples=80, deadline=None)
@given(start=st.integers(0, len(ANSWER) - 1), length=st.integers(1, 8), cuts=st.lists(st.integers(0, 80), max_size=6))
def test_a_harmony_reply_is_cut_where_its_content_first_holds_a_stop_string(start: int, length: int, cuts: list[int]) -> None:
    """Any piece of the final answer as the stop string: the content is the answer cut before
    its first occurrence there, however the ids come, the reasoning whole; what was handed out
    is never taken back (a tail that could begin the stop waits)."""
    stop = ANSWER[start : start + length]
    reader, events = read_cut(harmony_ids(REPLY), (stop, "zzz"), cuts)
    assert reader.stop_string == stop
    assert content(events) == ANSWER[: ANSWER.index(stop)]
    assert "".join(t for c, t, _ in events if c == "analysis") == "The user wants the fox. Say jumps over, not final."


@settings(max_examples=80, deadline=None)
@given(split=st.integers(1, len(ANSWER) - 1), start=st.integers(0, len(ANSWER) - 1), length=st.integers(1, 8), cuts=st.lists(st.integers(0, 90), max_size=6))
def test_a_stop_string_may_span_two_content_messages(split: int, start: int, length: int, cuts: list[int]) -> None:
    """The answer written as a preamble (commentary to no one), reasoning, then the final
    message: a client is shown the two contents as one text, so any piece of it stops the
    reply, across the messages' seam too, and what was handed out is that text cut before it."""
    stop = ANSWER[start : start + length]
    text = (
        "<|channel|>commentary<|message|>" + ANSWER[:split] + "<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Go on.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>" + ANSWER[split:] + "<|return|>"
    )
    reader, events = read_cut(harmony_ids(text), (stop, "zzz"), cuts)
    assert reader.stop_string == stop
    assert content(events) == ANSWER[: ANSWER.index(stop)]


def test_a_tail_held_at_a_content_messages_close_comes_before_a_call() -> None:
    """A preamble ending in what could begin the stop string, then a call: the held tail is
    sent before the call's message (whose JSON a client may be shown as content when the call
    fails), and nothing spans the call."""
    text = (
        "<|channel|>commentary<|message|>Checking the wea<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    )
    reader, events = read_cut(harmony_ids(text), ("weather", "wea{"))
    assert reader.stop_string is None
    assert content(events) == 'Checking the wea{"city": "Paris"}'


@pytest.mark.parametrize("stop", ["final", "analysis", "assistant", "jumps over, not", "Paris"])
def test_headers_reasoning_and_calls_never_stop_a_harmony_reply(stop: str) -> None:
    """A stop string only in the headers, the reasoning or a call's JSON ends nothing: the whole
    reply is read, its content whole (OpenAI's stop cuts the returned text, not reasoning)."""
    call = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|end|>'
    text = REPLY.replace("<|start|>assistant<|channel|>final", call + "<|start|>assistant<|channel|>final")
    reader, events = read_cut(harmony_ids(text), (stop,))
    assert reader.stop_string is None
    assert content(events).endswith(ANSWER)


def test_the_engine_ends_a_harmony_chat_reply_at_its_contents_stop_string_alone() -> None:
    """TextState with ContentStops (SamplingParams.stop_in_content): ends on the token that
    completes the stop string in the content, never earlier (the same string in the reasoning),
    and never cuts its own text while the reply reads as harmony; a reply that does not read as
    harmony (a guide's JSON) is matched and cut as any text."""
    token_ids = harmony_ids(REPLY)
    state = TextState(("jumps",), content=ContentStops(HARMONY, MARKS, ("jumps",)))
    ended = next(k for k in range(1, len(token_ids) + 1) if state.append(HARMONY, token_ids[:k]))
    assert HARMONY.decode(token_ids[:ended], skip_special_tokens=False).endswith("fox jumps")
    assert state.stop_string == "jumps" and state.text.endswith("fox jumps")
    plain = TextState(("b",), content=ContentStops(HARMONY, MARKS, ("b",)))
    plain_ids = harmony_ids('{"a": "b"}')
    assert next(k for k in range(1, len(plain_ids) + 1) if plain.append(HARMONY, plain_ids[:k])) <= len(plain_ids)
    assert plain.text == '{"a": "' and plain.stop_string == "b"
