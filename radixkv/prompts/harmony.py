"""gpt-oss's chat format (harmony) at the token level: whether a tokenizer speaks it (its marker
tokens), the ids that end a reply, and `HarmonyReader`, a reply's ids read into messages.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
# What a harmony reply's first header begins with; a reply that begins otherwise (a guided JSON
# reply, which a grammar keeps off the markers) is plain text.
_OPENINGS = ("<|channel|>", "<|start|>", "<|constrain|>", "<|message|>", " to=", "to=")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)(?:\s+(?!to=)([^\s<]+))?")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CONSTRAIN = re.compile(r"<\|constrain\|>\s*([^\s<]+)")


@dataclass(frozen=True, slots=True)
class HarmonyTokens:
    """The ids of harmony's markers in one tokenizer."""

    start: int
    end: int
    message: int
    channel: int
    constrain: int
    return_: int
    call: int

    @property
    def stops(self) -> frozenset[int]:
        """The ids that end a reply: done (`<|return|>`) or a tool call (`<|call|>`)."""
        return frozenset((self.return_, self.call))


# Each tokenizer's answer, found once: rendering a chat asks for it three times a request, and
# finding it walks the tokenizer's added tokens. A loaded tokenizer's special tokens do not change.
_FOUND: weakref.WeakKeyDictionary[Any, HarmonyTokens | None] = weakref.WeakKeyDictionary()


def harmony_tokens(tokenizer: Any) -> HarmonyTokens | None:
    """The markers' ids where the tokenizer has every one as a single special token (gpt-oss's
    does); None otherwise. This decides a model's reply format, never the request."""
    try:
        if tokenizer in _FOUND:
            return _FOUND[tokenizer]
        found = _FOUND[tokenizer] = _find_markers(tokenizer)
    except TypeError:  # neither hashable nor weakly referable: looked up each time
        found = _find_markers(tokenizer)
    return found


def _find_markers(tokenizer: Any) -> HarmonyTokens | None:
    special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    special |= {t.content for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values() if getattr(t, "special", False)}
    if not all(m in special for m in MARKERS):
        return None
    ids = [tokenizer.convert_tokens_to_ids(m) for m in MARKERS]
    if any(not isinstance(i, int) or i < 0 for i in ids) or len(set(ids)) != len(ids):
        return None
    return HarmonyTokens(*ids)


@dataclass(slots=True)
class Message:
    """One message of a reply: its header's channel, recipient (`functions.get_weather`) and
    content type (`json`), its text so far, and how it ended: "end", "call", "return", or None
    while open (or cut off by the reply's end)."""

    channel: str | None
    recipient: str | None
    content_type: str | None
    text: str = ""
    ended: str | None = None


class Event(NamedTuple):
    """Text added to a message (`text`), or the message closed (`closed`, text "")."""

    message: Message
    text: str
    closed: bool


# A UTF-8 character spans at most 4 byte tokens: text still ending in U+FFFD past that is a
# real replacement character.
_MAX_HELD_TOKENS = 4


def split_reply(tokenizer: Any, marks: HarmonyTokens, token_ids: list[int], reader: HarmonyReader | None = None) -> tuple[str, str] | None:
    """A finished reply's (content, reasoning): `analysis` messages are reasoning, every other
    message's text is content (a message to a tool, its JSON included: a chat without tools has
    no calls to make); None where the reply is not harmony (plain text, or nothing read). Read
    by `reader` where given (one that cuts the content at a stop string), else a new one."""
    reader = reader if reader is not None else HarmonyReader(tokenizer, marks)
    events = reader.feed(token_ids) + reader.finish()
    if reader.plain or not reader.messages:
        return None
    content = "".join(e.text for e in events if e.message.channel != "analysis")
    return content, "".join(e.text for e in events if e.message.channel == "analysis")


class HarmonyReader:
    """Reads a reply's ids as they come into messages. A reply continues the prompt's
    `<|start|>assistant`: messages of a header (` to=recipient`, `<|channel|>name`, a content
    type), `<|message|>`, text, and `<|end|>` (another message follows), `<|call|>` (a tool
    call: the reply stops) or `<|return|>` (done). The markers are special tokens the
    detokenizer drops, so a reply is read from its ids, never from its text.

    Each message's text is decoded as it grows (a character split over tokens is held until whole). Linear in the reply: each token
    is decoded once with at most the few held before it; a header is decoded once, when closed.
    `plain` turns True where the reply does not open as harmony; the reader then reads nothing.
    `reasoning_tokens` counts the reply's tokens of `analysis` messages: header, text and the
    marker that ends each (OpenAI's usage.completion_tokens_details.reasoning_tokens)."""

    def __init__(self, tokenizer: Any, marks: HarmonyTokens) -> None:
        self._tokenizer, self._marks = tokenizer, marks
        self._header: list[int] | None = []  # the open header's ids; None inside a message's text
        self._held: list[int] = []  # text ids not yet decoded to whole characters
        self._message: Message | None = None
        self.plain: bool | None = None  # None until the first header shows what the reply is
        self.messages: list[Message] = []
        self.reasoning_tokens = 0
        self._header_tokens = 0  # the reply's tokens since the last message closed, markers included

    def feed(self, token_ids: list[int]) -> list[Event]:
        events: list[Event] = []
        for token in token_ids:
            if self.plain:
                break
            self._token(token, events)
        return events

    def finish(self) -> list[Event]:
        """The reply has ended: an open message's held text, and the message closed as it was
        (`ended` None: cut off)."""
        events: list[Event] = []
        if self._message is not None:
            self._flush(events, final=True)
            events.append(Event(self._message, "", True))
            self._message = None
        elif self.plain is None and self._header:
            self.plain = True  # a reply that never opened a message is plain text
        return events

    def _token(self, token: int, events: list[Event]) -> None:
        marks = self._marks
        if self._header is not None:
            self._header_tokens += 1
            if token == marks.message:
                self._open(events)
            elif token == marks.start:
                self._header = []  # a new header; the role that follows is read from its text
                self.plain = False if self.plain is None else self.plain
            elif token in (marks.end, marks.call, marks.return_):
                self._header = []  # a header without a message: nothing to keep
            else:
                self._header.append(token)
                if self.plain is None:
                    self._decide()
            return
        assert self._message is not None
        reasoning = self._message.channel == "analysis"
        if token in (marks.end, marks.call, marks.return_, marks.start):
            self._flush(events, final=True)
            self.reasoning_tokens += reasoning and token != marks.start
            self._header_tokens = int(token == marks.start)  # a start opens the next header
            self._message.ended = {marks.end: "end", marks.call: "call", marks.return_: "return"}.get(token)
            events.append(Event(self._message, "", True))
            self._message, self._header = None, []
            return
        self.reasoning_tokens += reasoning
        self._held.append(token)
        self._flush(events, final=False)

    def _decide(self) -> None:
        text = self._tokenizer.decode(self._header, skip_special_tokens=False)
        if any(text.startswith(o) for o in _OPENINGS):
            self.plain = False
        elif not any(o.startswith(text) for o in _OPENINGS):
            self.plain = True

    def _open(self, events: list[Event]) -> None:
        text = self._tokenizer.decode(self._header or [], skip_special_tokens=False)
        channel = _CHANNEL.search(text)
        recipient = _RECIPIENT.search(text)
        constrain = _CONSTRAIN.search(text)
        content_type = constrain.group(1) if constrain else (channel.group(2) if channel else None)
        self.plain = False
        self._message = Message(channel.group(1) if channel else None, recipient.group(1) if recipient else None, content_type)
        self.messages.append(self._message)
        if self._message.channel == "analysis":
            self.reasoning_tokens += self._header_tokens
        self._header_tokens = 0
        self._header = None

    def _flush(self, events: list[Event], *, final: bool) -> None:
        if not self._held:
            return
        text = self._tokenizer.decode(self._held, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final and len(self._held) < _MAX_HELD_TOKENS:
            return
        self._held = []
        assert self._message is not None
        self._message.text += text
        if text:
            events.append(Event(self._message, text, False))
