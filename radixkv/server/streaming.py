"""Requests in flight, from submission to the last byte: submitting prompts to the engine,
merging their streams of deltas, collecting their finals, aborting them when the client goes
away, and the server-sent events of a streamed response.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Message, Receive, Scope, Send

from radixkv.engine.async_engine import (
    AsyncEngine,
    EngineStepError,
    EngineStopped,
    RequestStream,
)
from radixkv.engine.request import Keep
from radixkv.engine.request_output import RequestDelta, RequestOutput
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.sessions import SessionRef
from radixkv.server.errors import (
    WireNames,
    ENGINE_ERRORS,
    APIError,
    ClientGone,
    engine_error,
)
from radixkv.server.guards.parse_slots import ParseSlots
from radixkv.server.guards.quotas import KeyQuotas, Lease
from radixkv.server.metrics import RequestTracker, ServerMetrics

T = TypeVar("T")
logger = logging.getLogger("radixkv.server")


async def submit(
    engine: AsyncEngine,
    metrics: ServerMetrics,
    prompts: list[list[int]],
    params: SamplingParams,
    salt: str | None,
    names: WireNames,
    *,
    quotas: KeyQuotas | None = None,
    parse_slots: ParseSlots | None = None,
    key: bytes | None = None,
    owner: str | None = None,
    session: SessionRef | None = None,
    sibling_salts: tuple[str | None, ...] = (),
    keeps: Sequence[tuple[Keep, ...]] | None = None,
) -> list[RequestStream]:
    """One stream per prompt, or none: if any submission fails, those made are aborted. With
    `quotas`, each request holds a share of `key`'s quota until its stream is done (429 past it);
    `owner` (Tenants.owner of the key) is whose fair share of the engine's batch each takes;
    `session` (server/sessions.py) the owner's session each prompt is a turn of; `keeps`
(server/keeps.py), one tuple per prompt, what each keeps cached once computed. With
    `parse_slots`, the CPU time the owner's guide compiles spent is charged to `key`'s share."""
    streams: list[RequestStream] = []
    leases: list[Lease] = []
    if quotas is not None:
        quotas.check_fits(len(prompts), len(prompts) * params.n, names.prompt if len(prompts) > 1 else "n")
    try:
        for i, prompt in enumerate(prompts):
            if quotas is not None:
                leases.append(quotas.acquire(key, 1, params.n))
            stream = await engine.submit(
                prompt, params, salt=salt, owner=owner, session=session, sibling_salts=sibling_salts, keeps=keeps[i] if keeps is not None else (),
            )
            streams.append(stream)
            if quotas is not None:
                stream.add_done_callback(leases[-1].release)
    except BaseException as error:
        for stream in streams:
            stream.close()
        for lease in leases:
            lease.release()  # idempotent: those of closed streams are already back
        if isinstance(error, ENGINE_ERRORS):
            raise engine_error(error, names) from None
        raise
    finally:
        if parse_slots is not None and params.guide is not None:
            parse_slots.charge(key, engine.take_compile_cpu_s(owner))
    metrics.prompt_tokens.inc(sum(len(prompt) for prompt in prompts))
    return streams


async def merge(metrics: ServerMetrics, streams: list[RequestStream], n: int) -> AsyncIterator[tuple[int, RequestDelta]]:
    """(prompt index, delta) from every stream as they come; closes them all at the end."""
    trackers = [RequestTracker(metrics, n) for _ in streams]
    # Bounded: while the consumer is stalled (its client not reading), each pump waits here and
    # its stream keeps the backlog, joined into one delta, instead of this queue growing per step.
    queue: asyncio.Queue[tuple[int, RequestDelta | BaseException | None]] = asyncio.Queue(maxsize=len(streams))

    async def pump(i: int, stream: RequestStream) -> None:
        end: BaseException | None = None
        try:
            async for delta in stream:
                await queue.put((i, delta))
        except Exception as error:  # noqa: BLE001 - handed to the consumer
            end = error
        await queue.put((i, end))

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


async def collect(metrics: ServerMetrics, streams: list[RequestStream], n: int) -> list[RequestOutput]:
    """The finished output of every stream, in prompt order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async with aclosing(merge(metrics, streams, n)) as merged:
            async for i, delta in merged:
                if delta.output is not None:
                    finals[i] = delta.output
    except (EngineStepError, EngineStopped) as error:
        raise engine_error(error) from None
    if any(f is None or f.finish_reason == "abort" for f in finals):
        raise APIError(503, "the request was aborted (the server is shutting down)", type="server_error", code="aborted")
    return finals  # type: ignore[return-value]


async def until_disconnect(request: Request, work: Awaitable[T], streams: list[RequestStream]) -> T:
    """Await work, unless the client disconnects first: then abort its requests (ClientGone)."""
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
        raise ClientGone
    return work_task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- server-sent events ----------------------------------------------------------------------


def sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump() if isinstance(payload, BaseModel) else payload
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


class SlowReader(Exception):
    """A streaming client did not take the next event within the send timeout."""


class SSEResponse(StreamingResponse):
    """Server-sent events whose requests are aborted the moment the client goes away, or stops
    reading: a send that the client's socket has not taken within `send_timeout_s` ends the
    response and aborts its requests, so their pages go back.

    Starlette cancels the body iterator when it sees the disconnect; closing the iterator and
    the streams here as well covers a cancellation that lands while the iterator is suspended
    at a yield, or before it ever started."""

    def __init__(self, events: AsyncIterator[str], streams: list[RequestStream], send_timeout_s: float | None = None) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events = events
        self._streams = streams
        self._send_timeout_s = send_timeout_s

    async def stream_response(self, send: Send) -> None:
        if self._send_timeout_s is None:
            return await super().stream_response(send)
        timeout_s = self._send_timeout_s

        async def send_in_time(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), timeout_s)
            except TimeoutError:
                raise SlowReader from None

        return await super().stream_response(send_in_time)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SlowReader:
            # Returning with the response unfinished makes the server close the connection.
            logger.warning("a streaming client read nothing for %.1f s; its requests are aborted", self._send_timeout_s)
        finally:
            for stream in self._streams:
                stream.close()
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
