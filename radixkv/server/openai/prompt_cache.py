"""OpenAI's prompt-cache options as retentions: prompt_cache_options (mode, ttl, prewarm) and the
prompt_cache_breakpoint markers on content parts become the prompt lengths a request writes (up
to four, the implicit one at the prompt's end), each retained for its ttl once the prompt is
cached; prewarm computes and retains a prompt, generates nothing, and says how much is cached.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import Request
from pydantic import ValidationError

from radixkv.engine.request import SamplingParams
from radixkv.engine.sessions import SessionRef
from radixkv.errors import InvalidRequest
from radixkv.server.errors import APIError, WireNames, engine_error, validation_error_at
from radixkv.server.openai import responses_convert as convert
from radixkv.server.openai.protocol import (
    MAX_MARKED_PARTS,
    PROMPT_CACHE_TTL_S,
    ChatCompletionRequest,
    CompletionRequest,
    PromptCacheBreakpoint,
    PromptCacheOptions,
)
from radixkv.server.openai.responses_protocol import ResponsesRequest
from radixkv.server.streaming import collect, submit, until_disconnect
from radixkv.server.tool_prompts import encode_conversation
from radixkv.server.tools import Tool, ToolChoice

if TYPE_CHECKING:
    from radixkv.server.state import AppState

# OpenAI's: each request writes at most four breakpoints, the implicit one among them.
MAX_WRITTEN_BREAKPOINTS = 4


@dataclass(frozen=True, slots=True)
class CacheWrite:
    """One breakpoint a request writes: the prompt's first num_tokens, kept for ttl_s seconds."""

    num_tokens: int
    ttl_s: float


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


def implicit_writes(options: PromptCacheOptions | None, prompts: Sequence[list[int]]) -> list[list[CacheWrite]]:
    """Completion prompts have no parts to mark: in implicit mode the whole prompt is written,
    in explicit mode nothing."""
    if options is None or options.mode == "explicit":
        return [[] for _ in prompts]
    return [[CacheWrite(len(prompt), PROMPT_CACHE_TTL_S[options.ttl])] for prompt in prompts]


# A marked part: the prompt rendered up to it (or InvalidRequest where the template will not
# render that prefix alone), and its ttl (None: the request's).
Mark = tuple[Callable[[], list[int]], str | None]


def chat_writes(
    server: AppState, body: ChatCompletionRequest, tools: list[Tool], choice: ToolChoice, prompt: list[int]
) -> list[CacheWrite]:
    """The breakpoints a chat request writes (_writes), its marked text parts rendered as the
    conversation up to the part."""
    tokenizer = server.engine.tokenizer

    def render(i: int, j: int) -> list[int]:
        cut = body.messages[i].model_copy(update={"content": body.messages[i].content[: j + 1]})  # type: ignore[index]
        messages = [*(m.as_chat() for m in body.messages[:i]), cut.as_chat()]
        return encode_conversation(tokenizer, messages, tools, choice, add_generation_prompt=False)

    marks: list[Mark] = [
        (partial(render, i, j), part.prompt_cache_breakpoint.ttl)
        for i, message in enumerate(body.messages)
        if isinstance(message.content, list)
        for j, part in enumerate(message.content)
        if part.prompt_cache_breakpoint is not None
    ]
    return _writes(body.prompt_cache_options, marks, prompt)


def responses_writes(
    server: AppState, body: ResponsesRequest, history: list[dict[str, Any]], tools: list[Tool], choice: ToolChoice, prompt: list[int]
) -> list[CacheWrite]:
    """The breakpoints a Responses request writes (_writes): its input items' marked parts,
    each rendered as the request cut after that part (on the same stored history)."""
    tokenizer = server.engine.tokenizer
    items = body.input if isinstance(body.input, list) else []

    def render(k: int, j: int) -> list[int]:
        cut = body.model_copy(update={"input": [*items[:k], {**items[k], "content": items[k]["content"][: j + 1]}]})
        messages = convert.prompt_messages(cut, convert.conversation(cut, history))
        return encode_conversation(tokenizer, messages, tools, choice, add_generation_prompt=False)

    marks: list[Mark] = []
    for k, item in enumerate(items):
        content = item.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("prompt_cache_breakpoint") is not None:
                try:
                    mark = PromptCacheBreakpoint.model_validate(part["prompt_cache_breakpoint"])
                except ValidationError as error:
                    raise validation_error_at(("input", k, "content", j, "prompt_cache_breakpoint"), error.errors()) from None
                marks.append((partial(render, k, j), mark.ttl))
    if len(marks) > MAX_MARKED_PARTS:
        raise APIError(
            400, f"at most {MAX_MARKED_PARTS} content parts may carry prompt_cache_breakpoint, got {len(marks)}",
            param="prompt_cache_breakpoint",
        )  # fmt: skip
    return _writes(body.prompt_cache_options, marks, prompt)


def _writes(options: PromptCacheOptions | None, marks: list[Mark], prompt: list[int]) -> list[CacheWrite]:
    """The latest marks (three beside the implicit one at the prompt's end, four in explicit
    mode), each as the length of its rendering that agrees with the prompt (a template closes a
    turn differently when it is the last); nothing without options or marks."""
    if options is None and not marks:
        return []
    options = options or PromptCacheOptions()
    implicit = options.mode == "implicit"
    kept = marks[len(marks) - (MAX_WRITTEN_BREAKPOINTS - int(implicit)) :] if marks else []
    default_ttl_s = PROMPT_CACHE_TTL_S[options.ttl]
    writes = []
    for render, ttl in kept:
        try:
            rendered = render()
        except (InvalidRequest, APIError):
            continue  # a prefix the template will not render alone marks nothing
        writes.append(CacheWrite(_common_prefix(rendered, prompt), PROMPT_CACHE_TTL_S[ttl] if ttl else default_ttl_s))
    if implicit:
        writes.append(CacheWrite(len(prompt), default_ttl_s))
    return writes


async def write(server: AppState, prompt: list[int], writes: list[CacheWrite], salt: str | None, owner: str) -> int:
    """Retain each breakpoint's prefix for its ttl (capped per owner as every retention is:
    Engine.retain); the tokens the longest one retained."""
    if not writes:
        return 0

    def retain_all(engine: Any) -> int:
        return max(engine.retain(prompt[: w.num_tokens], salt, w.ttl_s, owner) for w in writes)

    try:
        return await server.engine.call_async(retain_all)
    except InvalidRequest as error:
        raise engine_error(error) from None


async def cached_now(server: AppState, prompt: list[int], salt: str | None) -> int:
    """The tokens of the prompt the caller's partition holds now, RAM and disk (a pure lookup)."""
    found = await server.engine.call_async(lambda engine: engine.lookup(prompt, salt))
    return found.num_cached_tokens


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


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
    writes: list[list[CacheWrite]],
    salt: str | None,
    owner: str,
    names: WireNames,
    session: SessionRef | None = None,
) -> Prewarmed:
    """Compute each prompt (a one-token request whose token is dropped, under the key's quotas
    as any request), retain its breakpoints, and count what is cached now."""
    params = SamplingParams(max_tokens=1)
    streams = await submit(server.engine, server.metrics, prompts, params, salt, names, quotas=server.quotas, parse_slots=server.parse_slots, key=key, owner=owner, session=session)
    finals = await until_disconnect(request, collect(server.metrics, streams, 1), streams)
    now_cached = 0
    for prompt, prompt_writes in zip(prompts, writes):
        await write(server, prompt, prompt_writes, salt, owner)
        now_cached += await cached_now(server, prompt, salt)
    return Prewarmed(sum(len(p) for p in prompts), sum(f.num_cached_tokens for f in finals), now_cached)
