"""KVManager on real cache objects and a real disk tier, without a model: admission extends a
RAM miss from disk itself and says so in its Admitted record (cached, loaded, more to load),
a long hit loads chunk by chunk through reserve, and the scheduler drives it with its verbs."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from radixkv.cache import BlockHasher, PagePool, RadixTree
from radixkv.cache.disk import DiskTier
from radixkv.config import EngineConfig
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.request import Admitted, SequenceState
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.scheduler import Scheduler

PAGE = 4
PROMPT = list(range(100, 145))  # 45 tokens: 11 full blocks before the last token
_ids = itertools.count()


def make_seq(tokens: list[int]) -> SequenceState:
    seq_id = next(_ids)
    return SequenceState(seq_id, f"r{seq_id}", 0, list(tokens), SamplingParams(max_tokens=4), None, 0)


def make_kv(directory: Path, num_pages: int = 32) -> KVManager:
    pool = PagePool(num_pages, PAGE, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    tree = RadixTree(pool, BlockHasher(PAGE, seed=0))
    disk = DiskTier(directory, 1 << 20, fingerprint="m", page_size=PAGE, payload_bytes=pool.page_nbytes)
    return KVManager(pool, tree, tree.hasher, True, disk)


def cache_on_disk_only(kv: KVManager, tokens: list[int]) -> None:
    """Compute `tokens` (as the engine would, without a model), then push their blocks out of
    RAM: written back, they are on disk alone."""
    seq = make_seq(tokens)
    assert kv.admit(seq, len(tokens)) == Admitted(0, 0, False)
    seq.num_computed_tokens = len(tokens)
    kv.commit(seq)
    kv.release(seq)
    assert kv.cache_view().flush(ram=True, disk=False)[0] == len(tokens) // PAGE
    assert kv.peek(make_seq(tokens)).num_cached_tokens == 0


def test_a_hit_that_goes_on_on_disk_loads_chunk_by_chunk(tmp_path: Path) -> None:
    kv = make_kv(tmp_path / "kv")
    cache_on_disk_only(kv, PROMPT)
    seq = make_seq(PROMPT)
    # Admission with a 16-token chunk: its 4 blocks load from disk, and the hit goes on past it,
    # so no page is allocated for computing (the next chunk loads on).
    assert kv.admit(seq, 16) == Admitted(16, 16, True)
    assert seq.num_cached_tokens == 16 and len(seq.page_table) == 4
    assert kv.reserve(seq, 16) == Admitted(32, 16, True)
    # The last chunk: 3 blocks left before the last token's; the hit ends, a page for the rest.
    assert kv.reserve(seq, 13) == Admitted(44, 12, False)
    assert seq.num_cached_tokens == 44 and len(seq.page_table) == 12
    view = kv.cache_view()  # the whole cache over the manager's parts
    assert view.disk_stats().hit_blocks == 11
    view.tree.check_invariants()
    kv.release(seq)
    assert view.pool.num_free + view.tree.evictable_pages == view.pool.num_pages
    view.close()


def test_without_a_disk_tier_admission_loads_nothing(tmp_path: Path) -> None:
    pool = PagePool(16, PAGE)
    tree = RadixTree(pool, BlockHasher(PAGE, seed=0))
    kv = KVManager(pool, tree, tree.hasher, True)
    seq = make_seq(PROMPT)
    assert kv.load_ready(seq, 16)
    assert kv.admit(seq, 16) == Admitted(0, 0, False) and len(seq.page_table) == 4
    seq.num_computed_tokens = 16  # the chunk computed
    assert kv.reserve(seq, 16) == Admitted(16, 0, False) and len(seq.page_table) == 8
    view = kv.cache_view()
    assert view.disk_stats() is None and view.disk_directory() is None and view.close() == 0


def test_the_scheduler_loads_a_disk_hit_chunk_by_chunk_then_computes(tmp_path: Path) -> None:
    kv = make_kv(tmp_path / "kv")
    cache_on_disk_only(kv, PROMPT)
    scheduler = Scheduler(EngineConfig(page_size=PAGE, max_batch_tokens=16), kv)
    seq = make_seq(PROMPT)
    scheduler.add(seq)
    loaded = []
    for _ in range(2):
        batch = scheduler.schedule()
        assert not batch.items  # loading only: nothing to compute yet
        loaded.append(batch.num_loaded_tokens)
    batch = scheduler.schedule()
    assert loaded == [16, 16] and batch.num_loaded_tokens == 0
    assert [(item.seq, item.num_new_tokens, item.samples) for item in batch.items] == [(seq, 1, True)]
    assert seq.num_cached_tokens == 44
    scheduler.remove(seq)
    kv.cache_view().close()
