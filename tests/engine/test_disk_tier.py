"""The disk tier in the engine, on a tiny model in fp32 with every page invariant checked each
step: a restart is warm (the disk hit counted, the greedy tokens transformers' own), blocks
evicted mid-run come back from disk, and corrupt files, another model's files, another tenant,
a full disk and an unusable directory each cost a miss, never a wrong token."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from radixkv import SamplingParams
from radixkv.config import EngineConfig
from radixkv.errors import ConfigError
from tests.cache.test_disk import file_size_limit
from tests.helpers.engine import VOCAB, assert_pages_returned, hf_greedy, make_llm
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


def test_a_restart_with_chunked_prefill_is_exact(tiny_llama: Path, workload, tmp_path: Path) -> None:
    """A disk hit loads the blocks inside each chunk (the pages the chunk needs anyway), chunk
    after chunk, leaving a token of each to compute; the tokens do not change."""
    batch, expected = workload
    first = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    generate(first, batch)
    first.close()
    second = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"), max_batch_tokens=16)
    outputs = [second.generate([prompt], PARAMS)[0] for prompt in batch]
    assert [output.token_ids for output in outputs] == expected
    # Each 16-token chunk loads 3 blocks and computes 4 tokens: 45-token prompts load 3 + 3 + 3
    # blocks before the last chunk computes the rest (10 blocks each at most).
    assert [output.num_cached_tokens for output in outputs] == [36] * len(batch)
    assert second.stats().disk.hit_blocks == 9 * len(batch)
    assert second.stats().counters.num_prompt_tokens_computed < sum(map(len, batch)) - 9 * 4 * len(batch) + 1
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
    first = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    generate(first, batch)
    first.close()
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
    first = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    generate(first, batch)
    first.close()
    other_model = make_tiny_model(tmp_path / "other", "llama", seed=1, max_position_embeddings=512)
    other = make_llm(other_model, kv_disk_dir=str(tmp_path / "kv"))
    assert generate(other, batch) == hf_greedy(other_model, batch, MAX_NEW)
    stats = other.stats().disk
    assert stats.hit_blocks == 0 and stats.rejected == {"fingerprint": len(batch)}
    assert_pages_returned(other.engine)


def test_another_tenants_blocks_are_not_found(tiny_llama: Path, workload, tmp_path: Path) -> None:
    batch, expected = workload
    first = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    assert generate(first, batch, salt="tenant-a") == expected
    first.close()
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
    first = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    generate(first, batch)
    first.close()
    second = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    assert generate(second, batch[:1]) == expected[:1]  # unmeasured: the disk is tried
    assert second.stats().disk.hit_blocks > 0 and second.stats().disk.read_s_per_block is not None
    warm_up = [[7] * 300]  # enough computed tokens for the engine to know its compute speed
    generate(second, warm_up)
    second.engine.disk.read_s_per_block = 3600.0  # as if the disk took an hour a block
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
