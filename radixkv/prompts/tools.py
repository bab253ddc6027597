"""How a conversation with tools becomes prompt tokens: the `Tool` record and the tool choice,
the model's chat template when it takes `tools`, else the fallback prompt below; messages
normalized as templates print them. Guides and reading calls back are the server's (server/tools.py).

gpt-oss's prompts (harmony) are written by radixkv/prompts/harmony_render.py, which takes its
tools; an assistant message with several calls is handed to it as one message per call.

The fallback, for chat templates that take no `tools`: a system-prompt section lists each
function as one JSON line {"name", "description", "parameters"} and asks for one line
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` per call (read back by
radixkv/server/tools.py). Earlier assistant calls are rendered in that same form, and tool results as a
user turn of `<tool_response>` lines.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from radixkv.errors import InvalidRequest
from radixkv.prompts.conversation import EncodedConversation, TemplateInput, common_prefix
from radixkv.prompts.encode import render_chat, template_takes_tools, tokenize_rendered
from radixkv.prompts.harmony import harmony_tokens

# "none" | "auto" | "required" | the name of the one function the reply must call.
ToolChoice = str
CHOICES = ("none", "auto", "required")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON Schema of the arguments (an object schema)
    strict: bool = False


def check_tool_choice(choice: ToolChoice, tools: Sequence[Tool], param: str = "tool_choice") -> None:
    if choice in ("required",) and not tools:
        raise InvalidRequest(f"{param} is 'required' but no tools were given", param=param)
    if choice not in CHOICES and choice not in {t.name for t in tools}:
        raise InvalidRequest(f"{param} names the function {choice!r}, which is not among the tools", param=param)


MALFORMED = object()


def loads_json(text: str) -> Any:
    """JSON text as a value, or MALFORMED: a model may write anything, nesting deeper than
    json's recursion takes included (RecursionError), and that is content, not a server error."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return MALFORMED


def encode_conversation(
    tokenizer: Any,
    messages: list[dict],
    tools: list[Tool],
    tool_choice: ToolChoice,
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Prompt token ids of a conversation with tools. Tools are offered even with "none" so that
    the prompt prefix (system + tools) stays the same, and cached, whatever the choice."""
    check_tool_choice(tool_choice, tools)
    return tokenize_rendered(tokenizer, render_conversation(tokenizer, messages, tools, add_generation_prompt=add_generation_prompt))


def prefix_tokens(
    tokenizer: Any,
    prompt: list[int],
    messages: list[dict],
    prefix: list[dict],
    tools: list[Tool],
    tool_choice: ToolChoice,
    encoded: EncodedConversation | None = None,
) -> int:
    """Tokens of `prompt` (the conversation `messages`) up to the end of `prefix`: the
    conversation cut at a mark, its leading messages with the last perhaps cut short. Read off
    `encoded`, the prompt's one rendering, where its layout tells (EncodedConversation.cut_tokens);
    else `prefix` rendered alone, counted only as far as it agrees with the prompt (a template
    closes a turn differently when it is the last). InvalidRequest where the template will not
    render that prefix alone."""
    cut = _cut(messages, prefix) if encoded is not None else None
    if cut is not None and (num_tokens := encoded.cut_tokens(tokenizer, *cut)) is not None:  # type: ignore[union-attr]
        return num_tokens
    return common_prefix(encode_conversation(tokenizer, prefix, tools, tool_choice, add_generation_prompt=False), prompt)


def _cut(messages: list[dict], prefix: list[dict]) -> tuple[int, str | None] | None:
    """Where `prefix` ends in `messages`: (its last message's index, None where that message is
    whole, else the first characters of its text that it keeps, its tool calls perhaps dropped:
    templates print calls after the text); None for any other prefix."""
    k = len(prefix) - 1
    if not 0 <= k < len(messages) or prefix[:k] != messages[:k]:
        return None
    try:
        whole, cut = _normalize(messages[k], k, True), _normalize(prefix[k], k, True)
    except InvalidRequest:
        return None
    if cut == whole:
        return k, None
    calls = {"tool_calls": whole["tool_calls"]} if "tool_calls" in whole and "tool_calls" not in cut else {}
    if {**cut, "content": whole["content"], **calls} == whole and whole["content"].startswith(cut["content"]):
        return k, cut["content"]
    return None


def render_conversation(tokenizer: Any, messages: list[dict], tools: list[Tool], *, add_generation_prompt: bool = True) -> str:
    """The template's text of a conversation with tools: what encode_conversation tokenizes."""
    view = template_input(tokenizer, messages, tools)
    return render_chat(tokenizer, view.messages, tools=view.tools, add_generation_prompt=add_generation_prompt)


def template_input(tokenizer: Any, messages: list[dict], tools: list[Tool]) -> TemplateInput:
    """The conversation as the template is given it (normalized; the fallback prompt's for a
    template that takes no tools), with where each request message begins in it."""
    if not messages:
        raise InvalidRequest("messages must hold at least one message", param="messages")
    normalized = normalize_messages(messages)
    roles = [m["role"] for m in normalized]
    if template_takes_tools(tokenizer):
        wire_tools = [_wire_tool(t) for t in tools] or None
        if harmony_tokens(tokenizer) is not None:
            split, origins = _one_call_each(normalized)
            return TemplateInput(split, roles, origins, wire_tools)
        return TemplateInput(normalized, roles, [[(i, 0)] for i in range(len(normalized))], wire_tools)
    out, origins, tools_at = _fallback(normalized, tools)
    return TemplateInput(out, roles, origins, None, tools_at)


def _one_call_each(messages: list[dict]) -> tuple[list[dict], list[list[tuple[int, int]]]]:
    """Harmony's assistant messages, one tool call each, as the model writes them: gpt-oss's
    template prints only an assistant message's first call (its text goes with that one)."""
    out: list[dict] = []
    origins: list[list[tuple[int, int]]] = []
    for k, message in enumerate(messages):
        calls = message.get("tool_calls") or []
        out.append(_harmony_message(message, calls))
        origins.append([(k, 0)])
        for call in calls[1:]:
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            origins.append([])
    return out, origins


def _harmony_message(message: dict, calls: list[dict]) -> dict:
    """A message as gpt-oss's template takes it: its first call only, and its reasoning as
    `thinking` where the template prints it: before a call, in a message with no text (the
    template refuses both; it prints the text in the analysis channel then)."""
    if not calls and "reasoning_content" not in message:
        return message
    out = {k: v for k, v in message.items() if k != "reasoning_content"}
    if calls:
        out["tool_calls"] = calls[:1]
        if message.get("reasoning_content") and not message["content"]:
            out["thinking"] = message["reasoning_content"]
    return out


def normalize_messages(messages: list[dict], *, argument_text: bool = True) -> list[dict]:
    """Messages as templates print them: content as text, tool calls as plain dicts (with the
    client's own arguments string as well, unless `argument_text` is off: only harmony prints it)."""
    return [_normalize(m, i, argument_text) for i, m in enumerate(messages)]


def _normalize(message: Mapping[str, Any], index: int, argument_text: bool) -> dict:
    """Content as text (templates print it as a string); tool calls as plain dicts."""
    if not isinstance(message, Mapping):
        raise InvalidRequest(f"messages[{index}] must be an object", param="messages")
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise InvalidRequest(f"messages[{index}].role {role!r} is not a known role", param="messages")
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"), index)}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = [_history_call(c, index, argument_text) for c in message["tool_calls"]]
    if role == "assistant" and isinstance(reasoning := message.get("reasoning_content"), str) and reasoning:
        # The reply's reasoning handed back (chat's reasoning_content, a Responses reasoning
        # item, an Anthropic thinking block): templates that know the key (Qwen3's) print it
        # within the current tool loop; gpt-oss's reads it as `thinking` (_one_call_each).
        out["reasoning_content"] = reasoning
    if role == "tool":
        out["tool_call_id"] = str(message.get("tool_call_id") or "")
        if message.get("name"):
            out["name"] = str(message["name"])
    return out


def _text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in content)
    raise InvalidRequest(f"messages[{index}].content must be a string or a list of text parts", param="messages")


def _history_call(raw: Any, index: int, argument_text: bool) -> dict:
    spec = raw.get("function", raw) if isinstance(raw, Mapping) else None
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise InvalidRequest(f"messages[{index}].tool_calls: every call needs a function name", param="messages")
    function = {"name": spec["name"], "arguments": _args_object(spec.get("arguments"))}
    # Harmony replays a call's text exactly as the model wrote it; kept through a second
    # normalization (a normalized call's arguments are an object by then).
    text = spec.get("arguments_text", spec.get("arguments"))
    if argument_text and isinstance(text, str):
        function["arguments_text"] = text
    return {"id": str(raw.get("id") or ""), "type": "function", "function": function}


def _args_object(arguments: Any) -> Any:
    """Arguments as a JSON value: templates (and the fallback) print them with tojson."""
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}
        value = loads_json(arguments)
        return arguments if value is MALFORMED else value  # a model's malformed call, replayed as it was
    return {} if arguments is None else arguments


def _wire_tool(tool: Tool) -> dict:
    return {"type": "function", "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters}}


def fallback_messages(messages: list[dict], tools: Sequence[Tool]) -> list[dict]:
    """The conversation for a template that takes no tools: the tools section joins the system
    prompt (or becomes one), calls and results become text in the documented format."""
    return _fallback(messages, tools)[0]


def _fallback(messages: list[dict], tools: Sequence[Tool]) -> tuple[list[dict], list[list[tuple[int, int]]], tuple[int, int] | None]:
    """fallback_messages, with TemplateInput's origins (where each request message begins) and
    where the tools section begins."""
    out: list[dict] = []
    origins: list[list[tuple[int, int]]] = []
    for k, message in enumerate(messages):
        if message["role"] == "tool":
            line = f"<tool_response>{_dumps({'tool_call_id': message['tool_call_id'], 'content': message['content']})}</tool_response>"
            if out and out[-1].get("_tool_results"):  # consecutive results: one user turn
                origins[-1].append((k, len(out[-1]["content"])))
                out[-1]["content"] += "\n" + line
                continue
            out.append({"role": "user", "content": line, "_tool_results": True})
        elif message["role"] == "assistant" and message.get("tool_calls"):
            calls = [_call_line(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([message["content"]] if message["content"] else []) + calls)})
        else:
            out.append({"role": message["role"], "content": message["content"]})
        origins.append([(k, 0)])
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    tools_at = None
    if tools:
        section = tools_section(tools)
        if out and out[0]["role"] in ("system", "developer"):
            tools_at = (0, len(out[0]["content"]))
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section}
        else:
            out.insert(0, {"role": "system", "content": section})
            origins.insert(0, [])
            tools_at = (0, 0)
    return out, origins, tools_at


def tools_section(tools: Sequence[Tool]) -> str:
    lines = [_dumps({"name": t.name, "description": t.description, "parameters": t.parameters}) for t in tools]
    return (
        "# Tools\nYou may call these functions:\n"
        + "\n".join(lines)
        + f'\nTo call one, reply with one line per call:\n{CALL_OPEN}{{"name": <name>, "arguments": <JSON object>}}{CALL_CLOSE}'
    )


def _call_line(name: str, arguments: Any) -> str:
    return f"{CALL_OPEN}{_dumps({'name': name, 'arguments': arguments})}{CALL_CLOSE}"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
