"""Between the Responses API and chat messages: input items (and a stored conversation) into
the chat messages tool_prompts.encode_conversation takes, function tools and text.format into
tools.py's terms and a JsonGuide, and a finished reply into output items and back into messages.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from radixkv.engine.sampling_params import GrammarGuide, Guide, JsonGuide
from radixkv.server import tools as tool_layer
from radixkv.server.errors import APIError, validation_error_at
from radixkv.server.openai.responses_protocol import (
    INPUT_ITEMS,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputReasoningText,
    OutputText,
    ReasoningItem,
    ResponsesRequest,
    new_item_id,
)

Message = dict[str, Any]


def conversation(body: ResponsesRequest, history: list[Message]) -> list[Message]:
    """The stored history followed by this request's input, as chat messages (no instructions)."""
    messages = list(history)
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    if not body.input and not history:
        raise APIError(400, "input must hold at least one item", param="input")
    call_names = _call_names(history)
    for index, item in enumerate(input_items(body.input)):
        if isinstance(item, MessageItem):
            _append_message(messages, item)
        elif isinstance(item, FunctionCallItem):
            call_names[item.call_id] = item.name
            _append_call(messages, item)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(_tool_result(item, call_names, index))
        elif isinstance(item, ReasoningItem) and (text := item.text()):
            # Held by an assistant turn of its own until that turn's text or calls arrive.
            messages.append({"role": "assistant", "content": None, "reasoning_content": text})
    # Reasoning that no text or call followed says nothing a template prints.
    return [m for m in messages if not _reasoning_only(m)]


def _reasoning_only(message: Message) -> bool:
    return message["role"] == "assistant" and "reasoning_content" in message and not message["content"] and not message.get("tool_calls")


def input_items(raw: list[dict[str, Any]]) -> list[InputItem]:
    """Each item as its model, or APIError 400 naming the item (input.N) and what is wrong."""
    items = []
    for index, value in enumerate(raw):
        # Messages may leave out `type` (OpenAI's "easy input message"); anything else names it.
        kind = value.get("type", "message" if "role" in value else None)
        model = INPUT_ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            accepted = ", ".join(INPUT_ITEMS)
            raise APIError(400, f"input.{index}: radixkv takes input items of type {accepted}; got {kind!r}", param=f"input.{index}")
        try:
            items.append(model.model_validate(value))
        except ValidationError as error:
            raise validation_error_at(("input", index), error.errors()) from None
    return items  # type: ignore[return-value]


def prompt_messages(body: ResponsesRequest, messages: list[Message]) -> list[Message]:
    """What the model sees: the instructions (which OpenAI never carries over from a previous
    response) as the system message first, then the conversation."""
    if body.instructions:
        return [{"role": "system", "content": body.instructions}, *messages]
    return messages


def _call_names(messages: list[Message]) -> dict[str, str]:
    return {
        call["id"]: call["function"]["name"] for m in messages for call in m.get("tool_calls") or () if m.get("role") == "assistant"
    }


def _append_message(messages: list[Message], item: MessageItem) -> None:
    if item.role == "assistant" and messages and _reasoning_only(messages[-1]):
        messages[-1]["content"] = item.text()  # the text its reasoning led to
    else:
        messages.append({"role": item.role, "content": item.text()})


def _append_call(messages: list[Message], item: FunctionCallItem) -> None:
    # Calls that follow an assistant message (its text, or earlier calls of the same turn) are
    # that message's tool_calls, as chat templates expect one assistant turn per reply.
    call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _tool_result(item: FunctionCallOutputItem, call_names: dict[str, str], index: int) -> Message:
    name = call_names.get(item.call_id)
    if name is None:  # as OpenAI: an output must answer a call the conversation holds
        raise APIError(400, f"no function call found with call_id {item.call_id!r} for this output", param=f"input.{index}.call_id")
    return {"role": "tool", "tool_call_id": item.call_id, "name": name, "content": item.text()}


# -- tools and guides ------------------------------------------------------------------------


def tool_list(body: ResponsesRequest) -> list[tool_layer.Tool]:
    tools = [
        tool_layer.Tool(
            name=t.name,
            description=t.description or "",
            parameters=t.parameters or {"type": "object", "properties": {}},
            strict=bool(t.strict),
        )
        for t in body.tools
    ]
    names: set[str] = set()  # linear in the tools, as in tools.tools_from_openai
    for tool in tools:
        if tool.name in names:
            raise APIError(400, f"tools: the function name {tool.name!r} appears twice", param="tools")
        names.add(tool.name)
    choice = body.choice()
    if choice not in ("none", "auto", "required") and choice not in names:
        raise APIError(400, f"tool_choice names the function {choice!r}, which is not among the tools", param="tool_choice")
    if choice == "required" and not tools:
        raise APIError(400, "tool_choice 'required' needs at least one tool", param="tool_choice")
    return tools


def calls_possible(tools: list[tool_layer.Tool], choice: str) -> bool:
    return bool(tools) and choice != "none"


def guide(body: ResponsesRequest, tools: list[tool_layer.Tool], choice: str) -> tuple[Guide | None, str]:
    """The JSON constraint on the reply, and the request field it comes from (for errors): a
    forced tool call's own schema wins over text.format, which only shapes plain answers."""
    if calls_possible(tools, choice):
        forced = tool_layer.guide_for(tools, choice, body.parallel_tool_calls)
        if forced is not None:
            return forced, "tools"
    fmt = body.text.format
    if body.guided_regex is not None:
        if fmt.type != "text":
            raise APIError(400, "send one of text.format and guided_regex, not both", param="guided_regex")
        return GrammarGuide("regex", body.guided_regex), "guided_regex"
    if fmt.type == "json_object":
        return JsonGuide(schema=None), "text.format"
    if fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError(400, "text.format of type json_schema needs a schema", param="text.format.schema")
        return JsonGuide(schema=json.dumps(fmt.schema_), strict=fmt.strict is not False), "text.format.schema"
    return None, "text.format"


# -- replies ---------------------------------------------------------------------------------


def output_items(content: str | None, calls: list[tool_layer.ToolCall], complete: bool, reasoning: str | None = None) -> list[OutputItem]:
    status = "completed" if complete else "incomplete"
    items: list[OutputItem] = []
    if reasoning:
        items.append(reasoning_item(reasoning, status))
    if content or not calls:  # a reply with neither is an empty message, as OpenAI sends it
        items.append(OutputMessage(id=new_item_id("msg"), status=status, content=[OutputText(text=content or "")]))
    items.extend(function_call_item(call, "completed") for call in calls)
    return items


def function_call_item(call: tool_layer.ToolCall, status: str) -> OutputFunctionCall:
    arguments = call.arguments if status == "completed" else ""
    return OutputFunctionCall(id=f"fc_{call.id.removeprefix('call_')}", call_id=call.id, name=call.name, arguments=arguments, status=status)


def reasoning_item(text: str, status: str) -> OutputReasoning:
    return OutputReasoning(id=new_item_id("rs"), content=[OutputReasoningText(text=text)], status=status)


def reply_messages(items: list[OutputItem]) -> list[Message]:
    """The reply as the assistant message a later turn's history holds (its reasoning too:
    a reasoning model's template prints it before the turn's calls)."""
    content = "".join(part.text for item in items if isinstance(item, OutputMessage) for part in item.content)
    reasoning = "".join(part.text for item in items if isinstance(item, OutputReasoning) for part in item.content)
    calls = [
        {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        for item in items
        if isinstance(item, OutputFunctionCall)
    ]
    message: Message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return [message]
