"""OpenAI's prompt-cache options on a request: prompt_cache_options (mode, ttl, prewarm) checked,
the prompt_cache_breakpoint markers on content parts found and rendered (server/keeps.py makes
them keeps the engine applies once the prompt is computed); prewarm computes a prompt with its
keeps, generates nothing, and says how much is cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import Request
from pydantic import ValidationError

from radixkv.engine.request import Keep
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.sessions import SessionRef
from radixkv.server import keeps
from radixkv.server.errors import APIError, WireNames, validation_error_at
from radixkv.server.openai import responses_convert as convert
from radixkv.server.openai.protocol import (
    MAX_MARKED_PARTS,
    ChatCompletionRequest,
    CompletionRequest,
    PromptCacheBreakpoint,
    PromptCacheOptions,
)
from radixkv.server.openai.responses_protocol import ResponsesRequest
from radixkv.server.streaming import collect, submit, until_disconnect
from radixkv.prompts.conversation import EncodedConversation
from radixkv.prompts.tools import Tool, ToolChoice, prefix_tokens

if TYPE_CHECKING:
    from radixkv.server.state import AppState


def check_options(body: ChatCompletionRequest | CompletionRequest | ResponsesRequest) -> None:
    """Refuse what OpenAI refuses, before any work: both lifetimes at once, and prewarm with
    n > 1 or a stream (a prewarm answers once, with no output)."""
    options = body.prompt_cache_options
    if options is None:
        return
    if getattr(body, "prompt_cache_retention", None) is not None and "ttl" in options.model_fields_set:
        raise APIError(400, "send prompt_cache_options.ttl or prompt_cache_retention, not both", param="prompt_cache_options.ttl")
    if options.prewarm and (body.stream or getattr(body, "n", 1) != 1):
        raise APIError(400, "a prewarm request generates nothing: it takes neither stream nor n > 1", param="prompt_cache_options.prewarm")


def chat_writes(
    server: AppState, body: ChatCompletionRequest, tools: list[Tool], choice: ToolChoice, prompt: list[int],
    encoded: EncodedConversation | None = None,
) -> tuple[Keep, ...]:  # fmt: skip
    """The breakpoints a chat request writes (keeps.breakpoint_writes), each marked text part
    as the prompt's tokens up to it: read off `encoded`, the prompt's one rendering, where the
    route has it, else the conversation up to the part rendered alone (prefix_tokens)."""
    tokenizer = server.engine.tokenizer

    def measure(i: int, j: int) -> int:
        cut = body.messages[i].model_copy(update={"content": body.messages[i].content[: j + 1]})  # type: ignore[index]
        messages = [*whole[:i], cut.as_chat()]
        return prefix_tokens(tokenizer, prompt, whole, messages, tools, choice, encoded)

    marks: list[keeps.Mark] = [
        (partial(measure, i, j), part.prompt_cache_breakpoint.ttl)
        for i, message in enumerate(body.messages)
        if isinstance(message.content, list)
        for j, part in enumerate(message.content)
        if part.prompt_cache_breakpoint is not None
    ]
    whole = [m.as_chat() for m in body.messages] if marks else []
    return keeps.breakpoint_writes(body.prompt_cache_options, marks, prompt)


def responses_writes(
    server: AppState, body: ResponsesRequest, history: list[dict[str, Any]], tools: list[Tool], choice: ToolChoice, prompt: list[int],
    encoded: EncodedConversation | None = None,
) -> tuple[Keep, ...]:  # fmt: skip
    """The breakpoints a Responses request writes (keeps.breakpoint_writes): its input items'
    marked parts, each as the prompt's tokens up to the request cut after that part (on the
    same stored history), read off `encoded` where the route has it (prefix_tokens)."""
    tokenizer = server.engine.tokenizer
    items = body.input if isinstance(body.input, list) else []

    def measure(k: int, j: int) -> int:
        cut = body.model_copy(update={"input": [*items[:k], {**items[k], "content": items[k]["content"][: j + 1]}]})
        messages = convert.prompt_messages(cut, convert.conversation(cut, history))
        return prefix_tokens(tokenizer, prompt, whole, messages, tools, choice, encoded)

    marks: list[keeps.Mark] = []
    for k, item in enumerate(items):
        content = item.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("prompt_cache_breakpoint") is not None:
                try:
                    mark = PromptCacheBreakpoint.model_validate(part["prompt_cache_breakpoint"])
                except ValidationError as error:
                    raise validation_error_at(("input", k, "content", j, "prompt_cache_breakpoint"), error.errors()) from None
                marks.append((partial(measure, k, j), mark.ttl))
    if len(marks) > MAX_MARKED_PARTS:
        raise APIError(
            400, f"at most {MAX_MARKED_PARTS} content parts may carry prompt_cache_breakpoint, got {len(marks)}",
            param="prompt_cache_breakpoint",
        )  # fmt: skip
    whole = convert.prompt_messages(body, convert.conversation(body, history)) if marks and encoded is not None else []
    return keeps.breakpoint_writes(body.prompt_cache_options, marks, prompt)


async def cached_now(server: AppState, prompt: list[int], salt: str | None) -> int:
    """The tokens of the prompt the caller's partition holds now, RAM and disk (a pure lookup)."""
    found = await server.engine.call_async(lambda engine: engine.lookup(prompt, salt))
    return found.num_cached_tokens


@dataclass(frozen=True, slots=True)
class Prewarmed:
    """What a prewarm did: the prompts' tokens, those the cache served, those cached now."""

    num_prompt_tokens: int
    num_cached_tokens: int  # served by the cache when the prompt was computed
    num_now_cached_tokens: int  # the cache holds now (RAM and disk): what a client may rely on

    @property
    def num_written_tokens(self) -> int:
        return max(0, self.num_now_cached_tokens - self.num_cached_tokens)


async def prewarm(
    server: AppState,
    request: Request,
    key: bytes | None,
    prompts: list[list[int]],
    writes: list[tuple[Keep, ...]],
    salt: str | None,
    owner: str,
    names: WireNames,
    session: SessionRef | None = None,
) -> Prewarmed:
    """Compute each prompt (a one-token request whose token is dropped, under the key's quotas
    as any request) with its breakpoints as keeps, and count what is cached now."""
    params = SamplingParams(max_tokens=1)
    streams = await submit(
        server.engine, server.metrics, prompts, params, salt, names, quotas=server.quotas, parse_slots=server.parse_slots, key=key, owner=owner,
        session=session, keeps=writes,
    )  # fmt: skip
    finals = await until_disconnect(request, collect(server.metrics, streams, 1), streams)
    now_cached = 0
    for prompt in prompts:
        now_cached += await cached_now(server, prompt, salt)
    return Prewarmed(sum(len(p) for p in prompts), sum(f.num_cached_tokens for f in finals), now_cached)
