"""How much one request body may carry (tools, messages, content blocks, cache breakpoints,
JSON schemas and arguments, ids and names), checked by the request models while they validate:
a part past its cap is a 400 naming it and the cap before anything is rendered or tokenized.

The numbers follow the hosted APIs where they publish one; they are wire constraints, the same
for every server, so they appear in the OpenAPI document (pydantic `max_length`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BeforeValidator

KIB = 1 << 10


class CapExceeded(ValueError):
    """A request part past its cap. `param` names the field when the check spans several
    (breakpoints); otherwise the validation error's location does."""

    def __init__(self, message: str, *, limit: int, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.limit = limit
        self.param = param


@dataclass(frozen=True, slots=True)
class RequestCaps:
    # Tools per request: OpenAI's and Anthropic's cap. Every tool is rendered into the prompt
    # and checked against the others, so this bounds the work of a request's definitions.
    max_tools: int = 128
    # Anthropic's cache_control breakpoints per request (system, messages' blocks and tools
    # together): each one renders and tokenizes its prefix once more to find its length.
    max_cache_breakpoints: int = 4
    # Messages (chat, Messages) or input items (Responses) per request. A turn costs a few
    # template tokens at least, so 8192 turns is past what a 32k-token context holds; long
    # agent transcripts stay in the low thousands and are compacted well before this.
    max_messages: int = 8192
    # Content blocks (parts) per message or item: real clients send a handful; each is a
    # pydantic object and a string join, so the cap bounds per-message work.
    max_content_blocks: int = 1024
    # One JSON schema (response_format, a tool's parameters or input_schema, text.format) as
    # compact JSON. OpenAI caps a strict schema's names and enum strings at ~120k characters;
    # the schema is rendered into the prompt and compiled into a grammar, so it stays small.
    max_schema_bytes: int = 128 * KIB
    # Nesting of a schema, or of a call's arguments, counted in JSON containers ({} and []).
    # OpenAI allows 10 levels of object nesting in a strict schema, each two containers (the
    # schema and its `properties`); 64 leaves room and keeps recursive walkers (the grammar
    # compiler, json, a chat template's tojson) far from Python's recursion limit.
    max_json_depth: int = 64
    # enum values across one schema: OpenAI's cap for structured outputs. Each is a branch of
    # the compiled grammar.
    max_enum_values: int = 1000
    # A function tool's name on the OpenAI APIs (OpenAI: 64, [a-zA-Z0-9_-]). Anthropic's tools
    # keep their own 128 (anthropic_protocol.ToolParam).
    max_tool_name_chars: int = 64
    max_anthropic_tool_name_chars: int = 128
    # Call ids, tool_use ids and response ids a client sends back: ours are under 64
    # characters; 256 leaves room for other servers' and still bounds what is echoed.
    max_id_chars: int = 256
    # Opaque strings a client hands back and nothing here reads (a thinking block's signature,
    # redacted thinking's data): Anthropic's run to a few KiB; kept only within this bound.
    max_opaque_chars: int = 64 * KIB


CAPS = RequestCaps()


def check_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` unchanged, or ValueError naming the cap it breaks (pydantic makes it a 400 on
    the field). Linear: one iterative walk, stopped at the first cap passed."""
    max_depth, max_enums = CAPS.max_json_depth, CAPS.max_enum_values
    num_enums = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            raise CapExceeded(f"the schema is nested deeper than {max_depth} levels", limit=max_depth)
        if isinstance(value, dict):
            enum = value.get("enum")
            if isinstance(enum, list):
                num_enums += len(enum)
                if num_enums > max_enums:
                    raise CapExceeded(f"the schema has more than {max_enums} enum values", limit=max_enums)
            stack.extend((child, depth + 1) for child in value.values() if isinstance(child, (dict, list)))
        else:
            stack.extend((child, depth + 1) for child in value if isinstance(child, (dict, list)))
    # The depth is bounded now, so json (recursive) is safe; its size is what gets rendered.
    size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
    if size > CAPS.max_schema_bytes:
        raise CapExceeded(f"the schema is {size} bytes as JSON; at most {CAPS.max_schema_bytes} are allowed", limit=CAPS.max_schema_bytes)
    return schema


def check_schema_or_none(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if schema is None else check_schema(schema)


def json_depth_exceeds(text: str, limit: int) -> bool:
    """Whether JSON text nests containers deeper than `limit`, in one pass without parsing (so
    no recursion): brackets inside strings do not count. Malformed text is judged as written."""
    depth = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False


def check_arguments(arguments: str | dict[str, Any]) -> str | dict[str, Any]:
    """A call's arguments (JSON text, or the object some clients send) unchanged, or ValueError
    when they nest past max_json_depth: json would recurse once per level and fail."""
    if isinstance(arguments, str):
        if json_depth_exceeds(arguments, CAPS.max_json_depth):
            raise CapExceeded(f"the arguments are nested deeper than {CAPS.max_json_depth} levels", limit=CAPS.max_json_depth)
    else:
        check_depth(arguments, CAPS.max_json_depth, "the arguments")
    return arguments


def check_depth(value: Any, limit: int, what: str) -> Any:
    """`value` unchanged, or ValueError when its containers nest deeper than `limit` (iterative)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise CapExceeded(f"{what} are nested deeper than {limit} levels", limit=limit)
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return value


def max_items(limit: int, what: str) -> BeforeValidator:
    """A cap on a list field that may also be a string (a union), checked before the items are
    validated: Field(max_length) on a union would report every branch, none naming the cap."""

    def check(value: Any) -> Any:
        if isinstance(value, list) and len(value) > limit:
            raise CapExceeded(f"at most {limit} {what} are allowed, got {len(value)}", limit=limit)
        return value

    return BeforeValidator(check)
