"""What routers expect of a worker beyond the OpenAI API, under sglang-router's names: /get_load
(requests running and waiting, KV tokens and pages: what load-aware policies poll), /server_info
and /model_info with their /get_ aliases (the name and limits a router registers the worker
under), /health_generate (one token through the engine) and POST /flush_cache (admin only).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixkv.engine.async_engine import EngineStepError, EngineStopped
from radixkv.engine.sampling_params import SamplingParams
from radixkv.errors import QueueFull
from radixkv.server.errors import APIError

if TYPE_CHECKING:
    from radixkv.engine.stats import EngineStats
    from radixkv.server.state import AppState

# /health_generate gives up on an engine that has not produced one token in this long.
_HEALTH_GENERATE_TIMEOUT_S = 20.0


def load_report(stats: EngineStats, page_size: int, draining: bool) -> dict[str, Any]:
    """One worker's load in /get_load's shape (a list entry per data-parallel rank; radixkv has
    one). sglang's fields first (num_tokens: KV tokens requests hold), then radixkv's own."""
    in_use = stats.num_pages_in_use
    return {
        "dp_rank": 0,
        "num_reqs": stats.num_running + stats.num_waiting,
        "num_waiting_reqs": stats.num_waiting,
        "num_tokens": in_use * page_size,
        "num_running_reqs": stats.num_running,
        "num_pages": stats.num_pages,
        "num_free_pages": stats.num_free_pages,
        "num_cached_pages": stats.cache.evictable_pages,
        "num_pages_in_use": in_use,
        "kv_usage": in_use / stats.num_pages if stats.num_pages else 0.0,
        "draining": draining,
    }


def register(app: FastAPI, server: AppState) -> None:
    engine = server.engine.engine  # read-only facts fixed at load; never stepped from here
    page_size = engine.pool.page_size

    def authorize(request: Request) -> None:
        # The same rule as /metrics (AccessGuard checked it already; kept here so the route
        # stands alone): these tell who runs what and how busy it is.
        if not server.limits.public_operator_endpoints:
            server.tenants.authenticate_headers(request.headers)

    @app.get("/get_load")
    async def get_load(request: Request) -> Response:
        authorize(request)
        return JSONResponse([load_report(await server.engine.stats_async(), page_size, server.drain.draining)])

    server_info = _server_info(server)
    model_info = _model_info(server)

    async def get_server_info(request: Request) -> Response:
        authorize(request)
        return JSONResponse(server_info)

    async def get_model_info(request: Request) -> Response:
        authorize(request)
        return JSONResponse(model_info)

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, get_server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, get_model_info, methods=["GET"])

    probe = _GenerateProbe(server)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Healthy only if the engine turns a prompt into a token now (not only alive)."""
        if server.drain.draining:
            return server.drain.refusal().response()
        reason = await probe.run()
        if reason is not None:
            return APIError(503, reason, type="server_error", code="engine_down").response()
        return JSONResponse({"status": "ok"})

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        """sglang's name for emptying the RAM tier (POST /v1/cache/flush with tier "ram")."""
        key = server.tenants.authenticate_headers(request.headers)
        server.tenants.require_admin(key)
        pages, _ = await server.engine.call_async(lambda e: e.flush_cache(ram=True, disk=False))
        return JSONResponse({"tier": "ram", "freed_ram_pages": pages})


def _server_info(server: AppState) -> dict[str, Any]:
    engine = server.engine.engine
    config = engine.config
    info: dict[str, Any] = {
        "served_model_name": server.model_name,
        "dp_size": 1,
        "max_total_tokens": engine.pool.num_pages * engine.pool.page_size,
        "max_running_requests": config.max_num_seqs,
        "max_context_tokens": engine.max_context_tokens,
        "page_size": engine.pool.page_size,
        "num_pages": engine.pool.num_pages,
        "enable_prefix_caching": config.enable_prefix_caching,
        "version": _version(),
    }
    path = _local_model_folder(config.model)
    if path is not None:
        # A router loads its tokenizer from model_path; only a folder it can read locally (a hub
        # id or the default GGUF would send it to the network).
        info["model_path"] = path
    return info


def _model_info(server: AppState) -> dict[str, Any]:
    engine = server.engine.engine
    info: dict[str, Any] = {"is_generation": True, "model_type": engine.model_config.architecture}
    path = _local_model_folder(engine.config.model)
    if path is not None:
        info["model_path"] = info["tokenizer_path"] = path
    return info


def _local_model_folder(model: str | None) -> str | None:
    if model is None:
        return None
    path = Path(model).expanduser()
    return str(path.resolve()) if (path / "config.json").is_file() else None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("radixkv")
    except PackageNotFoundError:
        return "unknown"


class _GenerateProbe:
    """One /health_generate generation at a time: concurrent probes share the one in flight, so
    a router polling fast never queues probes behind each other."""

    def __init__(self, server: AppState) -> None:
        self._server = server
        self._running: asyncio.Task[str | None] | None = None

    async def run(self) -> str | None:
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._generate_one())
        return await asyncio.shield(self._running)

    async def _generate_one(self) -> str | None:
        """None when a token came back, else why not."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        try:
            async with asyncio.timeout(_HEALTH_GENERATE_TIMEOUT_S):
                stream = await self._server.engine.submit([0], params)
                async with stream:
                    async for delta in stream:
                        if delta.finished:
                            return None
        except TimeoutError:
            return f"the engine produced no token within {_HEALTH_GENERATE_TIMEOUT_S:g} s"
        except QueueFull:
            return None  # busy, not broken: the queue is full of work it is doing
        except (EngineStopped, EngineStepError) as error:
            return f"the engine failed a one-token generation: {error}"
        return "the one-token generation ended without output"
