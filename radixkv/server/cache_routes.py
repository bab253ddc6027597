"""radixkv's own cache endpoints (not OpenAI's): POST /v1/cache/pin locks a prefix against
eviction, DELETE /v1/cache/pin/{pin_id} releases it; and the bookkeeping of who pinned what and
how many pages all pins may lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixkv.engine.engine import Engine, PinnedPrefix
from radixkv.engine.request import SamplingParams
from radixkv.server.errors import APIError, WireNames, parse_body
from radixkv.server.prompts import pin_prompt
from radixkv.server.protocol import PinRequest, PinResponse, UnpinResponse
from radixkv.server.streaming import collect, off_loop, submit, until_disconnect

if TYPE_CHECKING:
    from radixkv.server.state import Server

# Pins made over HTTP may lock at most this share of the page pool, so they cannot starve requests.
_MAX_PINNED_FRACTION = 0.5


class Pins:
    """Pins made over HTTP and the key that made each: only that key may unpin it, and together
    they lock at most _MAX_PINNED_FRACTION of the pool, and never so much that a request of the
    whole context no longer fits beside them (overlapping pins count twice: a safe
    over-estimate). Touched only on the engine thread (AsyncEngine.call), which orders them."""

    def __init__(self) -> None:
        self._owners: dict[int, tuple[bytes | None, int]] = {}  # pin_id -> (key, pages)
        self.pages = 0

    def pin(self, engine: Engine, prompt: list[int], salt: str | None, owner: bytes | None) -> PinnedPrefix:
        pinned = engine.pin(prompt, salt)
        num_pages, page_size = engine.pool.num_pages, engine.pool.page_size
        pages = pinned.num_pinned_tokens // page_size
        # Pinned pages are never evicted: leave room for a request of the whole context, or a
        # request the server accepted could wait forever for pages no one will give back.
        context_pages = -(-engine.max_context_tokens // page_size)
        limit = max(0, min(int(num_pages * _MAX_PINNED_FRACTION), num_pages - context_pages))
        if self.pages + pages > limit:
            engine.unpin(pinned.pin_id)
            raise APIError(
                400,
                f"pinning this prefix would lock {self.pages + pages} KV pages in all; the server allows at most "
                f"{limit} pinned pages (of {num_pages}); unpin others first",
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


def register(app: FastAPI, server: Server) -> None:
    pins = Pins()

    @app.post("/v1/cache/pin")
    async def pin_prefix(request: Request) -> Response:
        """Compute a prefix (a one-token request) and lock its full pages in the cache until
        DELETE /v1/cache/pin/{pin_id}; a pin lasts until then or until the server stops."""
        key = server.tenants.authenticate(request.headers.get("authorization"))
        raw = await request.body()

        def prepare() -> tuple[PinRequest, list[int]]:
            body = parse_body(PinRequest, raw)
            if body.model is not None:
                server.check_model(body.model)
            return body, pin_prompt(server, body)

        body, prompt = await off_loop(prepare)
        salt = server.tenants.cache_salt(key, body.cache_salt)
        names = WireNames(prompt="messages" if body.messages is not None else "prompt")
        streams = await submit(server.engine, server.metrics, [prompt], SamplingParams(max_tokens=1), salt, names, quotas=server.quotas, key=key)
        await until_disconnect(request, collect(server.metrics, streams, 1), streams)
        # Eviction between the request's end and the pin can only shorten what is pinned;
        # pinned_tokens says how much was.
        pinned = await server.engine.call_async(lambda engine: pins.pin(engine, prompt, salt, key))
        response = PinResponse(pin_id=pinned.pin_id, pinned_tokens=pinned.num_pinned_tokens, prompt_tokens=len(prompt))
        return JSONResponse(response.model_dump())

    @app.delete("/v1/cache/pin/{pin_id}")
    async def unpin_prefix(pin_id: int, request: Request) -> Response:
        key = server.tenants.authenticate(request.headers.get("authorization"))
        if not await server.engine.call_async(lambda engine: pins.unpin(engine, pin_id, key)):
            raise APIError(404, f"no pin {pin_id} (unknown, already unpinned, or another key's)", code="not_found")
        return JSONResponse(UnpinResponse(pin_id=pin_id).model_dump())
