"""The operator's endpoints: /health (is the engine thread alive) and /metrics (Prometheus).
Neither asks for an API key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from radixkv.server.errors import APIError
from radixkv.server.metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from radixkv.server.state import Server


def register(app: FastAPI, server: Server) -> None:
    @app.get("/health")
    async def health() -> Response:
        if not server.engine.alive:
            return APIError(503, "the engine is not running", type="server_error", code="engine_down").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)
