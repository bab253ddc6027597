"""Prompts to token ids through radixkv.prompts (the encoder LLM and the SDK use), for every
API family: a conversation of chat messages (with its tools, through
radixkv.prompts.tools) and completion prompts (text or token ids, one or a batch); a
caller's earlier replies spliced back in as their generated ids (radixkv.prompts.replies).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from radixkv.errors import InvalidRequest
from radixkv.prompts import encode_prompt
from radixkv.prompts.conversation import EncodedConversation
from radixkv.prompts.replies import encode_conversation_exact
from radixkv.server.errors import APIError, engine_error
from radixkv.prompts.tools import Tool, ToolChoice

if TYPE_CHECKING:
    from radixkv.server.state import AppState


def chat_prompt(server: AppState, conversation: Sequence[Mapping[str, Any]], *args: Any, **options: Any) -> list[int]:
    """chat_conversation's token ids (its arguments): one encoder for chat and pins alike, so a
    pinned conversation is the prefix of its next turn."""
    return chat_conversation(server, conversation, *args, **options).token_ids


def chat_conversation(
    server: AppState,
    conversation: Sequence[Mapping[str, Any]],
    tools: list[Tool] | None = None,
    tool_choice: ToolChoice = "none",
    *,
    add_generation_prompt: bool = True,
    owner: str | None = None,
    salt: str | None = None,
) -> EncodedConversation:
    """The conversation rendered once, knowing where its parts start (for the cache report and
    breakpoints). With an owner, that owner's earlier replies in the cache partition `salt` (the
    request's Tenants.cache_salt) go back in as the ids they were generated as (exact
    continuation, radixkv.prompts.replies), when the server has it on."""
    replies = server.replies if owner is not None else None
    engine = server.engine
    try:
        return encode_conversation_exact(
            replies, owner, engine.tokenizer, list(conversation), tools or [], tool_choice,
            salt=salt, max_context_tokens=engine.max_context_tokens, add_generation_prompt=add_generation_prompt,
        )  # fmt: skip
    except InvalidRequest as error:
        raise engine_error(error) from None


def completion_prompts(server: AppState, prompts: Sequence[str | list[int]]) -> list[list[int]]:
    if not prompts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    token_lists = [encode_prompt(server.engine.tokenizer, p) for p in prompts]
    if any(not tokens for tokens in token_lists):
        raise APIError(400, "prompt must hold at least one token", param="prompt")
    return token_lists
