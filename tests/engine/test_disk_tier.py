"""The disk tier in the engine, on a tiny model in fp32 with every page invariant checked each
step: a restart is warm (the disk hit counted, the greedy tokens transformers' own), blocks
evicted mid-run come back from disk, and corrupt files, another model's files, another tenant,
a full disk and an unusable directory each cost a miss, never a wrong token."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest

from radixkv import SamplingParams
from radixkv.config import EngineConfig
from radixkv.errors import ConfigError
from radixkv.cache.disk_format import digest
from tests.cache.test_disk import file_size_limit
from tests.helpers.engine import VOCAB, assert_pages_returned, hf_greedy, make_llm, run_to_end
from tests.helpers.tiny_models import make_tiny_model

MAX_NEW = 6
PARAMS = SamplingParams(max_tokens=MAX_NEW)


def prompts(seed: int, count: int = 3, length: int = 45) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(length)] for _ in range(count)]


@pytest.fixture(scope="module")
def workload(tiny_llama: Path) -> tuple[list[list[int]], list[list[int]]]:
    batch = prompts(1)
    return batch, hf_greedy(tiny_llama, batch, MAX_NEW)


def generate(llm, batch: list[list[int]], salt: str | None = None) -> list[list[int]]:
    """One prompt at a time, so each may hit what the previous ones left."""
    return [llm.generate([prompt], PARAMS, salt=salt)[0].token_ids for prompt in batch]


def write_tier(model: Path, batch: list[list[int]], kv_dir: Path, salt: str | None = None) -> list[list[int]]:
    """One engine's run over batch with the disk tier at kv_dir, then closed (every block
    written back): what a later engine on that directory restarts from. Its outputs."""
    first = make_llm(model, kv_disk_dir=str(kv_dir))
    outputs = generate(first, batch, salt)
    first.close()
    return outputs


def test_restart_is_warm_and_exact(tiny_llama: Path, workload, tmp_path: Path) -> None:
    batch, expected = workload
    first = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    assert generate(first, batch) == expected
    assert first.stats().disk.hit_blocks == 0
    first.close()
    assert first.stats().disk.written_blocks >= len(batch) * (len(batch[0]) // 4)

    second = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    assert second.stats().cache.cached_pages == 0 and second.stats().disk.blocks > 0
    outputs = [second.generate([prompt], PARAMS)[0] for prompt in batch]
    assert [output.token_ids for output in outputs] == expected
    # Every full block but the last token's (a match leaves one token to compute) came from disk.
    assert [output.num_cached_tokens for output in outputs] == [(len(p) - 1) // 4 * 4 for p in batch]
    assert second.stats().disk.hit_blocks == sum((len(p) - 1) // 4 for p in batch)
    assert second.stats().disk.rejected == {}
    assert_pages_returned(second.engine)


@pytest.mark.parametrize("prefetch_bytes", [256 << 20, 1], ids=["whole-hit-read-ahead", "read-in-chunk-parts"])
def test_a_restart_with_chunked_prefill_is_exact(tiny_llama: Path, workload, tmp_path: Path, prefetch_bytes: int) -> None:
    """A disk hit loads the blocks inside each chunk (the pages the chunk needs anyway), chunk
    after chunk, computing only once the hit ends; the tokens do not change. With a read-ahead
    budget smaller than a block, the hit is read a chunk at a time, and still wholly."""
    batch, expected = workload
    write_tier(tiny_llama, batch, tmp_path / "kv")
    second = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"), max_batch_tokens=16, kv_disk_prefetch_bytes=prefetch_bytes)
    outputs = [second.generate([prompt], PARAMS)[0] for prompt in batch]
    assert [output.token_ids for output in outputs] == expected
    # Each 16-token chunk loads 4 blocks and computes nothing while the hit goes on: 45-token
    # prompts load 4 + 4 + 3 blocks, the last chunk computing the last token only.
    assert [output.num_cached_tokens for output in outputs] == [44] * len(batch)
    assert second.stats().disk.hit_blocks == 11 * len(batch)
    assert second.stats().counters.num_prompt_tokens_computed == len(batch)
    assert_pages_returned(second.engine)


def test_blocks_evicted_mid_run_come_back_from_disk(tiny_llama: Path, workload, tmp_path: Path) -> None:
    batch, expected = workload
    # 16 pages of 4 tokens: each request's blocks push out the previous request's.
    llm = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"), num_pages=16)
    assert generate(llm, batch) == expected
    assert llm.stats().disk.written_blocks > 0  # written back on eviction, not at close
    again = llm.generate([batch[0]], PARAMS)[0]
    assert again.token_ids == expected[0] and again.num_cached_tokens > 0
    assert llm.stats().disk.hit_blocks == again.num_cached_tokens // 4
    assert_pages_returned(llm.engine)


def test_corrupt_files_are_misses(tiny_llama: Path, workload, tmp_path: Path) -> None:
    batch, expected = workload
    write_tier(tiny_llama, batch, tmp_path / "kv")
    for path in (tmp_path / "kv" / "blocks").rglob("*.kvb"):
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x01  # one bit of the KV: the checksum must catch it
        path.write_bytes(bytes(data))
    second = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    assert generate(second, batch) == expected
    stats = second.stats().disk
    assert stats.hit_blocks == 0 and stats.rejected == {"checksum": len(batch)}  # the first block of each
    assert_pages_returned(second.engine)


def test_another_models_files_are_misses(tiny_llama: Path, workload, tmp_path: Path) -> None:
    batch, _ = workload
    write_tier(tiny_llama, batch, tmp_path / "kv")
    other_model = make_tiny_model(tmp_path / "other", "llama", seed=1, max_position_embeddings=512)
    other = make_llm(other_model, kv_disk_dir=str(tmp_path / "kv"))
    assert generate(other, batch) == hf_greedy(other_model, batch, MAX_NEW)
    stats = other.stats().disk
    assert stats.hit_blocks == 0 and stats.rejected == {"fingerprint": len(batch)}
    assert_pages_returned(other.engine)


def test_another_tenants_blocks_are_not_found(tiny_llama: Path, workload, tmp_path: Path) -> None:
    batch, expected = workload
    assert write_tier(tiny_llama, batch, tmp_path / "kv", salt="tenant-a") == expected
    second = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    assert generate(second, batch, salt="tenant-b") == expected
    assert second.stats().disk.hit_blocks == 0
    assert generate(second, batch, salt="tenant-a") == expected
    assert second.stats().disk.hit_blocks == sum((len(p) - 1) // 4 for p in batch)  # the owner's own
    assert_pages_returned(second.engine)


def test_a_full_disk_at_close_leaves_a_cold_but_correct_restart(tiny_llama: Path, workload, tmp_path: Path) -> None:
    batch, expected = workload
    first = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    generate(first, batch)
    with file_size_limit(256):
        first.close()
    assert first.stats().disk.write_failures > 0 and first.stats().disk.blocks == 0
    second = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    assert generate(second, batch) == expected and second.stats().disk.hit_blocks == 0


def test_an_unusable_directory_runs_without_the_tier(tiny_llama: Path, workload, tmp_path: Path) -> None:
    batch, expected = workload
    (tmp_path / "file").write_text("not a directory")
    llm = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "file" / "kv"), num_pages=16)
    assert generate(llm, batch) == expected
    assert not llm.stats().disk.enabled
    llm.close()
    assert_pages_returned(llm.engine)


def test_a_disk_slower_than_compute_is_skipped(tiny_llama: Path, workload, tmp_path: Path) -> None:
    batch, expected = workload
    write_tier(tiny_llama, batch, tmp_path / "kv")
    second = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    assert generate(second, batch[:1]) == expected[:1]  # unmeasured: the disk is tried
    assert second.stats().disk.hit_blocks > 0 and second.stats().disk.read_s_per_block is not None
    warm_up = [[7] * 300]  # enough computed tokens for the engine to know its compute speed
    generate(second, warm_up)
    second.engine.cache_view.loader.tier.read_s_per_block = 3600.0  # as if the disk took an hour a block
    hits = second.stats().disk.hit_blocks
    assert generate(second, batch[1:]) == expected[1:]
    assert second.stats().disk.hit_blocks == hits and second.stats().disk.computed_instead == len(batch) - 1
    assert_pages_returned(second.engine)


def test_disk_options_are_validated() -> None:
    assert EngineConfig().kv_disk_dir is None  # off by default
    for bad in ({"kv_disk_dir": ""}, {"kv_disk_bytes": 0}, {"kv_disk_bytes": -1}):
        with pytest.raises(ConfigError) as info:
            EngineConfig(**bad)
        assert info.value.param == next(iter(bad))


def test_a_disk_hit_is_read_while_other_requests_compute(tiny_llama: Path, workload, tmp_path: Path) -> None:
    """The disk hit is read on the background thread while a running request decodes: with
    its reads held until released (a disk that does not answer), the other request goes on
    stepping and the hit waits, counted; once the read goes on it is admitted, and the tokens
    are transformers' own, every page invariant checked each step. (A pipe planted as a block
    is refused unread, test_a_planted_pipe_is_a_miss_not_a_hang: it cannot stand for a slow
    disk.)"""
    batch, expected = workload
    write_tier(tiny_llama, batch[:1], tmp_path / "kv")
    second = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"), max_batch_tokens=16)
    engine = second.engine
    disk_answers = threading.Event()
    real_read = engine.cache_view.loader.tier.read

    def slow_read(*args, **kwargs):
        disk_answers.wait()
        return real_read(*args, **kwargs)

    engine.cache_view.loader.tier.read = slow_read  # the real read, once the "disk" answers
    busy = prompts(7, count=1, length=9)[0]
    busy_id = engine.add_request(busy, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    hit_id = engine.add_request(batch[0], PARAMS)
    try:
        for _ in range(5):
            assert any(delta.request_id == busy_id for delta in engine.step())  # the loop is not blocked
        assert engine.scheduler.num_load_waits == 5 and len(engine.scheduler.waiting) == 1
    finally:
        disk_answers.set()  # whatever happened, the blocked read goes on
    outputs = run_to_end(engine)
    assert outputs[hit_id].outputs[0].token_ids == expected[0]
    assert outputs[hit_id].num_cached_tokens == 44  # every full block before the last token
    stats = second.stats()
    assert stats.disk.hit_blocks == 11 and stats.disk.prefetched_blocks >= 1
    assert stats.residency["disk"].hit_blocks == 11 and stats.disk.rejected == {}
    assert_pages_returned(engine)


def test_an_aborted_request_stops_its_read_and_returns_every_page(tiny_llama: Path, workload, tmp_path: Path) -> None:
    batch, _ = workload
    write_tier(tiny_llama, batch, tmp_path / "kv")
    second = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    engine = second.engine
    engine.add_request(prompts(7, count=1, length=9)[0], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    ids = [engine.add_request(prompt, PARAMS) for prompt in batch]
    engine.step()  # their reads start; they wait for them
    for request_id in ids:
        engine.abort(request_id)
    run_to_end(engine)
    assert engine.cache_view.loader.prefetcher.get(0) is None and not engine.cache_view.loader.prefetcher._pending
    assert_pages_returned(engine)


def test_retention_survives_a_restart_and_a_burst_on_disk(tiny_llama: Path, workload, tmp_path: Path) -> None:
    """A retained prompt stays on disk through a burst of other prompts larger than the tier's
    budget, before and after a restart, and then comes back token-exact; the others are
    evicted under 'capacity'."""
    batch, expected = workload
    block_bytes = 512 + 4 * 4 * 2 * 2 * 8 * 4  # well over one block file of the tiny model
    options = dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_bytes=40 * block_bytes, num_pages=24)
    first = make_llm(tiny_llama, **options)
    assert generate(first, batch[:1]) == expected[:1]
    assert first.engine.retain(batch[0], ttl_s=3600, owner="tenant") == 44  # 11 blocks, written through
    first.close()
    second = make_llm(tiny_llama, **options)
    assert second.stats().disk.retained_blocks == 11
    generate(second, prompts(9, count=5))  # a burst of distinct prompts, through RAM onto disk
    disk = second.stats().residency["disk"]
    assert disk.evicted_blocks["capacity"] > 0 and disk.evicted_blocks["retained"] == 0
    output = second.generate([batch[0]], PARAMS)[0]
    assert output.token_ids == expected[0] and output.num_cached_tokens == 44
    # Back in RAM it is retained again, until the same time: another burst leaves it there.
    assert second.stats().cache.retained_pages == 11
    generate(second, prompts(10, count=3))
    again = second.generate([batch[0]], PARAMS)[0]
    assert again.token_ids == expected[0] and second.stats().disk.hit_blocks == 11  # from RAM this time
    assert_pages_returned(second.engine)


def test_residency_counts_hits_evictions_and_lifetimes_per_tier(tiny_llama: Path, workload, tmp_path: Path) -> None:
    batch, expected = workload
    llm = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"), num_pages=16)
    assert generate(llm, batch + batch[:1]) == expected + expected[:1]
    ram = llm.stats().residency["ram"]
    # 16 pages: each prompt pushes the previous one out of RAM (capacity), then batch[0] comes back from disk.
    assert ram.evicted_blocks["capacity"] > 0 and ram.lifetime_s.count == sum(ram.evicted_blocks.values())
    disk = llm.stats().residency["disk"]
    assert disk.hit_blocks == 11 and disk.reuse_gap_s.count == 11 and disk.blocks > 0 and disk.bytes > 0
    pages, blocks = llm.engine.flush_cache(ram=True, disk=True)
    after = llm.stats().residency
    assert after["ram"].evicted_blocks["flush"] == pages and after["disk"].evicted_blocks["flush"] == blocks > 0
    assert after["ram"].blocks == 0 and after["disk"].bytes == 0
    assert_pages_returned(llm.engine)


def test_two_engines_on_one_directory_fail_clearly(tiny_llama: Path, tmp_path: Path) -> None:
    first = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    with pytest.raises(ConfigError, match="in use by another engine") as info:
        make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    assert info.value.param == "kv_disk_dir"
    first.close()  # releases the directory: a restart opens it
    assert make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv")).stats().disk.enabled


def test_a_directory_others_may_write_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    (tmp_path / "kv").mkdir()
    os.chmod(tmp_path / "kv", 0o775)
    with pytest.raises(ConfigError, match="writable by others") as info:
        make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    assert info.value.param == "kv_disk_dir"


def test_retention_is_written_off_the_engine_thread_and_close_persists_it(tiny_llama: Path, workload, tmp_path: Path) -> None:
    """retain() queues the write-through to the tier's writer thread: with that thread held,
    it returns having written no file on the calling thread, the queued blocks already serve a
    hit token-exact; close() waits for every queued write, and a restart finds them retained."""
    batch, expected = workload
    llm = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    disk = llm.engine.cache_view.loader.tier
    writer_may_go = threading.Event()
    writes_by_thread: list[str] = []
    real_write = disk.files.write_block

    def held_write(key: int, data: bytes) -> bool:
        writes_by_thread.append(threading.current_thread().name)
        if threading.current_thread() is not threading.main_thread():
            writer_may_go.wait()
        return real_write(key, data)

    disk.files.write_block = held_write
    assert generate(llm, batch[:1]) == expected[:1]
    try:
        assert llm.engine.retain(batch[0], ttl_s=3600, owner="tenant") == 44
        assert "MainThread" not in writes_by_thread  # nothing written on the calling thread
        assert sorted((tmp_path / "kv" / "blocks").rglob("*.kvb")) == []
        assert not (tmp_path / "kv" / "retained.json").exists()
        assert llm.stats().disk.blocks == 11 and llm.stats().disk.retained_blocks == 11
        # Out of RAM, the queued blocks serve the hit before any is on disk.
        llm.engine.flush_cache(ram=True, disk=False)
        output = llm.generate([batch[0]], PARAMS)[0]
        assert output.token_ids == expected[0] and output.num_cached_tokens == 44
        assert llm.stats().disk.hit_blocks == 11
    finally:
        writer_may_go.set()
    llm.close()
    assert "MainThread" not in writes_by_thread
    assert len(list((tmp_path / "kv" / "blocks").rglob("*.kvb"))) >= 11  # the retained prefix and what else RAM held
    restarted = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    assert restarted.stats().disk.retained_blocks == 11
    again = restarted.generate([batch[0]], PARAMS)[0]
    assert again.token_ids == expected[0] and again.num_cached_tokens == 44
    assert restarted.stats().disk.rejected == {}


def test_no_file_in_the_kv_directory_holds_the_tenant_secret(tiny_llama: Path, workload, tmp_path: Path, monkeypatch) -> None:
    """The tenant secret (every key's cache salt is made with it) is kept outside the KV
    directory by default: after serving, retaining and closing, no file there holds its bytes."""
    import argparse

    from radixkv.cli import tenant_secret_for

    batch, expected = workload
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    llm = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    secret = tenant_secret_for(argparse.Namespace(tenant_secret_file=None), llm.engine)
    assert secret is not None and len(secret) >= 16
    assert generate(llm, batch[:1], salt="tenant-a") == expected[:1]
    assert llm.engine.retain(batch[0], salt="tenant-a", ttl_s=3600, owner="tenant-a") == 44
    llm.close()
    files = [path for path in (tmp_path / "kv").rglob("*") if path.is_file()]
    assert len(files) > 11  # the blocks, the seed, the key, the manifest
    for path in files:
        data = path.read_bytes()
        assert secret not in data and secret.hex().encode() not in data, path


def test_int8_pages_restart_warm_and_exact_from_their_own_blocks(tiny_llama: Path, workload, tmp_path: Path) -> None:
    """A block file holds int8 pages' bytes and their scales: a restart under kv_dtype="int8"
    hits every full block and gives what the int8 run without a disk tier gives."""
    batch, _ = workload
    expected = generate(make_llm(tiny_llama, kv_dtype="int8", enable_prefix_caching=False), batch)
    first = make_llm(tiny_llama, kv_dtype="int8", kv_disk_dir=str(tmp_path / "kv"))
    assert generate(first, batch) == expected
    first.close()
    second = make_llm(tiny_llama, kv_dtype="int8", kv_disk_dir=str(tmp_path / "kv"))
    assert generate(second, batch) == expected
    stats = second.stats().disk
    assert stats.hit_blocks == sum((len(p) - 1) // 4 for p in batch) and stats.rejected == {}
    assert_pages_returned(second.engine)


@pytest.mark.parametrize("before,after", [("int8", "bf16"), ("auto", "int8")])
def test_another_kv_dtypes_blocks_are_misses(tiny_llama: Path, workload, tmp_path: Path, before: str, after: str) -> None:
    """Blocks written under one kv_dtype are misses under another, counted by reason, never
    another dtype's bytes read as pages."""
    batch, _ = workload
    first = make_llm(tiny_llama, kv_dtype=before, kv_disk_dir=str(tmp_path / "kv"))
    generate(first, batch)
    first.close()
    expected = generate(make_llm(tiny_llama, kv_dtype=after, enable_prefix_caching=False), batch)
    other = make_llm(tiny_llama, kv_dtype=after, kv_disk_dir=str(tmp_path / "kv"))
    assert generate(other, batch) == expected
    stats = other.stats().disk
    assert stats.hit_blocks == 0 and stats.rejected == {"fingerprint": len(batch)}
    assert_pages_returned(other.engine)


def test_a_key_cannot_pass_its_retention_cap_by_way_of_disk(tiny_llama: Path, workload, tmp_path: Path) -> None:
    """Issue 43: a retained block read back from disk was re-retained under a `disk:` owner, a
    second cap beside the key's own. Read back by the key, by another key, in this process or
    after a restart, it counts in the key's one cap (11 pages here: one prompt)."""
    batch, _ = workload
    options = dict(kv_disk_dir=str(tmp_path / "kv"), max_retained_pages_per_owner=11)
    llm = make_llm(tiny_llama, **options)
    generate(llm, batch[:2])
    assert llm.engine.retain(batch[0], ttl_s=3600, owner="tenant") == 44  # written through
    llm.engine.flush_cache(ram=True, disk=False)  # RAM gives it up: on disk, retained
    generate(llm, batch[:2])  # another owner reads both back: batch[0] re-retained in RAM
    assert llm.engine.retain(batch[1], ttl_s=3600, owner="tenant") == 44
    assert llm.stats().cache.retained_pages == 11  # only "tenant" retains here
    assert [r.num_pages for r in llm.engine.tree.retentions("tenant")] == [11]
    llm.close()

    restarted = make_llm(tiny_llama, **options)  # "tenant" has no retention in this process yet
    assert restarted.stats().disk.retained_blocks == 22
    generate(restarted, batch[:2])  # both back from disk, retained again under the name the disk knows
    restarted.engine.flush_cache(ram=True, disk=False)  # and written back under that same name
    owners = {retention.owner for _, retention in restarted.engine.cache_view.loader.tier.index.retentions()}
    assert owners == {digest("tenant").hex()}  # one owner on disk too: one disk cap
    generate(restarted, batch)
    assert restarted.engine.retain(batch[2], ttl_s=3600, owner="tenant") == 44
    assert restarted.stats().cache.retained_pages == 11
    assert [r.num_pages for r in restarted.engine.tree.retentions("tenant")] == [11]
    assert_pages_returned(restarted.engine)
