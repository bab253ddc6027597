"""Prometheus metrics of one server: request and token counters, latency histograms, and the
engine's cache and page state, all on a private CollectorRegistry so apps never share series;
and what feeds them: the request-counting middleware and a tracker per engine request.

Engine-side values are computed at scrape time (AsyncEngine.stats, on the engine thread between
steps), so render() waits for a step in flight: call it off the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixkv.cache.disk import REJECTED_REASONS, DiskStats
from radixkv.cache.residency import EVICTION_REASONS, HistogramSnapshot, TierResidency
from radixkv.engine.stats import EngineStats

if TYPE_CHECKING:
    from radixkv.engine.request_output import RequestDelta

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "radixkv_requests", "HTTP API requests by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.finished = Counter(
            "radixkv_request_finished", "Generation requests ended, by finish reason", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("radixkv_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.cached_prompt_tokens = Counter(
            "radixkv_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.generation_tokens = Counter("radixkv_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "radixkv_time_to_first_token_seconds",
            "From the engine receiving a request to its first generated token",
            buckets=_TTFT_BUCKETS_S,
            registry=r,
        )
        self.token_latency = Histogram(
            "radixkv_time_per_output_token_seconds",
            "Gap between consecutive generated tokens of one continuation",
            buckets=_TOKEN_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "radixkv_request_latency_seconds", "From the engine receiving a request to its end", buckets=_E2E_BUCKETS_S, registry=r
        )
        r.register(_EngineCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class KVEventsCollector(Collector):
    """The KV-event publisher's losses for /metrics (none while KV events are off): batches
    dropped because its queue was full (gaps its subscribers saw) and replay requests refused
    by the per-peer rate limit. Read at scrape time; plain ints, so no lock is needed."""

    def __init__(self, engine: object) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        recorder = getattr(self._engine, "kv_events", None)
        if recorder is None:
            return
        sink = recorder.sink
        yield CounterMetricFamily(
            "radixkv_kv_events_dropped_batches", "KV-event batches dropped on a full queue (sequence gaps)",
            value=getattr(sink, "num_dropped", 0),
        )
        yield CounterMetricFamily(
            "radixkv_kv_events_replays_refused", "KV-event replay requests refused by the per-peer rate limit",
            value=getattr(sink, "num_replays_refused", 0),
        )


_COUNTED_PATHS = frozenset(["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"])


class CountRequests:
    """Pure ASGI middleware (streaming-safe): counts requests by endpoint and status code."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in _COUNTED_PATHS else ("/v1/models/{model}" if path.startswith("/v1/models/") else "other")
        status = ["500"]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(endpoint, status[0]).inc()


class RequestTracker:
    """Per engine request: token counts and latency observations as its deltas arrive."""

    def __init__(self, metrics: ServerMetrics, n: int) -> None:
        self._metrics = metrics
        self._n = n
        self._last_token_s: dict[int, float] = {}
        self._counted_cache = False
        self.finished = False

    def update(self, delta: RequestDelta) -> None:
        now = time.perf_counter()
        m = self._metrics
        if not self._counted_cache and any(c.token_ids for c in delta.completions):
            self._counted_cache = True
            m.cached_prompt_tokens.inc(delta.num_cached_tokens)
            if delta.time_to_first_token_s is not None:
                m.ttft.observe(delta.time_to_first_token_s)
        for c in delta.completions:
            new = len(c.token_ids)
            if new == 0:
                continue
            m.generation_tokens.inc(new)
            last = self._last_token_s.get(c.index)
            if last is not None:
                for _ in range(new):
                    m.token_latency.observe((now - last) / new)
            self._last_token_s[c.index] = now
        output = delta.output
        if output is not None:
            self.finished = True
            for o in output.outputs:
                m.finished.labels(o.finish_reason or "unknown").inc()
            if output.total_time_s is not None:
                m.e2e.observe(output.total_time_s)

    def abandoned(self) -> None:
        """The consumer left before the end (client gone, error): the request is aborted."""
        if not self.finished:
            self.finished = True
            self._metrics.finished.labels("abort").inc(self._n)


class _EngineCollector(Collector):
    def __init__(self, engine_stats: Callable[[], EngineStats]) -> None:
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        s = self._engine_stats()
        cache, counters = s.cache, s.counters
        yield _counter("radixkv_prefix_cache_queries", "Prefix-cache lookups", cache.queries)
        yield _counter("radixkv_prefix_cache_query_tokens", "Tokens looked up in the prefix cache", cache.query_tokens)
        yield _counter("radixkv_prefix_cache_hit_tokens", "Looked-up tokens found in the prefix cache", cache.hit_tokens)
        yield _counter("radixkv_prefix_cache_evicted_pages", "Pages evicted from the prefix cache", cache.evicted_pages)
        yield _gauge("radixkv_prefix_cache_hit_rate", "hit_tokens / query_tokens since start", cache.hit_rate)
        yield _gauge("radixkv_kv_pages_total", "KV pages in the pool", s.num_pages)
        yield _gauge("radixkv_kv_pages_free", "KV pages on the free list", s.num_free_pages)
        yield _gauge("radixkv_kv_pages_cached", "KV pages held by the prefix cache (locked or not)", cache.cached_pages)
        yield _gauge("radixkv_kv_pages_evictable", "Cached pages no running request uses", cache.evictable_pages)
        yield _gauge(
            "radixkv_kv_pages_retained", "Cached pages under a live retention (cache_control ttl)", cache.retained_pages
        )
        yield _gauge("radixkv_kv_pages_in_use", "KV pages running requests hold", s.num_pages_in_use)
        yield _gauge(
            "radixkv_kv_usage", "Fraction of KV pages in use (neither free nor evictable)", s.num_pages_in_use / max(s.num_pages, 1)
        )
        yield _gauge("radixkv_num_requests_waiting", "Sequences in the waiting queue", s.num_waiting)
        yield _gauge("radixkv_num_requests_running", "Sequences running", s.num_running)
        yield _gauge("radixkv_num_requests_unfinished", "Requests the engine holds", s.num_unfinished)
        yield _counter("radixkv_engine_steps", "Engine steps run", counters.num_steps)
        yield _counter("radixkv_engine_tokens_computed", "Tokens run through the model", counters.num_tokens_computed)
        yield _counter("radixkv_decode_kv_tokens_read", "KV tokens decode steps attend to, summed over requests", counters.num_kv_tokens_read)
        yield _counter(
            "radixkv_decode_kv_tokens_read_shared",
            "Of those, tokens a cascade group read once for all its members instead of once per member",
            counters.num_kv_tokens_read_shared,
        )
        yield _counter("radixkv_preemptions", "Sequences preempted for pages", s.num_preemptions)
        yield _gauge(
            "radixkv_kv_pages_protected", "Cached pages that served a hit (slru evicts them after the rest)", cache.protected_pages
        )
        if s.disk is not None:
            yield from _disk_metrics(s.disk)
        if s.cache_misses is not None:
            yield _by_reason(s.cache_misses)
        if s.residency:
            yield from _residency_metrics(s.residency)


def _by_reason(counts: dict[str, int]) -> CounterMetricFamily:
    """Every request's cache report by reason (engine/cache_report.py; "hit" included), reported
    to the client or not."""
    family = CounterMetricFamily(
        "radixkv_cache_misses", "Requests by why their first uncached prompt token missed the cache", labels=["reason"]
    )
    for reason, count in counts.items():
        family.add_metric([reason], count)
    return family


def _residency_metrics(tiers: dict[str, TierResidency]) -> Iterator[Metric]:
    """Per tier (label tier="ram" or "disk"): hits, holdings, evictions by reason, and how long
    blocks stay and how long between their uses."""
    hits = CounterMetricFamily("radixkv_cache_hit_blocks", "KV blocks served from each cache tier", labels=["tier"])
    blocks = GaugeMetricFamily("radixkv_cache_blocks", "KV blocks each cache tier holds", labels=["tier"])
    nbytes = GaugeMetricFamily("radixkv_cache_bytes", "Bytes of KV each cache tier holds", labels=["tier"])
    evicted = CounterMetricFamily(
        "radixkv_cache_evicted_blocks",
        "KV blocks that left a tier, by reason: capacity, retained (under a live retention, nothing "
        "else left), retention_expired, flush, rejected (failed its checks on load)",
        labels=["tier", "reason"],
    )
    lifetime = HistogramMetricFamily(
        "radixkv_cache_block_lifetime_seconds", "From a block entering a tier to leaving it", labels=["tier"]
    )
    reuse = HistogramMetricFamily(
        "radixkv_cache_block_reuse_gap_seconds", "Between consecutive hits of a block in a tier (first hit: since it entered)", labels=["tier"]
    )
    for tier, residency in tiers.items():
        hits.add_metric([tier], residency.hit_blocks)
        blocks.add_metric([tier], residency.blocks)
        nbytes.add_metric([tier], residency.bytes)
        for reason in EVICTION_REASONS:
            evicted.add_metric([tier, reason], residency.evicted_blocks.get(reason, 0))
        lifetime.add_metric([tier], _buckets(residency.lifetime_s), sum_value=residency.lifetime_s.sum)
        reuse.add_metric([tier], _buckets(residency.reuse_gap_s), sum_value=residency.reuse_gap_s.sum)
    yield from (hits, blocks, nbytes, evicted, lifetime, reuse)


def _buckets(histogram: HistogramSnapshot) -> list[tuple[str, float]]:
    bounds = [repr(float(bound)) for bound in histogram.bounds] + ["+Inf"]
    return list(zip(bounds, histogram.cumulative()))


def _disk_metrics(disk: DiskStats) -> Iterator[Metric]:
    """The disk tier's residency: what it holds, what it served, what it refused and why."""
    yield _gauge("radixkv_disk_cache_enabled", "1 when the disk tier's directory is usable", float(disk.enabled))
    yield _gauge("radixkv_disk_cache_blocks", "KV blocks stored in the disk tier", disk.blocks)
    yield _gauge("radixkv_disk_cache_bytes", "Bytes the disk tier's block files take", disk.bytes_used)
    yield _gauge("radixkv_disk_cache_budget_bytes", "The disk tier's byte budget", disk.budget_bytes)
    yield _counter("radixkv_disk_cache_hit_blocks", "Blocks loaded from disk instead of computed", disk.hit_blocks)
    yield _counter("radixkv_disk_cache_written_blocks", "Blocks written to the disk tier", disk.written_blocks)
    yield _counter("radixkv_disk_cache_evicted_blocks", "Blocks deleted to stay within the budget", disk.evicted_blocks)
    yield _counter("radixkv_disk_cache_write_failures", "Block writes that failed (a full disk, a vanished directory)", disk.write_failures)
    yield _counter(
        "radixkv_disk_cache_computed_instead", "Disk hits recomputed because reading was the slower", disk.computed_instead
    )
    rejected = CounterMetricFamily(
        "radixkv_disk_cache_rejected_blocks", "Stored blocks refused on load, by reason (a miss each)", labels=["reason"]
    )
    for reason in REJECTED_REASONS:
        rejected.add_metric([reason], disk.rejected.get(reason, 0))
    yield rejected


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
