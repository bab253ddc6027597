"""Graceful drain: on SIGTERM `radixkv serve` stops taking work (503, and /health says draining,
so routers take the worker out), lets in-flight requests finish up to a deadline, aborts the
rest, checks that every page came back, then exits. Owns the drain state, the middleware that
refuses and counts requests, the drain itself, and the uvicorn server that turns SIGTERM into it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType

import uvicorn
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Receive, Scope, Send

from radixkv.engine.async_engine import AsyncEngine, EngineStopped
from radixkv.engine.engine import Engine
from radixkv.server.errors import APIError

logger = logging.getLogger(__name__)

# Reads that stay served while draining: routers and scrapers must see the worker go.
OPERATOR_PATHS = frozenset(
    ["/health", "/metrics", "/get_load", "/server_info", "/get_server_info", "/model_info", "/get_model_info"]
)
# After the deadline's aborts, how long the aborted responses get to write their last event.
_ABORT_GRACE_S = 5.0
_POLL_S = 0.05


@dataclass(slots=True)
class Drain:
    """Whether the server is draining, and how many requests it is serving (event loop only)."""

    draining: bool = False
    in_flight: int = 0  # HTTP requests being served, the operator's reads aside

    def refusal(self) -> APIError:
        # Retryable by its status: a router sends the request to another worker.
        return APIError(
            503, "the server is draining (shutting down); send the request to another replica",
            type="server_error", code="draining", headers={"Retry-After": "1", "Connection": "close"},
        )


class DrainGuard:
    """Pure ASGI middleware: refuses new work while draining, counts the requests in flight."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPERATOR_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await self.drain.refusal().response_for(path)(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)  # returns once a streamed body has been sent
        finally:
            self.drain.in_flight -= 1


class DrainCollector(Collector):
    """radixkv_draining for /metrics: 1 from SIGTERM on."""

    def __init__(self, drain: Drain) -> None:
        self._drain = drain

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("radixkv_draining", "1 while the server drains before exiting", value=float(self._drain.draining))


@dataclass(frozen=True, slots=True)
class DrainReport:
    """How a drain ended: who finished, who was aborted, and where every page is afterwards."""

    waited_s: float
    aborted: int  # requests still running at the deadline
    num_pages: int = 0
    free_pages: int = 0
    cached_pages: int = 0  # in the tree, unlocked: evictable, nobody's
    in_use_pages: int = 0  # still held: by pins (requests hold none once the drain is over)
    unfinished: int = 0
    error: str | None = None  # the page accounting failed, or the engine was gone

    @property
    def clean(self) -> bool:
        return self.error is None and self.unfinished == 0

    def describe(self) -> str:
        head = f"drained in {self.waited_s:.1f} s, {self.aborted} request(s) aborted at the deadline"
        if self.error is not None:
            return f"{head}; page check failed: {self.error}"
        return (
            f"{head}; pages: {self.free_pages} free + {self.cached_pages} cached + {self.in_use_pages} in use "
            f"== {self.num_pages} total, {self.unfinished} request(s) left"
        )


async def drain_engine(drain: Drain, engine: AsyncEngine, timeout_s: float) -> DrainReport:
    """Refuse new work; wait up to timeout_s for the requests in flight; abort what is left; then
    check the page accounting on the engine thread (free + evictable + in use == total)."""
    drain.draining = True
    start = time.monotonic()
    idle = await _wait_until(lambda: drain.in_flight == 0 and engine.num_unfinished() == 0, timeout_s)
    aborted = 0
    try:
        if not idle:
            aborted = await asyncio.wrap_future(engine.abort_all())
            # Each aborted stream ends with an abort event; let the responses write it.
            await _wait_until(lambda: drain.in_flight == 0, _ABORT_GRACE_S)
        waited_s = time.monotonic() - start
        return await engine.call_async(lambda e: _page_report(e, waited_s, aborted))
    except EngineStopped as error:
        return DrainReport(time.monotonic() - start, aborted, error=f"the engine is gone: {error}")


def _page_report(engine: Engine, waited_s: float, aborted: int) -> DrainReport:
    """On the engine thread, between steps."""
    try:
        engine.check_invariants()
        error = None
    except AssertionError as failed:
        error = str(failed) or "the page accounting does not add up"
    stats = engine.stats()
    return DrainReport(
        waited_s, aborted, stats.num_pages, stats.num_free_pages, stats.cache.evictable_pages,
        stats.num_pages_in_use, stats.num_unfinished, error,
    )


async def _wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_POLL_S)
    return True


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM drains (drain_engine) before the server stops,
    keeping the socket open meanwhile so /health can say so; SIGINT, or a second SIGTERM,
    stops at once as before. `report` holds how the drain ended."""

    def __init__(self, config: uvicorn.Config, drain: Drain, engine: AsyncEngine, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._engine = engine
        self._drain_timeout_s = drain_timeout_s
        self._drain_requested = False
        self._drain_task: asyncio.Task[None] | None = None
        self.report: DrainReport | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self._drain_requested:
            # Not recorded as a captured signal: uvicorn would re-raise it at exit, and the
            # process would end killed by it instead of with its own status.
            self._drain_requested = True
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_task is None:  # a signal handler cannot await
            self._drain_task = asyncio.create_task(self._drain_then_exit())
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        logger.info("SIGTERM: draining, refusing new requests (in-flight ones get up to %g s)", self._drain_timeout_s)
        try:
            self.report = await drain_engine(self._drain, self._engine, self._drain_timeout_s)
            log = logger.info if self.report.clean else logger.error
            log("%s", self.report.describe())
        finally:
            self.should_exit = True
