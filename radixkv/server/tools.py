"""Function tools for every API the server speaks: their definitions and the choice, the JSON
guide that makes forced calls parse, and how a reply (whole or streamed) splits into text and
calls, in the one call format the fallback prompt asks for (`<tool_call>` lines, or bare JSON).
The `Tool` record, the choice's check and how a conversation with tools becomes a prompt are
radixkv/prompts/tools.py, below the server.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from radixkv.engine.sampling_params import JsonGuide
from radixkv.errors import InvalidRequest
from radixkv.prompts.tools import CALL_CLOSE, CALL_OPEN, CHOICES, MALFORMED, Tool, ToolChoice, check_tool_choice, loads_json

# A guided array of parallel calls ends here: a weak model may otherwise append calls until
# max_tokens cuts the JSON, and then nothing parses.
MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str  # "call_<hex>"
    name: str
    arguments: str  # JSON text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- definitions ----------------------------------------------------------------------------


def tool_from_openai(raw: Mapping[str, Any], param: str = "tools") -> Tool:
    """A function tool as chat completions nest it ({"type", "function": {...}}) or as the
    Responses API flattens it ({"type", "name", ...})."""
    if not isinstance(raw, Mapping) or raw.get("type", "function") != "function":
        raise InvalidRequest(f"{param}: only tools of type 'function' are supported", param=param)
    spec = raw.get("function", raw)
    if not isinstance(spec, Mapping):
        raise InvalidRequest(f"{param}: function must be an object", param=param)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"{param}: every function needs a name", param=param)
    parameters = spec.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping):
        raise InvalidRequest(f"{param}: the parameters of {name!r} must be a JSON schema object", param=param)
    return Tool(name, str(spec.get("description") or ""), dict(parameters), bool(spec.get("strict") or False))


def tools_from_openai(raw: Sequence[Mapping[str, Any]] | None, param: str = "tools") -> list[Tool]:
    tools = [tool_from_openai(t, param) for t in raw or ()]
    seen: set[str] = set()  # linear: a request may carry up to request_caps' max_tools
    for tool in tools:
        if tool.name in seen:
            raise InvalidRequest(f"{param}: the function name {tool.name!r} appears twice", param=param)
        seen.add(tool.name)
    return tools


def tool_choice_from_openai(raw: Any, tools: Sequence[Tool], param: str = "tool_choice") -> ToolChoice:
    """OpenAI's tool_choice (a mode, {"type": "function", "function": {"name"}}, or the Responses
    API's {"type": "function", "name"}), checked against the tools; None means the default."""
    if raw is None:
        choice: ToolChoice = "auto" if tools else "none"
    elif isinstance(raw, str):
        choice = raw
        if choice not in CHOICES:
            raise InvalidRequest(f"{param} must be one of {', '.join(CHOICES)} or a function, got {raw!r}", param=param)
    elif isinstance(raw, Mapping) and raw.get("type") == "function":
        spec = raw.get("function", raw)
        choice = spec.get("name") if isinstance(spec, Mapping) else None  # type: ignore[assignment]
        if not isinstance(choice, str):
            raise InvalidRequest(f"{param}: a function choice needs the function's name", param=param)
    else:
        raise InvalidRequest(f"{param} must be a string or a function choice", param=param)
    check_tool_choice(choice, tools, param)
    return choice


# -- guides ---------------------------------------------------------------------------------


def guide_for(tools: list[Tool], tool_choice: ToolChoice, parallel_tool_calls: bool) -> JsonGuide | None:
    """For "required" or a named function, the JSON the reply must be: a call
    {"name", "arguments"} (arguments matching that function's schema), or for "required" with
    parallel calls an array of 1 to MAX_PARALLEL_CALLS; "auto" and "none" leave the model free."""
    if tool_choice in ("none", "auto"):
        return None
    check_tool_choice(tool_choice, tools)
    chosen = [t for t in tools if tool_choice == "required" or t.name == tool_choice]
    calls = [_call_schema(t) for t in chosen]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    # A named function is one call of it, as with OpenAI (langchain's bind_tools expects one).
    parallel = parallel_tool_calls and tool_choice == "required"
    schema = {"type": "array", "items": call, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS} if parallel else call
    return JsonGuide(schema=json.dumps(schema), strict=True)


def _call_schema(tool: Tool) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# -- replies --------------------------------------------------------------------------------


def parse_reply(text: str, tools: list[Tool], tool_choice: ToolChoice) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished reply: a bare JSON call or array of calls (what a
    guide produces), else `<tool_call>` lines; whatever is not a valid call stays content. A
    guided reply (a call forced) is never content: cut off, it gives the calls it completed."""
    if tool_choice == "none" or not tools:
        return text, []
    names = {t.name for t in tools}
    bare = _bare_calls(text, names)
    if bare is not None:
        return None, bare
    if forces_call(tool_choice):
        return None, completed_calls(text, names)
    content, calls = _tagged_calls(text, names)
    if not calls:
        return text, []
    return content.strip() or None, calls


def forces_call(tool_choice: ToolChoice) -> bool:
    """Whether a guide makes the whole reply JSON calls ("required", or one named function)."""
    return tool_choice not in CHOICES or tool_choice == "required"


def _bare_calls(text: str, names: set[str]) -> list[ToolCall] | None:
    stripped = text.strip()
    if not stripped or stripped[0] not in "{[":
        return None
    value = loads_json(stripped)
    if value is MALFORMED:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [call_of(item, names) for item in items]
    return _distinct(calls) if calls and all(c is not None for c in calls) else None  # type: ignore[arg-type]


def completed_calls(text: str, names: set[str]) -> list[ToolCall]:
    """The calls a guided reply cut off mid-way (max_tokens) completed: its first object if
    that closed, or the items of its array that closed before the cut."""
    stripped = text.strip()
    decoder = json.JSONDecoder()
    values: list[Any] = []
    try:
        if stripped.startswith("{"):
            values.append(decoder.raw_decode(stripped)[0])
        elif stripped.startswith("["):
            position = 1
            while True:
                position = _skip_space(stripped, position)
                value, position = decoder.raw_decode(stripped, position)
                values.append(value)
                position = _skip_space(stripped, position)
                if not stripped.startswith(",", position):
                    break
                position += 1
    except (json.JSONDecodeError, RecursionError):
        pass  # the cut: what closed before it is kept
    return _distinct([call for call in (call_of(value, names) for value in values) if call is not None])


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def _distinct(calls: list[ToolCall]) -> list[ToolCall]:
    """Calls in order, each (function, arguments) once: a model that repeats a parallel call
    word for word asks for nothing new, and a client would run it twice."""
    seen: set[tuple[str, str]] = set()
    distinct = []
    for call in calls:
        key = (call.name, call.arguments)
        if key not in seen:
            seen.add(key)
            distinct.append(call)
    return distinct


def call_of(value: Any, names: set[str]) -> ToolCall | None:
    """A ToolCall from {"name", "arguments"} (or "parameters", as some models write it)."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = loads_json(arguments)
    if not isinstance(arguments, dict):
        return None
    try:
        text = json.dumps(arguments, ensure_ascii=False)
    except RecursionError:  # parsed near json's recursion limit; may not write back from here
        return None
    return ToolCall(new_call_id(), value["name"], text)


def _parse_call(body: str, names: set[str]) -> ToolCall | None:
    value = loads_json(body)
    return None if value is MALFORMED else call_of(value, names)


def _tagged_calls(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    content: list[str] = []
    calls: list[ToolCall] = []
    rest = text
    while (start := rest.find(CALL_OPEN)) >= 0:
        end = rest.find(CALL_CLOSE, start)
        body_end = len(rest) if end < 0 else end
        call = _parse_call(rest[start + len(CALL_OPEN) : body_end], names)
        stop = len(rest) if end < 0 else end + len(CALL_CLOSE)
        content.append(rest[:start] if call is not None else rest[:stop])
        if call is not None:
            calls.append(call)
        rest = rest[stop:]
    content.append(rest)
    return "".join(content), calls


class ToolCallStream:
    """Splits a streamed reply into content deltas and finished calls. Text passes through as it
    comes while it cannot be part of a call: a possible `<tool_call>` opening is held back until
    it is or is not one; a reply that opens with JSON (a guided or bare call) is held to the end.

    Linear in the reply: each delta is searched once (an open call's end only in the delta and
    the few characters before it), and held text is kept as pieces joined once, so a call left
    open over a long reply is not re-scanned or re-copied per delta. `num_scanned_chars` counts
    the characters searched, for the tests that hold it to that."""

    def __init__(self, tools: list[Tool], tool_choice: ToolChoice) -> None:
        self._tools = tools
        self._names = {t.name for t in tools}
        self._active = tool_choice != "none" and bool(tools)
        self._pieces: list[str] = []  # before the first non-space character, or a JSON reply
        self._held = ""  # in text: a tail that may begin CALL_OPEN
        self._call: list[str] | None = None  # the body of an open call, in pieces
        self._call_tail = ""  # its last len(CALL_CLOSE) - 1 characters: a close may straddle
        self._guided = forces_call(tool_choice)  # all JSON calls, never content
        self._json_reply = self._guided
        self._started = False  # seen a non-space character
        self.num_calls = 0
        self.num_scanned_chars = 0

    def feed(self, text_delta: str) -> tuple[str, list[ToolCall]]:
        if not self._active:
            return text_delta, []
        if not self._started:
            self._pieces.append(text_delta)
            stripped = text_delta.lstrip()  # all before it was space: only the delta can start
            self.num_scanned_chars += len(text_delta) - len(stripped) + (1 if stripped else 0)
            if not stripped:
                return "", []
            self._started = True
            self._json_reply = self._json_reply or stripped[0] in "{["
            if self._json_reply:
                return "", []
            text_delta = "".join(self._pieces)
            self._pieces = []
        elif self._json_reply:
            self._pieces.append(text_delta)
            return "", []
        return self._text(text_delta, final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        if not self._active:
            return "", []
        held, self._pieces = "".join(self._pieces), []
        if self._json_reply:
            calls = _bare_calls(held, self._names)
            if calls is None and self._guided:
                calls = completed_calls(held, self._names)
            if calls is not None:
                self.num_calls += len(calls)
                return "", calls
            self._json_reply = False
        return self._text(held, final=True)

    def _text(self, delta: str, *, final: bool) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        text, self._held = self._held + delta, ""
        while True:
            if self._call is None:
                start = text.find(CALL_OPEN)
                self.num_scanned_chars += len(text) if start < 0 else start + len(CALL_OPEN)
                if start < 0:
                    keep = 0 if final else _partial_suffix(text, CALL_OPEN)
                    content.append(text[: len(text) - keep])
                    self._held = text[len(text) - keep :]
                    break
                content.append(text[:start])
                self._call, self._call_tail = [], ""
                text = text[start + len(CALL_OPEN) :]
            window = self._call_tail + text
            end = window.find(CALL_CLOSE)
            self.num_scanned_chars += len(window) if end < 0 else end + len(CALL_CLOSE)
            if end < 0:
                self._call.append(text)
                self._call_tail = window[len(window) - (len(CALL_CLOSE) - 1) :] if len(window) >= len(CALL_CLOSE) else window
                if final:  # cut off (max_tokens): a call if its body parses, else text
                    body = "".join(self._call)
                    self._call = None
                    call = _parse_call(body, self._names)
                    content.append("" if call is not None else CALL_OPEN + body)
                    calls += [call] if call is not None else []
                break
            # The close starts `cut` characters into this text (negative: in the pieces before).
            cut = end - len(self._call_tail)
            body = "".join(self._call) + text[:cut] if cut >= 0 else "".join(self._call)[:cut]
            self._call = None
            call = _parse_call(body, self._names)
            content.append("" if call is not None else CALL_OPEN + body + CALL_CLOSE)
            calls += [call] if call is not None else []
            text = text[cut + len(CALL_CLOSE) :]
        self.num_calls += len(calls)
        return "".join(content), calls


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of text that is a beginning of marker."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def response_format_guide(kind: str, schema: Any = None, strict: bool | None = None, param: str = "response_format") -> JsonGuide | None:
    """A response format ("text", "json_object", "json_schema" with its schema) as a guide; the
    engine checks the schema itself and refuses one it cannot compile (a 400 on `param`)."""
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonGuide(schema=None, strict=False)
    if kind != "json_schema":
        raise InvalidRequest(f"{param}: unknown type {kind!r}", param=param)
    if not isinstance(schema, Mapping):
        raise InvalidRequest(f"{param}: json_schema needs a schema, a JSON object", param=param)
    return JsonGuide(schema=json.dumps(schema), strict=bool(strict))
