"""The operator's endpoints: /health (is the engine serving: its thread alive, its steps
succeeding, none stuck, the server not draining) and /metrics (Prometheus). /health never asks
for an API key; /metrics does when keys are set (radixkv.server.guards.access), unless
ServerLimits.public_operator_endpoints.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from radixkv.server.errors import APIError
from radixkv.server.metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from radixkv.server.state import AppState


def register(app: FastAPI, server: AppState) -> None:
    @app.get("/health")
    async def health() -> Response:
        if server.drain.draining:  # 503 takes the worker out of a router's rotation
            return server.drain.refusal().response()
        reason = server.engine.unhealthy_reason()
        if reason is not None:
            return APIError(503, reason, type="server_error", code="engine_down").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        # Off the event loop: the engine's statistics are computed on its thread between steps.
        return Response(await asyncio.to_thread(server.metrics.render), media_type=CONTENT_TYPE)
