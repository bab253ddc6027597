"""Exact continuation: a conversation's prompt ids built from an earlier turn's reply ids as
they were generated (a reply's text may re-tokenize differently), with the template's own text
around them. Owns the checks that make a splice safe; knows nothing of owners or stores.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from radixkv.errors import InvalidRequest
from radixkv.prompts.encode import tokenize_rendered
from radixkv.prompts.harmony import HarmonyReader, HarmonyTokens

Message = Mapping[str, Any]
Render = Callable[[list[dict[str, Any]]], str]  # messages -> the chat template's text

# Replies spliced into one prompt when the caller names no cap (the server's is ServerLimits').
DEFAULT_MAX_SPLICED_REPLIES = 64
# A marker stands in for a reply in one rendering. The nonce is per process and never leaves
# it, so no message a client writes can hold a marker: a forged one can neither break a splice
# (a marker seen twice) nor place ids where the client chose.
_NONCE = secrets.token_hex(16)
_MARKER_RE = re.compile(f"\ue000radixkv-{_NONCE}-(\\d+)\ue001")


def _marker(tag: object) -> str:
    return f"\ue000radixkv-{_NONCE}-{tag}\ue001"


@dataclass(frozen=True, slots=True)
class Rendered:
    """A conversation's plain prompt: the template's text and its token ids."""

    text: str
    token_ids: list[int]


def render_plain(tokenizer: Any, render: Render, messages: Sequence[Message]) -> Rendered:
    text = render(list(messages))
    return Rendered(text, tokenize_rendered(tokenizer, text))


def decode_exact(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """Token ids as text with nothing skipped or cleaned, for comparing against message text."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def decodes_to(tokenizer: Any, token_ids: Sequence[int], text: str) -> bool:
    """Whether `token_ids` are exactly `text`'s bytes. Decoding replaces bytes that are not
    UTF-8 with U+FFFD, so a text holding one cannot vouch for the bytes behind it: refused."""
    return "\ufffd" not in text and decode_exact(tokenizer, token_ids) == text


def reply_ids(tokenizer: Any, text: str, token_ids: Sequence[int]) -> list[int] | None:
    """The generated ids that decode to exactly `text` (the reply as a client sees it): all of
    them, or all but an end token the text leaves out; None when neither does (a stop string
    cut the text, the text was parsed into tool calls, or it holds U+FFFD: decodes_to)."""
    if not text:
        return None
    for end in (len(token_ids), len(token_ids) - 1):
        if end > 0 and decodes_to(tokenizer, token_ids[:end], text):
            return list(token_ids[:end])
    return None


def splice_replies(
    tokenizer: Any,
    render: Render,
    messages: Sequence[Message],
    lookup: Callable[[str], list[int] | None],
    *,
    plain: Rendered | None = None,
    max_replies: int = DEFAULT_MAX_SPLICED_REPLIES,
) -> list[int] | None:
    """Prompt ids of `messages` with the first `max_replies` assistant replies that `lookup`
    knows (text -> ids that decode to it) put back as their generated ids, and every other
    character tokenized as the template renders it; None when no reply can be put back safely.
    A reply goes back only where the template prints it verbatim, with the same text around it
    as around a marker in its place (a template that drops an earlier turn's reasoning keeps the
    other replies), and the whole result must decode to what the plain prompt decodes to.
    Renders twice at most (the plain prompt, unless given, and once with markers), however many
    replies there are, so a long conversation costs linear time."""
    found = _known_replies(messages, lookup, max_replies)
    if not found:
        return None
    plain = plain or render_plain(tokenizer, render, messages)
    spliced = _splice(tokenizer, render, messages, plain.text, found)
    if spliced is None or decode_exact(tokenizer, spliced) != decode_exact(tokenizer, plain.token_ids):
        return None
    return spliced


def _known_replies(messages: Sequence[Message], lookup: Callable[[str], list[int] | None], max_replies: int) -> dict[int, list[int]]:
    """Message index -> generated ids of the first `max_replies` plain-text assistant replies
    `lookup` knows. The earliest: each turn then splices the same ones as the turn before, so
    what that turn computed stays the prefix."""
    found: dict[int, list[int]] = {}
    for i, m in enumerate(messages):
        if len(found) >= max_replies:
            break
        content = m.get("content")
        if m.get("role") == "assistant" and not m.get("tool_calls") and isinstance(content, str) and content:
            if (ids := lookup(content)) is not None:
                found[i] = ids
    return found


def _splice(tokenizer: Any, render: Render, messages: Sequence[Message], plain: str, found: dict[int, list[int]]) -> list[int] | None:
    """`plain` tokenized, with each reply in `found` that the template printed verbatim as its
    ids; None when none was, or the text around the markers is not the plain rendering's (the
    template changed it for a reply's text)."""
    marked = _render_or_none(render, [{**m, "content": _marker(i)} if i in found else dict(m) for i, m in enumerate(messages)])
    pieces = None if marked is None else _pieces(marked, found)
    if pieces is None or not plain.startswith(pieces[0]):
        return None
    out: list[int] = []
    start = 0  # plain text not yet tokenized starts here
    pos = len(pieces[0])  # where the next reply is in plain
    for n, (i, after) in enumerate(pieces[1]):
        last = n == len(pieces[1]) - 1
        content = messages[i]["content"]
        if _fits(plain, pos, content + after, last):
            out += _tokens(tokenizer, plain[start:pos]) + found[i]
            start = pos + len(content)
            pos = start + len(after)
        elif (at := _find(plain, pos, after, last)) is not None:
            pos = at + len(after)  # the template rewrote this reply: its text stays plain
        else:
            return None
    if start == 0 or pos != len(plain):
        return None
    return out + _tokens(tokenizer, plain[start:])


def _pieces(marked: str, indices: Mapping[int, object]) -> tuple[str, list[tuple[int, str]]] | None:
    """The marked rendering cut at its markers, in one pass: the text before the first, then
    each marker's message index with the text after it up to the next marker; None unless
    every marker shows exactly once."""
    cuts = list(_MARKER_RE.finditer(marked))
    order = [int(cut.group(1)) for cut in cuts]
    if len(order) != len(indices) or set(order) != set(indices):
        return None
    ends = [cut.start() for cut in cuts[1:]] + [len(marked)]
    return marked[: cuts[0].start()], [(i, marked[cut.end() : end]) for i, cut, end in zip(order, cuts, ends)]


def _fits(plain: str, pos: int, text: str, last: bool) -> bool:
    # The last reply's text runs to the prompt's end; any other's up to the next reply.
    return plain.startswith(text, pos) and (not last or pos + len(text) == len(plain))


def _find(plain: str, pos: int, after: str, last: bool) -> int | None:
    """Where the text after a rewritten reply starts in `plain`, at or past `pos`."""
    at = len(plain) - len(after) if last else plain.find(after, pos)
    return at if at >= pos and plain.startswith(after, at) else None


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
    marker = _marker("end")
    if not 0 <= reply_index < len(messages) or not 0 < num_reply_tokens <= len(prefix_ids):
        return None
    reply = messages[reply_index]
    content = reply.get("content")
    if reply.get("role") != "assistant" or reply.get("tool_calls") or not isinstance(content, str):
        return None
    if not decodes_to(tokenizer, prefix_ids[len(prefix_ids) - num_reply_tokens :], content):
        return None
    marked = _render_or_none(render, [{**m, "content": content + marker} if i == reply_index else dict(m) for i, m in enumerate(messages)])
    if marked is None or marked.count(marker) != 1 or marked.replace(marker, "") != render(list(messages)):
        return None
    return list(prefix_ids) + _tokens(tokenizer, marked.split(marker, 1)[1])


def continue_after_harmony(
    tokenizer: Any,
    render: Render,
    render_through: Render,
    messages: Sequence[Message],
    reply_index: int,
    prefix_ids: Sequence[int],
    num_reply_tokens: int,
    marks: HarmonyTokens,
) -> list[int] | None:
    """continue_after for a harmony reply (gpt-oss): its ids as generated, its reasoning and
    markers included, then the template's text after it. The reply ends as the template ends
    it: a call's `<|call|>` stays, a final answer's `<|return|>` becomes `<|end|>` (harmony's
    rule for a conversation that goes on). `render_through` renders a conversation without
    the generation prompt; the template's text after the reply is what the whole rendering
    adds to the rendering through the reply. None where the stored reply is not the one in
    `messages` (its last message's text, or the function it calls, differs) or the text after
    it cannot be told apart."""
    if not 0 <= reply_index < len(messages) or not 0 < num_reply_tokens <= len(prefix_ids):
        return None
    reply, reply_ids_ = messages[reply_index], list(prefix_ids[len(prefix_ids) - num_reply_tokens :])
    reader = HarmonyReader(tokenizer, marks)
    reader.feed(reply_ids_)
    last = reader.messages[-1] if reader.messages and not reader.plain else None
    calls = reply.get("tool_calls") or []
    if reply.get("role") != "assistant" or last is None or reply_ids_[-1] not in marks.stops:
        return None
    if calls:
        name = calls[-1].get("function", {}).get("name") if isinstance(calls[-1], Mapping) else None
        if last.ended != "call" or last.recipient != f"functions.{name}":
            return None
        ending, ids = "<|call|>", list(prefix_ids)
    else:
        if last.ended != "return" or last.text != reply.get("content"):
            return None
        ending, ids = "<|end|>", [*prefix_ids[:-1], marks.end]
    through = _render_or_none(render_through, list(messages[: reply_index + 1]))
    whole = _render_or_none(render, list(messages))
    if through is None or whole is None:
        return None
    for closing in ("<|return|>", "<|call|>"):  # the template closes a last reply as training does
        if through.endswith(closing):
            through = through[: -len(closing)] + ending
    if not through.endswith(ending) or not whole.startswith(through):
        return None
    return ids + _tokens(tokenizer, whole[len(through) :])


def _render_or_none(render: Render, messages: list[dict[str, Any]]) -> str | None:
    """A rendering with a marker in a reply; None if the template refuses it (it took the real
    reply, which the caller renders too, so the plain path reports any real refusal)."""
    try:
        return render(messages)
    except InvalidRequest:
        return None


def _tokens(tokenizer: Any, text: str) -> list[int]:
    return tokenize_rendered(tokenizer, text) if text else []
