"""An Anthropic Messages request as radixkv sees it: the conversation as chat messages for
tools.encode_conversation, the tools and tool choice in tools' terms, and the token length of
the prompt up to each cache_control breakpoint (with its ttl), for retention and usage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from radixkv.engine.request import Keep
from radixkv.errors import InvalidRequest
from radixkv.prompts import tools as tool_prompts
from radixkv.server import keeps
from radixkv.server.anthropic.protocol import (
    CacheControl,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from radixkv.prompts.conversation import EncodedConversation
from radixkv.prompts.tools import Tool


@dataclass(frozen=True, slots=True)
class Conversation:
    messages: list[dict[str, Any]]  # transformers' chat format
    tools: list[Tool]
    tool_choice: str  # tools' ToolChoice: "none" | "auto" | "required" | a tool name
    parallel_tool_calls: bool


def conversation(body: MessagesRequest) -> Conversation:
    tools = _tools(body)
    choice, parallel = _tool_choice(body, tools)
    return Conversation(_chat_messages(body, None), tools, choice, parallel)


def encode(tokenizer: Any, conv: Conversation, *, add_generation_prompt: bool = True) -> list[int]:
    return tool_prompts.encode_conversation(
        tokenizer, conv.messages, conv.tools, conv.tool_choice, add_generation_prompt=add_generation_prompt
    )


def breakpoints(
    tokenizer: Any, body: MessagesRequest, conv: Conversation, prompt: list[int], encoded: EncodedConversation | None = None
) -> list[Keep]:
    """Each cache_control breakpoint as a keep (server/keeps.py) of a prompt length: the
    prompt's tokens up to the marked block, read off `encoded` (the prompt's one rendering)
    where the caller has it, else the conversation up to the block rendered alone and counted
    only as far as it agrees with the whole prompt (tool_prompts.prefix_tokens)."""
    found: list[Keep] = []
    for cut, control in _marks(body):
        messages = _chat_messages(body, cut)
        if not messages:
            continue
        try:
            num_tokens = tool_prompts.prefix_tokens(tokenizer, prompt, conv.messages, messages, conv.tools, conv.tool_choice, encoded)
        except InvalidRequest:
            continue  # a prefix the template will not render alone marks nothing
        found.append(keeps.cache_control(num_tokens, control.ttl))
    return found


# -- internals -------------------------------------------------------------------------------

Cut = tuple[int, int]  # (message index, block index): keep everything up to that block; -1: the system


def _marks(body: MessagesRequest) -> list[tuple[Cut, CacheControl]]:
    marks: list[tuple[Cut, CacheControl]] = []
    tool_marks = [t.cache_control for t in body.tools or [] if t.cache_control is not None]
    system = body.system_blocks()
    if tool_marks:
        marks.append(((-1, 0) if system else (0, 0), tool_marks[-1]))  # tools render beside the first turn
    marks += [((-1, j), b.cache_control) for j, b in enumerate(system) if b.cache_control is not None]
    for i, message in enumerate(body.messages):
        blocks = message.blocks()  # thinking blocks carry no cache_control
        marks += [((i, j), b.cache_control) for j, b in enumerate(blocks) if getattr(b, "cache_control", None) is not None]
    return marks


def _chat_messages(body: MessagesRequest, cut: Cut | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.system_blocks()
    if system:
        end = cut[1] + 1 if cut is not None and cut[0] == -1 else len(system)
        out.append({"role": "system", "content": "".join(b.text for b in system[:end])})
        if cut is not None and cut[0] == -1:
            return out
    for i, message in enumerate(body.messages):
        blocks = message.blocks()
        if cut is not None and i == cut[0]:
            blocks = blocks[: cut[1] + 1]
        out += _assistant(blocks) if message.role == "assistant" else _user(blocks, i)
        if cut is not None and i == cut[0]:
            break
    return out


def _user(blocks: list[Any], index: int) -> list[dict[str, Any]]:
    misplaced = next((b.type for b in blocks if isinstance(b, (ToolUseBlock, ThinkingBlock, RedactedThinkingBlock))), None)
    if misplaced is not None:
        raise InvalidRequest(f"messages.{index}: {misplaced} blocks belong in assistant messages", param=f"messages.{index}")
    # Anthropic puts tool results first in a user turn; chat templates want them as tool messages.
    out: list[dict[str, Any]] = [
        {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()} for b in blocks if isinstance(b, ToolResultBlock)
    ]
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


def _assistant(blocks: list[Any]) -> list[dict[str, Any]]:
    message: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in blocks if isinstance(b, TextBlock))}
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
        for b in blocks
        if isinstance(b, ToolUseBlock)
    ]
    if calls:
        message["tool_calls"] = calls
    thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    if thinking:
        message["reasoning_content"] = thinking
    return [message]


def _tools(body: MessagesRequest) -> list[Any]:
    if not body.tools:
        return []
    names = [t.name for t in body.tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools: tool names must be unique", param="tools")
    return [Tool(name=t.name, description=t.description, parameters=t.input_schema) for t in body.tools]


def _tool_choice(body: MessagesRequest, tools: list[Any]) -> tuple[str, bool]:
    choice = body.tool_choice
    if choice is None:
        return ("auto" if tools else "none"), True
    parallel = not choice.disable_parallel_tool_use
    if choice.type in ("any", "tool") and not tools:
        raise InvalidRequest(f"tool_choice {choice.type!r} needs tools", param="tool_choice")
    if choice.type == "tool":
        if choice.name not in {t.name for t in tools}:
            raise InvalidRequest(f"tool_choice.name {choice.name!r} is not one of the tools", param="tool_choice.name")
        return choice.name, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel
