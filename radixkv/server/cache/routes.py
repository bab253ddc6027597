"""radixkv's own cache endpoints (not OpenAI's): POST /v1/cache/pin locks a prefix against
eviction, GET /v1/cache/pin lists the caller's pins, DELETE /v1/cache/pin/{pin_id} releases
one; POST /v1/cache/lookup tells how much of a prompt the caller's partition holds in RAM and on
disk; POST /v1/cache/flush (admin only) empties a tier. Pins, their caps and expiry are the
engine's (engine/pins.py); this module turns the wire into its calls, with the key's owner.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixkv.engine.async_engine import EngineStopped
from radixkv.engine.pins import PinnedPrefix
from radixkv.engine.sampling_params import SamplingParams
from radixkv.errors import InvalidRequest
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
from radixkv.server import keeps
from radixkv.server.encode import chat_prompt
from radixkv.server.errors import APIError, WireNames, engine_error, parse_body
from radixkv.server.streaming import collect, submit, until_disconnect

if TYPE_CHECKING:
    from radixkv.server.state import AppState

P = TypeVar("P", bound=PinRequest)  # a pin or a lookup body: a prefix to encode


def pin_prompt(server: AppState, body: PinRequest, owner: str | None = None, salt: str | None = None) -> list[int]:
    """The prefix's token ids; messages with the owner's earlier replies in partition `salt`
    spliced back in as their generated ids, as that owner's next chat turn will be
    (radixkv.prompts.replies)."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give the prefix to pin as exactly one of prompt (text or token ids) or messages")
    if body.messages is not None:
        prompt = chat_prompt(server, [m.as_chat() for m in body.messages], add_generation_prompt=False, owner=owner, salt=salt)
        param = "messages"
    else:
        prompt = encode_prompt(server.engine.tokenizer, body.prompt)  # type: ignore[arg-type]
        param = "prompt"
    if not prompt:
        raise APIError(400, f"{param} must hold at least one token", param=param)
    # No token or context check here: the engine checks a pin's warming request (and
    # Engine.pin again); a lookup is checked in its parse slot (_prefix_request's `check`). A
    # prompt past the context splices nothing (encode_conversation_exact).
    return prompt


def _names(body: PinRequest) -> WireNames:
    return WireNames(prompt="messages" if body.messages is not None else "prompt")


async def _prefix_request(
    server: AppState, request: Request, model: type[P], check: Callable[[list[int]], None] | None = None
) -> tuple[bytes | None, P, list[int], str | None]:
    """A pin or lookup body, parsed, encoded and `check`ed (InvalidRequest: a 400 in the body's
    names) in the caller's parse slots: (its key, the body, the prefix's token ids, the cache
    partition to look in)."""
    key = server.tenants.authenticate_headers(request.headers)
    raw = await request.body()

    def prepare() -> tuple[P, list[int], str | None]:
        body = parse_body(model, raw)
        if body.model is not None:
            server.check_model(body.model)
        salt = server.tenants.cache_salt(key, body.cache_salt)
        prompt = pin_prompt(server, body, server.tenants.owner(key), salt)
        if check is not None:
            try:
                check(prompt)
            except InvalidRequest as error:
                raise engine_error(error, _names(body)) from None
        return body, prompt, salt

    body, prompt, salt = await server.parse_slots.run(key, prepare)
    return key, body, prompt, salt


def _pin_response(pinned: PinnedPrefix) -> PinResponse:
    expires_in_s = None if pinned.expires_at_s is None else max(0.0, pinned.expires_at_s - time.monotonic())
    return PinResponse(
        pin_id=pinned.pin_id, pinned_tokens=pinned.num_pinned_tokens, prompt_tokens=pinned.num_prompt_tokens, expires_in_s=expires_in_s
    )


def _expire_soon(server: AppState) -> None:
    try:
        server.engine.call(lambda engine: engine.expire())
    except EngineStopped:
        pass  # shutting down: the engine goes with its pins


def register(app: FastAPI, server: AppState) -> None:
    ttl_s = server.limits.pin_ttl_s or None  # 0: pins made over HTTP never expire

    @app.post("/v1/cache/pin")
    async def pin_prefix(request: Request) -> Response:
        """Compute a prefix (a one-token request) and lock its full pages in the cache until
        DELETE /v1/cache/pin/{pin_id}; a pin lasts until then or until the server stops."""
        key, body, prompt, salt = await _prefix_request(server, request, PinRequest)
        owner = server.tenants.owner(key)  # not the salt's: one pin cap per key, whatever salts it uses
        names = _names(body)
        params = SamplingParams(max_tokens=1)
        streams = await submit(
            server.engine, server.metrics, [prompt], params, salt, names, quotas=server.quotas, parse_slots=server.parse_slots, key=key, owner=owner,
            keeps=[keeps.pin(prompt, ttl_s)],
        )  # fmt: skip
        finals = await until_disconnect(request, collect(server.metrics, streams, 1), streams)
        # The pin was made right after the step that computed the prefix (nothing could evict
        # it in between); the caps' refusal comes back on the output.
        kept = finals[0].kept
        if kept is None or kept.pin is None:
            error = kept.error if kept is not None and kept.error is not None else InvalidRequest("the prefix was not pinned", param="prompt")
            raise engine_error(error, names) from None
        pinned = kept.pin
        if ttl_s is not None:
            # Released on time even if no other pin call comes to expire it lazily.
            asyncio.get_running_loop().call_later(ttl_s, _expire_soon, server)
        return JSONResponse(_pin_response(pinned).model_dump())

    @app.get("/v1/cache/pin")
    async def list_pins(request: Request) -> Response:
        """The caller's own pins (no other key's), oldest first."""
        owner = server.tenants.owner(server.tenants.authenticate_headers(request.headers))
        owned = await server.engine.call_async(lambda engine: engine.pins_of(owner))
        return JSONResponse(PinList(data=[_pin_response(pinned) for pinned in owned]).model_dump())

    @app.delete("/v1/cache/pin/{pin_id}")
    async def unpin_prefix(pin_id: int, request: Request) -> Response:
        owner = server.tenants.owner(server.tenants.authenticate_headers(request.headers))
        if not await server.engine.call_async(lambda engine: engine.unpin(pin_id, owner)):
            raise APIError(404, f"no pin {pin_id} (unknown, already unpinned, or another key's)", code="not_found")
        return JSONResponse(UnpinResponse(pin_id=pin_id).model_dump())

    @app.post("/v1/cache/lookup")
    async def lookup_prefix(request: Request) -> Response:
        """How many tokens of a prompt are cached for the caller, in RAM and on disk. Only the
        caller's own partition (its key and cache_salt) is looked at: another tenant's cache
        is neither visible nor timeable through this. A prompt past the context is refused in
        the caller's parse slot, so the engine thread's part is bounded by the context."""
        _, _, prompt, salt = await _prefix_request(server, request, CacheLookupRequest, server.engine.context.check_lookup)
        try:
            found = await server.engine.call_async(lambda engine: engine.lookup(prompt, salt))
        except InvalidRequest as error:
            raise engine_error(error, WireNames()) from None
        response = CacheLookupResponse(
            prompt_tokens=len(prompt), cached_tokens=found.num_cached_tokens, ram_tokens=found.num_ram_tokens, disk_tokens=found.num_disk_tokens
        )
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
