"""OpenAI's API: /v1/models, /v1/chat/completions and /v1/completions, streamed or not. Owns
turning a request body into SamplingParams within the engine's context limit, and the engine's
outputs into OpenAI's responses and stream chunks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixkv.engine.async_engine import RequestStream
from radixkv.engine.request import CompletionDelta, RequestOutput, SamplingParams
from radixkv.errors import InvalidRequest
from radixkv.server.errors import APIError, WireNames, context_error, engine_error, parse_body
from radixkv.server.prompts import chat_prompt, completion_prompts
from radixkv.server.protocol import (
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
    ModelCard,
    ModelList,
    Usage,
    new_id,
    now_s,
)
from radixkv.server.streaming import SSEResponse, collect, sse, submit, text_events, until_disconnect, usage

if TYPE_CHECKING:
    from radixkv.server.state import Server

# Below this a temperature is greedy: dividing logits by ~0 would overflow to inf/NaN.
_MIN_TEMPERATURE = 1e-5
# Sampler seeds are (seed * 1_000_003 + index) and must fit torch's 64-bit seed range.
_SEED_MODULUS = 1 << 43
_INT64 = (-(1 << 63), (1 << 64) - 1)
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions API


def register(app: FastAPI, server: Server) -> None:
    @app.get("/v1/models")
    async def list_models(request: Request) -> ModelList:
        server.tenants.authenticate(request.headers.get("authorization"))
        return ModelList(data=[_model_card(server)])

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> ModelCard:
        server.tenants.authenticate(request.headers.get("authorization"))
        server.check_model(model)
        return _model_card(server)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        key = server.tenants.authenticate(request.headers.get("authorization"))
        body = parse_body(ChatCompletionRequest, await request.body())
        _check_request(server, body)
        prompt = chat_prompt(server, body.messages)
        max_tokens, max_tokens_param = body.requested_max_tokens()
        names = WireNames(prompt="messages", max_tokens=max_tokens_param)
        params = _sampling_params(server, body, [prompt], max_tokens, names, default_max_tokens=None)
        salt = server.tenants.cache_salt(key, body.cache_salt)
        streams = await submit(server.engine, server.metrics, [prompt], params, salt, names)
        if body.stream:
            return SSEResponse(_chat_events(server, body, streams, params.n), streams)
        finals = await until_disconnect(request, collect(server.metrics, streams, params.n), streams)
        return JSONResponse(_chat_response(server, finals[0]).model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        key = server.tenants.authenticate(request.headers.get("authorization"))
        body = parse_body(CompletionRequest, await request.body())
        _check_request(server, body)
        prompts = completion_prompts(server, body)
        names = WireNames()
        params = _sampling_params(server, body, prompts, body.max_tokens, names, default_max_tokens=_COMPLETIONS_DEFAULT_MAX_TOKENS)
        salt = server.tenants.cache_salt(key, body.cache_salt)
        streams = await submit(server.engine, server.metrics, prompts, params, salt, names)
        if body.stream:
            return SSEResponse(_completion_events(server, body, streams, params.n), streams)
        finals = await until_disconnect(request, collect(server.metrics, streams, params.n), streams)
        return JSONResponse(_completion_response(server, finals, params.n).model_dump())


def _check_request(server: Server, body: ChatCompletionRequest | CompletionRequest) -> None:
    if body.model is not None:
        server.check_model(body.model)
    unsupported = body.unsupported()
    if unsupported:
        raise APIError(400, f"radixkv does not support {unsupported!r}", param=unsupported, code="unsupported_parameter")


def _model_card(server: Server) -> ModelCard:
    # The limit requests are held to: the model's context, or less when the page pool is smaller.
    return ModelCard(id=server.model_name, created=server.created, max_model_len=server.engine.max_context_tokens)


def _sampling_params(
    server: Server,
    body: ChatCompletionRequest | CompletionRequest,
    prompts: list[list[int]],
    max_tokens: int | None,
    names: WireNames,
    *,
    default_max_tokens: int | None,
) -> SamplingParams:
    # The engine would refuse a request past its context too, but only after the default
    # max_tokens below is derived from the room left, and after earlier prompts were submitted.
    context = server.engine.max_context_tokens
    longest = max(len(p) for p in prompts)
    if longest >= context:
        raise context_error(context, longest, None, names.prompt)
    if max_tokens is None:
        # Chat: as much as the context allows (OpenAI's default); completions: OpenAI's 16.
        max_tokens = context - longest if default_max_tokens is None else min(default_max_tokens, context - longest)
    temperature = 1.0 if body.temperature is None else body.temperature
    if 0.0 <= temperature < _MIN_TEMPERATURE:
        temperature = 0.0
    seed = body.seed
    if seed is not None:
        if not _INT64[0] <= seed <= _INT64[1]:
            raise APIError(400, f"seed must be a 64-bit integer, got {seed}", param="seed")
        seed %= _SEED_MODULUS  # same seed, same stream; fits the sampler's seed arithmetic
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=seed,
            stop=body.stop_list(),
            n=body.n,
        )
    except InvalidRequest as error:
        raise engine_error(error, names) from None
    if longest + params.max_tokens > context:
        raise context_error(context, longest, params.max_tokens, names.max_tokens)
    return params


# -- responses -------------------------------------------------------------------------------


def _chat_response(server: Server, final: RequestOutput) -> ChatCompletion:
    return ChatCompletion(
        id=new_id("chatcmpl"),
        created=now_s(),
        model=server.model_name,
        choices=[
            ChatChoice(index=o.index, message=AssistantMessage(content=o.text), finish_reason=o.finish_reason)
            for o in final.outputs
        ],
        usage=usage([final]),
    )


def _completion_response(server: Server, finals: list[RequestOutput], n: int) -> Completion:
    return Completion(
        id=new_id("cmpl"),
        created=now_s(),
        model=server.model_name,
        choices=[
            CompletionChoice(index=i * n + o.index, text=o.text, finish_reason=o.finish_reason)
            for i, final in enumerate(finals)
            for o in final.outputs
        ],
        usage=usage(finals),
    )


async def _chat_events(server: Server, body: ChatCompletionRequest, streams: list[RequestStream], n: int) -> AsyncIterator[str]:
    chunk_id, created, model = new_id("chatcmpl"), now_s(), server.model_name

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return _sse_data(ChatCompletionChunk(id=chunk_id, created=created, model=model, choices=choices, usage=usage), body.include_usage)

    def choice(_: int, c: CompletionDelta) -> ChatChunkChoice:
        return ChatChunkChoice(index=c.index, delta=Delta(content=c.text or None), finish_reason=c.finish_reason)

    opening = chunk([ChatChunkChoice(index=j, delta=Delta(role="assistant", content="")) for j in range(n)])
    async for event in text_events(server.metrics, streams, n, body, chunk, choice, opening):
        yield event


async def _completion_events(server: Server, body: CompletionRequest, streams: list[RequestStream], n: int) -> AsyncIterator[str]:
    chunk_id, created, model = new_id("cmpl"), now_s(), server.model_name

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return _sse_data(Completion(id=chunk_id, created=created, model=model, choices=choices, usage=usage), body.include_usage)

    def choice(i: int, c: CompletionDelta) -> CompletionChoice:
        return CompletionChoice(index=i * n + c.index, text=c.text, finish_reason=c.finish_reason)

    async for event in text_events(server.metrics, streams, n, body, chunk, choice):
        yield event


def _sse_data(payload: ChatCompletionChunk | Completion, include_usage: bool) -> str:
    data = payload.model_dump()
    if not include_usage:
        data.pop("usage")
    return sse(data)
