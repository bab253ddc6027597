"""LimitBody: reads a request's body before any route sees it, refusing one over
ServerLimits.max_body_bytes with 413 (in the error shape of the API the path belongs to) before
it is read in full, and one that has not arrived within ServerLimits.body_read_timeout_s with
408. It runs after AccessGuard, so a body is only read for a caller who may send one.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixkv.server.errors import APIError


class LimitBody:
    """Pure ASGI middleware: a declared Content-Length past the limit is refused unread; any
    other body (chunked ones too) is read up to the limit, under the deadline, and refused as
    soon as it passes either; the route then gets the body read already."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, body_read_timeout_s: float = 60.0) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_read_timeout_s = body_read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._refuse(scope, receive, send, declared)
            return
        if not declared and not _chunked(scope):
            await self.app(scope, receive, send)  # no body to wait for
            return
        try:
            # The whole body, not each chunk, has the deadline: a client sending one byte a
            # second would otherwise never run out of time.
            async with asyncio.timeout(self.body_read_timeout_s):
                body, more = await self._read_up_to_limit(receive)
        except TimeoutError:
            error = APIError(
                408,
                f"the request body did not arrive within {self.body_read_timeout_s:g} s (body_read_timeout_s)",
                param="body", code="request_timeout", headers={"Connection": "close"},
            )
            await error.response_for(scope.get("path", ""))(scope, receive, send)
            return
        if more:
            await self._refuse(scope, receive, send, None)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_up_to_limit(self, receive: Receive) -> tuple[bytes, bool]:
        """The body, and whether more was coming past the limit (then the body is partial)."""
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(parts), False  # disconnected: the app will see it on its own
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", True
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts), False

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else "more"
        error = APIError(
            413,
            f"the request body is {size}; the server accepts at most {self.max_body_bytes} bytes",
            param="body",
            code="request_too_large",
            # The unread body is still in flight: tell the client this connection is done.
            headers={"Connection": "close"},
        )
        await error.response_for(scope.get("path", ""))(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses a malformed length before we see it
    return None


def _chunked(scope: Scope) -> bool:
    return any(name == b"transfer-encoding" for name, _ in scope.get("headers", ()))


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out the body read already, then the client's own messages
    (so a later disconnect still reaches the app)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
