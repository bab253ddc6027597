"""Exact continuation in process: an `LLM` remembers the replies it generated and puts them back
as their generated ids, so `LLM.chat` and the SDK's in-process `Conversation` hit the previous
turn in full, as a chat over HTTP does. The reply is made by hand from ids its text does not
re-tokenize to (found by searching the tokenizer), so no case depends on what the model samples."""

from __future__ import annotations

from typing import Any

import pytest

from radixkv.engine.request_output import CompletionOutput, RequestOutput

from radixkv.engine.sampling_params import SamplingParams
from radixkv.prompts import Prompt
from radixkv.prompts.continuation import decode_exact, reply_ids
from radixkv.sdk import Conversation
from tests.helpers.sdk import PAGE_SIZE, WORDS, make_sdk_llm

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)
FIRST = [
    {"role": "system", "content": "You are a helpful assistant (exact continuation in process)."},
    {"role": "user", "content": "Say something about caches."},
]


def retokenizing_reply(tokenizer: Any, min_tokens: int = 3 * PAGE_SIZE) -> tuple[str, list[int]]:
    """A reply text and ids that decode to it but are not what it re-tokenizes to, diverging
    early: each character on its own, for the first text the tokenizer merges."""
    for n in range(1, len(WORDS)):
        text = " ".join(WORDS[:n] * 3)
        ids = [i for ch in text for i in tokenizer(ch, add_special_tokens=False).input_ids]
        plain = tokenizer(text, add_special_tokens=False).input_ids
        if decode_exact(tokenizer, ids) == text and len(ids) >= min_tokens and ids[:PAGE_SIZE] != plain[:PAGE_SIZE]:
            return text, ids
    pytest.skip("this tokenizer merges no characters")


def as_if_generated(llm: Any, reply: str, ids: list[int]) -> int:
    """The first turn as if the model had sampled `ids`: its prompt and reply computed into the
    cache, and the reply handed to the LLM as one it generated. Returns their length."""
    prompt = llm.encode_chat(FIRST)
    llm.generate(Prompt(token_ids=prompt + ids), ONE_TOKEN)
    output = CompletionOutput(index=0, text=reply, token_ids=ids, finish_reason="stop")
    llm.remember(RequestOutput("r", prompt, [output], num_prompt_tokens=len(prompt), num_cached_tokens=0, time_to_first_token_s=None, total_time_s=None))
    return len(prompt) + len(ids)


def next_turn_cached(llm: Any, door: str, reply: str) -> int:
    messages = [*FIRST, {"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    if door == "chat":
        return llm.chat(messages, ONE_TOKEN)[0].num_cached_tokens
    return Conversation(llm, messages=messages).generate(ONE_TOKEN).num_cached_tokens


@pytest.mark.parametrize("door", ["chat", "sdk"])
def test_the_next_turn_hits_a_reply_that_re_tokenizes_otherwise(tiny_llama, door):
    cached = {}
    for exact in (True, False):
        llm = make_sdk_llm(tiny_llama, exact_continuation=exact)
        reply, ids = retokenizing_reply(llm.tokenizer)
        computed = as_if_generated(llm, reply, ids)
        cached[exact] = next_turn_cached(llm, door, reply)
    assert cached[True] >= computed // PAGE_SIZE * PAGE_SIZE  # the whole first turn, as generated
    assert cached[False] < computed // PAGE_SIZE * PAGE_SIZE - PAGE_SIZE  # re-rendered from text: a miss at the reply


def test_replies_the_llm_generates_are_remembered_for_chats_only(tiny_llama):
    llm = make_sdk_llm(tiny_llama)
    llm.generate("Plain text, not a chat.", SamplingParams(max_tokens=4, temperature=0.0))
    assert llm.replies.held_by(None) == (0, 0)
    [out] = llm.chat(FIRST, SamplingParams(max_tokens=4, temperature=0.0))
    keepable = reply_ids(llm.tokenizer, out.outputs[0].text, out.outputs[0].token_ids) is not None  # no U+FFFD
    assert llm.replies.held_by(None)[0] == int(keepable)
    assert make_sdk_llm(tiny_llama, exact_continuation=False).replies is None
