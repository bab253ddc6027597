"""OpenAI's API: /v1/models, /v1/chat/completions and /v1/completions, streamed or not. Owns
turning a request body into a prompt, its tools and guide (its SamplingParams come from
server.sampling; the engine alone checks the context), and the engine's outputs into OpenAI's
responses and stream chunks (radixkv.server.openai.outputs: text, tool calls and logprobs).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixkv.engine.request import Keep

from radixkv.engine.request_output import RequestOutput

from radixkv.engine.sampling_params import Guide, SamplingParams
from radixkv.errors import InvalidRequest
from radixkv.prompts.conversation import EncodedConversation
from radixkv.server import keeps, sampling
from radixkv.server.cache_report import CacheReporter, ChatSource, wanted
from radixkv.server.continuation import ReplyCollector
from radixkv.server.encode import chat_conversation, completion_prompts
from radixkv.server.errors import APIError, WireNames, engine_error, parse_body
from radixkv.server.logprobs import TokenTexts
from radixkv.server.openai import prompt_cache
from radixkv.server.openai.outputs import (
    ChatTools,
    Report,
    chat_events,
    chat_response,
    completion_events,
    completion_response,
)
from radixkv.server.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, make_usage, new_id, now_s
from radixkv.server.sessions import hint_resume, session_ref
from radixkv.server.streaming import SSEResponse, collect, submit, until_disconnect
from radixkv.server.tools import guide_for, response_format_guide, tool_choice_from_openai, tools_from_openai

if TYPE_CHECKING:
    from radixkv.server.state import AppState

logger = logging.getLogger("radixkv.server")


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
        hint_resume(server, request.headers, key)  # the disk read starts before the body is read
        raw = await request.body()
        owner = server.tenants.owner(key)

        def prepare() -> tuple[ChatCompletionRequest, ChatTools, EncodedConversation, WireNames, SamplingParams, tuple[Keep, ...], str | None]:
            body = parse_body(ChatCompletionRequest, raw)
            _check_request(server, body)
            prompt_cache.check_options(body)
            tools = _chat_tools(server, body)
            salt = server.tenants.cache_salt(key, body.cache_salt)
            encoded = chat_conversation(server, [m.as_chat() for m in body.messages], tools.tools, tools.choice, owner=owner, salt=salt)
            guide, guide_param = _chat_guide(body, tools)
            names = sampling.chat_names(body, guide_param)
            writes = prompt_cache.chat_writes(server, body, tools.tools, tools.choice, encoded.token_ids, encoded)
            return body, tools, encoded, names, sampling.chat_params(body, names, guide), writes, salt

        body, tools, encoded, names, params, writes, salt = await server.parse_slots.run(key, prepare)
        prompt = encoded.token_ids
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
        source = ChatSource([m.as_chat() for m in body.messages], tools.tools, tools.choice, encoded=encoded) if asked else None
        reporter = CacheReporter(server, key, asked, [prompt], source)
        if body.stream:
            events = chat_events(server, texts, body, tools, streams, params.n, reporter, replies)
            return SSEResponse(events, streams, server.limits.stream_send_timeout_s)
        finals = await until_disconnect(request, collect(server.metrics, streams, params.n), streams)
        hints.log(finals)
        replies.finished(finals[0])
        response = chat_response(server, texts, body, tools, finals[0])
        response.usage.prompt_tokens_details.cache_write_tokens = hints.written(finals)
        return JSONResponse(_with_report(response.model_dump(), await reporter.one(finals)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        key = server.tenants.authenticate_headers(request.headers)
        hint_resume(server, request.headers, key)  # the disk read starts before the body is read
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
            events = completion_events(server, texts, body, streams, params.n, reporter)
            return SSEResponse(events, streams, server.limits.stream_send_timeout_s)
        finals = await until_disconnect(request, collect(server.metrics, streams, params.n), streams)
        hints.log(finals)
        response = completion_response(server, texts, body, finals, params.n)
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


def _chat_tools(server: AppState, body: ChatCompletionRequest) -> ChatTools:
    try:
        tools = tools_from_openai(body.tools)
        choice = tool_choice_from_openai(body.tool_choice, tools)
    except InvalidRequest as error:
        raise engine_error(error) from None
    return ChatTools(tools, choice, body.parallel_tool_calls is not False, server.reply_format)  # OpenAI's default: parallel


def _chat_guide(body: ChatCompletionRequest, tools: ChatTools) -> tuple[Guide | None, str]:
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
