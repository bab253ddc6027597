"""A conversation rendered once: `EncodedConversation` holds the template's text, its token ids
and where each part (system, tools, message k, the generation prompt) starts, found by aligning
the messages' own text in that one rendering, for the cache report, breakpoints and the splice.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixkv.prompts.encode import render_chat, tokenize_rendered

# (add_generation_prompt, with_tools) -> the template's text of the same conversation.
Rerender = Callable[[bool, bool], str]


@dataclass(frozen=True, slots=True)
class TemplateInput:
    """A conversation as the chat template is given it, and how it maps back to the request.

    `origins[i]` lists the request messages that begin in template message i, each with the
    character of its content where it begins (a fallback prompt merges tool results into one
    turn); `tools_at` is (template message, character) where a tools section begins that runs
    to that content's end (the fallback prompt's), None where the template renders tools itself."""

    messages: list[dict[str, Any]]
    roles: list[str | None]  # each request message's role
    origins: list[list[tuple[int, int]]]
    tools: list[dict[str, Any]] | None = None
    tools_at: tuple[int, int] | None = None

    @classmethod
    def plain(cls, messages: Sequence[dict[str, Any]]) -> TemplateInput:
        """Messages the template takes as they are (no tools): one template message each."""
        listed = [dict(m) for m in messages]
        return cls(listed, [m.get("role") for m in listed], [[(i, 0)] for i in range(len(listed))])


@dataclass(frozen=True, slots=True)
class Part:
    """A part of a prompt: "system", "tools", "message" (with the request message's index) or
    "generation_prompt"; the message's role where it is one."""

    kind: str
    index: int | None = None
    role: str | None = None


@dataclass(slots=True)
class _Layout:
    """Where each part starts in the text, in characters; message_chars (and content_chars,
    where each request message's own text starts, None for one whose text is not printed as it
    is) are None where the messages could not be aligned (the caller then asks the template per
    prefix). The tools' span is found on first asking: it may cost a rendering without them."""

    generation_char: int
    message_chars: list[int] | None
    content_chars: list[int | None] | None
    content_ends: list[int] | None  # where each request message's part of its template message ends
    closing: str  # what the template prints after the last message ("" where not aligned)
    find_tools: Callable[[], tuple[int, int] | None]
    _tools_span: tuple[tuple[int, int] | None] | None = None

    @property
    def tools_span(self) -> tuple[int, int] | None:
        if self._tools_span is None:
            self._tools_span = (self.find_tools(),)
        return self._tools_span[0]


@dataclass(slots=True)
class EncodedConversation:
    """One rendering of a conversation: `text`, its tokens `plain_ids`, and `token_ids`, the
    prompt (the plain ids, or those with earlier replies spliced back: exact continuation).
    Where the parts lie is worked out on first asking, from this text alone plus at most one
    rendering without the generation prompt (and one without tools, for a template that prints
    tools itself): never once per message."""

    text: str
    plain_ids: list[int]
    token_ids: list[int]
    view: TemplateInput
    add_generation_prompt: bool
    rerender: Rerender
    _layout: _Layout | None = field(default=None, repr=False)
    _token_chars: list[int] | None = field(default=None, repr=False)

    @property
    def spliced(self) -> bool:
        return self.token_ids != self.plain_ids

    def layout(self) -> _Layout:
        if self._layout is None:
            self._layout = _align(self)
        return self._layout

    def char_of_token(self, tokenizer: Any, prompt: Sequence[int], token: int) -> int:
        """Where token `token` of `prompt` (these ids, plain or spliced) starts in the text."""
        if token >= len(prompt):
            return len(self.text)
        if list(prompt) == self.plain_ids:
            if self._offsets(tokenizer):
                return self._token_chars[token]  # type: ignore[index]
        return len(tokenizer.decode(list(prompt[:token])))

    def part_at_char(self, char: int, at_end: bool = False) -> Part | None:
        """The part character `char` lies in; None where the messages could not be aligned
        (only the generation prompt and tools are known then). `at_end`: past the prompt."""
        layout = self.layout()
        if char >= layout.generation_char and not at_end:
            return Part("generation_prompt")
        if layout.tools_span is not None and layout.tools_span[0] <= char < layout.tools_span[1]:
            return Part("tools")
        if layout.message_chars is None:
            return None
        k = max(0, bisect_right(layout.message_chars, char) - 1)
        return Part("message", k, self.view.roles[k])

    def message_start(self, tokenizer: Any, k: int) -> int | None:
        """Prompt tokens before message k's rendering (plain ids); None where not aligned."""
        chars = self.layout().message_chars
        if chars is None:
            return None
        return self.tokens_before_char(tokenizer, chars[k])

    def tokens_before_char(self, tokenizer: Any, char: int) -> int:
        """How many plain tokens start before character `char`."""
        if self._offsets(tokenizer):
            return bisect_right(self._token_chars, char - 1) if char > 0 else 0  # type: ignore[arg-type]
        return len(tokenize_rendered(tokenizer, self.text[:char])) if char > 0 else 0

    def cut_tokens(self, tokenizer: Any, k: int, content: str | None = None) -> int | None:
        """Prompt tokens (of `token_ids`) that the conversation up to request message k, rendered
        alone with it as the last turn, shares with the prompt: the whole message (`content`
        None), or only its text's first characters, `content`, which must stand at its start
        here. Read off this rendering (that prefix's text is this text up to there, then the
        closing of a last turn), tokenized from the message's start; no further than a spliced
        prompt agrees with the plain one. None where the layout cannot tell (the caller renders
        that prefix alone)."""
        layout = self.layout()
        if layout.message_chars is None or layout.content_chars is None or not 0 <= k < len(layout.message_chars):
            return None
        start = layout.content_chars[k]
        if content is None:
            end = layout.content_ends[k]  # type: ignore[index]
        elif start is not None and self.text.startswith(content, start):
            end = start + len(content)
        else:
            return None
        count = self._shared(tokenizer, self.text[:end] + layout.closing, layout.message_chars[k])
        return min(count, common_prefix(self.plain_ids, self.token_ids)) if self.spliced else count

    def _shared(self, tokenizer: Any, text: str, since: int) -> int:
        """How many plain ids `text` tokenizes to alike; it agrees with this text before
        character `since`, so where a plain token starts there only the rest is tokenized."""
        if self._offsets(tokenizer):
            back = bisect_left(self._token_chars, since)  # type: ignore[arg-type]
            if back < len(self.plain_ids) and self._token_chars[back] == since:  # type: ignore[index]
                ids = tokenize_rendered(tokenizer, text[since:])
                shared = common_prefix(ids, self.plain_ids[back : back + len(ids)])
                if shared or back == 0:  # else the tokenizer reads a piece apart otherwise: all of it
                    return back + shared
        return common_prefix(tokenize_rendered(tokenizer, text), self.plain_ids)

    def _offsets(self, tokenizer: Any) -> bool:
        """Each plain token's first character, found once; False where the tokenizer gives no
        offsets (a slow one)."""
        if self._token_chars is None:
            self._token_chars = _offsets(tokenizer, self.text, self.plain_ids)
        return bool(self._token_chars)


def encode_conversation(
    tokenizer: Any, view: TemplateInput, *, add_generation_prompt: bool = True, render: Rerender | None = None
) -> EncodedConversation:
    """Render `view` once (through `render` when given: the server's, with its tools) and
    tokenize it: the plain prompt, whose parts are found when first asked."""
    rerender = render or _plain_rerender(tokenizer, view)
    text = rerender(add_generation_prompt, True)
    ids = tokenize_rendered(tokenizer, text)
    return EncodedConversation(text, ids, ids, view, add_generation_prompt, rerender)


def _plain_rerender(tokenizer: Any, view: TemplateInput) -> Rerender:
    def render(generation: bool, with_tools: bool) -> str:
        return render_chat(tokenizer, view.messages, add_generation_prompt=generation, tools=view.tools if with_tools else None)

    return render


def _offsets(tokenizer: Any, text: str, ids: list[int]) -> list[int]:
    """Each token's first character, or [] where the tokenizer gives no offsets (a slow one)."""
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(encoded.input_ids) == ids:
            return [int(start) for start, _ in encoded["offset_mapping"]]
    except (NotImplementedError, KeyError, TypeError):
        pass
    return []


def _align(encoded: EncodedConversation) -> _Layout:
    """The parts' first characters. The generation prompt starts where the rendering without it
    stops agreeing with this one; each template message's content is found in order, followed by
    the closing the template prints after the last message (read off that same rendering), and a
    message starts after the closing of the one before: exactly where the template's rendering of
    the messages before it ends, for a template that renders each turn alike wherever it stands."""
    text, view = encoded.text, encoded.view
    bare = text if not encoded.add_generation_prompt else encoded.rerender(False, True)
    generation_char = common_prefix(bare, text) if encoded.add_generation_prompt else len(text)
    contents = [m.get("content") for m in view.messages]
    message_chars: list[int] | None = None
    content_chars: list[int | None] | None = None
    content_ends: list[int] | None = None
    closing = ""
    starts = _content_starts(text, bare, contents)
    if starts is not None:
        content_starts, closing = starts
        template_chars = [0] + [content_starts[i] + len(contents[i]) + len(closing) for i in range(len(contents) - 1)]  # type: ignore[arg-type]
        message_chars = [0] * len(view.roles)
        content_chars = [None] * len(view.roles)
        content_ends = [0] * len(view.roles)
        for i, origins in enumerate(view.origins):
            if not origins:
                continue  # the fallback's own tools section
            ends = [offset for _, offset in origins[1:]] + [len(contents[i])]  # type: ignore[arg-type]
            for (k, offset), end in zip(origins, ends, strict=True):
                message_chars[k] = template_chars[i] if offset == 0 else content_starts[i] + offset
                content_chars[k] = content_starts[i] if offset == 0 else None  # a merged tool result is quoted
                content_ends[k] = content_starts[i] + end
        message_chars[0] = 0  # whatever the template prints before the first message is its part

    def find_tools() -> tuple[int, int] | None:
        if view.tools_at is not None and starts is not None:
            i, offset = view.tools_at
            return (starts[0][i] + offset, starts[0][i] + len(contents[i]))  # type: ignore[arg-type]
        if not view.tools:
            return None
        without = encoded.rerender(encoded.add_generation_prompt, False)
        start = common_prefix(without, text)
        return (start, len(text) - _common_suffix(without, text, start))

    return _Layout(generation_char, message_chars, content_chars, content_ends, closing, find_tools)


def _content_starts(text: str, bare: str, contents: list[Any]) -> tuple[list[int], str] | None:
    """Where each content starts in `text`, and the closing printed after a message; None when
    a content is empty or not text, the closing is empty, or one is not found in order."""
    if not contents or not all(isinstance(c, str) and c for c in contents):
        return None
    last = bare.rfind(contents[-1])
    closing = bare[last + len(contents[-1]) :] if last >= 0 else ""
    if not closing:
        return None
    starts, cursor = [], 0
    for content in contents:
        at = text.find(content + closing, cursor)
        if at < 0:
            return None
        starts.append(at)
        cursor = at + len(content)
    return starts, closing


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items (characters, token ids) two sequences share; pure."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # the longest equal prefix, by halving (string compares run in C)
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def _common_suffix(a: str, b: str, floor: int) -> int:
    """The longest common suffix, leaving at least `floor` characters of each before it."""
    n = min(len(a), len(b)) - floor
    low, high = 0, max(0, n)
    while low < high:
        mid = (low + high + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            low = mid
        else:
            high = mid - 1
    return low
