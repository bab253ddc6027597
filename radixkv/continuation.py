"""Exact continuation: a conversation's prompt ids built from an earlier turn's reply ids as
they were generated (a reply's text may re-tokenize differently), with the template's own text
around them. Owns the checks that make a splice safe; knows nothing of owners or stores.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from radixkv.errors import InvalidRequest
from radixkv.prompts import tokenize_rendered

Message = Mapping[str, Any]
Render = Callable[[list[dict[str, Any]]], str]  # messages -> the chat template's text

# Private-use characters around a counter: no template treats them, no reply holds them.
_MARKER = "\ue000radixkv-reply-{}\ue001"


def decode_exact(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """Token ids as text with nothing skipped or cleaned, for comparing against message text."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def reply_ids(tokenizer: Any, text: str, token_ids: Sequence[int]) -> list[int] | None:
    """The generated ids that decode to exactly `text` (the reply as a client sees it): all of
    them, or all but an end token the text leaves out; None when neither does (a stop string
    cut the text, or the text was parsed into tool calls)."""
    if not text:
        return None
    for end in (len(token_ids), len(token_ids) - 1):
        if end > 0 and decode_exact(tokenizer, token_ids[:end]) == text:
            return list(token_ids[:end])
    return None


def splice_replies(
    tokenizer: Any, render: Render, messages: Sequence[Message], lookup: Callable[[str], list[int] | None]
) -> list[int] | None:
    """Prompt ids of `messages` with each assistant reply that `lookup` knows (text -> ids that
    decode to it) put back as its generated ids, and every other character tokenized as the
    template renders it; None when no reply can be put back safely. A reply goes back only where
    the template prints it verbatim and the text around it does not depend on it (a template
    that drops earlier reasoning fails that), and the whole result must decode to what the
    plain prompt decodes to."""
    found = {
        i: ids
        for i, m in enumerate(messages)
        if m.get("role") == "assistant" and not m.get("tool_calls") and isinstance(m.get("content"), str)
        and m["content"] and (ids := lookup(m["content"])) is not None
    }  # fmt: skip
    if not found:
        return None
    plain = render(list(messages))
    spliced = _splice(tokenizer, render, messages, plain, found)
    if spliced is None and len(found) > 1:
        # Some replies are rewritten (an earlier turn's reasoning dropped): keep the others.
        kept = {i: ids for i, ids in found.items() if _splice(tokenizer, render, messages, plain, {i: ids}) is not None}
        spliced = _splice(tokenizer, render, messages, plain, kept) if kept else None
    if spliced is None:
        return None
    if decode_exact(tokenizer, spliced) != decode_exact(tokenizer, tokenize_rendered(tokenizer, plain)):
        return None
    return spliced


def _splice(tokenizer: Any, render: Render, messages: Sequence[Message], plain: str, replies: dict[int, list[int]]) -> list[int] | None:
    markers = {i: _MARKER.format(i) for i in replies}
    marked = _render_or_none(render, [{**m, "content": markers[i]} if i in markers else dict(m) for i, m in enumerate(messages)])
    if marked is None:
        return None
    if any(marked.count(marker) != 1 for marker in markers.values()):
        return None
    restored = marked
    for i, marker in markers.items():
        restored = restored.replace(marker, messages[i]["content"])
    if restored != plain:
        return None
    out: list[int] = []
    rest = marked
    for i in sorted(markers, key=lambda k: marked.index(markers[k])):
        before, rest = rest.split(markers[i], 1)
        out += _tokens(tokenizer, before) + replies[i]
    return out + _tokens(tokenizer, rest)


def continue_after(
    tokenizer: Any, render: Render, messages: Sequence[Message], reply_index: int, prefix_ids: Sequence[int], num_reply_tokens: int
) -> list[int] | None:
    """Prompt ids for `messages` continuing from `prefix_ids`: the ids of the conversation up to
    and including the reply `messages[reply_index]` as generated (its prompt, then its reply's
    last `num_reply_tokens` ids), then the template's text after that reply (the turn's closing,
    the new messages, the generation prompt), tokenized. The earlier turns are never
    re-rendered, so a template that rewrites them (drops reasoning) still continues exactly.
    None when the reply is not plain text that those ids decode to, or the template's text
    after it cannot be told apart from the reply itself."""
    marker = _MARKER.format("end")
    if not 0 <= reply_index < len(messages) or not 0 < num_reply_tokens <= len(prefix_ids):
        return None
    reply = messages[reply_index]
    content = reply.get("content")
    if reply.get("role") != "assistant" or reply.get("tool_calls") or not isinstance(content, str):
        return None
    if decode_exact(tokenizer, prefix_ids[len(prefix_ids) - num_reply_tokens :]) != content:
        return None
    marked = _render_or_none(render, [{**m, "content": content + marker} if i == reply_index else dict(m) for i, m in enumerate(messages)])
    if marked is None or marked.count(marker) != 1 or marked.replace(marker, "") != render(list(messages)):
        return None
    return list(prefix_ids) + _tokens(tokenizer, marked.split(marker, 1)[1])


def _render_or_none(render: Render, messages: list[dict[str, Any]]) -> str | None:
    """A rendering with a marker in a reply; None if the template refuses it (it took the real
    reply, which the caller renders too, so the plain path reports any real refusal)."""
    try:
        return render(messages)
    except InvalidRequest:
        return None


def _tokens(tokenizer: Any, text: str) -> list[int]:
    return tokenize_rendered(tokenizer, text) if text else []
