"""Request bodies to prompt token ids through radixkv.prompts (the encoder LLM and the SDK use):
chat messages (with their tools, through radixkv.server.tools), completion prompts (text or
token ids, one or a batch), and the prefix a pin request names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixkv.errors import InvalidRequest
from radixkv.prompts import encode_prompt
from radixkv.server.errors import APIError, context_error, engine_error
from radixkv.server.protocol import ChatMessage, CompletionRequest, PinRequest
from radixkv.server.tools import Tool, ToolChoice, encode_conversation

if TYPE_CHECKING:
    from radixkv.server.state import Server


def chat_prompt(
    server: Server,
    messages: list[ChatMessage],
    tools: list[Tool] | None = None,
    tool_choice: ToolChoice = "none",
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """One encoder for chat and pins alike, so a pinned conversation is the prefix of its next turn."""
    conversation = [m.as_chat() for m in messages]
    try:
        return encode_conversation(
            server.engine.tokenizer, conversation, tools or [], tool_choice, add_generation_prompt=add_generation_prompt
        )
    except InvalidRequest as error:
        raise engine_error(error) from None


def completion_prompts(server: Server, body: CompletionRequest) -> list[list[int]]:
    prompts = body.prompts()
    if not prompts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    token_lists = [encode_prompt(server.engine.tokenizer, p) for p in prompts]
    if any(not tokens for tokens in token_lists):
        raise APIError(400, "prompt must hold at least one token", param="prompt")
    return token_lists


def check_token_ids(server: Server, token_ids: list[int], param: str) -> None:
    vocab = server.engine.vocab_size
    if any(isinstance(t, bool) or not 0 <= t < vocab for t in token_ids):
        raise APIError(400, f"{param}: token ids must be integers in [0, {vocab})", param=param)


def pin_prompt(server: Server, body: PinRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give the prefix to pin as exactly one of prompt (text or token ids) or messages")
    if body.messages is not None:
        prompt = chat_prompt(server, body.messages, add_generation_prompt=False)
        param = "messages"
    else:
        prompt = encode_prompt(server.engine.tokenizer, body.prompt)  # type: ignore[arg-type]
        param = "prompt"
        if isinstance(body.prompt, list):
            # A lookup never reaches the engine's request check: out-of-range ids are refused
            # here as a request's would be, not looked up (or hashed) as if they were tokens.
            check_token_ids(server, prompt, param)
    if not prompt:
        raise APIError(400, f"{param} must hold at least one token", param=param)
    if len(prompt) >= server.engine.max_context_tokens:
        raise context_error(server.engine.max_context_tokens, len(prompt), None, param)
    return prompt
