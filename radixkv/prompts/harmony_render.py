"""gpt-oss's prompts written as openai-harmony (the format's reference encoder, which vLLM serves
gpt-oss with) writes them, from the messages and tools a chat template would be given.

Why not the model's own chat template: it writes a tool result JSON-quoted (`"{\\"temp\\": 20}"`)
where harmony and the model's training write it as it is, a call's content type as ` json` where
the model writes ` <|constrain|>json`, every result as the reply to the latest call, and nested or
union parameter schemas unlike harmony's TypeScript. tests/prompts/test_harmony_reference.py
checks this module's text against openai-harmony's. Which reasoning is printed follows the
template: a call's, until a final answer follows it.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

from radixkv.errors import InvalidRequest

IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
REASONING_EFFORT = "medium"
CHANNELS = "# Valid channels: analysis, commentary, final. Channel must be included for every message."
CALLS_CHANNEL = "Calls to these tools must go to the commentary channel: 'functions'."
CALL_CONTENT_TYPE = "<|constrain|>json"  # what gpt-oss writes after a call's channel


def render_harmony(
    messages: Sequence[Mapping[str, Any]], tools: list[dict] | None, *, add_generation_prompt: bool = True, today: str | None = None
) -> str:
    """The prompt text: harmony's system message (today's date, as the template prints it),
    a developer message for the first system message and the tools, then the conversation."""
    tools = [t.get("function", t) for t in tools or ()]
    first = messages[0] if messages else {}
    instructions = first.get("content") if first.get("role") in ("system", "developer") else None
    rest = messages[1:] if instructions is not None else messages
    out = [_block("system", None, None, None, _system_text(today or datetime.date.today().isoformat(), bool(tools)), "<|end|>")]
    if instructions or tools:
        out.append(_block("developer", None, None, None, _developer_text(instructions, tools), "<|end|>"))
    out.extend(_conversation(list(rest), add_generation_prompt))
    if add_generation_prompt:
        out.append("<|start|>assistant")
    return "".join(out)


def _system_text(today: str, has_tools: bool) -> str:
    channels = CHANNELS + ("\n" + CALLS_CHANNEL if has_tools else "")
    return "\n\n".join((f"{IDENTITY}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {today}", f"Reasoning: {REASONING_EFFORT}", channels))


def _developer_text(instructions: str | None, tools: list[Mapping[str, Any]]) -> str:
    sections = ["# Instructions", instructions] if instructions else []
    if tools:
        sections.append(tools_section(tools))
    return "\n\n".join(sections)


def tools_section(tools: Sequence[Mapping[str, Any]]) -> str:
    """The `functions` namespace: each tool's description as comment lines, then its arguments
    as a TypeScript type (`() => any` for a tool that declares none)."""
    lines = ["## functions\n", "namespace functions {\n"]
    for tool in tools:
        lines.extend(f"// {line}" for line in _lines(str(tool.get("description") or "")))
        parameters = tool.get("parameters")
        signature = "()" if parameters is None else f"(_: {schema_type(parameters, '')})"
        lines.append(f"type {tool['name']} = {signature} => any;\n")
    lines.append("} // namespace functions")
    return "# Tools\n\n" + "\n".join(lines)


def _lines(text: str) -> list[str]:
    """Rust's str::lines, which harmony splits descriptions with: no empty last line after a
    final newline, a carriage return before a newline dropped."""
    parts = text.split("\n")
    if parts and parts[-1] == "":
        parts.pop()
    return [p[:-1] if p.endswith("\r") else p for p in parts]


def _conversation(messages: list[Mapping[str, Any]], add_generation_prompt: bool) -> list[str]:
    out: list[str] = []
    names: dict[str, str] = {}  # call id -> function name, so each result answers its own call
    latest: str | None = None
    for index, message in enumerate(messages):
        role = message.get("role")
        if role == "user":
            out.append(_block("user", None, None, None, _content(message), "<|end|>"))
        elif role == "assistant" and message.get("tool_calls"):
            reasoning = message.get("thinking") or message.get("content")
            if message.get("thinking") and message.get("content"):
                raise InvalidRequest("an assistant message with tool calls cannot carry both text and reasoning", param="messages")
            if reasoning and not _final_follows(messages[index + 1 :]):
                out.append(_block("assistant", None, "analysis", None, _checked(reasoning), "<|end|>"))
            for call in message["tool_calls"]:
                function = call.get("function", call)
                latest = str(function["name"])
                names[str(call.get("id") or "")] = latest
                out.append(_block("assistant", f"functions.{latest}", "commentary", CALL_CONTENT_TYPE, _arguments(function.get("arguments_text", function.get("arguments"))), "<|call|>"))
        elif role == "assistant":
            last = index == len(messages) - 1 and not add_generation_prompt
            if last and message.get("thinking"):  # a training-form conversation ends with its reasoning
                out.append(_block("assistant", None, "analysis", None, _checked(message["thinking"]), "<|end|>"))
            out.append(_block("assistant", None, "final", None, _checked(_content(message)), "<|return|>" if last else "<|end|>"))
            latest = None
        elif role == "tool":
            name = names.get(str(message.get("tool_call_id") or "")) or latest
            if name is None:
                raise InvalidRequest("a tool message must follow an assistant message with a tool call", param="messages")
            out.append(_block(f"functions.{name}", "assistant", "commentary", None, _content(message), "<|end|>"))
        # A later system message has no place in harmony's conversation (the template drops it too).
    return out


def _final_follows(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a final answer comes later: then a call's reasoning is no longer printed."""
    return any(m.get("role") == "assistant" and not m.get("tool_calls") for m in messages)


def _block(author: str, recipient: str | None, channel: str | None, content_type: str | None, text: str, end: str) -> str:
    header = author + (f" to={recipient}" if recipient else "") + (f"<|channel|>{channel}" if channel else "")
    header += f" {content_type}" if content_type else ""
    return f"<|start|>{header}<|message|>{text}{end}"


def _content(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def _checked(text: str) -> str:
    if "<|channel|>" in text:
        raise InvalidRequest("an assistant message's text or reasoning must not hold harmony's <|channel|> markers", param="messages")
    return text


def _arguments(arguments: Any) -> str:
    """A call's arguments as the client sent them back, so as the model wrote them: text as it
    is, a JSON value as json.dumps writes it (as the template's tojson does)."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps({} if arguments is None else arguments, ensure_ascii=False)


def schema_type(schema: Any, indent: str) -> str:
    """A JSON schema as harmony's TypeScript: objects as `{ name?: type, }` with descriptions,
    titles, examples and defaults as comments, oneOf as ` | ` lines, enums as literal unions."""
    if not isinstance(schema, Mapping):
        return "any"
    if isinstance(variants := schema.get("oneOf"), list):
        return "".join(f"\n{indent} | " + _variant(v, indent) + _comments(_variant_notes(v, None, False, quote_enum_strings=True)) for v in variants)
    kind = schema.get("type")
    if isinstance(kind, list):
        names = ["number" if k == "integer" else k for k in kind if isinstance(k, str)]
        if names:
            return " | ".join(names)
    if not isinstance(kind, str):
        return "any"
    if kind == "object":
        return _object_type(schema, indent)
    if kind == "string":
        values = schema.get("enum") if isinstance(schema.get("enum"), list) else []
        literals = [f'"{v}"' for v in values if isinstance(v, str)]
        return " | ".join(literals) if literals else "string"
    if kind == "array":
        return schema_type(schema["items"], indent) + "[]" if "items" in schema else "Array<any>"
    return {"number": "number", "integer": "number", "boolean": "boolean"}.get(kind, "any")


def _object_type(schema: Mapping[str, Any], indent: str) -> str:
    out = f"{indent}// {schema['description']}\n" if isinstance(schema.get("description"), str) else ""
    out += "{\n"
    properties = schema.get("properties")
    if isinstance(properties, Mapping):
        required = {r for r in schema.get("required") or () if isinstance(r, str)} if isinstance(schema.get("required"), list) else set()
        for key, value in properties.items():
            out += _property(str(key), value, key in required, indent)
    return out + indent + "}"


def _property(key: str, value: Any, required: bool, indent: str) -> str:
    spec = value if isinstance(value, Mapping) else {}
    mark = "" if required else "?"
    out = ""
    if isinstance(spec.get("title"), str):
        out += f"{indent}// {spec['title']}\n{indent}//\n"
    if "oneOf" not in spec and isinstance(spec.get("description"), str):
        out += f"{indent}// {spec['description']}\n"
    if isinstance(spec.get("examples"), list) and spec["examples"]:
        out += f"{indent}// Examples:\n" + "".join(f'{indent}// - "{e}"\n' for e in spec["examples"] if isinstance(e, str))
    if isinstance(variants := spec.get("oneOf"), list):
        return out + _one_of_property(key, spec, variants, mark, indent)
    out += f"{indent}{key}{mark}: " + _nullable(spec, schema_type(value, indent + "    ")) + ","
    if "oneOf" not in spec and "default" in spec:
        out += " // " + _default_note(spec)
    return out + "\n"


def _one_of_property(key: str, spec: Mapping[str, Any], variants: list, mark: str, indent: str) -> str:
    described = spec.get("description") if isinstance(spec.get("description"), str) else None
    first = variants[0] if variants and isinstance(variants[0], Mapping) else {}
    above = described is not None and first.get("description") != described
    out = f"{indent}// {described}\n" if above else ""
    if "default" in spec:
        out += f"{indent}// {_default_note(spec)}\n"
    out += f"{indent}{key}{mark}:\n"
    for i, variant in enumerate(variants):
        notes = _variant_notes(variant, described, i == 0 and above, quote_enum_strings=False)
        out += f"{indent} | " + _variant(variant, indent) + _comments(notes) + "\n"
    return out + f"{indent},\n"


def _variant(variant: Any, indent: str) -> str:
    return _nullable(variant if isinstance(variant, Mapping) else {}, schema_type(variant, indent + "   "))


def _variant_notes(variant: Any, described: str | None, skip_description: bool, *, quote_enum_strings: bool) -> list[str]:
    """A oneOf variant's trailing comments: its description (unless the property's own says it)
    and its default."""
    spec = variant if isinstance(variant, Mapping) else {}
    notes = []
    if not skip_description and isinstance(spec.get("description"), str) and spec["description"] != described:
        notes.append(spec["description"])
    if "default" in spec:
        notes.append(_default_note(spec, quote_enum_strings=quote_enum_strings))
    return notes


def _comments(notes: list[str]) -> str:
    return " // " + " ".join(notes) if notes else ""


def _nullable(spec: Mapping[str, Any], text: str) -> str:
    return text + " | null" if spec.get("nullable") is True and "null" not in text else text


def _default_note(spec: Mapping[str, Any], quote_enum_strings: bool = False) -> str:
    """`default: ...` as harmony writes it: a string in quotes unless the schema is an enum (then
    bare, except a top-level oneOf variant's, written as JSON), anything else as compact JSON."""
    default = spec["default"]
    if isinstance(default, str):
        if not _is_enum(spec):
            return f'default: "{default}"'
        return f"default: {_json(default)}" if quote_enum_strings else f"default: {default}"
    return f"default: {_json(default)}"


def _is_enum(spec: Mapping[str, Any]) -> bool:
    return isinstance(spec.get("enum"), list) and bool(spec["enum"])


def _json(value: Any) -> str:
    """serde_json's compact form, which harmony prints defaults with."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
