"""The OpenAI-compatible HTTP server as a FastAPI app: `create_app` and the state its routes
share (the engine, tenants, the served model's names, metrics). The routes live in
`openai_routes`, `cache_routes` and `ops_routes`; `radixkv serve` is in `radixkv.cli`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fastapi import FastAPI

from radixkv.engine.async_engine import AsyncEngine
from radixkv.server import cache_routes, openai_routes, ops_routes
from radixkv.server.errors import APIError, install_error_handlers
from radixkv.server.metrics import CountRequests, ServerMetrics
from radixkv.server.protocol import now_s
from radixkv.server.tenants import Tenants


@dataclass(slots=True)
class Server:
    """What every route of one app reads: fixed at creation, except the metrics it counts."""

    engine: AsyncEngine
    tenants: Tenants
    model_name: str
    model_aliases: frozenset[str]
    metrics: ServerMetrics
    created: int = field(default_factory=now_s)

    def check_model(self, model: str) -> None:
        """APIError 404 unless `model` names the model this server serves."""
        if model not in self.model_aliases:
            raise APIError(
                404, f"the model {model!r} does not exist; this server serves {self.model_name!r}", param="model", code="model_not_found"
            )


def create_app(
    async_engine: AsyncEngine,
    api_keys: Sequence[str] | None = None,
    model_name: str = "radixkv",
    *,
    model_aliases: Sequence[str] = (),
    tenant_secret: bytes | None = None,
) -> FastAPI:
    """An app serving `async_engine` (started and shut down by the caller) as `model_name`."""
    server = Server(
        engine=async_engine,
        tenants=Tenants(api_keys, tenant_secret),
        model_name=model_name,
        model_aliases=frozenset([model_name, *model_aliases]),
        metrics=ServerMetrics(async_engine.stats),
    )
    app = FastAPI(title="radixkv", description="OpenAI-compatible API over a prefix-sharing KV cache")
    app.state.radixkv = server
    install_error_handlers(app)
    app.add_middleware(CountRequests, metrics=server.metrics)
    ops_routes.register(app, server)
    openai_routes.register(app, server)
    cache_routes.register(app, server)
    return app
