"""The engine's numbers, typed: running counters, a snapshot of pages and queues, and where a
step's time goes. Metrics, `LLM.stats()` and the scenarios read these, never string keys.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from radixkv.cache.disk import DiskStats
from radixkv.cache.radix import CacheStats
from radixkv.cache.residency import TierResidency

if TYPE_CHECKING:
    from radixkv.attention.base import KVReads
    from radixkv.cache.layer_groups import WindowPages
    from radixkv.cache.pages import PagePool
    from radixkv.cache.radix import RadixTree
    from radixkv.engine.cache_view import CacheView
    from radixkv.engine.scheduler import Scheduler
    from radixkv.engine.request import Batch


@dataclass(slots=True)
class EngineCounters:
    """Totals since the engine started."""

    num_steps: int = 0
    num_tokens_computed: int = 0  # tokens run through the model (prompt chunks and decode)
    num_prompt_tokens_computed: int = 0  # of those, prompt tokens: what the cache did not serve
    num_output_tokens: int = 0
    # KV tokens decode steps attend to (summed over requests), and of those, the ones a cascade
    # group read once for all its members instead of each member reading them again
    # (EngineConfig.share_decode_reads; CPU backend).
    num_kv_tokens_read: int = 0
    num_kv_tokens_read_shared: int = 0

    def record_step(self, batch: Batch, kv_reads: KVReads | None) -> None:
        """Count a step that ran `batch`, before its computed tokens are committed."""
        self.num_steps += 1
        if kv_reads is not None:
            self.num_kv_tokens_read += kv_reads.tokens
            self.num_kv_tokens_read_shared += kv_reads.shared_tokens
        for item in batch.items:
            start = item.seq.num_computed_tokens
            self.num_tokens_computed += item.num_new_tokens
            prompt_end = len(item.seq.prompt_token_ids)
            self.num_prompt_tokens_computed += max(0, min(start + item.num_new_tokens, prompt_end) - start)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine between steps."""

    counters: EngineCounters
    cache: CacheStats
    num_pages: int
    num_free_pages: int
    num_pages_in_use: int  # held by requests or pins: neither free nor evictable
    num_running: int
    num_waiting: int
    num_unfinished: int  # requests the engine holds (a request with n > 1 counts once)
    num_preemptions: int
    num_deferrals: int
    disk: DiskStats | None = None  # the disk tier's, when there is one
    # Per tier ("ram", and "disk" with a disk tier): hits, blocks, bytes, evictions by reason,
    # block lifetime and reuse gap histograms.
    residency: dict[str, TierResidency] | None = None
    # Requests by the reason of their cache report (engine/cache_report.py MISS_REASONS; "hit"
    # included), made for every request at its first admission.
    cache_misses: dict[str, int] | None = None

    @classmethod
    def snapshot(
        cls, counters: EngineCounters, pool: PagePool, tree: RadixTree, scheduler: Scheduler, num_unfinished: int, view: CacheView,
        windows: WindowPages | None = None,
    ) -> EngineStats:
        """The engine's numbers now; expires the tree's retentions first, so `retained_pages`
        counts live ones only. With layer groups, kv_bytes_in_use adds the window layers' pages."""
        tree.expire()
        cache = tree.stats()
        if windows is not None:
            held = windows.pool.num_pages - windows.pool.num_free
            cache = replace(cache, kv_bytes_in_use=cache.kv_bytes_in_use + held * windows.pool.page_nbytes)
        return cls(
            counters=replace(counters),
            cache=cache,
            num_pages=pool.num_pages,
            num_free_pages=pool.num_free,
            num_pages_in_use=pool.num_pages - pool.num_free - tree.evictable_pages,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_unfinished=num_unfinished,
            num_preemptions=scheduler.num_preemptions,
            num_deferrals=scheduler.num_deferrals,
            disk=view.disk_stats(),
            residency=view.residency(),
            cache_misses=view.miss_counts(),
        )


@dataclass(slots=True)
class StepTimes:
    """Seconds spent in each phase of the steps run so far (scenarios/decode_profile.py)."""

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    postprocess: float = 0.0

    def add(self, phase: str, seconds: float) -> None:
        setattr(self, phase, getattr(self, phase) + seconds)

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0.0)
