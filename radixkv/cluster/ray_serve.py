"""radixkv on Ray Serve: replicas (each an Engine on its AsyncEngine thread, serving radixkv's own
FastAPI app in process) behind Ray Serve's prefix-aware request router, so requests that share
a prompt prefix go to the replica whose cache holds it; an HTTP ingress serves every route of
that app (the OpenAI and Anthropic endpoints, cache management) through Ray Serve's proxy.
Needs the `ray` extra (`ray[serve]`).

Why two deployments: Ray's PrefixCacheAffinityRouter chooses a replica from the text of the
`prompt` or `messages` attribute of a handle call's argument, which an HTTP request reaching an
ingress deployment does not have. So the ingress reads the body, names its text, and hands the
request to the replicas through a handle whose router sees that text. The ingress first applies
the server's own guards (radixkv.server.app.install_guards: the API key, before any body is
read, then the body's size and read deadline), so it buffers nothing for a caller the replicas
would refuse.

    from ray import serve
    from radixkv.cluster.ray_serve import build_app
    serve.run(build_app({"model": "/models/llama"}, num_replicas=2), route_prefix="/")
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

try:
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.handle import DeploymentHandle
except ImportError as error:  # pragma: no cover - the extra is not installed
    raise ImportError("radixkv.cluster.ray_serve needs Ray Serve: pip install 'radixkv[ray]'") from error

from radixkv.server.limits import ServerLimits

logger = logging.getLogger(__name__)

# Response headers that belong to one hop; the ingress's own server sets its own.
_HOP_HEADERS = frozenset([b"connection", b"transfer-encoding", b"keep-alive"])


def prefix_cache_affinity_router() -> type:
    """Ray Serve's prefix-aware request router. Its public home, ray.serve.llm.request_router,
    imports Ray's LLM stack (pyarrow, and vLLM for its engines); the class it re-exports lives
    in a module that needs only Ray Serve, which is where radixkv takes it from when the LLM
    stack is not installed."""
    try:
        from ray.serve.llm.request_router import PrefixCacheAffinityRouter
    except ImportError:
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
            PrefixCacheAffinityRouter,
        )
    return PrefixCacheAffinityRouter


@dataclass(slots=True)
class ForwardedRequest:
    """One HTTP request on its way from the ingress to a replica. The router reads `prompt`."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prompt: str  # the text the router matches prefixes on; never empty (it divides by its length)
    client: tuple[str, int] | None = None


def routing_text(body: bytes, method: str, path: str) -> str:
    """The prompt text of an API request body, in the order the model reads it (system text,
    then messages, or the completion prompt, or a Responses input); the request line for one
    without any, such as GET /v1/models."""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        data = None
    text = ""
    if isinstance(data, dict):
        text = "".join(_text_of(data.get(key)) for key in ("system", "instructions", "messages", "prompt", "input"))
    return text or f"{method} {path}"


def _text_of(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text_of(item) for item in value)
    if isinstance(value, dict):
        return _text_of(value.get("text")) + _text_of(value.get("content"))
    return ""


@serve.deployment(ray_actor_options={"num_cpus": 1})
class RadixkvReplica:
    """One engine and radixkv's HTTP app over it; `forward` runs a request through that app."""

    def __init__(
        self,
        engine_options: dict[str, Any],
        model_name: str,
        api_keys: Sequence[str] | None = None,
        limits: ServerLimits | None = None,
    ) -> None:
        from radixkv.config import EngineConfig
        from radixkv.engine.async_engine import AsyncEngine
        from radixkv.engine.engine import Engine
        from radixkv.server.app import create_app

        self.async_engine = AsyncEngine.build(lambda: Engine(EngineConfig(**engine_options)))
        model = engine_options.get("model")
        self.app = create_app(
            self.async_engine,
            api_keys=api_keys,
            model_name=model_name,
            model_aliases=[model] if model else [],
            limits=limits,
        )

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[tuple[int, list[tuple[bytes, bytes]]] | bytes]:
        """Yield the response's (status, headers), then its body chunk by chunk (a stream's
        events as the engine makes them)."""
        async for item in call_asgi(self.app, request):
            yield item

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose check fails: one whose engine is stuck or dead."""
        reason = self.async_engine.unhealthy_reason()
        if reason is not None:
            raise RuntimeError(reason)

    def __del__(self) -> None:
        async_engine = getattr(self, "async_engine", None)
        if async_engine is not None:
            async_engine.shutdown()


async def call_asgi(app: Any, request: ForwardedRequest) -> AsyncIterator[tuple[int, list[tuple[bytes, bytes]]] | bytes]:
    """Run `app` on one request in this event loop: yields (status, headers), then each body
    chunk. Closing the iterator early (the client left) tells the app the client disconnected
    and cancels it, so the engine aborts the request and gives its pages back."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": request.headers,
        "client": request.client,
        "server": ("127.0.0.1", 80),
    }
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict[str, Any]:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    async def run() -> None:
        try:
            await app(scope, receive, messages.put)
        except Exception:  # noqa: BLE001 - the app answered 500 already; the rest is for the log
            logger.exception("radixkv app failed on %s %s", request.method, request.path)
        finally:
            messages.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in _HOP_HEADERS]
                yield message["status"], headers
            elif message["type"] == "http.response.body" and message.get("body"):
                yield message["body"]
    finally:
        gone.set()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class OpenAIIngress:
    """Every route of radixkv's app, answered by the replica the prefix-aware router picks."""

    def __init__(
        self, replicas: DeploymentHandle, api_keys: Sequence[str] | None = None, limits: ServerLimits | None = None
    ) -> None:
        self.replicas = replicas.options(stream=True)
        self.api_keys = list(api_keys or [])
        self.limits = limits or ServerLimits()

    def __serve_build_asgi_app__(self) -> FastAPI:
        # Built per ingress replica around its handle (Ray Serve calls this after __init__).
        return ingress_app(self.replicas, self.api_keys, self.limits)


def ingress_app(replicas: Any, api_keys: Sequence[str] | None, limits: ServerLimits) -> FastAPI:
    """The ingress's HTTP app: every path forwarded to `replicas`, behind the same guards as
    radixkv's own app (a keyed server refuses a caller without a key before reading its body)."""
    from radixkv.server.app import install_guards
    from radixkv.server.guards.tenants import Tenants

    app = FastAPI(title="radixkv on Ray Serve", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.replicas = replicas
    app.add_api_route("/{path:path}", _forward, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    # Only the key's validity matters here (the replicas derive the tenant): any secret does.
    install_guards(app, Tenants(api_keys), limits)
    return app


async def _forward(request: Request) -> StreamingResponse:
    # A module-level function, so FastAPI resolves its annotations in this module: Ray ships
    # the ingress class by value, and a function nested in it would lose the names.
    body = await request.body()
    path = request.scope["path"]
    forwarded = ForwardedRequest(
        method=request.method,
        path=path,
        query_string=request.scope.get("query_string", b""),
        headers=list(request.headers.raw),
        body=body,
        prompt=routing_text(body, request.method, path),
        client=tuple(request.client) if request.client else None,
    )
    stream = request.app.state.replicas.forward.remote(forwarded)
    status, headers = await stream.__anext__()
    response = StreamingResponse(_chunks(stream), status_code=status)
    response.raw_headers = headers  # as the app set them, repeated ones included
    return response


async def _chunks(stream: Any) -> AsyncIterator[bytes]:
    try:
        async for chunk in stream:
            yield chunk
    finally:
        stream.cancel()  # the client left mid-stream (or the stream ended: then a no-op)


def build_app(
    engine_options: Mapping[str, Any],
    *,
    num_replicas: int = 2,
    model_name: str = "radixkv",
    api_keys: Sequence[str] | None = None,
    limits: ServerLimits | None = None,
    replica_actor_options: Mapping[str, Any] | None = None,
    router_kwargs: Mapping[str, Any] | None = None,
) -> serve.Application:
    """The Ray Serve application: `num_replicas` replicas of an engine made from
    `engine_options` (EngineConfig's fields), routed by prefix, behind the HTTP ingress.
    `router_kwargs` go to PrefixCacheAffinityRouter (imbalanced_threshold,
    match_rate_threshold, eviction settings); `replica_actor_options` to each replica's actor
    (num_cpus, num_gpus: one GPU each for CUDA engines)."""
    router = RequestRouterConfig(
        request_router_class=prefix_cache_affinity_router(),
        request_router_kwargs=dict(router_kwargs or {}),
    )
    options: dict[str, Any] = {"num_replicas": num_replicas, "request_router_config": router}
    if replica_actor_options is not None:
        options["ray_actor_options"] = dict(replica_actor_options)
    replicas = RadixkvReplica.options(**options).bind(dict(engine_options), model_name, api_keys, limits)
    return OpenAIIngress.bind(replicas, api_keys, limits)
