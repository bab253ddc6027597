"""AccessGuard: who may reach the server before any route runs. With API keys, every path but
the health checks needs one (as `Authorization: Bearer` or `x-api-key`), checked before the body
is read; the operator endpoints (/metrics, /get_load, /server_info, /model_info) can be opened
with ServerLimits.public_operator_endpoints. Without keys (a local server), requests a web page
could forge are refused: a foreign Origin, a non-loopback Host, a non-JSON body. A generation
request from a key with its whole share in flight is refused (429) here too, unread.
"""

from __future__ import annotations

import asyncio

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from radixkv.server.errors import APIError
from radixkv.server.guards.quotas import KeyQuotas
from radixkv.server.guards.tenants import Tenants
from radixkv.server.limits import ServerLimits

# Routers and supervisors probe these without credentials; they tell only whether it serves.
OPEN_PATHS = frozenset(["/health", "/health_generate"])
# What operators and routers poll: load, limits, model. Open only with public_operator_endpoints.
OPERATOR_PATHS = frozenset(
    ["/metrics", "/get_load", "/server_info", "/get_server_info", "/model_info", "/get_model_info"]
)
# The paths whose POST becomes engine requests, each counted against its key's share.
GENERATION_PATHS = frozenset(["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/cache/pin"])
_LOOPBACK_HOSTS = frozenset(["localhost", "127.0.0.1", "[::1]", "::1"])
_BODY_METHODS = frozenset(["POST", "PUT", "PATCH", "DELETE"])


class AccessGuard:
    """Pure ASGI middleware; see the module docstring. The routes authenticate again for the
    caller's key (its tenant); this guard makes sure no route, and no body read, runs for a
    caller without one."""

    def __init__(self, app: ASGIApp, tenants: Tenants, limits: ServerLimits, quotas: KeyQuotas | None = None) -> None:
        self.app = app
        self.tenants = tenants
        self.limits = limits
        self.quotas = quotas  # None: no per-key shares to check (the Ray Serve ingress)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self._refusal(scope)
            if error is not None:
                if error.status == 429:
                    # Held for its Retry-After before it is sent (an idle coroutine, no thread):
                    # a client retrying at once then costs one request per lane a second, not
                    # hundreds that each take the event loop and the interpreter lock.
                    await asyncio.sleep(float(error.headers.get("Retry-After", "0")) if error.headers else 0.0)
                await error.response_for(scope.get("path", ""))(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        headers = Headers(scope=scope)
        path = scope.get("path", "")
        try:
            key = None
            if not self.tenants.auth_required:
                self._check_same_site(headers, scope.get("method", "GET"))
            elif path not in OPEN_PATHS and not (path in OPERATOR_PATHS and self.limits.public_operator_endpoints):
                key = self.tenants.authenticate_headers(headers)
            if self.quotas is not None and path in GENERATION_PATHS and scope.get("method") == "POST":
                # A flooding key's excess then costs no body read, parse, template or tokenizer.
                self.quotas.check_room(key)
        except APIError as error:
            return error
        return None

    def _check_same_site(self, headers: Headers, method: str) -> None:
        """Without keys anyone who can send to the socket may use it, and a browser can: a page
        on any site may post to localhost, or rebind its own name to 127.0.0.1."""
        host = headers.get("host", "")
        allowed_hosts = self.limits.allowed_hosts
        if "*" not in allowed_hosts and _hostname(host) not in _LOOPBACK_HOSTS | set(allowed_hosts):
            raise APIError(
                403, f"Host {host!r} is not served here; without an API key this server answers loopback names only",
                type="permission_error", param="host", code="host_not_allowed",
            )
        origin = headers.get("origin")
        same_site = (f"http://{host}", f"https://{host}")
        if origin is not None and origin not in self.limits.allowed_origins and origin not in same_site:
            raise APIError(
                403, f"cross-site requests from {origin!r} are refused; allow the origin in the server's options",
                type="permission_error", param="origin", code="origin_not_allowed",
            )
        if method in _BODY_METHODS and _has_body(headers):
            # A form or a no-cors fetch can send text/plain or form types without a preflight;
            # only JSON makes a browser ask first (and this server grants no CORS).
            media_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if media_type != "application/json":
                raise APIError(
                    415, f"request bodies must be application/json, got {media_type or 'none'!r}",
                    param="content-type", code="unsupported_media_type",
                )


def _hostname(host: str) -> str:
    """The Host header without its port ('[::1]:8000' -> '[::1]', 'localhost:8000' -> 'localhost')."""
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _has_body(headers: Headers) -> bool:
    return headers.get("content-length", "0") not in ("0", "") or "transfer-encoding" in headers
