"""Prompt drift named: why a prompt that was meant to repeat the previous turn's missed it (tools
reordered or their keys reordered, a timestamp in the system prompt, a system message injected,
the same text tokenized to other ids), read off keyed digests only; nothing is ever rewritten.
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Token ids are digested in chained blocks of this many: a finer block names the first changed
# token more closely and costs a digest more per block in the per-owner byte caps.
TOKEN_BLOCK = 32

DRIFT_REASONS = (
    "tools_reordered", "tool_schema_keys_reordered", "system_timestamp_changed", "system_message_injected",
    "message_boundary_retokenized",
)  # fmt: skip

# Date and time spans as clients stamp them into system prompts: ISO dates and times, numeric
# dates, clock times, month and weekday names with their numbers. Masked, two system prompts
# that differ only there digest alike.
_MONTHS = r"(?:jan|feb|mar|apr|may|jun|jul|aug|sep|sept|oct|nov|dec)[a-z]*\.?"
_WEEKDAYS = r"(?:mon|tue|tues|wed|thu|thur|thurs|fri|sat|sun)[a-z]*\.?"
_TIMESTAMP = re.compile(
    r"\d{4}-\d{2}-\d{2}(?:[T ]\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?)?(?:Z|[+-]\d{2}:?\d{2})?"
    r"|\d{1,4}[/.]\d{1,2}[/.]\d{2,4}"  # a date, not a version (1.2.3)
    r"|\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:\s?[ap]\.?m\.?)?(?:\s?(?:UTC|GMT|Z))?"
    rf"|\b{_WEEKDAYS}(?=[\s,])"
    rf"|\b{_MONTHS}\s+\d{{1,2}}(?:st|nd|rd|th)?(?:,?\s+\d{{4}})?"
    rf"|\b\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTHS}(?:,?\s+\d{{4}})?"
    r"|\b\d{10,13}\b",  # Unix time in seconds or milliseconds
    re.IGNORECASE,
)

Digest = Callable[[Any], bytes]


@dataclass(frozen=True, slots=True)
class DriftDigests:
    """What naming a drift needs of one prompt, as keyed digests and counts (never text)."""

    tool_set: bytes  # the tools as a set, each with its keys sorted
    tools_sorted_keys: bytes  # the tools in order, each with its keys sorted
    system_masked: bytes  # the system prompt with its date and time spans masked
    system_messages: tuple[int, ...]  # which messages (after the system one) are system or developer
    token_blocks: tuple[bytes, ...]  # chained digests of the prompt's ids, a full TOKEN_BLOCK each

    @property
    def num_bytes(self) -> int:
        return 3 * 16 + 8 * len(self.system_messages) + 16 * len(self.token_blocks)


def drift_digests(
    digest: Digest, *, system: Any, tools: list[dict[str, Any]], messages: Sequence[dict[str, Any]], token_ids: Sequence[int]
) -> DriftDigests:
    canonical = [json.dumps(tool, sort_keys=True, ensure_ascii=False, default=str) for tool in tools]
    masked = _TIMESTAMP.sub("\0", system) if isinstance(system, str) else system
    roles = tuple(k for k, m in enumerate(messages) if m.get("role") in ("system", "developer"))
    return DriftDigests(digest(sorted(canonical)), digest(canonical), digest([masked]), roles, _token_blocks(digest, token_ids))


def _token_blocks(digest: Digest, token_ids: Sequence[int]) -> tuple[bytes, ...]:
    """One digest per full block, each over its parent's digest and its ids: a block's digest
    names the whole prefix up to its end, as the cache's block hashes do."""
    blocks: list[bytes] = []
    parent = b""
    for start in range(0, len(token_ids) - TOKEN_BLOCK + 1, TOKEN_BLOCK):
        parent = digest(parent + array("q", token_ids[start : start + TOKEN_BLOCK]).tobytes())
        blocks.append(parent)
    return tuple(blocks)


def first_changed_token(previous: DriftDigests, current: DriftDigests) -> int | None:
    """The first token of the first block whose ids differ between the two prompts (None: every
    full block both have agrees). Pure."""
    for i, (a, b) in enumerate(zip(previous.token_blocks, current.token_blocks)):
        if a != b:
            return i * TOKEN_BLOCK
    return None


def retokenized(previous: DriftDigests, current: DriftDigests, text_change_token: int | None) -> int | None:
    """Where the ids part while the text still agrees (the same text tokenized otherwise, at a
    message boundary or a spliced reply): the changed block lies wholly before the first text
    change (`text_change_token`; None: the text never changed). Pure."""
    changed = first_changed_token(previous, current)
    if changed is None:
        return None
    if text_change_token is None or changed + TOKEN_BLOCK <= text_change_token:
        return changed
    return None


def tools_drift(previous: DriftDigests, current: DriftDigests) -> str | None:
    """Tools that differ only in order, or only in their JSON keys' order (checked in that order:
    keys alone first, since reordered keys change the set's digests too). Pure."""
    if previous.tools_sorted_keys == current.tools_sorted_keys:
        return "tool_schema_keys_reordered"
    if previous.tool_set == current.tool_set:
        return "tools_reordered"
    return None


def system_drift(previous: DriftDigests, current: DriftDigests) -> str | None:
    """A system prompt that differs only in a date or time span. Pure."""
    return "system_timestamp_changed" if previous.system_masked == current.system_masked else None


def injected(previous_messages: Sequence[bytes], current_messages: Sequence[bytes], current: DriftDigests, k: int) -> str | None:
    """Message k of the new prompt is a system message the compared one lacks, and the compared
    one's messages from k on follow it unchanged. Pure."""
    if k not in current.system_messages:
        return None
    rest = previous_messages[k:]
    if tuple(current_messages[k + 1 : k + 1 + len(rest)]) == tuple(rest):
        return "system_message_injected"
    return None
