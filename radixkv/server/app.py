"""The OpenAI-compatible HTTP server: routes, auth and tenant cache salts, streaming, errors.

`create_app` builds a FastAPI app around a running AsyncEngine; `radixkv serve` is in radixkv.cli.
Every user error becomes OpenAI's error shape with its status; the server stays up after each.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import time
from contextlib import aclosing
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixkv.engine.async_engine import AsyncEngine, EngineStepError, EngineStopped, RequestStream
from radixkv.engine.engine import Engine, PinnedPrefix
from radixkv.errors import InvalidRequest, QueueFull
from radixkv.engine.request import CompletionOutput, RequestOutput, SamplingParams
from radixkv.server.metrics import CONTENT_TYPE, ServerMetrics
from radixkv.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
    PinRequest,
    PinResponse,
    UnpinResponse,
    Usage,
    make_usage,
    new_id,
    now_s,
)

logger = logging.getLogger("radixkv.server")

M = TypeVar("M", bound=BaseModel)

# Below this a temperature is greedy: dividing logits by ~0 would overflow to inf/NaN.
_MIN_TEMPERATURE = 1e-5
# Sampler seeds are (seed * 1_000_003 + index) and must fit torch's 64-bit seed range.
_SEED_MODULUS = 1 << 43
_INT64 = (-(1 << 63), (1 << 64) - 1)
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions API
_SAMPLING_FIELDS = ("max_tokens", "n", "temperature", "top_p", "seed", "stop", "top_k")
# Pins made over HTTP may lock at most this share of the page pool, so they cannot starve requests.
_MAX_PINNED_FRACTION = 0.5


class APIError(Exception):
    """An error the client caused (or may retry), rendered in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# -- tenants ---------------------------------------------------------------------------------


class Tenants:
    """Bearer-key checks and cache salts: each key (and each cache_salt within it) gets its own
    prefix-cache partition, so no tenant can hit, or time, another's cached prefixes.

    Salts are HMACs under a per-process secret: a raw key never enters the engine."""

    def __init__(self, api_keys: Sequence[str] | None, secret: bytes | None = None) -> None:
        self._keys = [key.encode() for key in api_keys or []]
        if any(not key for key in self._keys):
            raise ValueError("an API key must not be empty")
        self._secret = secret or secrets.token_bytes(32)

    @property
    def auth_required(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> bytes | None:
        """The caller's key (None when auth is off); APIError 401 if it is missing or wrong."""
        if not self._keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        candidate = token.strip().encode() if scheme.lower() == "bearer" else b""
        # Compare against every key, always, so timing tells nothing about which one matched.
        matched = None
        for key in self._keys:
            if hmac.compare_digest(candidate, key):
                matched = key
        if matched is None:
            raise APIError(
                401,
                "missing or incorrect API key; send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return matched

    def cache_salt(self, key: bytes | None, request_salt: str | None) -> str | None:
        if key is None and request_salt is None:
            return None
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in (key or b"", (request_salt or "").encode()):
            mac.update(len(part).to_bytes(8, "little") + part)  # length-prefixed: no ambiguity
        mac.update(b"\x01" if request_salt is not None else b"\x00")
        return mac.hexdigest()[:32]


# -- app state -------------------------------------------------------------------------------


class _Pins:
    """Pins made over HTTP and the key that made each: only that key may unpin it, and together
    they lock at most _MAX_PINNED_FRACTION of the pool, and never so much that a request of the
    whole context no longer fits beside them (overlapping pins count twice: a safe
    over-estimate). Touched only on the engine thread (AsyncEngine.call), which orders them."""

    def __init__(self) -> None:
        self._owners: dict[int, tuple[bytes | None, int]] = {}  # pin_id -> (key, pages)
        self.pages = 0

    def pin(self, engine: Engine, prompt: list[int], salt: str | None, owner: bytes | None) -> PinnedPrefix:
        pinned = engine.pin(prompt, salt)
        pool, page_size = engine.pool, engine.pool.page_size
        pages = pinned.num_pinned_tokens // page_size
        # Pinned pages are never evicted: leave room for a request of the whole context, or a
        # request the server accepted could wait forever for pages no one will give back.
        context_pages = -(-min(engine.max_model_len, pool.num_pages * page_size) // page_size)
        limit = max(0, min(int(pool.num_pages * _MAX_PINNED_FRACTION), pool.num_pages - context_pages))
        if self.pages + pages > limit:
            engine.unpin(pinned.pin_id)
            raise APIError(
                400,
                f"pinning this prefix would lock {self.pages + pages} KV pages in all; the server allows at most "
                f"{limit} pinned pages (of {engine.pool.num_pages}); unpin others first",
                code="pin_limit_exceeded",
            )
        self._owners[pinned.pin_id] = (owner, pages)
        self.pages += pages
        return pinned

    def unpin(self, engine: Engine, pin_id: int, owner: bytes | None) -> bool:
        record = self._owners.get(pin_id)
        if record is None or record[0] != owner:
            return False  # unknown, or another tenant's: the same answer, so ids reveal nothing
        del self._owners[pin_id]
        self.pages -= record[1]
        return engine.unpin(pin_id)


@dataclass(slots=True)
class _Server:
    engine: AsyncEngine
    tenants: Tenants
    model_name: str
    model_aliases: frozenset[str]
    metrics: ServerMetrics
    created: int = field(default_factory=now_s)
    pins: _Pins = field(default_factory=_Pins)

    @property
    def context_tokens(self) -> int:
        """The most tokens (prompt + completion) one request may have."""
        return min(self.engine.max_model_len, self.engine.num_pages * self.engine.page_size)


def create_app(
    async_engine: AsyncEngine,
    api_keys: Sequence[str] | None = None,
    model_name: str = "radixkv",
    *,
    model_aliases: Sequence[str] = (),
    tenant_secret: bytes | None = None,
) -> FastAPI:
    """An app serving `async_engine` (started and shut down by the caller) as `model_name`."""
    server = _Server(
        engine=async_engine,
        tenants=Tenants(api_keys, tenant_secret),
        model_name=model_name,
        model_aliases=frozenset([model_name, *model_aliases]),
        metrics=ServerMetrics(async_engine.stats),
    )
    app = FastAPI(title="radixkv", description="OpenAI-compatible API over a prefix-sharing KV cache")
    app.state.radixkv = server
    _install_error_handlers(app)
    app.add_middleware(_CountRequests, metrics=server.metrics)

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.alive:
            return APIError(503, "the engine is not running", type="server_error", code="engine_down").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models(request: Request) -> ModelList:
        server.tenants.authenticate(request.headers.get("authorization"))
        return ModelList(data=[_model_card(server)])

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> ModelCard:
        server.tenants.authenticate(request.headers.get("authorization"))
        _check_model(server, model)
        return _model_card(server)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        key = server.tenants.authenticate(request.headers.get("authorization"))
        body = _parse(ChatCompletionRequest, await request.body())
        _check_request(server, body)
        prompt = _chat_prompt(server, body.messages)
        limit, limit_param = body.requested_max_tokens()
        params = _sampling_params(server, body, [prompt], limit, limit_param, default_max_tokens=None)
        salt = server.tenants.cache_salt(key, body.cache_salt)
        streams = await _submit(server, [prompt], params, salt)
        if body.stream:
            return _SSEResponse(_chat_events(server, body, streams, params.n), streams)
        finals = await _until_disconnect(request, _collect(server, streams, params.n), streams)
        return JSONResponse(_chat_response(server, finals[0]).model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        key = server.tenants.authenticate(request.headers.get("authorization"))
        body = _parse(CompletionRequest, await request.body())
        _check_request(server, body)
        prompts = _completion_prompts(server, body)
        params = _sampling_params(
            server, body, prompts, body.max_tokens, "max_tokens", default_max_tokens=_COMPLETIONS_DEFAULT_MAX_TOKENS
        )
        salt = server.tenants.cache_salt(key, body.cache_salt)
        streams = await _submit(server, prompts, params, salt)
        if body.stream:
            return _SSEResponse(_completion_events(server, body, streams, params.n), streams)
        finals = await _until_disconnect(request, _collect(server, streams, params.n), streams)
        return JSONResponse(_completion_response(server, finals, params.n).model_dump())

    # radixkv's own endpoints (not OpenAI's): pin a prefix against eviction, and unpin it.

    @app.post("/v1/cache/pin")
    async def pin_prefix(request: Request) -> Response:
        """Compute a prefix (a one-token request) and lock its full pages in the cache until
        DELETE /v1/cache/pin/{pin_id}; a pin lasts until then or until the server stops."""
        key = server.tenants.authenticate(request.headers.get("authorization"))
        body = _parse(PinRequest, await request.body())
        if body.model is not None:
            _check_model(server, body.model)
        prompt = _pin_prompt(server, body)
        salt = server.tenants.cache_salt(key, body.cache_salt)
        streams = await _submit(server, [prompt], SamplingParams(max_tokens=1), salt)
        await _until_disconnect(request, _collect(server, streams, 1), streams)
        # Eviction between the request's end and the pin can only shorten what is pinned;
        # pinned_tokens says how much was.
        pinned = await server.engine.call_async(lambda engine: server.pins.pin(engine, prompt, salt, key))
        response = PinResponse(pin_id=pinned.pin_id, pinned_tokens=pinned.num_pinned_tokens, prompt_tokens=len(prompt))
        return JSONResponse(response.model_dump())

    @app.delete("/v1/cache/pin/{pin_id}")
    async def unpin_prefix(pin_id: int, request: Request) -> Response:
        key = server.tenants.authenticate(request.headers.get("authorization"))
        if not await server.engine.call_async(lambda engine: server.pins.unpin(engine, pin_id, key)):
            raise APIError(404, f"no pin {pin_id} (unknown, already unpinned, or another key's)", code="not_found")
        return JSONResponse(UnpinResponse(pin_id=pin_id).model_dump())

    return app


# -- request handling ------------------------------------------------------------------------


def _parse(model: type[M], raw: bytes) -> M:
    try:
        return model.model_validate_json(raw or b"null")
    except ValidationError as error:
        raise _validation_error(error.errors()) from None


def _validation_error(errors: Sequence[Any]) -> APIError:
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
    locs = [[str(part) for part in e.get("loc", ()) if part != "body"] for e in errors] or [[]]
    if first.get("type") == "model_type" and not locs[0]:
        return APIError(400, "the request body must be a JSON object")
    # Several errors under one field are the branches of a union (`stop`: a string or a list
    # of strings): name the field itself, not a branch.
    loc = locs[0]
    if len(errors) > 1:
        common = 0
        while all(len(other) > common and other[common] == loc[common] for other in locs):
            common += 1
        loc = loc[:common] or loc
    param = ".".join(loc) or None
    detail = str(first.get("msg", "invalid value"))
    if len(loc) < len(locs[0]):  # the branch that got furthest says most
        deepest = max(range(len(errors)), key=lambda i: len(locs[i]))
        where = ".".join(locs[deepest][len(loc) :])
        detail = f"matches no accepted form; as {where}: {errors[deepest].get('msg', 'invalid value')}"
    message = f"{param}: {detail}" if param else detail
    return APIError(400, message, param=param)


def _check_request(server: _Server, body: ChatCompletionRequest | CompletionRequest) -> None:
    if body.model is not None:
        _check_model(server, body.model)
    unsupported = body.unsupported()
    if unsupported:
        raise APIError(400, f"radixkv does not support {unsupported!r}", param=unsupported, code="unsupported_parameter")


def _check_model(server: _Server, model: str) -> None:
    if model not in server.model_aliases:
        raise APIError(
            404, f"the model {model!r} does not exist; this server serves {server.model_name!r}", param="model", code="model_not_found"
        )


def _model_card(server: _Server) -> ModelCard:
    # The limit requests are held to: the model's context, or less when the page pool is smaller.
    return ModelCard(id=server.model_name, created=server.created, max_model_len=server.context_tokens)


def _chat_prompt(server: _Server, messages: list[ChatMessage], *, add_generation_prompt: bool = True) -> list[int]:
    if not messages:
        raise APIError(400, "messages must hold at least one message", param="messages")
    tokenizer = server.engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions with a prompt", param="messages")
    # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
    conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception as error:  # jinja's TemplateError, or raise_exception() inside a template
        raise APIError(400, f"the chat template refused these messages: {error}", param="messages") from None
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _completion_prompts(server: _Server, body: CompletionRequest) -> list[list[int]]:
    prompts = body.prompts()
    if not prompts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    tokenizer = server.engine.tokenizer
    token_lists = [list(tokenizer(p).input_ids) if isinstance(p, str) else list(p) for p in prompts]
    if any(not tokens for tokens in token_lists):
        raise APIError(400, "prompt must hold at least one token", param="prompt")
    return token_lists


def _pin_prompt(server: _Server, body: PinRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give the prefix to pin as exactly one of prompt (text or token ids) or messages")
    if body.messages is not None:
        prompt = _chat_prompt(server, body.messages, add_generation_prompt=False)
        param = "messages"
    else:
        prompt = list(server.engine.tokenizer(body.prompt).input_ids) if isinstance(body.prompt, str) else list(body.prompt)
        param = "prompt"
    if not prompt:
        raise APIError(400, f"{param} must hold at least one token", param=param)
    if len(prompt) >= server.context_tokens:
        raise _context_error(server.context_tokens, len(prompt), None, param)
    return prompt


def _sampling_params(
    server: _Server,
    body: ChatCompletionRequest | CompletionRequest,
    prompts: list[list[int]],
    max_tokens: int | None,
    max_tokens_param: str,
    *,
    default_max_tokens: int | None,
) -> SamplingParams:
    context = server.context_tokens
    longest = max(len(p) for p in prompts)
    prompt_param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    if longest >= context:
        raise _context_error(context, longest, None, prompt_param)
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
        message = str(error)
        name = message.split(" ", 1)[0]
        if name == "max_tokens":
            message = max_tokens_param + message[len(name) :]
            name = max_tokens_param
        raise APIError(400, message, param=name if name in (*_SAMPLING_FIELDS, max_tokens_param) else None) from None
    if longest + params.max_tokens > context:
        raise _context_error(context, longest, params.max_tokens, max_tokens_param)
    return params


def _context_error(context: int, prompt_tokens: int, max_tokens: int | None, param: str) -> APIError:
    if max_tokens is None:
        detail = f"the prompt has {prompt_tokens} tokens, which leaves no room for a completion"
    else:
        detail = f"the request needs {prompt_tokens + max_tokens} ({prompt_tokens} prompt + {max_tokens} completion)"
    return APIError(
        400, f"this model's maximum context length is {context} tokens; {detail}", param=param, code="context_length_exceeded"
    )


async def _submit(server: _Server, prompts: list[list[int]], params: SamplingParams, salt: str | None) -> list[RequestStream]:
    streams: list[RequestStream] = []
    try:
        for prompt in prompts:
            streams.append(await server.engine.submit(prompt, params, salt=salt))
    except BaseException as error:
        for stream in streams:
            stream.close()
        if isinstance(error, InvalidRequest):
            raise APIError(400, str(error), param="prompt" if str(error).startswith("prompt") else None) from None
        if isinstance(error, QueueFull):
            raise APIError(503, str(error), type="server_error", code="queue_full", headers={"Retry-After": "1"}) from None
        if isinstance(error, EngineStopped):
            raise APIError(503, str(error), type="server_error", code="engine_down") from None
        raise
    server.metrics.prompt_tokens.inc(sum(len(prompt) for prompt in prompts))
    return streams


class _Tracker:
    """Per engine request: token counts and latency observations as outputs arrive."""

    def __init__(self, metrics: ServerMetrics, n: int) -> None:
        self._metrics = metrics
        self._n = n
        self._num_tokens: dict[int, int] = {}
        self._last_token_s: dict[int, float] = {}
        self._counted_cache = False
        self.finished = False

    def update(self, output: RequestOutput) -> None:
        now = time.perf_counter()
        m = self._metrics
        if not self._counted_cache and output.outputs and any(o.token_ids for o in output.outputs):
            self._counted_cache = True
            m.cached_prompt_tokens.inc(output.num_cached_tokens)
            if output.time_to_first_token_s is not None:
                m.ttft.observe(output.time_to_first_token_s)
        for o in output.outputs:
            new = len(o.token_ids) - self._num_tokens.get(o.index, 0)
            if new <= 0:
                continue
            m.generation_tokens.inc(new)
            last = self._last_token_s.get(o.index)
            if last is not None:
                for _ in range(new):
                    m.token_latency.observe((now - last) / new)
            self._num_tokens[o.index] = len(o.token_ids)
            self._last_token_s[o.index] = now
        if output.finished:
            self.finished = True
            for o in output.outputs:
                m.finished.labels(o.finish_reason or "unknown").inc()
            if output.total_time_s is not None:
                m.e2e.observe(output.total_time_s)

    def abandoned(self) -> None:
        """The consumer left before the end (client gone, error): the request is aborted."""
        if not self.finished:
            self.finished = True
            self._metrics.finished.labels("abort").inc(self._n)


async def _merge(server: _Server, streams: list[RequestStream], n: int) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come; closes them all at the end."""
    trackers = [_Tracker(server.metrics, n) for _ in streams]
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except Exception as error:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, error))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                trackers[i].update(item)
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream, tracker in zip(streams, trackers):
            stream.close()  # aborts whatever has not finished (client gone, error)
            tracker.abandoned()


async def _collect(server: _Server, streams: list[RequestStream], n: int) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async with aclosing(_merge(server, streams, n)) as merged:
            async for i, output in merged:
                if output.finished:
                    finals[i] = output
    except (EngineStepError, EngineStopped) as error:
        raise _engine_error(error) from None
    if any(f is None or f.finish_reason == "abort" for f in finals):
        raise APIError(503, "the request was aborted (the server is shutting down)", type="server_error", code="aborted")
    return finals  # type: ignore[return-value]


def _engine_error(error: BaseException) -> APIError:
    if isinstance(error, EngineStopped):
        return APIError(503, str(error), type="server_error", code="engine_down")
    return APIError(500, "the engine failed while running this request", type="server_error", code="engine_error")


T = TypeVar("T")


class _ClientGone(Exception):
    """The client disconnected before its (non-streamed) response was ready."""


async def _until_disconnect(request: Request, work: Awaitable[T], streams: list[RequestStream]) -> T:
    """Await work, unless the client disconnects first: then abort its requests (_ClientGone)."""
    work_task = asyncio.ensure_future(work)
    gone_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone_task.cancel()
        if not work_task.done():
            work_task.cancel()
            for stream in streams:
                stream.close()
    if not work_task.done():
        await asyncio.wait({work_task})  # let its cleanup (closing streams, metrics) run
        raise _ClientGone
    return work_task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- responses -------------------------------------------------------------------------------


def _usage(finals: Sequence[RequestOutput]) -> Usage:
    return make_usage(
        sum(f.num_prompt_tokens for f in finals),
        sum(f.num_output_tokens for f in finals),
        sum(f.num_cached_tokens for f in finals),
    )


def _chat_response(server: _Server, final: RequestOutput) -> ChatCompletion:
    return ChatCompletion(
        id=new_id("chatcmpl"),
        created=now_s(),
        model=server.model_name,
        choices=[
            ChatChoice(index=o.index, message=AssistantMessage(content=o.text), finish_reason=o.finish_reason)
            for o in final.outputs
        ],
        usage=_usage([final]),
    )


def _completion_response(server: _Server, finals: list[RequestOutput], n: int) -> Completion:
    return Completion(
        id=new_id("cmpl"),
        created=now_s(),
        model=server.model_name,
        choices=[
            CompletionChoice(index=i * n + o.index, text=o.text, finish_reason=o.finish_reason)
            for i, final in enumerate(finals)
            for o in final.outputs
        ],
        usage=_usage(finals),
    )


def _sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump() if isinstance(payload, BaseModel) else payload
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _stream_error(error: BaseException) -> str:
    api_error = error if isinstance(error, APIError) else _engine_error(error)
    return _sse(api_error.body())


class _TextDeltas:
    """What to send of each continuation's cumulative text. While a continuation runs, a tail
    that could begin a stop string is held back: the engine cuts the text at a stop string
    once it completes, and what was sent cannot be taken back."""

    def __init__(self, stop: list[str]) -> None:
        self._stop = stop
        self._sent: dict[tuple[int, int], int] = {}

    def delta(self, key: tuple[int, int], text: str, finished: bool) -> str:
        visible = len(text) if finished else len(text) - self._held_back(text)
        sent = self._sent.get(key, 0)
        if visible <= sent:
            return ""
        self._sent[key] = visible
        return text[sent:visible]

    def _held_back(self, text: str) -> int:
        held = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return held


async def _chat_events(server: _Server, body: ChatCompletionRequest, streams: list[RequestStream], n: int) -> AsyncIterator[str]:
    chunk_id, created, model = new_id("chatcmpl"), now_s(), server.model_name

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return _sse_data(ChatCompletionChunk(id=chunk_id, created=created, model=model, choices=choices, usage=usage), body.include_usage)

    def choice(_: int, o: CompletionOutput, text: str) -> ChatChunkChoice:
        return ChatChunkChoice(index=o.index, delta=Delta(content=text or None), finish_reason=o.finish_reason)

    opening = chunk([ChatChunkChoice(index=j, delta=Delta(role="assistant", content="")) for j in range(n)])
    async for event in _text_events(server, streams, n, body, chunk, choice, opening):
        yield event


async def _completion_events(server: _Server, body: CompletionRequest, streams: list[RequestStream], n: int) -> AsyncIterator[str]:
    chunk_id, created, model = new_id("cmpl"), now_s(), server.model_name

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return _sse_data(Completion(id=chunk_id, created=created, model=model, choices=choices, usage=usage), body.include_usage)

    def choice(i: int, o: CompletionOutput, text: str) -> CompletionChoice:
        return CompletionChoice(index=i * n + o.index, text=text, finish_reason=o.finish_reason)

    async for event in _text_events(server, streams, n, body, chunk, choice):
        yield event


def _sse_data(payload: ChatCompletionChunk | Completion, include_usage: bool) -> str:
    data = payload.model_dump()
    if not include_usage:
        data.pop("usage")
    return _sse(data)


async def _text_events(
    server: _Server,
    streams: list[RequestStream],
    n: int,
    body: ChatCompletionRequest | CompletionRequest,
    chunk: Callable[..., str],
    choice: Callable[[int, CompletionOutput, str], ChatChunkChoice | CompletionChoice],
    opening: str | None = None,
) -> AsyncIterator[str]:
    """The SSE events of a streamed chat or completion: each choice's new text as it comes
    (held back while it may still become a stop string), the usage chunk when asked for, and
    [DONE]; an error mid-stream ends it with an error event. chunk(choices, usage) formats one
    event and choice(prompt index, output, text) one choice of it."""
    deltas = _TextDeltas(body.stop_list())
    finals: list[RequestOutput] = []
    try:
        if opening is not None:
            yield opening
        async with aclosing(_merge(server, streams, n)) as merged:
            async for i, output in merged:
                if output.finished and output.finish_reason == "abort":
                    raise APIError(503, "the request was aborted", type="server_error", code="aborted")
                choices = []
                for o in output.outputs:
                    text = deltas.delta((i, o.index), o.text, o.finish_reason is not None)
                    if text or o.finish_reason is not None:
                        choices.append(choice(i, o, text))
                if choices:
                    yield chunk(choices)
                if output.finished:
                    finals.append(output)
        if body.include_usage:
            yield chunk([], _usage(finals))
        yield "data: [DONE]\n\n"
    except (APIError, EngineStepError, EngineStopped) as error:
        yield _stream_error(error)


class _SSEResponse(StreamingResponse):
    """Server-sent events whose requests are aborted the moment the client goes away.

    Starlette cancels the body iterator when it sees the disconnect; closing the iterator and
    the streams here as well covers a cancellation that lands while the iterator is suspended
    at a yield, or before it ever started."""

    def __init__(self, events: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events = events
        self._streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                stream.close()
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()


# -- errors and request counting -------------------------------------------------------------


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> Response:
        return error.response()

    @app.exception_handler(_ClientGone)
    async def client_gone(_: Request, __: _ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> Response:
        return _validation_error(error.errors()).response()  # 400, not FastAPI's 422

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> Response:
        kind = "not_found" if error.status_code == 404 else None
        return APIError(error.status_code, str(error.detail), code=kind, headers=error.headers).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> Response:
        logger.exception("unhandled error", exc_info=error)
        return APIError(500, "internal server error", type="server_error", code="internal_error").response()


_COUNTED_PATHS = frozenset(["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"])


class _CountRequests:
    """Pure ASGI middleware (streaming-safe): counts requests by endpoint and status code."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in _COUNTED_PATHS else ("/v1/models/{model}" if path.startswith("/v1/models/") else "other")
        status = ["500"]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(endpoint, status[0]).inc()


__all__ = ["APIError", "Tenants", "create_app"]
