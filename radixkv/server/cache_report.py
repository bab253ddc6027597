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
from radixkv.engine.request_output import RequestOutput
from radixkv.errors import InvalidRequest
from radixkv.server.errors import APIError
from radixkv.prompts.conversation import EncodedConversation, common_prefix, encode_conversation
from radixkv.prompts.tools import Tool, ToolChoice, render_conversation, template_input

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
    """A chat prompt as the encoder rendered it (radixkv/prompts/tools.render_conversation), so parts are
    found in the very text its token ids came from."""

    messages: list[dict[str, Any]]
    tools: list[Tool]
    tool_choice: ToolChoice
    message_offset: int = 0  # subtracted from an index: a family's own system field is no message of its own
    encoded: EncodedConversation | None = None  # the encoder's one rendering, where the route kept it


def locate(tokenizer: Any, source: ChatSource | None, prompt: Sequence[int], token: int) -> PromptPart:
    """The part of `prompt` that token index `token` lies in, read off the conversation as the
    encoder rendered it once (EncodedConversation: its messages aligned in that text; rendered
    here when the route kept none). Only a conversation whose messages cannot be aligned is
    rendered again, its message prefixes by binary search: O(log messages) renderings."""
    if source is None:
        return PromptPart("prompt")
    encoded = source.encoded if source.encoded is not None else _encode(tokenizer, source)
    char = encoded.char_of_token(tokenizer, prompt, token)
    part = encoded.part_at_char(char, at_end=token >= len(prompt))
    if part is not None and part.kind != "message":
        return PromptPart(part.kind)
    k = part.index if part is not None and part.index is not None else _message_at(tokenizer, source, encoded.text, char)
    role = source.messages[k].get("role")
    if role in ("system", "developer"):
        return PromptPart("system", role)
    return PromptPart(f"message[{k - source.message_offset}]", role)


def _encode(tokenizer: Any, source: ChatSource) -> EncodedConversation:
    def render(generation: bool, with_tools: bool) -> str:
        return render_conversation(tokenizer, source.messages, source.tools if with_tools else [], add_generation_prompt=generation)

    return encode_conversation(tokenizer, template_input(tokenizer, source.messages, source.tools), render=render)


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
        self.drift: str | None = None  # the drift the diagnostics named against the compared prompt

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
        drift = {"drift": self.drift} if self.drift is not None else {}
        return [{**wire(report, part), **drift} if report is not None else None for report, part in zip(made, found)]

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


def _message_at(tokenizer: Any, source: ChatSource, full: str, char: int) -> int:
    """The last message whose rendering starts at or before `char`."""
    low, high = 0, len(source.messages) - 1
    while low < high:
        mid = (low + high + 1) // 2
        try:
            start = common_prefix(_render(tokenizer, source, source.messages[:mid], generation=False), full)
        except InvalidRequest:
            start = 0  # a template that will not render this prefix alone: taken as before `char`
        if start <= char:
            low = mid
        else:
            high = mid - 1
    return low
