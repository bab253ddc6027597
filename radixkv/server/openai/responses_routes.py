"""OpenAI's Responses API: POST /v1/responses, streamed or not. Owns turning a request (input
items, a stored conversation, tools, text.format) into one engine request, and its output into a
Response or its events; conversations (and their turns' ids, which the next turn continues from:
responses_continuation) are kept for previous_response_id in a ResponseStore, per API key
(Tenants.owner), within ServerLimits' caps.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixkv.engine.async_engine import EngineStepError, EngineStopped, RequestStream
from radixkv.engine.request import Keep
from radixkv.engine.request_output import RequestOutput
from radixkv.engine.sampling_params import SamplingParams
from radixkv.errors import InvalidRequest
from radixkv.server import keeps, sampling
from radixkv.prompts.conversation import EncodedConversation
from radixkv.prompts.replies import encode_conversation_exact
from radixkv.server.cache_diagnostics import PromptFingerprint, diverge, openai_diagnostics
from radixkv.server.cache_report import CacheReporter, ChatSource, wanted
from radixkv.server.errors import (
    WireNames,
    APIError,
    engine_error,
    parse_body,
)
from radixkv.server.openai import responses_continuation as continuation
from radixkv.server.openai import responses_convert as convert
from radixkv.server.openai import prompt_cache
from radixkv.server.openai.responses_events import ResponseEvents
from radixkv.server.openai.protocol import PromptCacheKept
from radixkv.server.openai.responses_protocol import (
    IncompleteDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    new_item_id,
    now_s,
    response_usage,
)
from radixkv.server.openai.responses_store import ResponseStore, conversation_bytes
from radixkv.server.sessions import hint_resume, session_ref
from radixkv.server.streaming import (
    SSEResponse,
    collect,
    merge,
    submit,
    until_disconnect,
)
from radixkv.server.reply_format import Piece, ReplyStream
from radixkv.server.tools import Tool, check_tool_choice

if TYPE_CHECKING:
    from radixkv.server.state import AppState

Message = dict[str, Any]


@dataclass(slots=True)
class _Turn:
    """One request made ready for the engine, and what its reply needs to be read and stored."""

    body: ResponsesRequest
    owner: str  # Tenants.owner: whose store it reads and is kept in
    messages: list[Message]  # the conversation so far, without instructions
    tools: list[Tool]
    choice: str
    params: SamplingParams
    names: WireNames
    prompt: list[int]  # stored with the reply's ids, for the next turn to continue from
    writes: tuple[Keep, ...] = ()  # its prompt_cache breakpoints, kept once the prompt is computed
    encoded: EncodedConversation | None = None  # its one rendering (None: continued from stored ids)
    fingerprint: PromptFingerprint | None = None  # kept under the response's id once answered
    diagnostics: dict[str, Any] | None = None  # prompt_cache_diagnostics, when asked for


def register(app: FastAPI, server: AppState, store: ResponseStore | None = None) -> None:
    # The store lives with the app (one per server); tests reach it through app.state.
    limits = server.limits
    store = store or ResponseStore(
        limits.max_stored_responses_per_key, limits.max_stored_response_bytes_per_key,
        limits.max_stored_responses, limits.max_stored_response_bytes,
    )
    app.state.responses_store = store

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        key = server.tenants.authenticate_headers(request.headers)
        hint_resume(server, request.headers, key)  # the disk read starts before the body is read
        raw = await request.body()
        owner = server.tenants.owner(key)

        def prepare() -> tuple[ResponsesRequest, _Turn, list[int]]:
            body = parse_body(ResponsesRequest, raw)
            if body.model is not None:
                server.check_model(body.model)
            prompt_cache.check_options(body)
            turn, prompt = _prepare(server, store, body, owner)
            _diagnose(server, turn, server.tenants.cache_salt(key, body.cache_salt))
            return body, turn, prompt

        body, turn, prompt = await server.parse_slots.run(key, prepare)
        salt = server.tenants.cache_salt(key, body.cache_salt)
        session = session_ref(request.headers, owner, body.prompt_cache_key, server.tenants.session_namespace(salt))
        writes = turn.writes
        if body.prompt_cache_options is not None and body.prompt_cache_options.prewarm:
            done = await prompt_cache.prewarm(server, request, key, [prompt], [writes], salt, owner, turn.names, session)
            return JSONResponse(_prewarmed(server, body, done).model_dump())
        streams = await submit(
            server.engine, server.metrics, [prompt], turn.params, salt, turn.names, quotas=server.quotas, parse_slots=server.parse_slots, key=key, owner=owner,
            session=session,
            sibling_salts=server.tenants.sibling_salts(key, body.cache_salt), keeps=[writes],
        )
        # message[k] counts the conversation (stored history, then input) as chat messages; the
        # instructions are the system part, no message of their own.
        offset = 1 if body.instructions else 0
        source = ChatSource(convert.prompt_messages(body, turn.messages), turn.tools, turn.choice, message_offset=offset, encoded=turn.encoded)
        reporter = CacheReporter(server, key, wanted(body.cache_report, request.headers), [prompt], source)
        reporter.drift = (turn.diagnostics or {}).get("drift")
        if body.stream:
            events = _events(server, store, turn, streams, reporter)
            return SSEResponse(events, streams, server.limits.stream_send_timeout_s)
        finals = await until_disconnect(request, collect(server.metrics, streams, 1), streams)
        response = _finished(server, turn, finals[0])
        response.cache_report = await reporter.one(finals)
        _answered(server, turn, response.id)
        if body.store:
            ids = continuation.turn_ids(server, body, prompt, finals[0])
            store.put(response.id, turn.owner, turn.messages + convert.reply_messages(response.output), ids)
        return JSONResponse(response.model_dump())


def _prepare(server: AppState, store: ResponseStore, body: ResponsesRequest, owner: str) -> tuple[_Turn, list[int]]:
    history: list[Message] = []
    if body.previous_response_id is not None:
        found = store.get(body.previous_response_id, owner)
        if found is None:
            raise APIError(
                400,
                f"previous response with id {body.previous_response_id!r} not found (never stored, expired, or not yours)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = found
    messages = convert.conversation(body, history)
    if body.store and (size := conversation_bytes(messages)) > store.max_bytes_per_owner:
        # Refused before any work: stored after it, the reply could not be kept, and the
        # client would learn so only when it chains onto it.
        raise APIError(
            400,
            f"this conversation is {size} bytes; a key may keep at most {store.max_bytes_per_owner} bytes of stored "
            "responses; send store=false, or a shorter conversation",
            param="input",
            code="stored_response_too_large",
        )
    tools = convert.tool_list(body)
    choice = body.choice()
    guide, guide_param = convert.guide(body, tools, choice)
    names = sampling.responses_names(guide_param)
    try:
        check_tool_choice(choice, tools)
        prompt = continuation.continued_prompt(server, store, body, owner, history, messages, tools)
        encoded = None
        if prompt is None:  # rendered once, for the prompt and the cache report alike
            encoded = encode_conversation_exact(
                None, owner, server.engine.tokenizer, convert.prompt_messages(body, messages), tools, choice,
                salt=None, max_context_tokens=server.engine.max_context_tokens,
            )  # fmt: skip
            prompt = encoded.token_ids
    except InvalidRequest as error:
        raise engine_error(error, names) from None
    params = sampling.responses_params(body, names, guide)
    # The retention first, as chat keeps it: a later keep of the same prefix then reports it.
    writes = keeps.retention(body.prompt_cache_retention, prompt) + prompt_cache.responses_writes(
        server, body, history, tools, choice, prompt, encoded
    )
    return _Turn(body, owner, messages, tools, choice, params, names, prompt, writes, encoded), prompt


def _diagnose(server: AppState, turn: _Turn, salt: str | None) -> None:
    """The turn's fingerprint and, when prompt_cache_options.comparison_response_id asks, its
    prompt_cache_diagnostics: compared with the key's own earlier response only."""
    body = turn.body
    turn.fingerprint = server.diagnoses.digester.fingerprint(
        model=server.model_name, salt=salt, system=body.instructions or None,
        tools=[tool.model_dump(exclude_none=True) for tool in body.tools],  # in order: reordering is a change
        options=[turn.choice, body.parallel_tool_calls], messages=turn.messages, num_prompt_tokens=len(turn.prompt),
        token_ids=turn.prompt,
    )  # fmt: skip
    options = body.prompt_cache_options
    if options is None or options.comparison_response_id is None:
        return
    previous = server.diagnoses.get(turn.owner, options.comparison_response_id)
    offset = 1 if body.instructions else 0
    divergence = None if previous is None else diverge(previous, turn.fingerprint, server.engine.tokenizer, turn.encoded, offset)
    turn.diagnostics = openai_diagnostics(divergence)


def _answered(server: AppState, turn: _Turn, response_id: str) -> None:
    """The response is answered: later requests of this key may compare with it (store or not:
    the fingerprint holds no text)."""
    if turn.fingerprint is not None:
        server.diagnoses.put(turn.owner, response_id, turn.fingerprint)


def _skeleton(server: AppState, body: ResponsesRequest) -> ResponseObject:
    """The Response before any output: the request's settings echoed as OpenAI does."""
    return ResponseObject(
        id=new_item_id("resp"),
        created_at=now_s(),
        status="in_progress",
        model=server.model_name,
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        parallel_tool_calls=body.parallel_tool_calls,
        previous_response_id=body.previous_response_id,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        text=body.text.model_dump(by_alias=True, exclude_none=True),
        tool_choice=body.tool_choice if isinstance(body.tool_choice, str) else body.tool_choice.model_dump(),
        tools=[tool.model_dump(exclude_none=True) for tool in body.tools],
        store=body.store,
        metadata=body.metadata or {},
        user=body.user,
        prompt_cache_key=body.prompt_cache_key,
        prompt_cache_retention=body.prompt_cache_retention,
    )


def _prewarmed(server: AppState, body: ResponsesRequest, done: prompt_cache.Prewarmed) -> ResponseObject:
    """A prewarm's Response: completed with no output; usage says the input's tokens, those the
    cache served, and (cache_write_tokens) those it holds now beyond them."""
    response = _skeleton(server, body)
    response.status = "completed"
    response.usage = response_usage(done.num_prompt_tokens, 0, done.num_cached_tokens, done.num_written_tokens)
    return response


def _usage(server: AppState, final: RequestOutput, reasoning_tokens: int = 0) -> ResponseUsage:
    # Written to the cache: the prompt's full pages (only those are cached) that it did not
    # already hold. The engine's config is fixed once built, so reading it here is safe.
    config = server.engine.engine.config
    full_tokens = final.num_prompt_tokens // config.page_size * config.page_size if config.enable_prefix_caching else 0
    written = max(0, full_tokens - final.num_cached_tokens)
    made = response_usage(final.num_prompt_tokens, final.num_output_tokens, final.num_cached_tokens, written, reasoning_tokens)
    made.prompt_cache_kept = PromptCacheKept(**keeps.prompt_cache_kept([final]))
    return made


def _finished(server: AppState, turn: _Turn, final: RequestOutput) -> ResponseObject:
    complete = final.outputs[0].finish_reason != "length"
    reply = server.reply_format.parse(final.outputs[0].text, final.outputs[0].token_ids, turn.tools, turn.choice)
    response = _skeleton(server, turn.body)
    response.prompt_cache_diagnostics = turn.diagnostics
    response.output = convert.output_items(reply.content, reply.calls, complete, reply.reasoning)
    response.usage = _usage(server, final, reply.reasoning_tokens)
    response.status = "completed" if complete else "incomplete"
    if not complete:
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
    return response


async def _events(
    server: AppState, store: ResponseStore, turn: _Turn, streams: list[RequestStream], reporter: CacheReporter
) -> AsyncIterator[str]:
    """The streamed response: text passes through as the engine decodes it, except what may
    still become a tool call (the reply format's stream holds that back until it parses)."""
    skeleton = _skeleton(server, turn.body)
    skeleton.prompt_cache_diagnostics = turn.diagnostics  # known before generation: in every event's response
    events = ResponseEvents(skeleton)
    splitter = server.reply_format.stream(turn.tools, turn.choice)
    final: RequestOutput | None = None
    try:
        for event in events.start():
            yield event
        async with aclosing(merge(server.metrics, streams, 1)) as merged:
            async for _, delta in merged:
                for completion in delta.completions:
                    if completion.finish_reason == "abort":
                        raise APIError(503, "the request was aborted", type="server_error", code="aborted")
                    for event in _pieces(events, splitter, completion.text, completion.token_ids):
                        yield event
                if delta.output is not None:
                    final = delta.output
        for event in _emit(events, splitter.finish()):
            yield event
        if final is None:
            raise APIError(503, "the request was aborted", type="server_error", code="aborted")
        events.response.cache_report = await reporter.one([final])  # in the closing event, beside usage
        closing = events.finish(_usage(server, final, splitter.reasoning_tokens), final.outputs[0].finish_reason != "length")
        # Stored before the last event goes out: a client may hang up the moment it has it.
        _answered(server, turn, events.response.id)
        if turn.body.store:
            ids = continuation.turn_ids(server, turn.body, turn.prompt, final)
            store.put(events.response.id, turn.owner, turn.messages + convert.reply_messages(events.response.output), ids)
        for event in closing:
            yield event
    except (APIError, EngineStepError, EngineStopped) as error:
        yield events.error(error if isinstance(error, APIError) else engine_error(error))


def _pieces(events: ResponseEvents, splitter: ReplyStream, text: str, token_ids: list[int]) -> list[str]:
    if not text and not token_ids:
        return []
    return _emit(events, splitter.feed(text, token_ids))


def _emit(events: ResponseEvents, piece: Piece) -> list[str]:
    out = events.reasoning(piece.reasoning) + events.text(piece.content)
    for call in piece.calls:
        out += events.call(call)
    return out
