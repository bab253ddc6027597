"""Incremental detokenization with stop strings: each new token's text, and the part of it that
is safe to send (a tail that could still grow into a stop string is held back).

One `TextState` per continuation; the engine feeds it tokens and takes `pending()` deltas, so no
consumer ever diffs whole texts or cuts stop strings itself. A harmony chat reply's stop strings
match its content alone (`ContentStops`, read by the engine and by the server's reply split alike).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixkv.prompts.harmony import Event, HarmonyReader, HarmonyTokens, Message

# Tokens past read_offset decoded again while they end mid-character (U+FFFD) or add no text
# (special tokens skipped). A character is at most 4 UTF-8 bytes, one token at least one, so a
# real character completes within 4 tokens; past 8 the bytes are invalid for good, and are
# emitted as U+FFFD so the window (and each token's decode) stays bounded: without the bound a
# model writing invalid bytes made every token decode the whole run again, O(n^2).
MAX_PENDING_TOKENS = 8


@dataclass(slots=True)
class TextState:
    """The decoded text of one continuation, and how much of it was handed out already."""

    stop: tuple[str, ...] = ()
    text: str = ""
    num_sent_chars: int = 0
    # Decode a window [prefix_offset, read_offset) of the tokens and the same window extended
    # by the new tokens: their difference is the new text (vLLM's incremental scheme).
    prefix_offset: int = 0
    read_offset: int = 0
    # A harmony chat reply's (SamplingParams.stop_in_content): while it reads as harmony its stop
    # strings match its content alone and this text is never cut.
    content: ContentStops | None = None
    stop_string: str | None = None  # the stop string that ended it
    _max_stop_chars: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._max_stop_chars = max((len(s) for s in self.stop), default=0)

    def append(self, tokenizer: Any, token_ids: list[int]) -> bool:
        """Decode the newest token of `token_ids` (all output tokens so far) into the text;
        True when a stop string completed (the text is then cut before it, or, for a harmony
        reply read by `content`, its content)."""
        if self.content is not None:
            self.content.feed(token_ids[-1:])
            self.stop_string = self.content.stop_string
        old_len = len(self.text)
        decoded = self._decode(tokenizer, token_ids)
        if self.content is not None and self.content.plain is False:
            return self.stop_string is not None
        return decoded and self._cut_at_stop(old_len)

    def add_text(self, text: str) -> bool:
        """Text appended as it is (decoded elsewhere); True when a stop string completed in it."""
        old_len = len(self.text)
        self.text += text
        return self._cut_at_stop(old_len)

    def _decode(self, tokenizer: Any, token_ids: list[int]) -> bool:
        """The newest token's text appended to the text; False while it ends mid-character."""
        before = tokenizer.decode(token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        after = tokenizer.decode(token_ids[self.prefix_offset :], skip_special_tokens=True)
        # A byte-level token may end mid-character, which decodes to U+FFFD until the next
        # token completes it: emit only complete characters, within MAX_PENDING_TOKENS.
        settled = len(token_ids) - self.read_offset >= MAX_PENDING_TOKENS
        if (len(after) <= len(before) or after.endswith("\ufffd")) and not settled:
            return False
        self.text += after[len(before) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return True

    def _cut_at_stop(self, old_len: int) -> bool:
        if not self.stop:
            return False
        # Only a match that ends in the new text is new: search from where such a match can start.
        start = max(0, old_len - self._max_stop_chars + 1)
        found = [(p, s) for s in self.stop if (p := self.text.find(s, start)) >= 0]
        if not found:
            return False
        at, self.stop_string = min(found, key=lambda f: f[0])
        self.text = self.text[:at]
        return True

    def pending(self, finished: bool) -> str:
        """The text not handed out yet that no later token can take back, marked as sent."""
        visible = len(self.text) if finished else len(self.text) - self._held_back()
        if visible <= self.num_sent_chars:
            return ""
        delta = self.text[self.num_sent_chars : visible]
        self.num_sent_chars = visible
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        return max((_suffix_prefix_overlap(self.text, s) for s in self.stop), default=0)


def _suffix_prefix_overlap(text: str, stop: str) -> int:
    """The longest k < len(stop) with text ending in stop[:k], in O(len(stop)): KMP's matcher
    for stop run over the text's last len(stop) - 1 characters; its final state is k."""
    if len(stop) < 2 or not text:
        return 0
    failure = [0] * len(stop)
    for i in range(1, len(stop)):
        k = failure[i - 1]
        while k and stop[i] != stop[k]:
            k = failure[k - 1]
        failure[i] = k + 1 if stop[i] == stop[k] else k
    k = 0
    for char in text[-(len(stop) - 1) :]:
        while k and char != stop[k]:
            k = failure[k - 1]
        if char == stop[k]:
            k += 1
    return k


class ContentStops(HarmonyReader):
    """A harmony reply's reader whose content is cut at the first stop string. The content is
    what a client is shown: the text of every content message (`final`, or `commentary` to no
    one) in order, as one stream, so a stop string may begin in one such message and end in a
    later one. It is matched as it is read and cut before the stop string, which ends the reply
    (`stop_string`); a tail that could still begin one is held until the content grows or the
    reply ends (past its message's close: the held text then comes with the next content
    message, or before a message to a recipient, which nothing spans). Headers, reasoning
    (`analysis`) and a message to a recipient (a call's JSON) never match: OpenAI's `stop` cuts
    "the returned text", and a reasoning model's reasoning is not that text (OpenAI's own
    reasoning models take no `stop`), so a stop string the model reasons about ends nothing.
    The engine reads each reply with stops through one of these to end it, the server's reply
    split through another to cut what it sends: the same ids give the same cut."""

    def __init__(self, tokenizer: Any, marks: HarmonyTokens, stop: tuple[str, ...]) -> None:
        super().__init__(tokenizer, marks)
        self._stop = stop
        self._content = TextState(stop)  # every content message's text so far, as one stream
        self._last_content: Message | None = None  # the message held text is sent under when it is sealed
        self.stop_string: str | None = None

    def feed(self, token_ids: list[int]) -> list[Event]:
        return self._cut(super().feed(token_ids), final=False)

    def finish(self) -> list[Event]:
        return self._cut(super().finish(), final=True)

    def _cut(self, events: list[Event], *, final: bool) -> list[Event]:
        if not self._stop:
            return events
        out: list[Event] = []
        for event in events:
            message, text, closed = event
            if message.recipient is not None or message.channel == "analysis":
                if message.recipient is not None:
                    self._seal(out)
                if self.stop_string is None or closed:
                    out.append(event)
                continue
            self._last_content = message
            if text and self.stop_string is None and self._content.add_text(text):
                self.stop_string = self._content.stop_string
            self._send(message, out, final and closed)
            if closed:
                out.append(event)
        if final:
            self._seal(out)
        return out

    def _seal(self, out: list[Event]) -> None:
        """Send the held tail and match afresh: a message to a recipient (a call, or the JSON a
        failed call leaves in the content) comes between, so nothing spans it."""
        if self._last_content is None:  # nothing read since the last seal: the state is fresh
            return
        self._send(self._last_content, out, True)
        self._content, self._last_content = TextState(self._stop), None

    def _send(self, message: Message, out: list[Event], finished: bool) -> None:
        sent = self._content.pending(finished or self.stop_string is not None)
        if sent:
            out.append(Event(message, sent, False))
