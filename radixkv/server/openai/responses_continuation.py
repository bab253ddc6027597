"""Exact continuation for previous_response_id: a turn's prompt built from the stored ids of
the turn it follows (its prompt and its reply as generated) and the template's text after that
reply, when its instructions and tools are the same; and the ids a finished turn is stored with.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from typing import TYPE_CHECKING, Any

from radixkv.prompts.continuation import continue_after, continue_after_harmony, reply_ids
from radixkv.engine.request_output import RequestOutput
from radixkv.prompts import tools as tool_prompts
from radixkv.server.openai import responses_convert as convert
from radixkv.server.openai.responses_protocol import ResponsesRequest
from radixkv.server.openai.responses_store import ResponseStore, TurnIds
from radixkv.server.tools import Tool

if TYPE_CHECKING:
    from radixkv.server.state import AppState

Message = dict[str, Any]


def context_key(body: ResponsesRequest) -> str:
    """What a stored prompt was rendered with besides the conversation: the instructions (which
    OpenAI never carries over) and the tools. A turn that changes either is re-rendered."""
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    return hashlib.sha256(json.dumps([body.instructions, tools], sort_keys=True, default=str).encode()).hexdigest()


def continued_prompt(
    server: AppState, store: ResponseStore, body: ResponsesRequest, owner: str, history: list[Message],
    messages: list[Message], tools: list[Tool],
) -> list[int] | None:  # fmt: skip
    """The prompt continuing from the previous turn's stored ids, or None (continuation off, no
    ids stored, other instructions or tools, a reply that was not plain text, or for harmony
    not the stored reply): re-render then."""
    if body.previous_response_id is None or not server.limits.exact_continuation or not history:
        return None
    ids = store.ids_of(body.previous_response_id, owner)
    if ids is None or ids.context_key != context_key(body):
        return None
    tokenizer = server.engine.tokenizer
    prompt_messages = tool_prompts.normalize_messages(convert.prompt_messages(body, messages))
    reply_index = len(convert.prompt_messages(body, history)) - 1

    def render(ms: list[Message]) -> str:
        return tool_prompts.render_conversation(tokenizer, ms, tools)

    marks = server.reply_format.harmony
    if marks is not None:

        def render_through(ms: list[Message]) -> str:
            return tool_prompts.render_conversation(tokenizer, ms, tools, add_generation_prompt=False)

        return continue_after_harmony(tokenizer, render, render_through, prompt_messages, reply_index, ids.token_ids, ids.num_reply_tokens, marks)
    return continue_after(tokenizer, render, prompt_messages, reply_index, ids.token_ids, ids.num_reply_tokens)


def turn_ids(server: AppState, body: ResponsesRequest, prompt: list[int], final: RequestOutput) -> TurnIds | None:
    """What a finished turn is stored with for the next to continue from: its prompt and its
    reply's ids, when they decode to the reply's text exactly (else None: a stop string cut it);
    a harmony reply's ids whole, markers and reasoning included, when it ended on its own stop."""
    if not server.limits.exact_continuation:
        return None
    output = final.outputs[0]
    marks = server.reply_format.harmony
    if marks is not None:
        reply = list(output.token_ids) if output.token_ids and output.token_ids[-1] in marks.stops else None
    else:
        reply = reply_ids(server.engine.tokenizer, output.text, output.token_ids)
    if reply is None:
        return None
    return TurnIds(array("i", prompt + reply), len(reply), context_key(body))
