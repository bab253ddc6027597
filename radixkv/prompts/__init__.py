"""How a conversation becomes token ids, below the server: the one prompt encoder and `Prompt`
(`encode`), exact continuation (`continuation`) and the conversation rendered once (`conversation`).
"""

from __future__ import annotations

from radixkv.prompts.encode import (
    Message,
    Prompt,
    encode,
    encode_chat,
    encode_prompt,
    has_chat_template,
    render_chat,
    template_takes_tools,
    tokenize_rendered,
)

__all__ = [
    "Message",
    "Prompt",
    "encode",
    "encode_chat",
    "encode_prompt",
    "has_chat_template",
    "render_chat",
    "template_takes_tools",
    "tokenize_rendered",
]
