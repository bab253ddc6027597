"""radixkv's own cache endpoints (not OpenAI's): POST /v1/cache/pin locks a prefix against
eviction, GET /v1/cache/pin lists the caller's pins, DELETE /v1/cache/pin/{pin_id} releases
one; POST /v1/cache/lookup tells how much of a prompt the caller's partition holds in RAM and on
disk; POST /v1/cache/flush (admin only) empties a tier. And the bookkeeping of who pinned what,
how many pages pins may lock, and when they expire.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixkv.engine.async_engine import EngineStopped
from radixkv.engine.engine import Engine
from radixkv.engine.request import SamplingParams
from radixkv.prompts import encode_prompt
from radixkv.server.cache.protocol import (
    CacheFlushRequest,
    CacheFlushResponse,
    CacheLookupRequest,
    CacheLookupResponse,
    PinList,
    PinRequest,
    PinResponse,
    UnpinResponse,
)
from radixkv.server.encode import chat_prompt
from radixkv.server.errors import APIError, WireNames, context_error, parse_body
from radixkv.server.streaming import collect, submit, until_disconnect

if TYPE_CHECKING:
    from radixkv.server.state import AppState

# Pins made over HTTP may lock at most this share of the page pool, so they cannot starve requests.
_MAX_PINNED_FRACTION = 0.5
# One key's pins may lock at most this share of the pool unless ServerLimits sets a number of
# pages: half of what all pins may lock, so no one key takes all the pin room, on a pool of any
# size (a fixed number is the whole pin room on a small pool and a sliver of a large one).
MAX_PINNED_FRACTION_PER_KEY = 0.25
# A pin whose expiry is this close counts as expired. The timer that expires a pin fires once,
# and uvloop's timers (uvicorn's default loop where uvloop is installed) count from the loop's
# cached millisecond clock, so they may fire a millisecond or two before time.monotonic()
# reaches the expiry: without the slack such a pin would stay until the next pin call.
_EXPIRY_SLACK_S = 0.05


@dataclass(frozen=True, slots=True)
class PinRecord:
    owner: str  # Tenants.owner of the API key that made the pin
    pages: int
    pinned_tokens: int
    prompt_tokens: int
    expires_at_s: float | None  # time.monotonic() seconds; None: until unpinned


class Pins:
    """Pins made over HTTP and the owner (the key) that made each: only that owner may see or
    unpin it; each owner locks at most `max_pages_per_key` (None: MAX_PINNED_FRACTION_PER_KEY of
    the pool), all together at most _MAX_PINNED_FRACTION of the pool and never so much that a
    request of the whole context no longer fits beside them (overlapping pins count twice: a
    safe over-estimate). A pin that locks no page (a prefix shorter than a page) is refused, so
    pins cannot pile up uncounted; each expires `ttl_s` after it was made (0: never). Pin ids
    are the engine's, random: one tells nothing of the others. Touched only on the engine
    thread (AsyncEngine.call)."""

    def __init__(self, max_pages_per_key: int | None, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._records: dict[int, PinRecord] = {}
        self._max_pages_per_key = max_pages_per_key
        self._ttl_s = ttl_s
        self._clock = clock
        self.pages = 0

    def pin(self, engine: Engine, prompt: list[int], salt: str | None, owner: str) -> tuple[int, PinRecord]:
        self.expire(engine)
        pinned = engine.pin(prompt, salt)
        pages = pinned.num_pinned_tokens // engine.pool.page_size
        try:
            self._check(engine, pages, owner)
        except APIError:
            engine.unpin(pinned.pin_id)
            raise
        expires = self._clock() + self._ttl_s if self._ttl_s else None
        record = PinRecord(owner, pages, pinned.num_pinned_tokens, len(prompt), expires)
        self._records[pinned.pin_id] = record
        self.pages += pages
        return pinned.pin_id, record

    def max_pages_per_key(self, engine: Engine) -> int:
        """The pages one owner's pins may lock on this engine's pool."""
        if self._max_pages_per_key is not None:
            return self._max_pages_per_key
        return max(1, int(engine.pool.num_pages * MAX_PINNED_FRACTION_PER_KEY))

    def _check(self, engine: Engine, pages: int, owner: str) -> None:
        num_pages, page_size = engine.pool.num_pages, engine.pool.page_size
        if pages == 0:
            raise APIError(
                400, f"the prefix holds no full page of {page_size} tokens (or none is cached), so there is nothing to pin",
                param="prompt", code="nothing_to_pin",
            )
        # Pinned pages are never evicted: leave room for a request of the whole context, or a
        # request the server accepted could wait forever for pages no one will give back.
        context_pages = -(-engine.max_context_tokens // page_size)
        limit = max(0, min(int(num_pages * _MAX_PINNED_FRACTION), num_pages - context_pages))
        if self.pages + pages > limit:
            raise APIError(
                400,
                f"pinning this prefix would lock {self.pages + pages} KV pages in all; the server allows at most "
                f"{limit} pinned pages (of {num_pages}); unpin others first",
                code="pin_limit_exceeded",
            )
        held = sum(r.pages for r in self._records.values() if r.owner == owner)
        per_key = self.max_pages_per_key(engine)
        if held + pages > per_key:
            raise APIError(
                429,
                f"this key's pins would lock {held + pages} KV pages; each key may pin at most "
                f"{per_key} (of {num_pages}); unpin others first",
                type="rate_limit_error",
                code="pin_limit_exceeded",
            )

    def unpin(self, engine: Engine, pin_id: int, owner: str) -> bool:
        self.expire(engine)
        record = self._records.get(pin_id)
        if record is None or record.owner != owner:
            return False  # unknown, or another tenant's: the same answer, so ids reveal nothing
        self._release(engine, pin_id)
        return True

    def owned_by(self, engine: Engine, owner: str) -> list[tuple[int, PinRecord]]:
        self.expire(engine)
        return [(pin_id, r) for pin_id, r in self._records.items() if r.owner == owner]

    def expire(self, engine: Engine) -> int:
        """Release every pin past its ttl; how many were."""
        now = self._clock() + _EXPIRY_SLACK_S
        expired = [pin_id for pin_id, r in self._records.items() if r.expires_at_s is not None and r.expires_at_s <= now]
        for pin_id in expired:
            self._release(engine, pin_id)
        return len(expired)

    def _release(self, engine: Engine, pin_id: int) -> None:
        record = self._records.pop(pin_id)
        self.pages -= record.pages
        engine.unpin(pin_id)



def check_token_ids(server: AppState, token_ids: list[int], param: str) -> None:
    vocab = server.engine.vocab_size
    if any(isinstance(t, bool) or not 0 <= t < vocab for t in token_ids):
        raise APIError(400, f"{param}: token ids must be integers in [0, {vocab})", param=param)


def pin_prompt(server: AppState, body: PinRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give the prefix to pin as exactly one of prompt (text or token ids) or messages")
    if body.messages is not None:
        prompt = chat_prompt(server, [m.as_chat() for m in body.messages], add_generation_prompt=False)
        param = "messages"
    else:
        prompt = encode_prompt(server.engine.tokenizer, body.prompt)  # type: ignore[arg-type]
        param = "prompt"
        if isinstance(body.prompt, list):
            # A lookup never reaches the engine's request check: out-of-range ids are refused
            # here as a request's would be, not looked up (or hashed) as if they were tokens.
            check_token_ids(server, prompt, param)
    if not prompt:
        raise APIError(400, f"{param} must hold at least one token", param=param)
    if len(prompt) >= server.engine.max_context_tokens:
        raise context_error(server.engine.max_context_tokens, len(prompt), None, param)
    return prompt

def _pin_response(pin_id: int, record: PinRecord) -> PinResponse:
    expires_in_s = None if record.expires_at_s is None else max(0.0, record.expires_at_s - time.monotonic())
    return PinResponse(pin_id=pin_id, pinned_tokens=record.pinned_tokens, prompt_tokens=record.prompt_tokens, expires_in_s=expires_in_s)


def _expire_soon(server: AppState, pins: Pins) -> None:
    try:
        server.engine.call(pins.expire)
    except EngineStopped:
        pass  # shutting down: the engine goes with its pins


def register(app: FastAPI, server: AppState) -> None:
    pins = Pins(server.limits.max_pinned_pages_per_key, server.limits.pin_ttl_s)
    app.state.pins = pins  # tests reach it here

    @app.post("/v1/cache/pin")
    async def pin_prefix(request: Request) -> Response:
        """Compute a prefix (a one-token request) and lock its full pages in the cache until
        DELETE /v1/cache/pin/{pin_id}; a pin lasts until then or until the server stops."""
        key = server.tenants.authenticate_headers(request.headers)
        raw = await request.body()

        def prepare() -> tuple[PinRequest, list[int]]:
            body = parse_body(PinRequest, raw)
            if body.model is not None:
                server.check_model(body.model)
            return body, pin_prompt(server, body)

        body, prompt = await server.parse_slots.run(key, prepare)
        salt = server.tenants.cache_salt(key, body.cache_salt)
        owner = server.tenants.owner(key)  # not the salt's: one pin cap per key, whatever salts it uses
        names = WireNames(prompt="messages" if body.messages is not None else "prompt")
        params = SamplingParams(max_tokens=1)
        streams = await submit(server.engine, server.metrics, [prompt], params, salt, names, quotas=server.quotas, key=key, owner=owner)
        await until_disconnect(request, collect(server.metrics, streams, 1), streams)
        # Eviction between the request's end and the pin can only shorten what is pinned;
        # pinned_tokens says how much was.
        pin_id, record = await server.engine.call_async(lambda engine: pins.pin(engine, prompt, salt, owner))
        if record.expires_at_s is not None:
            # Released on time even if no other pin call comes to expire it lazily.
            asyncio.get_running_loop().call_later(server.limits.pin_ttl_s, _expire_soon, server, pins)
        return JSONResponse(_pin_response(pin_id, record).model_dump())

    @app.get("/v1/cache/pin")
    async def list_pins(request: Request) -> Response:
        """The caller's own pins (no other key's), oldest first."""
        owner = server.tenants.owner(server.tenants.authenticate_headers(request.headers))
        owned = await server.engine.call_async(lambda engine: pins.owned_by(engine, owner))
        return JSONResponse(PinList(data=[_pin_response(pin_id, record) for pin_id, record in owned]).model_dump())

    @app.delete("/v1/cache/pin/{pin_id}")
    async def unpin_prefix(pin_id: int, request: Request) -> Response:
        owner = server.tenants.owner(server.tenants.authenticate_headers(request.headers))
        if not await server.engine.call_async(lambda engine: pins.unpin(engine, pin_id, owner)):
            raise APIError(404, f"no pin {pin_id} (unknown, already unpinned, or another key's)", code="not_found")
        return JSONResponse(UnpinResponse(pin_id=pin_id).model_dump())

    @app.post("/v1/cache/lookup")
    async def lookup_prefix(request: Request) -> Response:
        """How many tokens of a prompt are cached for the caller, in RAM and on disk. Only the
        caller's own partition (its key and cache_salt) is looked at: another tenant's cache
        is neither visible nor timeable through this."""
        key = server.tenants.authenticate_headers(request.headers)
        raw = await request.body()

        def prepare() -> tuple[CacheLookupRequest, list[int]]:
            body = parse_body(CacheLookupRequest, raw)
            if body.model is not None:
                server.check_model(body.model)
            return body, pin_prompt(server, body)

        body, prompt = await server.parse_slots.run(key, prepare)
        salt = server.tenants.cache_salt(key, body.cache_salt)
        ram, disk = await server.engine.call_async(lambda engine: engine.lookup(prompt, salt))
        response = CacheLookupResponse(prompt_tokens=len(prompt), cached_tokens=ram + disk, ram_tokens=ram, disk_tokens=disk)
        return JSONResponse(response.model_dump())

    @app.post("/v1/cache/flush")
    async def flush_cache(request: Request) -> Response:
        """Empty the RAM tier (unlocked pages), the disk tier, or both, for every tenant;
        admin keys only. Reports what was freed."""
        key = server.tenants.authenticate_headers(request.headers)
        server.tenants.require_admin(key)
        body = parse_body(CacheFlushRequest, await request.body() or b"{}")
        ram, disk = body.tier in ("ram", "all"), body.tier in ("disk", "all")
        pages, blocks = await server.engine.call_async(lambda engine: engine.flush_cache(ram=ram, disk=disk))
        return JSONResponse(CacheFlushResponse(tier=body.tier, freed_ram_pages=pages, freed_disk_blocks=blocks).model_dump())
