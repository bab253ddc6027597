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
