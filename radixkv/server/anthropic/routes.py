"""Anthropic's Messages API: POST /v1/messages, streamed or not. Owns turning a Messages body
into an engine request, its output into content blocks with a stop_reason, the usage split
(cache read / cache creation / input: the creation read from what the engine reports its
cache_control keeps did, server/keeps.py), and Anthropic-shaped errors on this path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixkv.engine.async_engine import EngineStepError, EngineStopped, RequestStream
from radixkv.engine.request import Keep
from radixkv.engine.request_output import RequestOutput
from radixkv.engine.sampling_params import SamplingParams
from radixkv.errors import InvalidRequest
from radixkv.prompts.conversation import EncodedConversation
from radixkv.server import keeps, sampling
from radixkv.server import tools as tool_layer
from radixkv.server.anthropic import conversation as conv_mod
from radixkv.server.anthropic.conversation import Conversation
from radixkv.server.anthropic.protocol import MessagesRequest
from radixkv.server.cache_diagnostics import PromptFingerprint, anthropic_reason, diverge, drift_field
from radixkv.server.cache_report import CacheReporter, ChatSource, wanted
from radixkv.prompts.replies import encode_conversation_exact
from radixkv.server.continuation import ReplyCollector
from radixkv.server.errors import (
    APIError,
    ClientGone,
    anthropic_error_body,
    engine_error,
    parse_body,
)
from radixkv.server.sessions import hint_resume, session_ref
from radixkv.server.streaming import (
    SSEResponse,
    collect,
    merge,
    submit,
    until_disconnect,
)

if TYPE_CHECKING:
    from radixkv.server.state import AppState

logger = logging.getLogger("radixkv.server")
_NAMES = sampling.MESSAGES_NAMES


def register(app: FastAPI, server: AppState) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        try:
            return await _messages(server, request)
        except ClientGone:
            raise
        except APIError as error:
            return _error_response(error)
        except Exception as error:  # noqa: BLE001 - answered in Anthropic's shape, logged
            logger.exception("unhandled error", exc_info=error)
            return JSONResponse(anthropic_error_body(500, "internal server error"), status_code=500)


def _error_response(error: APIError) -> JSONResponse:
    return error.anthropic_response()


async def _messages(server: AppState, request: Request) -> Response:
    key = server.tenants.authenticate_headers(request.headers)
    hint_resume(server, request.headers, key)  # the disk read starts before the body is read
    raw = await request.body()
    owner = server.tenants.owner(key)  # whose retention cap the breakpoints count against, whose replies splice
    salt = server.tenants.cache_salt(key, None)  # the same partition as the key's OpenAI calls
    body, conv, encoded, marks, params, diagnosis = await server.parse_slots.run(key, lambda: _prepare(server, raw, owner, salt))
    prompt = encoded.token_ids
    # The X-Radixkv-Session header: Anthropic has no field.
    session = session_ref(request.headers, owner, namespace=server.tenants.session_namespace(salt))
    # The breakpoints are kept by the engine once the prompt is computed, under the owner's cap.
    streams = await submit(
        server.engine, server.metrics, [prompt], params, salt, _NAMES, quotas=server.quotas, parse_slots=server.parse_slots, key=key, owner=owner,
        session=session, keeps=[tuple(marks)],
    )  # fmt: skip
    ctx = _Context(server, body, conv, prompt, salt, owner)
    ctx.breakpoints = tuple(marks)
    ctx.fingerprint, ctx.diagnostics = diagnosis
    # The system field is rendered as the conversation's first message; message[k] counts the
    # request's own messages.
    offset = _system_offset(body, conv)
    source = ChatSource(conv.messages, conv.tools, conv.tool_choice, message_offset=offset, encoded=encoded)
    ctx.reporter = CacheReporter(server, key, wanted(body.cache_report, request.headers), [prompt], source)
    ctx.reporter.drift = (ctx.diagnostics or {}).get("drift")
    if body.stream:
        return SSEResponse(_events(ctx, streams), streams, server.limits.stream_send_timeout_s)
    finals = await until_disconnect(request, collect(server.metrics, streams, 1), streams)
    return JSONResponse(await _message(ctx, finals[0]))


def _prepare(
    server: AppState, raw: bytes, owner: str, salt: str | None
) -> tuple[MessagesRequest, Conversation, EncodedConversation, list[Keep], SamplingParams, tuple[PromptFingerprint, dict[str, Any] | None]]:
    """The body parsed, templated, tokenized and checked (off the event loop: it may be large)."""
    body = parse_body(MessagesRequest, raw)
    server.check_model(body.model)
    tokenizer = server.engine.tokenizer
    try:
        conv = conv_mod.conversation(body)
        encoded = encode_conversation_exact(
            server.replies, owner, tokenizer, conv.messages, conv.tools, conv.tool_choice,
            salt=salt, max_context_tokens=server.engine.max_context_tokens,
        )  # fmt: skip
        marks = conv_mod.breakpoints(tokenizer, body, conv, encoded.token_ids, encoded)
    except InvalidRequest as error:
        raise engine_error(error, _NAMES) from None
    return body, conv, encoded, marks, _sampling_params(conv, body), _diagnose(server, body, conv, encoded, owner, salt)


def _diagnose(
    server: AppState, body: MessagesRequest, conv: Conversation, encoded: EncodedConversation, owner: str, salt: str | None
) -> tuple[PromptFingerprint, dict[str, Any] | None]:
    """This prompt's fingerprint (kept once it is answered) and, when the body asks, the
    `diagnostics` it answers: compared with the key's own earlier message only."""
    offset = _system_offset(body, conv)
    system = conv.messages[0]["content"] if offset else None
    tools = [t.model_dump(exclude={"cache_control"}) for t in body.tools or ()]  # in order: reordering is a change
    fingerprint = server.diagnoses.digester.fingerprint(
        model=server.model_name, salt=salt, system=system, tools=tools, options=[conv.tool_choice, conv.parallel_tool_calls],
        messages=conv.messages[offset:], num_prompt_tokens=len(encoded.token_ids), token_ids=encoded.token_ids,
    )  # fmt: skip
    if body.diagnostics is None:
        return fingerprint, None
    previous_id = body.diagnostics.previous_message_id
    if previous_id is None:
        return fingerprint, {"cache_miss_reason": None}
    previous = server.diagnoses.get(owner, previous_id)
    divergence = None if previous is None else diverge(previous, fingerprint, server.engine.tokenizer, encoded, offset)
    return fingerprint, {"cache_miss_reason": anthropic_reason(divergence), **drift_field(divergence)}


def _system_offset(body: MessagesRequest, conv: Conversation) -> int:
    """Chat messages before the request's first: the system field, rendered as a message."""
    return 1 if body.system and conv.messages and conv.messages[0].get("role") == "system" else 0


class _Context:
    def __init__(self, server: AppState, body: MessagesRequest, conv: Conversation, prompt: list[int],
                 salt: str | None, owner: str) -> None:
        self.server, self.body, self.conv, self.prompt = server, body, conv, prompt
        self.salt, self.owner = salt, owner
        self.message_id = f"msg_{secrets.token_hex(12)}"
        self.reporter: CacheReporter | None = None  # set once the request is submitted
        self.fingerprint: PromptFingerprint | None = None  # kept under message_id once answered
        self.diagnostics: dict[str, Any] | None = None  # the body asked for diagnostics: the answer
        self.breakpoints: tuple[Keep, ...] = ()  # the cache_control keeps, in the request's order

    def answered(self) -> None:
        """The message is answered: later requests of this key may compare with it."""
        if self.fingerprint is not None:
            self.server.diagnoses.put(self.owner, self.message_id, self.fingerprint)

    def diagnostics_field(self) -> dict[str, Any]:
        return {"diagnostics": self.diagnostics} if self.diagnostics is not None else {}


def _sampling_params(conv: Conversation, body: MessagesRequest) -> SamplingParams:
    guide = None
    if conv.tools and conv.tool_choice != "auto":
        guide = tool_layer.guide_for(conv.tools, conv.tool_choice, conv.parallel_tool_calls)
    return sampling.messages_params(body, guide)


# -- usage ---------------------------------------------------------------------------------


def _usage(ctx: _Context, final: RequestOutput) -> dict[str, Any]:
    """The prompt split honestly: tokens the cache served; tokens up to the last breakpoint
    that were computed now and are now kept (the engine's KeepReport), split by their
    breakpoints' ttl in cache_creation; the rest. The three add up to the prompt's tokens.
    radixkv's prompt_cache_kept says what stays kept and until when."""
    cached = final.num_cached_tokens
    creation = keeps.creation_tokens(final)
    return {
        "input_tokens": len(ctx.prompt) - cached - creation,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": creation,
        "cache_creation": keeps.cache_creation_by_ttl(final, ctx.breakpoints),
        "output_tokens": sum(len(o.token_ids) for o in final.outputs),
        "prompt_cache_kept": keeps.prompt_cache_kept([final]),
    }


# -- the reply -------------------------------------------------------------------------------


def _content(text: str | None, calls: list[Any], thinking: str | None = None) -> list[dict[str, Any]]:
    """A reply's content blocks: its thinking (where asked for), its text, a tool_use block per call."""
    blocks = [_thinking_block(thinking)] if thinking else []
    return blocks + ([{"type": "text", "text": text}] if text else []) + [_tool_use(call) for call in calls]


def _thinking_block(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": _signature(text)}


def _signature(text: str) -> str:
    # Clients hand a thinking block back with its signature; ours names the text and proves
    # nothing (a reasoning model's thinking is read back as any other history, not trusted).
    return hashlib.sha256(text.encode()).hexdigest()


def _tool_use(call: Any) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments) if call.arguments else {}
    except json.JSONDecodeError:
        arguments = {}
    call_id = call.id.removeprefix("call_")
    return {"type": "tool_use", "id": f"toolu_{call_id}", "name": call.name, "input": arguments}


def _stop_reason(ctx: _Context, final: RequestOutput, has_calls: bool) -> tuple[str, str | None]:
    out = final.outputs[0]
    if has_calls:
        return "tool_use", None
    if out.finish_reason == "length":
        return "max_tokens", None
    if out.stop_string is not None:  # the engine ended it at this stop string
        return "stop_sequence", out.stop_string
    return "end_turn", None


async def _message(ctx: _Context, final: RequestOutput) -> dict[str, Any]:
    ReplyCollector(ctx.server.replies, ctx.owner, ctx.salt).finished(final)
    ctx.answered()
    output = final.outputs[0]
    reply = ctx.server.reply_format.parse(output.text, output.token_ids, ctx.conv.tools, ctx.conv.tool_choice, ctx.body.stop_sequences)
    calls = reply.calls
    # A reasoning model's reasoning goes out as a thinking block only where the body asks.
    content = _content(reply.content, calls, reply.reasoning if ctx.body.wants_thinking else None)
    stop_reason, stop_sequence = _stop_reason(ctx, final, bool(calls))
    return {
        "id": ctx.message_id,
        "type": "message",
        "role": "assistant",
        "model": ctx.server.model_name,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(ctx, final),
        **ctx.diagnostics_field(),
        **await _report(ctx, final),
    }


async def _report(ctx: _Context, final: RequestOutput) -> dict[str, Any]:
    """{"cache_report": ...} beside usage when the request asked for it, else nothing."""
    report = await ctx.reporter.one([final]) if ctx.reporter is not None else None
    return {"cache_report": report} if report is not None else {}


# -- streaming -------------------------------------------------------------------------------


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, separators=(',', ':'))}\n\n"


class _Blocks:
    """Content blocks as stream events: an open text or thinking block takes its deltas (a
    thinking block's signature comes as its last delta); a tool call is a whole tool_use block
    (start, its input JSON as one delta, stop)."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the open block's type: "text", "thinking" or none
        self.thought = ""  # the open thinking block's text, which its signature names

    def thinking(self, delta: str) -> list[str]:
        if not delta:
            return []
        events = [] if self.open == "thinking" else self.close() + self._start({"type": "thinking", "thinking": "", "signature": ""})
        self.thought += delta
        events.append(_event("content_block_delta", {"index": self.index, "delta": {"type": "thinking_delta", "thinking": delta}}))
        return events

    def text(self, delta: str) -> list[str]:
        if not delta:
            return []
        events = [] if self.open == "text" else self.close() + self._start({"type": "text", "text": ""})
        events.append(_event("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": delta}}))
        return events

    def _start(self, block: dict[str, Any]) -> list[str]:
        self.index += 1
        self.open = block["type"]
        return [_event("content_block_start", {"index": self.index, "content_block": block})]

    def tool(self, call: Any) -> list[str]:
        events = self.close()
        self.index += 1
        block = {**_tool_use(call), "input": {}}
        partial = json.dumps(_tool_use(call)["input"])
        return events + [
            _event("content_block_start", {"index": self.index, "content_block": block}),
            _event("content_block_delta", {"index": self.index, "delta": {"type": "input_json_delta", "partial_json": partial}}),
            _event("content_block_stop", {"index": self.index}),
        ]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            signature = {"type": "signature_delta", "signature": _signature(self.thought)}
            events.append(_event("content_block_delta", {"index": self.index, "delta": signature}))
            self.thought = ""
        self.open = None
        return events + [_event("content_block_stop", {"index": self.index})]


async def _events(ctx: _Context, streams: list[RequestStream]) -> AsyncIterator[str]:
    message = {"id": ctx.message_id, "type": "message", "role": "assistant", "model": ctx.server.model_name,
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": len(ctx.prompt), "output_tokens": 0}, **ctx.diagnostics_field()}
    splitter = ctx.server.reply_format.stream(ctx.conv.tools, ctx.conv.tool_choice, ctx.body.stop_sequences)
    blocks, final, num_calls = _Blocks(), None, 0
    thinking = ctx.body.wants_thinking  # a reasoning model's reasoning streams as thinking blocks
    try:
        yield _event("message_start", {"message": message})
        yield _event("ping", {})
        async with aclosing(merge(ctx.server.metrics, streams, 1)) as merged:
            async for _, delta in merged:
                if any(c.finish_reason == "abort" for c in delta.completions):
                    raise APIError(529, "the request was aborted")
                for completion in delta.completions:
                    piece = splitter.feed(completion.text, completion.token_ids)
                    for event in _stream_parts(blocks, piece.content, piece.calls, piece.reasoning if thinking else ""):
                        yield event
                    num_calls += len(piece.calls)
                if delta.output is not None:
                    final = delta.output
        piece = splitter.finish()
        num_calls += len(piece.calls)
        for event in _stream_parts(blocks, piece.content, piece.calls, piece.reasoning if thinking else ""):
            yield event
        for event in blocks.close():
            yield event
        if final is None:  # every stream ends with its output or an error; never a silent end
            raise APIError(500, "the request ended without an output", type="server_error")
        ReplyCollector(ctx.server.replies, ctx.owner, ctx.salt).finished(final)
        ctx.answered()
        stop_reason, stop_sequence = _stop_reason(ctx, final, num_calls > 0)
        usage = _usage(ctx, final)
        closing = {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": usage, **await _report(ctx, final)}
        yield _event("message_delta", closing)
        yield _event("message_stop", {})
    except (APIError, EngineStepError, EngineStopped) as error:
        api_error = error if isinstance(error, APIError) else engine_error(error)
        status = 529 if api_error.status == 503 else api_error.status
        yield f"event: error\ndata: {json.dumps(anthropic_error_body(status, api_error.message))}\n\n"


def _stream_parts(blocks: _Blocks, content: str, calls: list[Any], thinking: str = "") -> list[str]:
    events = blocks.thinking(thinking) + blocks.text(content)
    for call in calls:
        events += blocks.tool(call)
    return events
