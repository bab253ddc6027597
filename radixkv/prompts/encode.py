"""Prompt encoding: text, token ids, or chat messages (through the model's chat template) into
prompt token ids. `LLM`, the SDK and the server all encode here, so the same input always gives
the same tokens, and so the same cache hits. `Prompt` is the one record of a prompt in any form.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from radixkv.errors import InvalidRequest
from radixkv.prompts.harmony import harmony_tokens
from radixkv.prompts.harmony_render import render_harmony

Message = Mapping[str, Any]


@dataclass(slots=True)
class Prompt:
    """One prompt in any of its forms: chat messages or text, and its token ids once known.

    `add_generation_prompt=False` renders messages as a prefix (for warm and pin), without the
    assistant header that a chat template appends to ask for a reply.
    """

    messages: list[Message] | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    add_generation_prompt: bool = True

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.text is None) and self.token_ids is None:
            raise InvalidRequest("a Prompt needs exactly one of messages or text (or token ids)", param="prompt")


def encode(tokenizer: Any, prompt: Prompt | str | Sequence[int]) -> list[int]:
    """Token ids exactly as `LLM`, the SDK and `radixkv serve` compute them for the same input."""
    if not isinstance(prompt, Prompt):
        return encode_prompt(tokenizer, prompt)
    if prompt.token_ids is not None:
        return list(prompt.token_ids)
    if prompt.text is not None:
        return encode_prompt(tokenizer, prompt.text)
    return encode_chat(tokenizer, prompt.messages or [], add_generation_prompt=prompt.add_generation_prompt)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders tool definitions: its source mentions `tools` (the
    variable transformers hands it); templates that do not would silently drop them. A harmony
    model's prompts are written by radixkv/prompts/harmony_render.py, which takes them."""
    if harmony_tokens(tokenizer) is not None:
        return True
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default, or the tool-use one
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template


def encode_prompt(tokenizer: Any, prompt: str | Sequence[int]) -> list[int]:
    """Text (tokenized with the model's special tokens, as transformers does) or token ids.
    An empty result is the engine's to refuse (Engine.check_request), like every length."""
    return list(tokenizer(prompt).input_ids) if isinstance(prompt, str) else list(prompt)


def encode_chat(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    param: str = "messages",
    tools: list[dict] | None = None,
) -> list[int]:
    """Messages rendered by the chat template; add_generation_prompt=False renders them as the
    beginning of a longer conversation (for warming and pinning a prefix). `tools` (OpenAI's
    function definitions) go to templates that take them (see template_takes_tools)."""
    text = render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt, param=param, tools=tools)
    return tokenize_rendered(tokenizer, text)


def tokenize_rendered(tokenizer: Any, text: str) -> list[int]:
    """Token ids of rendered template text: its special tokens are already written out."""
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def render_chat(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    param: str = "messages",
    tools: list[dict] | None = None,
) -> str:
    """The chat template's text for these messages (what encode_chat tokenizes): where each
    message lies in a prompt is found in it (radixkv/server/cache_report.py)."""
    if not messages:
        raise InvalidRequest(f"{param} must hold at least one message", param=param)
    if harmony_tokens(tokenizer) is not None:  # gpt-oss: written as openai-harmony writes it, template or none
        return render_harmony(messages, tools, add_generation_prompt=add_generation_prompt)
    if not has_chat_template(tokenizer):
        raise InvalidRequest("this model has no chat template; send a prompt (text or token ids) instead", param=param)
    # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
    conversation = [{**m, "role": "system" if m.get("role") == "developer" else m.get("role")} for m in messages]
    try:
        extra = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False, **extra)
    except Exception as error:  # jinja's TemplateError, or raise_exception() inside a template
        raise InvalidRequest(f"the chat template refused these messages: {error}", param=param) from None
    return text
