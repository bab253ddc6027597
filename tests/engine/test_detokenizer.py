"""The incremental detokenizer: what it hands out adds up to the final text, is never taken back
by a stop string, and holds back only a tail that could still become one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.engine.detokenizer import TextState, _suffix_prefix_overlap
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
