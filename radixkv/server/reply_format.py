"""How a reply splits into content, reasoning and tool calls, by the model's format: harmony's
channels read from the ids (gpt-oss), or the text with the fallback's calls (server/tools.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixkv.engine.detokenizer import ContentStops
from radixkv.prompts.harmony import Event, HarmonyTokens, harmony_tokens
from radixkv.prompts.tools import MALFORMED, Tool, ToolChoice, loads_json
from radixkv.server.tools import ToolCall, ToolCallStream, call_of, parse_reply

FUNCTIONS = "functions."


@dataclass(slots=True)
class Piece:
    """What a reply (or a delta of it) holds: text for the user, reasoning, finished calls."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, other: Piece) -> Piece:
        self.content += other.content
        self.reasoning += other.reasoning
        self.calls += other.calls
        return self


@dataclass(frozen=True, slots=True)
class Reply:
    """A finished reply: content None where it made calls and wrote nothing else."""

    content: str | None
    reasoning: str | None
    calls: list[ToolCall]
    reasoning_tokens: int = 0  # the reply's tokens of reasoning (harmony's analysis messages)


class ReplyFormat:
    """The served model's reply format, "harmony" or "text", chosen once per app from the
    tokenizer (radixkv/prompts/harmony.py decides); routes ask it for `parse` (a finished
    reply) or `stream` (deltas) and never look at the format. In harmony `analysis` is
    reasoning, `final` (and `commentary` to no one) is content, and a message to
    `functions.<name>` is a call of that tool when its JSON is an object; a message to another
    recipient, an unknown function or JSON that does not parse is content, as written. A
    request's stop strings (`stop`) cut a harmony reply's content where the engine's
    ContentStops ended it; a text reply comes cut by the engine already."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._marks = harmony_tokens(tokenizer)
        self.name = "text" if self._marks is None else "harmony"

    @property
    def harmony(self) -> HarmonyTokens | None:
        """Harmony's marker ids where the model speaks it (exact continuation reads them)."""
        return self._marks

    def stream(self, tools: list[Tool], choice: ToolChoice, stop: list[str] | None = None) -> ReplyStream:
        return ReplyStream(self._tokenizer, self._marks, tools, choice, tuple(stop or ()))

    def parse(self, text: str, token_ids: list[int], tools: list[Tool], choice: ToolChoice, stop: list[str] | None = None) -> Reply:
        """A finished reply: its engine text (stop strings cut) and its ids."""
        if self._marks is None:
            content, calls = parse_reply(text, tools, choice) if tools and choice != "none" else (text, [])
            return Reply(content, None, calls)
        stream = self.stream(tools, choice, stop)
        whole = stream.feed(text, token_ids).add(stream.finish())
        content = whole.content if whole.content or not whole.calls else None
        return Reply(content, whole.reasoning or None, whole.calls, stream.reasoning_tokens)


class ReplyStream:
    """A reply split as it streams; `feed` takes each delta's text and ids. Harmony's reasoning
    and content pass through as decoded (content cut at a stop string, and a tail that could begin
    one held back); a call is given whole when its message closes."""

    def __init__(self, tokenizer: Any, marks: Any, tools: list[Tool], choice: ToolChoice, stop: tuple[str, ...] = ()) -> None:
        self._text = ToolCallStream(tools, choice)
        self._reader = None if marks is None else ContentStops(tokenizer, marks, stop)
        self._names = {t.name for t in tools} if choice != "none" else set()
        self._undecided: list[str] = []  # engine text while the reader does not know the form
        self.num_calls = 0

    @property
    def reasoning_tokens(self) -> int:
        """The reply's tokens of reasoning so far (0 for a reply that is not harmony)."""
        return 0 if self._reader is None or self._reader.plain else self._reader.reasoning_tokens

    def feed(self, text: str, token_ids: list[int]) -> Piece:
        if self._reader is None or self._reader.plain:
            return self._plain(text)
        events = self._reader.feed(token_ids)
        if self._reader.plain is None:
            self._undecided.append(text)
            return Piece()
        if self._reader.plain:
            held, self._undecided = "".join(self._undecided), []
            return self._plain(held + text)
        self._undecided = []
        return self._pieces(events)

    def finish(self) -> Piece:
        if self._reader is not None and not self._reader.plain:
            piece = self._pieces(self._reader.finish())
            if not self._reader.plain:
                return piece
            text, self._undecided = "".join(self._undecided), []
            return self._plain(text).add(self._plain_finish())
        return self._plain_finish()

    def _plain(self, text: str) -> Piece:
        content, calls = self._text.feed(text)
        self.num_calls += len(calls)
        return Piece(content=content, calls=calls)

    def _plain_finish(self) -> Piece:
        content, calls = self._text.finish()
        self.num_calls += len(calls)
        return Piece(content=content, calls=calls)

    def _pieces(self, events: list[Event]) -> Piece:
        piece = Piece()
        for message, text, closed in events:
            if message.recipient is None:
                if message.channel == "analysis":
                    piece.reasoning += text
                else:
                    piece.content += text
            elif closed:
                call = self._call(message.recipient, message.text)
                if call is None:
                    piece.content += message.text
                else:
                    piece.calls.append(call)
                    self.num_calls += 1
        return piece

    def _call(self, recipient: str, body: str) -> ToolCall | None:
        name = recipient.removeprefix(FUNCTIONS) if recipient.startswith(FUNCTIONS) else None
        if name not in self._names:
            return None
        value = loads_json(body)
        return None if value is MALFORMED else call_of({"name": name, "arguments": value}, self._names)
