"""radixkv's session endpoints: GET /v1/cache/sessions lists the caller's sessions, DELETE
/v1/cache/sessions/{key} releases one. Sessions are the engine's (engine/sessions.py), keyed by
the API key's owner (keyless: by the `cache_salt` query parameter's namespace too): another
owner's session answers as one that does not exist.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixkv.server.cache.protocol import SessionDeleted, SessionList, SessionResponse
from radixkv.server.errors import APIError

if TYPE_CHECKING:
    from radixkv.server.state import AppState


def register(app: FastAPI, server: AppState) -> None:
    def caller(request: Request, cache_salt: str | None) -> tuple[str, str | None]:
        """(owner, session namespace) of the caller: keyless, its cache_salt's partition."""
        key = server.tenants.authenticate_headers(request.headers)
        salt = server.tenants.cache_salt(key, cache_salt)
        return server.tenants.owner(key), server.tenants.session_namespace(salt)

    @app.get("/v1/cache/sessions")
    async def list_sessions(request: Request, cache_salt: str | None = None) -> Response:
        """The caller's own live sessions (no other key's), least recently active first."""
        owner, namespace = caller(request, cache_salt)
        infos = await server.engine.call_async(lambda engine: engine.sessions.of_owner(owner, namespace))
        data = [
            SessionResponse(
                key=i.key, retained_tokens=i.num_retained_tokens, turns=i.num_turns, idle_s=i.idle_s,
                expires_in_s=i.expires_in_s, turns_in_flight=i.in_flight,
            )  # fmt: skip
            for i in infos
        ]
        return JSONResponse(SessionList(data=data).model_dump())

    @app.delete("/v1/cache/sessions/{key:path}")
    async def delete_session(key: str, request: Request, cache_salt: str | None = None) -> Response:
        """Release the caller's session now: its retention ends and its tail is marked dead."""
        owner, namespace = caller(request, cache_salt)
        if not await server.engine.call_async(lambda engine: engine.sessions.release(owner, key, namespace)):
            # The same answer for another owner's key: a key's existence is not revealed.
            raise APIError(404, "no such session (unknown, expired, released, or another key's)", code="not_found")
        return JSONResponse(SessionDeleted(key=key).model_dump())
