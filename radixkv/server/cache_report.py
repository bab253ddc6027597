"""Cache reports on the wire: whether a request asked for one (`cache_report: true` or the
header X-Radixkv-Cache-Report: 1), which part of its prompt the engine's first uncached token
falls in (system, tools, message k, the generation prompt; a completion's prompt), and the
report's JSON shape, the same for every API family.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixkv.engine.cache_report import CacheReport
from radixkv.engine.request import RequestOutput
from radixkv.errors import InvalidRequest
from radixkv.server.errors import APIError
from radixkv.server.tool_prompts import render_conversation
from radixkv.server.tools import Tool, ToolChoice

if TYPE_CHECKING:
    from radixkv.server.state import AppState

REPORT_HEADER = "x-radixkv-cache-report"
_TRUE = ("1", "true", "yes", "on")


def wanted(flag: bool, headers: Mapping[str, str]) -> bool:
    """Whether a request asked for its cache report, in its body or by header."""
    return flag or headers.get(REPORT_HEADER, "").strip().lower() in _TRUE


@dataclass(frozen=True, slots=True)
class PromptPart:
    """Where in a prompt a token lies: "system", "tools", "message[k]" (k indexes the
    conversation as chat messages), "generation_prompt" or "prompt" (a completion's); the
    message's role where it is one."""

    part: str
    role: str | None = None


@dataclass(frozen=True, slots=True)
class ChatSource:
    """A chat prompt as the encoder rendered it (server/tool_prompts.render_conversation), so parts are
    found in the very text its token ids came from."""

    messages: list[dict[str, Any]]
    tools: list[Tool]
    tool_choice: ToolChoice
    message_offset: int = 0  # subtracted from an index: a family's own system field is no message of its own


def locate(tokenizer: Any, source: ChatSource | None, prompt: Sequence[int], token: int) -> PromptPart:
    """The part of `prompt` that token index `token` lies in. A chat prompt is rendered again:
    whole, without its generation prompt, without its tools, and its message prefixes by
    binary search (a message starts where the rendering of the messages before it stops
    agreeing with the whole), so O(log messages) renderings of the request's own text."""
    if source is None:
        return PromptPart("prompt")
    full = _render(tokenizer, source, source.messages, generation=True)
    char = _char_of_token(tokenizer, full, prompt, token)
    if char >= _common_prefix(_render(tokenizer, source, source.messages, generation=False), full) and token < len(prompt):
        return PromptPart("generation_prompt")
    if source.tools:
        bare = ChatSource(source.messages, [], "none")
        without = _render(tokenizer, bare, source.messages, generation=True)
        start = _common_prefix(without, full)
        end = len(full) - _common_suffix(without, full, start)
        if start <= char < end:
            return PromptPart("tools")
    k = _message_at(tokenizer, source, full, char)
    role = source.messages[k].get("role")
    if role in ("system", "developer"):
        return PromptPart("system", role)
    return PromptPart(f"message[{k - source.message_offset}]", role)


def wire(report: CacheReport, part: PromptPart | None) -> dict[str, Any]:
    """The report's JSON: the same keys in every family."""
    return {
        "reason": report.reason,
        "prompt_tokens": report.num_prompt_tokens,
        "cached_tokens": {"ram": report.num_ram_tokens, "disk": report.num_disk_tokens},
        "first_uncached_token": report.first_uncached_token,
        "part": part.part if part is not None else None,
        "role": part.role if part is not None else None,
    }


class CacheReporter:
    """One request's reports (one per prompt), if it asked: made from its final outputs, the
    parts located off the event loop in the key's parse slots (charged to the key like its
    parsing). A key at its parse limit gets its report without the part."""

    def __init__(
        self, server: AppState, key: bytes | None, asked: bool, prompts: list[list[int]], source: ChatSource | None = None
    ) -> None:
        self.server, self.key, self.asked, self.prompts, self.source = server, key, asked, prompts, source

    async def reports(self, finals: Sequence[RequestOutput]) -> list[dict[str, Any] | None] | None:
        """The wire reports of `finals` (in prompt order; None for one the engine never admitted),
        or None when none was asked for."""
        if not self.asked or not finals:
            return None
        tokenizer = self.server.engine.tokenizer
        made = [f.cache_report for f in finals]

        def parts() -> list[PromptPart | None]:
            return [
                locate(tokenizer, self.source, prompt, report.first_uncached_token) if report is not None else None
                for prompt, report in zip(self.prompts, made)
            ]

        try:
            found = await self.server.parse_slots.run(self.key, parts)
        except (APIError, InvalidRequest):
            found = [None] * len(made)
        return [wire(report, part) if report is not None else None for report, part in zip(made, found)]

    async def for_prompts(self, finals: Sequence[RequestOutput]) -> dict[str, Any] | list[dict[str, Any] | None] | None:
        """A completion's: the report of its prompt, or a list in prompt order for a batch."""
        reports = await self.reports(finals)
        if reports is None or len(self.prompts) > 1:
            return reports
        return reports[0]

    async def one(self, finals: Sequence[RequestOutput]) -> dict[str, Any] | None:
        """The report of a single-prompt request (chat, Responses, Messages)."""
        reports = await self.reports(finals)
        return reports[0] if reports else None


# -- rendering -----------------------------------------------------------------------------------


def _render(tokenizer: Any, source: ChatSource, messages: list[dict[str, Any]], *, generation: bool) -> str:
    return render_conversation(tokenizer, messages, source.tools, add_generation_prompt=generation)


def _char_of_token(tokenizer: Any, text: str, prompt: Sequence[int], token: int) -> int:
    """Where token `token` of `prompt` (the tokens of `text`) starts in `text`."""
    if token >= len(prompt):
        return len(text)
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(encoded.input_ids) == list(prompt):
            return int(encoded["offset_mapping"][token][0])
    except (NotImplementedError, KeyError, TypeError):
        pass  # a slow tokenizer has no offsets: decode the tokens before it instead
    return len(tokenizer.decode(list(prompt[:token])))


def _message_at(tokenizer: Any, source: ChatSource, full: str, char: int) -> int:
    """The last message whose rendering starts at or before `char`."""
    low, high = 0, len(source.messages) - 1
    while low < high:
        mid = (low + high + 1) // 2
        try:
            start = _common_prefix(_render(tokenizer, source, source.messages[:mid], generation=False), full)
        except InvalidRequest:
            start = 0  # a template that will not render this prefix alone: taken as before `char`
        if start <= char:
            low = mid
        else:
            high = mid - 1
    return low


def _common_prefix(a: str, b: str) -> int:
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
