"""Incremental detokenization with stop strings: each new token's text, and the part of it that
is safe to send (a tail that could still grow into a stop string is held back).

One `TextState` per continuation; the engine feeds it tokens and takes `pending()` deltas, so no
consumer ever diffs whole texts or cuts stop strings itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    _max_stop_chars: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._max_stop_chars = max((len(s) for s in self.stop), default=0)

    def append(self, tokenizer: Any, token_ids: list[int]) -> bool:
        """Decode the newest token of `token_ids` (all output tokens so far) into the text;
        True when a stop string completed (the text is then cut before it)."""
        before = tokenizer.decode(token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        after = tokenizer.decode(token_ids[self.prefix_offset :], skip_special_tokens=True)
        # A byte-level token may end mid-character, which decodes to U+FFFD until the next
        # token completes it: emit only complete characters, within MAX_PENDING_TOKENS.
        settled = len(token_ids) - self.read_offset >= MAX_PENDING_TOKENS
        if (len(after) <= len(before) or after.endswith("\ufffd")) and not settled:
            return False
        old_len = len(self.text)
        self.text += after[len(before) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return self._cut_at_stop(old_len)

    def _cut_at_stop(self, old_len: int) -> bool:
        if not self.stop:
            return False
        # Only a match that ends in the new text is new: search from where such a match can start.
        start = max(0, old_len - self._max_stop_chars + 1)
        found = [p for p in (self.text.find(s, start) for s in self.stop) if p >= 0]
        if not found:
            return False
        self.text = self.text[: min(found)]
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
