"""Connection guards under uvicorn: a cap on open connections and a deadline for a request's
headers (slowloris), in an h11 protocol subclass; `uvicorn_options` gives the uvicorn.Config
arguments that install them from ServerLimits. The body's own deadline is LimitBody's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from radixkv.server.limits import ServerLimits

logger = logging.getLogger(__name__)

_REFUSED_LINGER_S = 1.0  # how long a refused connection is read (and dropped) before it closes


def _raw_response(status: int, reason: str, text: str) -> bytes:
    # Written straight to the socket: h11 will not send a response before a request has come.
    body = text.encode()
    head = f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with two guards its options lack: past `max_connections` open
    connections a new one is answered 503 and closed; a connection whose request
    headers are not complete `header_read_timeout_s` after it opened (or after the previous
    response ended) is answered 408 (closed silently if none of them came) and closed. uvicorn's timeout_keep_alive alone does not do
    this: any byte cancels it, so a client sending one header byte at a time held a connection
    (and a file descriptor) forever. Subclassed per server by `guarded_protocol`."""

    max_connections: int = 1024
    header_read_timeout_s: float = 10.0
    num_refused: int = 0  # connections refused for max_connections (per subclass: per server)

    _header_deadline: asyncio.TimerHandle | None = None
    _partial_headers = False  # a byte of the awaited request's headers has come
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse_connection(transport)
            return
        self._arm_header_deadline()

    def _refuse_connection(self, transport: asyncio.Transport) -> None:
        cls = type(self)
        cls.num_refused += 1
        if cls.num_refused == 1 or cls.num_refused % 1000 == 0:  # a flood must not flood the log
            logger.warning("%d connections refused so far: %d open (max_connections)", cls.num_refused, self.max_connections)
        self._close_with(_raw_response(503, "Service Unavailable", f"the server has {self.max_connections} connections open, its limit (max_connections)"))

    def _close_with(self, response: bytes) -> None:
        """Send `response` and end the connection; its place in the count is free at once."""
        self._refused = True
        self.connections.discard(self)  # on its way out: it must not keep others out meanwhile
        self.transport.write(response)
        # Half-close and keep reading (and dropping) what the client sends for a moment: closing
        # with its request unread would reset the connection, and the client might lose the answer.
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(_REFUSED_LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self._header_deadline is not None:
            if self.conn.their_state is not h11.IDLE:
                self._cancel_header_deadline()  # the headers are in: the body has LimitBody's deadline
            else:
                self._partial_headers = True

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Waiting for the next request on this connection: its headers get the same deadline
        # (an idle connection is closed sooner, by uvicorn's timeout_keep_alive).
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        self._partial_headers = False
        self._header_deadline = self.loop.call_later(self.header_read_timeout_s, self._header_deadline_passed)

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if not self._partial_headers or self.conn.our_state is not h11.IDLE:
            # Idle (a client's pooled connection must not find a stray response on it later),
            # or mid-cycle with no room for a response of ours: closed silently.
            self.transport.close()
            return
        self._close_with(
            _raw_response(408, "Request Timeout", f"the request headers did not arrive within {self.header_read_timeout_s:g} s (header_read_timeout_s)")
        )


def guarded_protocol(limits: ServerLimits) -> type[GuardedH11Protocol]:
    """A GuardedH11Protocol class with `limits`' caps (uvicorn makes one instance per connection
    from the class it is given)."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"max_connections": limits.max_connections, "header_read_timeout_s": limits.header_read_timeout_s},
    )


def uvicorn_options(limits: ServerLimits) -> dict[str, Any]:
    """uvicorn.Config arguments for a radixkv server under `limits`."""
    return {"http": guarded_protocol(limits)}
