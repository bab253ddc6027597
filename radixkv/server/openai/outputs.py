"""OpenAI's chat and completion replies: the engine's outputs as response bodies and SSE chunks,
text, tool calls (radixkv.server.tools, split off the reply whole or as it streams), logprobs
(radixkv.server.logprobs), usage and the cache report riding the last chunk.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixkv.engine.async_engine import EngineStepError, EngineStopped, RequestStream
from radixkv.engine.request_output import CompletionDelta, CompletionOutput, RequestOutput
from radixkv.server.cache_report import CacheReporter
from radixkv.server.continuation import ReplyCollector
from radixkv.server.errors import APIError, engine_error
from radixkv.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from radixkv.server.metrics import ServerMetrics
from radixkv.server import keeps
from radixkv.server.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    CompletionTokensDetails,
    Delta,
    DeltaFunction,
    DeltaToolCall,
    ReplyFunction,
    ReplyToolCall,
    Usage,
    make_usage,
    PromptCacheKept,
    new_id,
    now_s,
)
from radixkv.server.streaming import merge, sse
from radixkv.server.reply_format import Reply, ReplyFormat
from radixkv.server.tools import Tool, ToolCall, ToolChoice

if TYPE_CHECKING:
    from radixkv.server.state import AppState

# A cache report on the wire (server/cache_report.py): one prompt's, or a batch's in order.
Report = dict[str, Any] | list[dict[str, Any] | None] | None


@dataclass(frozen=True, slots=True)
class ChatTools:
    """A chat request's tools, its checked tool_choice, whether calls may come in parallel, and
    the model's reply format that splits the reply."""

    tools: list[Tool]
    choice: ToolChoice
    parallel: bool
    format: ReplyFormat


def _reply_calls(calls: list[ToolCall]) -> list[ReplyToolCall] | None:
    return [ReplyToolCall(id=c.id, function=ReplyFunction(name=c.name, arguments=c.arguments)) for c in calls] or None


def _finish_reason(engine_reason: str, has_calls: bool) -> str:
    """OpenAI's: "tool_calls" for a reply that ended on its calls; one cut off by max_tokens is
    "length" whatever calls it completed (a client then knows more were on the way)."""
    return "tool_calls" if has_calls and engine_reason != "length" else engine_reason


def _chat_choice(texts: TokenTexts, body: ChatCompletionRequest, output: CompletionOutput, reply: Reply) -> ChatChoice:
    return ChatChoice(
        index=output.index,
        message=AssistantMessage(content=reply.content, tool_calls=_reply_calls(reply.calls), reasoning_content=reply.reasoning),
        finish_reason=_finish_reason(output.finish_reason, bool(reply.calls)),
        logprobs=chat_logprobs(texts, output.logprobs, body.top_logprobs or 0) if body.logprobs else None,
    )


def chat_response(server: AppState, texts: TokenTexts, body: ChatCompletionRequest, tools: ChatTools, final: RequestOutput) -> ChatCompletion:
    replies = [(o, tools.format.parse(o.text, o.token_ids, tools.tools, tools.choice, body.stop_list())) for o in final.outputs]
    return ChatCompletion(
        id=new_id("chatcmpl"),
        created=now_s(),
        model=server.model_name,
        choices=[_chat_choice(texts, body, o, reply) for o, reply in replies],
        usage=with_reasoning(usage([final]), tools.format, sum(reply.reasoning_tokens for _, reply in replies)),
    )


def with_reasoning(made: Usage, reply_format: ReplyFormat, reasoning_tokens: int) -> Usage:
    """usage with its completion_tokens_details where the model reasons (harmony)."""
    if reply_format.harmony is not None:
        made.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
    return made


def completion_response(server: AppState, texts: TokenTexts, body: CompletionRequest, finals: list[RequestOutput], n: int) -> Completion:
    def logprobs(o: CompletionOutput) -> dict | None:
        return None if body.logprobs is None else completion_logprobs(texts, o.logprobs, body.logprobs)

    return Completion(
        id=new_id("cmpl"),
        created=now_s(),
        model=server.model_name,
        choices=[
            CompletionChoice(index=i * n + o.index, text=o.text, finish_reason=o.finish_reason, logprobs=logprobs(o))
            for i, final in enumerate(finals)
            for o in final.outputs
        ],
        usage=usage(finals),
    )


class _ChatChoiceStream:
    """One streamed chat choice split by the model's reply format (server/reply_format.py):
    reasoning and content pass through; each finished call is sent as OpenAI sends one (its id,
    type and name with arguments "", then its arguments), and the last chunk says "tool_calls"
    when any call was made."""

    def __init__(self, texts: TokenTexts, body: ChatCompletionRequest, tools: ChatTools, index: int) -> None:
        self._texts, self._body, self._index = texts, body, index
        self._calls = tools.format.stream(tools.tools, tools.choice, body.stop_list())

    @property
    def reasoning_tokens(self) -> int:
        return self._calls.reasoning_tokens

    def choices(self, delta: CompletionDelta) -> list[ChatChunkChoice]:
        piece = self._calls.feed(delta.text, delta.token_ids)
        out: list[ChatChunkChoice] = []
        logprobs = chat_logprobs(self._texts, delta.logprobs, self._body.top_logprobs or 0) if self._body.logprobs else None
        if piece.reasoning:
            out.append(self._choice(Delta(reasoning_content=piece.reasoning)))
        if piece.content or logprobs:
            out.append(self._choice(Delta(content=piece.content or None), logprobs=logprobs))
        out += self._call_choices(piece.calls, self._calls.num_calls - len(piece.calls))
        if delta.finish_reason is not None:
            piece = self._calls.finish()
            if piece.reasoning:
                out.append(self._choice(Delta(reasoning_content=piece.reasoning)))
            if piece.content:
                out.append(self._choice(Delta(content=piece.content)))
            out += self._call_choices(piece.calls, self._calls.num_calls - len(piece.calls))
            finish = _finish_reason(delta.finish_reason, self._calls.num_calls > 0)
            out.append(self._choice(Delta(), finish_reason=finish))
        return out

    def _call_choices(self, calls: list[ToolCall], first_index: int) -> list[ChatChunkChoice]:
        out = []
        for k, call in enumerate(calls, start=first_index):
            head = DeltaToolCall(index=k, id=call.id, type="function", function=DeltaFunction(name=call.name, arguments=""))
            out.append(self._choice(Delta(tool_calls=[head])))
            out.append(self._choice(Delta(tool_calls=[DeltaToolCall(index=k, function=DeltaFunction(arguments=call.arguments))])))
        return out

    def _choice(self, delta: Delta, *, finish_reason: str | None = None, logprobs: dict | None = None) -> ChatChunkChoice:
        return ChatChunkChoice(index=self._index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)


async def chat_events(
    server: AppState, texts: TokenTexts, body: ChatCompletionRequest, tools: ChatTools, streams: list[RequestStream], n: int,
    reporter: CacheReporter,
    replies: ReplyCollector,
) -> AsyncIterator[str]:
    chunk_id, created, model = new_id("chatcmpl"), now_s(), server.model_name
    per_choice = [_ChatChoiceStream(texts, body, tools, j) for j in range(n)]

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None, report: Report = None) -> str:
        if usage is not None:
            usage = with_reasoning(usage, tools.format, sum(c.reasoning_tokens for c in per_choice))
        payload = ChatCompletionChunk(id=chunk_id, created=created, model=model, choices=choices, usage=usage)
        return _sse_data(payload, body.include_usage, report)

    def choice(_: int, c: CompletionDelta) -> list[ChatChunkChoice]:
        return per_choice[c.index].choices(c)

    opening = chunk([ChatChunkChoice(index=j, delta=Delta(role="assistant", content="")) for j in range(n)])
    async for event in text_events(server.metrics, streams, n, body, chunk, choice, opening, reporter.one, replies.finished):
        yield event


async def completion_events(
    server: AppState, texts: TokenTexts, body: CompletionRequest, streams: list[RequestStream], n: int, reporter: CacheReporter
) -> AsyncIterator[str]:
    chunk_id, created, model = new_id("cmpl"), now_s(), server.model_name
    text_offsets: dict[int, int] = {}  # characters each choice has sent, for logprobs' text_offset

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None, report: Report = None) -> str:
        payload = Completion(id=chunk_id, created=created, model=model, choices=choices, usage=usage)
        return _sse_data(payload, body.include_usage, report)

    def choice(i: int, c: CompletionDelta) -> list[CompletionChoice]:
        if not c.text and not c.logprobs and c.finish_reason is None:
            return []  # ids that decode to nothing yet: a completion sends text alone
        index = i * n + c.index
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(texts, c.logprobs, body.logprobs, text_offsets.get(index, 0))
        text_offsets[index] = text_offsets.get(index, 0) + len(c.text)
        return [CompletionChoice(index=index, text=c.text, finish_reason=c.finish_reason, logprobs=logprobs)]

    async for event in text_events(server.metrics, streams, n, body, chunk, choice, reports=reporter.for_prompts):
        yield event


def _sse_data(payload: ChatCompletionChunk | Completion, include_usage: bool, report: Report = None) -> str:
    data = payload.model_dump()
    for choice in data["choices"]:
        # OpenAI's call deltas leave out what they do not carry; clients merge present keys, so
        # an explicit null would erase the call's id, type or name.
        for call in (choice.get("delta") or {}).get("tool_calls") or []:
            for holder in (call, call["function"]):
                for key in [k for k, v in holder.items() if v is None]:
                    del holder[key]
    if not include_usage:
        data.pop("usage")
    if report is not None:
        data["cache_report"] = report
    return sse(data)


async def text_events(
    metrics: ServerMetrics,
    streams: list[RequestStream],
    n: int,
    body: ChatCompletionRequest | CompletionRequest,
    chunk: Callable[..., str],
    choice: Callable[[int, CompletionDelta], Sequence[ChatChunkChoice | CompletionChoice]],
    opening: str | None = None,
    reports: Callable[[list[RequestOutput]], Awaitable[Report]] | None = None,
    on_final: Callable[[RequestOutput], None] | None = None,
) -> AsyncIterator[str]:
    """The SSE events of a streamed chat or completion: each choice's new text as the engine
    hands it out (already safe from stop strings), the usage chunk when asked for, and [DONE];
    an error mid-stream ends it with an error event. chunk(choices, usage) formats one event;
    choice(prompt index, completion delta) gives that completion's choices in order (a tool
    call takes several), and event k holds the k-th of each, so no event names an index twice.
    A cache report (`reports`, when asked for) rides the last chunk, beside usage."""
    finals: list[RequestOutput] = []
    try:
        if opening is not None:
            yield opening
        async with aclosing(merge(metrics, streams, n)) as merged:
            async for i, delta in merged:
                if any(c.finish_reason == "abort" for c in delta.completions):
                    raise APIError(503, "the request was aborted", type="server_error", code="aborted")
                # Ids without text too: a harmony reply's markers decode to nothing, and chat reads them.
                per_completion = [
                    choice(i, c) for c in delta.completions if c.text or c.token_ids or c.logprobs or c.finish_reason is not None
                ]
                for k in range(max(map(len, per_completion), default=0)):
                    yield chunk([choices[k] for choices in per_completion if k < len(choices)])
                if delta.output is not None:
                    finals.append(delta.output)
                    if on_final is not None:
                        on_final(delta.output)
        report = await reports(finals) if reports is not None else None
        if body.include_usage or report is not None:
            yield chunk([], usage(finals), report)
        yield "data: [DONE]\n\n"
    except (APIError, EngineStepError, EngineStopped) as error:
        api_error = error if isinstance(error, APIError) else engine_error(error)
        yield sse(api_error.body())


def usage(finals: Sequence[RequestOutput]) -> Usage:
    """The prompts' and replies' tokens, those the cache served, and what stays kept until when."""
    made = make_usage(
        sum(f.num_prompt_tokens for f in finals),
        sum(f.num_output_tokens for f in finals),
        sum(f.num_cached_tokens for f in finals),
    )
    made.prompt_cache_kept = PromptCacheKept(**keeps.prompt_cache_kept(finals))
    return made
