"""OpenAI's API: /v1/models, /v1/chat/completions and /v1/completions, streamed or not. Owns
turning a request body into a prompt, its tools and guide (its SamplingParams come from
server.sampling; the engine alone checks the context), and the engine's outputs into OpenAI's
responses and stream chunks: text, tool calls (radixkv.server.tools) and logprobs
(radixkv.server.logprobs).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixkv.engine.async_engine import EngineStepError, EngineStopped, RequestStream
from radixkv.engine.request import Keep
from radixkv.engine.request_output import CompletionDelta, CompletionOutput, RequestOutput
from radixkv.engine.sampling_params import Guide, SamplingParams
from radixkv.errors import InvalidRequest
from radixkv.server import keeps, sampling
from radixkv.server.cache_report import CacheReporter, ChatSource, wanted
from radixkv.server.continuation import ReplyCollector
from radixkv.server.encode import chat_prompt, completion_prompts
from radixkv.server.errors import (
    WireNames,
    APIError,
    engine_error,
    parse_body,
)
from radixkv.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from radixkv.server.metrics import ServerMetrics
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
    Delta,
    DeltaFunction,
    DeltaToolCall,
    ModelCard,
    ModelList,
    ReplyFunction,
    ReplyToolCall,
    Usage,
    make_usage,
    new_id,
    now_s,
)
from radixkv.server.openai import prompt_cache
from radixkv.server.sessions import session_ref
from radixkv.server.streaming import (
    SSEResponse,
    collect,
    merge,
    sse,
    submit,
    until_disconnect,
)
from radixkv.server.tools import (
    Tool,
    ToolCall,
    ToolCallStream,
    ToolChoice,
    guide_for,
    parse_reply,
    response_format_guide,
    tool_choice_from_openai,
    tools_from_openai,
)

if TYPE_CHECKING:
    from radixkv.server.state import AppState

logger = logging.getLogger("radixkv.server")
# A cache report on the wire (server/cache_report.py): one prompt's, or a batch's in order.
Report = dict[str, Any] | list[dict[str, Any] | None] | None


@dataclass(frozen=True, slots=True)
class _ChatTools:
    """A chat request's tools, its checked tool_choice, and whether calls may come in parallel."""

    tools: list[Tool]
    choice: ToolChoice
    parallel: bool


def register(app: FastAPI, server: AppState) -> None:
    @app.get("/v1/models")
    async def list_models(request: Request) -> ModelList:
        server.tenants.authenticate_headers(request.headers)
        return ModelList(data=[_model_card(server)])

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> ModelCard:
        server.tenants.authenticate_headers(request.headers)
        server.check_model(model)
        return _model_card(server)

    texts = TokenTexts(server.engine.tokenizer)  # token text and bytes for logprobs, cached per id

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        key = server.tenants.authenticate_headers(request.headers)
        raw = await request.body()
        owner = server.tenants.owner(key)

        def prepare() -> tuple[ChatCompletionRequest, _ChatTools, list[int], WireNames, SamplingParams, tuple[Keep, ...], str | None]:
            body = parse_body(ChatCompletionRequest, raw)
            _check_request(server, body)
            prompt_cache.check_options(body)
            tools = _chat_tools(body)
            salt = server.tenants.cache_salt(key, body.cache_salt)
            prompt = chat_prompt(server, [m.as_chat() for m in body.messages], tools.tools, tools.choice, owner=owner, salt=salt)
            guide, guide_param = _chat_guide(body, tools)
            names = sampling.chat_names(body, guide_param)
            writes = prompt_cache.chat_writes(server, body, tools.tools, tools.choice, prompt)
            return body, tools, prompt, names, sampling.chat_params(body, names, guide), writes, salt

        body, tools, prompt, names, params, writes, salt = await server.parse_slots.run(key, prepare)
        session = session_ref(request.headers, owner, body.prompt_cache_key, server.tenants.session_namespace(salt))
        if body.prompt_cache_options is not None and body.prompt_cache_options.prewarm:
            done = await prompt_cache.prewarm(server, request, key, [prompt], [writes], salt, owner, names, session)
            return JSONResponse(_prewarm_response(server, "chat.completion", "chatcmpl", done))
        hints = _CacheHints(body, [prompt], [writes])
        streams = await submit(
            server.engine, server.metrics, [prompt], params, salt, names, quotas=server.quotas, parse_slots=server.parse_slots, key=key, owner=owner,
            session=session, sibling_salts=server.tenants.sibling_salts(key, body.cache_salt), keeps=hints.keeps,
        )
        replies = ReplyCollector(server.replies, owner, salt)
        asked = wanted(body.cache_report, request.headers)
        source = ChatSource([m.as_chat() for m in body.messages], tools.tools, tools.choice) if asked else None
        reporter = CacheReporter(server, key, asked, [prompt], source)
        if body.stream:
            events = _chat_events(server, texts, body, tools, streams, params.n, reporter, replies)
            return SSEResponse(events, streams, server.limits.stream_send_timeout_s)
        finals = await until_disconnect(request, collect(server.metrics, streams, params.n), streams)
        hints.log(finals)
        replies.finished(finals[0])
        response = _chat_response(server, texts, body, tools, finals[0])
        response.usage.prompt_tokens_details.cache_write_tokens = hints.written(finals)
        return JSONResponse(_with_report(response.model_dump(), await reporter.one(finals)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        key = server.tenants.authenticate_headers(request.headers)
        raw = await request.body()

        def prepare() -> tuple[CompletionRequest, list[list[int]], WireNames, SamplingParams]:
            body = parse_body(CompletionRequest, raw)
            _check_request(server, body)
            guide, guide_param = _body_guide(body)
            names = sampling.completion_names(guide_param)
            prompt_cache.check_options(body)
            prompts = completion_prompts(server, body.prompts())
            longest = max(len(p) for p in prompts)
            return body, prompts, names, sampling.completion_params(body, server.engine.max_context_tokens, longest, names, guide)

        body, prompts, names, params = await server.parse_slots.run(key, prepare)
        writes = [keeps.implicit_writes(body.prompt_cache_options, prompt) for prompt in prompts]
        salt, owner = server.tenants.cache_salt(key, body.cache_salt), server.tenants.owner(key)
        session = session_ref(request.headers, owner, body.prompt_cache_key, server.tenants.session_namespace(salt))
        if body.prompt_cache_options is not None and body.prompt_cache_options.prewarm:
            done = await prompt_cache.prewarm(server, request, key, prompts, writes, salt, owner, names, session)
            return JSONResponse(_prewarm_response(server, "text_completion", "cmpl", done))
        hints = _CacheHints(body, prompts, writes)
        streams = await submit(
            server.engine, server.metrics, prompts, params, salt, names, quotas=server.quotas, parse_slots=server.parse_slots, key=key, owner=owner,
            session=session, sibling_salts=server.tenants.sibling_salts(key, body.cache_salt), keeps=hints.keeps,
        )
        reporter = CacheReporter(server, key, wanted(body.cache_report, request.headers), prompts)
        if body.stream:
            events = _completion_events(server, texts, body, streams, params.n, reporter)
            return SSEResponse(events, streams, server.limits.stream_send_timeout_s)
        finals = await until_disconnect(request, collect(server.metrics, streams, params.n), streams)
        hints.log(finals)
        response = _completion_response(server, texts, body, finals, params.n)
        response.usage.prompt_tokens_details.cache_write_tokens = hints.written(finals)
        return JSONResponse(_with_report(response.model_dump(), await reporter.for_prompts(finals)))


def _with_report(data: dict[str, Any], report: Report) -> dict[str, Any]:
    """A response body with its cache report beside usage, when one was asked for."""
    if report is not None:
        data["cache_report"] = report
    return data


def _check_request(server: AppState, body: ChatCompletionRequest | CompletionRequest) -> None:
    if body.model is not None:
        server.check_model(body.model)
    unsupported = body.unsupported()
    if unsupported:
        raise APIError(400, f"radixkv does not support {unsupported!r}", param=unsupported, code="unsupported_parameter")


def _chat_tools(body: ChatCompletionRequest) -> _ChatTools:
    try:
        tools = tools_from_openai(body.tools)
        choice = tool_choice_from_openai(body.tool_choice, tools)
    except InvalidRequest as error:
        raise engine_error(error) from None
    return _ChatTools(tools, choice, body.parallel_tool_calls is not False)  # OpenAI's default: parallel


def _chat_guide(body: ChatCompletionRequest, tools: _ChatTools) -> tuple[Guide | None, str]:
    """The guide a forced tool call needs, else the response format's; and the field it came
    from. A forced call's reply is the call, so the response format has nothing to shape."""
    try:
        guide = guide_for(tools.tools, tools.choice, tools.parallel)
    except InvalidRequest as error:
        raise engine_error(error) from None
    return (guide, "tools") if guide is not None else _body_guide(body)


def _body_guide(body: ChatCompletionRequest | CompletionRequest) -> tuple[Guide | None, str]:
    """The guide a body asks for in response_format or as a regex or grammar (one of them), and
    the field it came in."""
    try:
        grammar, grammar_param = body.grammar_guide()
        fmt = body.response_format
        if grammar is not None and grammar_param is not None:
            if fmt is not None and fmt.type != "text":
                raise InvalidRequest(f"send one of response_format and {grammar_param}, not both", param=grammar_param)
            return grammar, grammar_param
        if fmt is None:
            return None, "response_format"
        schema = fmt.json_schema
        return response_format_guide(fmt.type, schema and schema.schema_, schema and schema.strict), "response_format"
    except InvalidRequest as error:
        raise engine_error(error) from None


class _CacheHints:
    """What a request's prompt_cache fields ask: prompt_cache_retention and the breakpoints as
    each prompt's keeps (server/keeps.py, applied by the engine once the prompt is computed),
    cache_write_tokens read back from the outputs; prompt_cache_key (it names a session,
    server/sessions.py, and is logged with the cache hits it saw; it partitions nothing, as
    with OpenAI)."""

    def __init__(self, body: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]], writes: list[tuple[Keep, ...]]) -> None:
        self._body, self._prompts, self._writes = body, prompts, writes
        # The retention first, as it was retained before the breakpoints: a later keep of the
        # same path supersedes an earlier one that ends no later (RadixTree.retain).
        self.keeps = [keeps.retention(body.prompt_cache_retention, prompt) + w for prompt, w in zip(prompts, writes)]

    def written(self, finals: list[RequestOutput]) -> int | None:
        """OpenAI's cache_write_tokens: each prompt's breakpoints kept beyond what the cache
        served, from its output's KeepReport; None if no breakpoints were asked."""
        if not any(self._writes):
            return None
        return sum(keeps.written_tokens(final, len(w)) for final, w in zip(finals, self._writes))

    def log(self, finals: list[RequestOutput]) -> None:
        if self._body.prompt_cache_key is not None:
            cached = sum(f.num_cached_tokens for f in finals)
            logger.info("prompt_cache_key=%r prompts=%d cached_tokens=%s", self._body.prompt_cache_key, len(self._prompts), cached)


def _prewarm_response(server: AppState, object_name: str, id_prefix: str, done: prompt_cache.Prewarmed) -> dict:
    """A prewarm's answer: no choices; usage says the prompt's tokens, those the cache served,
    and (cache_write_tokens) those it holds now beyond them."""
    usage = make_usage(done.num_prompt_tokens, 0, done.num_cached_tokens)
    usage.prompt_tokens_details.cache_write_tokens = done.num_written_tokens
    return {"id": new_id(id_prefix), "object": object_name, "created": now_s(), "model": server.model_name, "choices": [], "usage": usage.model_dump()}


def _model_card(server: AppState) -> ModelCard:
    # The limit requests are held to: the model's context, or less when the page pool is smaller.
    return ModelCard(id=server.model_name, created=server.created, max_model_len=server.engine.max_context_tokens)


# -- responses -------------------------------------------------------------------------------


def _reply_calls(calls: list[ToolCall]) -> list[ReplyToolCall] | None:
    return [ReplyToolCall(id=c.id, function=ReplyFunction(name=c.name, arguments=c.arguments)) for c in calls] or None


def _finish_reason(engine_reason: str, has_calls: bool) -> str:
    """OpenAI's: "tool_calls" for a reply that ended on its calls; one cut off by max_tokens is
    "length" whatever calls it completed (a client then knows more were on the way)."""
    return "tool_calls" if has_calls and engine_reason != "length" else engine_reason


def _chat_choice(texts: TokenTexts, body: ChatCompletionRequest, tools: _ChatTools, output: CompletionOutput) -> ChatChoice:
    content, calls = parse_reply(output.text, tools.tools, tools.choice)
    return ChatChoice(
        index=output.index,
        message=AssistantMessage(content=content, tool_calls=_reply_calls(calls)),
        finish_reason=_finish_reason(output.finish_reason, bool(calls)),
        logprobs=chat_logprobs(texts, output.logprobs, body.top_logprobs or 0) if body.logprobs else None,
    )


def _chat_response(server: AppState, texts: TokenTexts, body: ChatCompletionRequest, tools: _ChatTools, final: RequestOutput) -> ChatCompletion:
    return ChatCompletion(
        id=new_id("chatcmpl"),
        created=now_s(),
        model=server.model_name,
        choices=[_chat_choice(texts, body, tools, o) for o in final.outputs],
        usage=usage([final]),
    )


def _completion_response(server: AppState, texts: TokenTexts, body: CompletionRequest, finals: list[RequestOutput], n: int) -> Completion:
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
    """One streamed chat choice: content passes through a ToolCallStream; each finished call is
    sent as OpenAI sends one (its id, type and name with arguments "", then its arguments), and
    the last chunk says "tool_calls" when any call was made."""

    def __init__(self, texts: TokenTexts, body: ChatCompletionRequest, tools: _ChatTools, index: int) -> None:
        self._texts, self._body, self._index = texts, body, index
        self._calls = ToolCallStream(tools.tools, tools.choice)

    def choices(self, delta: CompletionDelta) -> list[ChatChunkChoice]:
        content, calls = self._calls.feed(delta.text)
        out: list[ChatChunkChoice] = []
        logprobs = chat_logprobs(self._texts, delta.logprobs, self._body.top_logprobs or 0) if self._body.logprobs else None
        if content or logprobs:
            out.append(self._choice(Delta(content=content or None), logprobs=logprobs))
        out += self._call_choices(calls, self._calls.num_calls - len(calls))
        if delta.finish_reason is not None:
            content, calls = self._calls.finish()
            if content:
                out.append(self._choice(Delta(content=content)))
            out += self._call_choices(calls, self._calls.num_calls - len(calls))
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


async def _chat_events(
    server: AppState, texts: TokenTexts, body: ChatCompletionRequest, tools: _ChatTools, streams: list[RequestStream], n: int,
    reporter: CacheReporter,
    replies: ReplyCollector,
) -> AsyncIterator[str]:
    chunk_id, created, model = new_id("chatcmpl"), now_s(), server.model_name
    per_choice = [_ChatChoiceStream(texts, body, tools, j) for j in range(n)]

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None, report: Report = None) -> str:
        payload = ChatCompletionChunk(id=chunk_id, created=created, model=model, choices=choices, usage=usage)
        return _sse_data(payload, body.include_usage, report)

    def choice(_: int, c: CompletionDelta) -> list[ChatChunkChoice]:
        return per_choice[c.index].choices(c)

    opening = chunk([ChatChunkChoice(index=j, delta=Delta(role="assistant", content="")) for j in range(n)])
    async for event in text_events(server.metrics, streams, n, body, chunk, choice, opening, reporter.one, replies.finished):
        yield event


async def _completion_events(
    server: AppState, texts: TokenTexts, body: CompletionRequest, streams: list[RequestStream], n: int, reporter: CacheReporter
) -> AsyncIterator[str]:
    chunk_id, created, model = new_id("cmpl"), now_s(), server.model_name
    text_offsets: dict[int, int] = {}  # characters each choice has sent, for logprobs' text_offset

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None, report: Report = None) -> str:
        payload = Completion(id=chunk_id, created=created, model=model, choices=choices, usage=usage)
        return _sse_data(payload, body.include_usage, report)

    def choice(i: int, c: CompletionDelta) -> list[CompletionChoice]:
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
                per_completion = [
                    choice(i, c) for c in delta.completions if c.text or c.logprobs or c.finish_reason is not None
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
    return make_usage(
        sum(f.num_prompt_tokens for f in finals),
        sum(f.num_output_tokens for f in finals),
        sum(f.num_cached_tokens for f in finals),
    )
