"""The OpenAI-compatible HTTP server as a FastAPI app: `create_app` builds the routes' shared
state (`state.AppState`), the guards before any route (`access`, `body_limit`) and registers the
routes of `openai/` (chat, completions, models, Responses), `anthropic/`, `cache/`, `ops_routes`
and `worker_routes` (what routers poll), with `drain` refusing new work while draining; `radixkv serve`
is in `radixkv.cli`.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI

from radixkv.engine.async_engine import AsyncEngine
from radixkv.server import ops_routes, worker_routes
from radixkv.server.anthropic import routes as anthropic_routes
from radixkv.server.anthropic.protocol import MessagesRequest
from radixkv.server.cache import routes as cache_routes
from radixkv.server.cache import session_routes
from radixkv.server.cache.protocol import (
    CacheFlushRequest,
    CacheLookupRequest,
    PinRequest,
)
from radixkv.server.errors import install_error_handlers
from radixkv.server.guards.access import AccessGuard
from radixkv.server.guards.body_limit import LimitBody
from radixkv.server.guards.drain import DrainCollector, DrainGuard
from radixkv.server.guards.quotas import KeyQuotas
from radixkv.server.guards.tenants import Tenants
from radixkv.server.limits import ServerLimits
from radixkv.server.metrics import CountRequests, KVEventsCollector, ServerMetrics
from radixkv.server.openai import responses_routes
from radixkv.server.openai import routes as openai_routes
from radixkv.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from radixkv.server.openai.responses_protocol import ResponsesRequest
from radixkv.server.openapi import document_request_bodies
from radixkv.server.state import AppState


def create_app(
    async_engine: AsyncEngine,
    api_keys: Sequence[str] | None = None,
    model_name: str = "radixkv",
    *,
    model_aliases: Sequence[str] = (),
    tenant_secret: bytes | None = None,
    admin_keys: Sequence[str] | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """An app serving `async_engine` (started and shut down by the caller) as `model_name`.
    `tenant_secret` fixes the cache salts across restarts (a disk tier needs that to stay warm
    for tenants); `admin_keys` may also flush the cache."""
    server = AppState(
        engine=async_engine,
        tenants=Tenants(api_keys, tenant_secret, admin_keys),
        model_name=model_name,
        model_aliases=frozenset([model_name, *model_aliases]),
        metrics=ServerMetrics(async_engine.stats),
        limits=limits or ServerLimits(),
    )
    app = FastAPI(title="radixkv", description="OpenAI-compatible API over a prefix-sharing KV cache")
    app.state.radixkv = server
    install_error_handlers(app)
    # Added last runs first: count every request, then refuse forged or oversized ones unread.
    install_guards(app, server.tenants, server.limits, server.quotas)
    app.add_middleware(DrainGuard, drain=server.drain)  # refusals while draining are counted too
    app.add_middleware(CountRequests, metrics=server.metrics)
    server.metrics.registry.register(DrainCollector(server.drain))
    server.metrics.registry.register(KVEventsCollector(async_engine.engine))
    ops_routes.register(app, server)
    openai_routes.register(app, server)
    responses_routes.register(app, server)
    cache_routes.register(app, server)
    session_routes.register(app, server)
    anthropic_routes.register(app, server)
    worker_routes.register(app, server)
    document_request_bodies(
        app,
        {
            "/v1/chat/completions": ChatCompletionRequest,
            "/v1/completions": CompletionRequest,
            "/v1/responses": ResponsesRequest,
            "/v1/messages": MessagesRequest,
            "/v1/cache/pin": PinRequest,
            "/v1/cache/lookup": CacheLookupRequest,
            "/v1/cache/flush": CacheFlushRequest,
        },
    )
    return app


def install_guards(app: FastAPI, tenants: Tenants, limits: ServerLimits, quotas: KeyQuotas | None = None) -> None:
    """AccessGuard, then LimitBody: a caller without a valid key is refused before a byte of
    its body is read, and a body is read only up to the size limit and the read deadline.
    Shared with the Ray Serve ingress (radixkv.cluster.ray_serve), which must refuse the same requests."""
    # Starlette runs the middleware added last first.
    app.add_middleware(LimitBody, max_body_bytes=limits.max_body_bytes, body_read_timeout_s=limits.body_read_timeout_s)
    app.add_middleware(AccessGuard, tenants=tenants, limits=limits, quotas=quotas)
