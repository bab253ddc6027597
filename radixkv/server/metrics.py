"""Prometheus metrics of one server: request and token counters, latency histograms, and the
engine's cache and page state, all on a private CollectorRegistry so apps never share series.

Engine-side values are read at scrape time from the AsyncEngine's last stats snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixkv.engine.stats import EngineStats

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
        yield _gauge("radixkv_kv_pages_in_use", "KV pages running requests hold", s.num_pages_in_use)
        yield _gauge("radixkv_num_requests_waiting", "Sequences in the waiting queue", s.num_waiting)
        yield _gauge("radixkv_num_requests_running", "Sequences running", s.num_running)
        yield _gauge("radixkv_num_requests_unfinished", "Requests the engine holds", s.num_unfinished)
        yield _counter("radixkv_engine_steps", "Engine steps run", counters.num_steps)
        yield _counter("radixkv_engine_tokens_computed", "Tokens run through the model", counters.num_tokens_computed)
        yield _counter("radixkv_preemptions", "Sequences preempted for pages", s.num_preemptions)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
