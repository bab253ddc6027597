"""Request bodies to prompt token ids: chat messages through the model's chat template,
completion prompts (text or token ids, one or a batch), and the prefix a pin request names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixkv.server.errors import APIError, context_error
from radixkv.server.protocol import ChatMessage, CompletionRequest, PinRequest

if TYPE_CHECKING:
    from radixkv.server.app import Server


def chat_prompt(server: Server, messages: list[ChatMessage], *, add_generation_prompt: bool = True) -> list[int]:
    if not messages:
        raise APIError(400, "messages must hold at least one message", param="messages")
    tokenizer = server.engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions with a prompt", param="messages")
    # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
    conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception as error:  # jinja's TemplateError, or raise_exception() inside a template
        raise APIError(400, f"the chat template refused these messages: {error}", param="messages") from None
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def completion_prompts(server: Server, body: CompletionRequest) -> list[list[int]]:
    prompts = body.prompts()
    if not prompts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    tokenizer = server.engine.tokenizer
    token_lists = [list(tokenizer(p).input_ids) if isinstance(p, str) else list(p) for p in prompts]
    if any(not tokens for tokens in token_lists):
        raise APIError(400, "prompt must hold at least one token", param="prompt")
    return token_lists


def pin_prompt(server: Server, body: PinRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give the prefix to pin as exactly one of prompt (text or token ids) or messages")
    if body.messages is not None:
        prompt = chat_prompt(server, body.messages, add_generation_prompt=False)
        param = "messages"
    else:
        prompt = list(server.engine.tokenizer(body.prompt).input_ids) if isinstance(body.prompt, str) else list(body.prompt)
        param = "prompt"
    if not prompt:
        raise APIError(400, f"{param} must hold at least one token", param=param)
    if len(prompt) >= server.engine.max_context_tokens:
        raise context_error(server.engine.max_context_tokens, len(prompt), None, param)
    return prompt
