"""Cache reports in the engine, on the tiny Llama (pages of 4 tokens), one test per reason, each
constructing it: a repeated prompt is a hit, a fresh one never seen, an evicted prefix evicted,
a prompt continuing a partial page partial_page, a disk read judged slower disk_read_skipped,
the same owner's other partition another_partition; another tenant's blocks never show."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from radixkv import SamplingParams
from radixkv.engine.cache_report import MISS_REASONS, CacheReport
from radixkv.engine.request_output import RequestOutput
from tests.helpers.engine import VOCAB, assert_pages_returned, make_llm, run_to_end

PS = 4  # make_llm's page size
ONE = SamplingParams(max_tokens=1)


def tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(length)]


def report(llm, prompt: list[int], salt: str | None = None, params: SamplingParams = ONE) -> CacheReport:
    out = llm.generate([prompt], params, salt=salt)[0]
    assert out.cache_report is not None
    return out.cache_report


@pytest.fixture
def llm(tiny_llama: Path):
    llm = make_llm(tiny_llama)
    yield llm
    assert_pages_returned(llm.engine)


def test_a_repeated_prompt_is_a_hit_up_to_its_last_tokens_block(llm) -> None:
    prompt = tokens(1, 45)
    first = report(llm, prompt)
    assert first == CacheReport(45, 0, 0, 0, "never_seen")
    again = report(llm, prompt)
    # 45 tokens: 11 full blocks before the block of the last token, all served from RAM.
    assert again == CacheReport(45, 44, 0, 44, "hit")


def test_a_changed_message_misses_from_its_block_as_never_seen(llm) -> None:
    system, first_turn = tokens(2, 30), tokens(3, 20)
    report(llm, system + first_turn)
    changed = list(first_turn)
    changed[9] = changed[9] % (VOCAB - 1) + 1  # token 39 of the prompt
    got = report(llm, system + changed)
    assert got.first_uncached_token == 36 and got.num_ram_tokens == 36 and got.reason == "never_seen"


def test_an_evicted_prefix_reads_as_evicted(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama, num_pages=40)
    prompt = tokens(4, 45)
    report(llm, prompt)
    for seed in range(5, 10):  # 12 pages each: prompt's blocks go
        report(llm, tokens(seed, 45))
    assert llm.engine.tree.peek(prompt, None).num_cached_tokens < 44
    got = report(llm, prompt)
    assert got.reason == "evicted" and got.first_uncached_token < 44
    # Computed again, its blocks are cached again and leave the ghost index.
    assert report(llm, prompt).reason == "hit"
    assert not any(h in llm.engine.cache_view.misses.ghost for h in llm.engine.hasher.hash_blocks(prompt[:44], None))
    assert_pages_returned(llm.engine)


def test_a_prompt_continuing_a_partial_page_reads_as_partial_page(llm) -> None:
    prompt = tokens(11, 45)  # 11 full pages and one token: that token is computed, never cached
    report(llm, prompt)
    got = report(llm, prompt + tokens(12, 10))
    assert got.first_uncached_token == 44 and got.reason == "partial_page"
    # Not any prompt that misses at 44: one whose block 11 does not begin with that token.
    other = prompt[:44] + [prompt[44] % (VOCAB - 1) + 1] + tokens(12, 10)
    assert report(llm, other).reason == "never_seen"


def test_a_prompt_within_one_page_reads_as_partial_page(llm) -> None:
    assert report(llm, tokens(13, 3)) == CacheReport(3, 0, 0, 0, "partial_page")
    assert report(llm, tokens(13, 3)).reason == "partial_page"


def test_another_tenants_identical_prompt_is_never_seen(llm) -> None:
    prompt = tokens(14, 45)
    assert report(llm, prompt, salt="tenant-a").reason == "never_seen"
    assert report(llm, prompt, salt="tenant-a").reason == "hit"
    assert report(llm, prompt, salt="tenant-b") == CacheReport(45, 0, 0, 0, "never_seen")
    # Neither the ghost nor the tail index answers across partitions; tenant a is unchanged.
    assert report(llm, prompt + tokens(15, 8), salt="tenant-b").reason == "partial_page"
    assert report(llm, prompt, salt="tenant-a") == CacheReport(45, 44, 0, 44, "hit")


def test_the_same_owners_other_partition_is_named(llm) -> None:
    prompt = tokens(16, 45)
    report(llm, prompt, salt="owner-default")
    engine = llm.engine
    mine = engine.add_request(prompt, ONE, salt="owner-session", sibling_salts=("owner-default",))
    stranger = engine.add_request(prompt, ONE, salt="someone-else")
    finals = run_to_end(engine)
    assert finals[mine].cache_report == CacheReport(45, 0, 0, 0, "another_partition")
    assert finals[stranger].cache_report == CacheReport(45, 0, 0, 0, "never_seen")


def test_every_request_is_counted_by_reason_once(llm) -> None:
    prompt = tokens(17, 45)
    before = llm.stats().cache_misses
    assert set(before) == set(MISS_REASONS) and sum(before.values()) == 0
    report(llm, prompt)
    report(llm, prompt, params=SamplingParams(max_tokens=2, n=3, temperature=1.0, seed=1))
    report(llm, tokens(18, 2))
    after = llm.stats().cache_misses
    assert after["never_seen"] == 1 and after["hit"] == 1 and after["partial_page"] == 1
    assert sum(after.values()) == 3  # n=3 is one request, one report


def test_a_disk_hit_is_reported_per_tier_and_a_skipped_read_says_so(tiny_llama: Path, tmp_path: Path) -> None:
    batch = [tokens(seed, 45) for seed in (20, 21, 22)]
    first = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    for prompt in batch:
        report(first, prompt)
    first.close()
    second = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    assert report(second, batch[0]) == CacheReport(45, 0, 44, 44, "hit")  # unmeasured: read
    for _ in range(2):
        report(second, [7] * 300)  # the engine learns its compute speed
    second.engine.cache_view.loader.tier.read_s_per_block = 3600.0  # as if the disk took an hour a block
    assert report(second, batch[1]) == CacheReport(45, 0, 0, 0, "disk_read_skipped")
    second.close()
    assert_pages_returned(second.engine)


def test_a_block_the_disk_dropped_reads_as_evicted(tiny_llama: Path, tmp_path: Path) -> None:
    """After a restart RAM never held the prompt; its blocks were on disk until the disk's
    budget dropped them for newer ones: evicted, told by the dropped disk keys."""
    from radixkv.cache.disk_format import block_file_bytes

    prompt = tokens(25, 45)
    first = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    report(first, prompt)
    first.close()
    payload = first.engine.pool.page_nbytes
    budget = sum(block_file_bytes((b + 1) * PS, payload) for b in range(40))  # about three prompts' blocks
    second = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"), kv_disk_bytes=budget, num_pages=16)
    tier = second.engine.cache_view.loader.tier
    keys = tier.keys(prompt[:44], None)
    assert tier.count_cached(keys, 0, 11, touch=False) == 11
    for seed in range(26, 31):  # a small RAM writes each back; the disk's budget drops the oldest
        report(second, tokens(seed, 45))
    tier.drain()
    assert tier.count_cached(keys, 0, 11, touch=False) < 11
    assert not any(h in second.engine.cache_view.misses.ghost for h in second.engine.hasher.hash_blocks(prompt[:44], None))
    got = report(second, prompt)
    assert got.reason == "evicted" and got.num_ram_tokens == 0
    second.close()
    assert_pages_returned(second.engine)


def test_the_ghost_is_bounded_over_all_tenants(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama, num_pages=24, max_ghost_blocks=10)
    for seed in range(40, 46):
        report(llm, tokens(seed, 45), salt=f"tenant-{seed}")
    assert len(llm.engine.cache_view.misses.ghost) == 10 and llm.engine.cache_view.misses.ghost.num_tails <= 10
    assert_pages_returned(llm.engine)


def test_the_ghost_size_is_validated() -> None:
    from radixkv.config import EngineConfig
    from radixkv.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        EngineConfig(max_ghost_blocks=0)
    assert error.value.param == "max_ghost_blocks"
    assert EngineConfig(max_ghost_blocks=None).max_ghost_blocks is None


def test_the_report_is_the_admission_state_not_a_later_peek(llm) -> None:
    """Two identical prompts in one step: the first computes, the second is put off a step and
    then hits what the first computed; each report says what that request saw."""
    prompt = tokens(24, 45)
    engine = llm.engine
    a = engine.add_request(prompt, ONE)
    b = engine.add_request(prompt, ONE)
    finals: dict[str, RequestOutput] = run_to_end(engine)
    assert finals[a].cache_report.reason == "never_seen"
    assert finals[b].cache_report.reason == "hit"
    assert finals[b].num_cached_tokens == finals[b].cache_report.num_ram_tokens
