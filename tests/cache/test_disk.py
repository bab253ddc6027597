"""Unit tests for the disk tier over real files and a real page pool: blocks round-trip byte for
byte, a new tier on the same directory finds them from file names alone, and every way a file
can be wrong (corrupt, truncated, another model's, another tenant's, another prefix's, a full
disk, a vanished or unusable directory) is a miss counted under its reason, never an error."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import stat
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.cache import BlockHasher, PagePool
from radixkv.cache.disk import DiskTier
from radixkv.cache.disk_index import DiskIndex

PS = 4
FINGERPRINT = "model-a|float32|rope=10000"


def make_pool(num_pages: int = 16) -> PagePool:
    pool = PagePool(num_pages, PS, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    for cache in (*pool.k_cache, *pool.v_cache):
        cache.copy_(torch.randn(cache.shape, generator=generator))
    return pool


_open_tiers: dict[Path, DiskTier] = {}


def make_tier(directory: Path, budget_bytes: int = 1 << 20, fingerprint: str = FINGERPRINT, pool: PagePool | None = None) -> DiskTier:
    """A tier on `directory`; a tier opened there before is closed first, as a process that
    restarts has exited (the directory is locked by one tier at a time)."""
    previous = _open_tiers.pop(Path(directory), None)
    if previous is not None:
        previous.close()
    pool = pool or make_pool()
    tier = DiskTier(directory, budget_bytes, fingerprint=fingerprint, page_size=PS, payload_bytes=pool.page_nbytes)
    _open_tiers[Path(directory)] = tier
    return tier


def save_prompt(tier: DiskTier, pool: PagePool, tokens: list[int], salt: str | None = None, pages: list[int] | None = None) -> list[int]:
    """Store every full block of `tokens` with the KV of pages 0.. (or `pages`)."""
    num = len(tokens) // PS
    pages = pages or list(range(num))
    keys = tier.keys(tokens, salt)
    assert tier.save(tokens, salt, keys, 0, num, lambda i: pool.page_bytes(pages[i])) == num
    return keys


def load_prompt(tier: DiskTier, tokens: list[int], salt: str | None = None) -> list[bytes]:
    keys = tier.keys(tokens, salt)
    num = tier.count_cached(keys, 0, len(keys))
    return tier.load(tokens, salt, keys, 0, num)


def block_files(directory: Path) -> list[Path]:
    return sorted((directory / "blocks").rglob("*.kvb"))


PROMPT = list(range(100, 100 + 3 * PS))


def test_blocks_round_trip_and_a_restart_finds_them_by_name(tmp_path: Path) -> None:
    pool = make_pool()
    tier = make_tier(tmp_path / "kv", pool=pool)
    save_prompt(tier, pool, PROMPT)
    assert len(block_files(tmp_path / "kv")) == 3
    again = make_tier(tmp_path / "kv", pool=pool)  # a new process: index from the names and sizes
    assert again.stats().blocks == 3 and again.stats().bytes_used == tier.stats().bytes_used
    payloads = load_prompt(again, PROMPT)
    assert payloads == [pool.page_bytes(page) for page in range(3)]
    target = make_pool()
    for page, payload in zip((5, 6, 7), payloads):
        target.load_page(page, payload)
    for source, copy in zip((*pool.k_cache, *pool.v_cache), (*target.k_cache, *target.v_cache)):
        assert torch.equal(source[0:3], copy[5:8])
    assert again.stats().hit_blocks == 3 and again.stats().rejected == {}


def test_files_are_owner_only(tmp_path: Path) -> None:
    pool = make_pool()
    tier = make_tier(tmp_path / "kv", pool=pool)
    save_prompt(tier, pool, PROMPT)
    for path in [tmp_path / "kv", tmp_path / "kv" / "blocks", *[(p.parent) for p in block_files(tmp_path / "kv")]]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for path in [tmp_path / "kv" / "seed", *block_files(tmp_path / "kv")]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_keys_survive_a_restart_but_differ_between_directories(tmp_path: Path) -> None:
    first = make_tier(tmp_path / "a")
    assert make_tier(tmp_path / "a").keys(PROMPT, None) == first.keys(PROMPT, None)
    assert make_tier(tmp_path / "b").keys(PROMPT, None) != first.keys(PROMPT, None)  # a secret seed each


def _corrupt_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


@pytest.mark.parametrize(("damage", "reason"), [(_corrupt_middle, "checksum"), (_truncate, "truncated")])
def test_a_damaged_block_is_a_miss_and_is_deleted(tmp_path: Path, damage, reason: str) -> None:
    pool = make_pool()
    tier = make_tier(tmp_path / "kv", pool=pool)
    keys = save_prompt(tier, pool, PROMPT)
    damage(tier.files.block_path(keys[1]))
    restarted = make_tier(tmp_path / "kv", pool=pool)
    payloads = load_prompt(restarted, PROMPT)
    assert payloads == [pool.page_bytes(0)]  # the blocks before it still serve
    assert restarted.stats().rejected == {reason: 1}
    assert not restarted.files.block_path(keys[1]).exists() and keys[1] not in restarted.index


def test_another_models_block_is_a_miss(tmp_path: Path) -> None:
    pool = make_pool()
    save_prompt(make_tier(tmp_path / "kv", pool=pool), pool, PROMPT)
    other = make_tier(tmp_path / "kv", fingerprint="model-b|float32|rope=10000", pool=pool)
    assert load_prompt(other, PROMPT) == []
    assert other.stats().rejected == {"fingerprint": 1}


def test_another_layout_is_a_miss(tmp_path: Path) -> None:
    pool = make_pool()
    save_prompt(make_tier(tmp_path / "kv", pool=pool), pool, PROMPT)
    wider = PagePool(4, PS, num_layers=3, num_kv_heads=2, head_dim=8)
    other = make_tier(tmp_path / "kv", pool=wider)
    assert load_prompt(other, PROMPT) == [] and other.stats().rejected == {"fingerprint": 1}


def test_tenants_do_not_share_blocks_and_a_misfiled_one_is_refused(tmp_path: Path) -> None:
    pool = make_pool()
    tier = make_tier(tmp_path / "kv", pool=pool)
    keys_a = save_prompt(tier, pool, PROMPT, salt="tenant-a")
    assert load_prompt(tier, PROMPT, salt="tenant-b") == []  # other keys: not even looked at
    assert load_prompt(tier, PROMPT, salt=None) == []
    # A file under tenant b's key that holds tenant a's block (a collision, or a copy):
    keys_b = tier.keys(PROMPT, "tenant-b")
    tier.files.block_path(keys_b[0]).parent.mkdir(exist_ok=True)
    os.replace(tier.files.block_path(keys_a[0]), tier.files.block_path(keys_b[0]))
    restarted = make_tier(tmp_path / "kv", pool=pool)
    assert load_prompt(restarted, PROMPT, salt="tenant-b") == []
    assert restarted.stats().rejected == {"salt": 1}


def test_another_prefix_under_the_same_key_is_a_miss(tmp_path: Path) -> None:
    pool = make_pool()
    tier = make_tier(tmp_path / "kv", pool=pool)
    # Every key collides: only the stored tokens tell two prefixes apart.
    tier.hasher = BlockHasher(PS, seed=1, hash_fn=lambda data: 7)
    other = [token + 1 for token in PROMPT]
    keys = tier.keys(PROMPT, None)
    assert tier.save(PROMPT, None, keys, 0, 1, lambda i: pool.page_bytes(0)) == 1
    assert tier.load(other, None, tier.keys(other, None), 0, 1) == []
    assert tier.stats().rejected == {"tokens": 1}


@contextmanager
def file_size_limit(limit_bytes: int):
    """A real write failure without a real full disk: the kernel refuses to grow any file past
    the limit (EFBIG; SIGXFSZ ignored so it is an error, not a kill)."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def test_a_full_disk_degrades_to_a_miss(tmp_path: Path) -> None:
    pool = make_pool()
    tier = make_tier(tmp_path / "kv", pool=pool)
    keys = tier.keys(PROMPT, None)
    with file_size_limit(256):  # smaller than one block's file
        written = tier.save(PROMPT, None, keys, 0, 3, lambda i: pool.page_bytes(i))
    assert written == 0 and tier.stats().write_failures == 1 and tier.stats().blocks == 0
    assert [p for p in (tmp_path / "kv" / "blocks").rglob("*") if p.is_file()] == []  # no torn file left
    assert load_prompt(tier, PROMPT) == []
    save_prompt(tier, pool, PROMPT)  # room again: it works again
    assert len(load_prompt(tier, PROMPT)) == 3


def test_a_vanished_directory_is_a_miss_and_not_recreated(tmp_path: Path) -> None:
    pool = make_pool()
    tier = make_tier(tmp_path / "kv", pool=pool)
    save_prompt(tier, pool, PROMPT)
    shutil.rmtree(tmp_path / "kv")
    assert load_prompt(tier, PROMPT) == []
    assert tier.stats().rejected == {"missing": 1}
    keys = tier.keys(PROMPT, None)
    assert tier.save(PROMPT, None, keys, 0, 3, lambda i: pool.page_bytes(i)) == 0
    assert tier.stats().write_failures == 1 and not (tmp_path / "kv").exists()


def test_an_unusable_directory_turns_the_tier_off(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    pool = make_pool()
    tier = make_tier(tmp_path / "file" / "kv", pool=pool)
    assert not tier.enabled and tier.counters["unavailable"] == 1
    assert tier.save(PROMPT, None, [1, 2, 3], 0, 3, lambda i: pool.page_bytes(i)) == 0
    assert tier.load(PROMPT, None, [1, 2, 3], 0, 3) == [] and tier.count_cached([1, 2, 3], 0, 3) == 0


def test_budget_evicts_least_recently_used_blocks_first(tmp_path: Path) -> None:
    pool = make_pool()
    probe = make_tier(tmp_path / "probe", pool=pool)
    save_prompt(probe, pool, PROMPT[:PS])
    one_block = probe.stats().bytes_used
    tier = make_tier(tmp_path / "kv", budget_bytes=4 * one_block + 64, pool=pool)
    old, new = [1] * (2 * PS), [2] * (2 * PS)
    save_prompt(tier, pool, old)
    save_prompt(tier, pool, new)
    assert len(load_prompt(tier, old)) == 2  # old is now the more recently used
    save_prompt(tier, pool, [3] * (2 * PS))
    assert tier.stats().evicted_blocks == 2 and tier.stats().bytes_used <= tier.stats().budget_bytes
    assert load_prompt(tier, new) == [] and len(load_prompt(tier, old)) == 2
    assert len(block_files(tmp_path / "kv")) == 4
    restarted = make_tier(tmp_path / "kv", budget_bytes=2 * one_block + 64, pool=pool)  # budget shrank
    assert restarted.stats().blocks == 2 and len(block_files(tmp_path / "kv")) == 2


FOREVER = float("inf")


def test_disk_index_keeps_retained_blocks_last() -> None:
    index = DiskIndex(budget_bytes=3)
    index.add("kept", 1, retention_expires_at_s=FOREVER)
    index.add("a", 1)
    index.add("b", 1)
    assert index.add("c", 1) == ["a"] and index.reasons == ["capacity"]
    index.touch("b")
    assert index.add("d", 1) == ["c"]
    assert index.add("e", 2) == ["b", "d"]
    assert index.add("f", 1) == ["e"] and "kept" in index
    assert index.add("g", 3) == ["f", "kept"] and index.reasons == ["capacity", "retained"]
    assert index.add("h", 4) is None


def test_disk_retentions_go_by_expiry_then_lapse_into_lru() -> None:
    now = [100.0]
    index = DiskIndex(budget_bytes=4, clock=lambda: now[0])
    index.add("late", 1, retention_expires_at_s=300.0)
    index.add("early", 1, retention_expires_at_s=200.0)
    index.add("plain", 1)
    index.add("plain2", 1)
    assert index.add("x", 2) == ["plain", "plain2"]
    assert index.add("y", 2) == ["x"]  # retained ones stay while any plain is left
    index.remove("y")
    assert index.add("w", 3) == ["early"] and index.reasons == ["retained"]  # earliest expiry first
    index.add("u", 3)  # late (1) + u (3): full
    now[0] = 301.0  # "late" expired: first in line among the plain, under its own reason
    assert index.retention("late") is None
    assert index.add("v", 1) == ["late"] and index.reasons == ["retention_expired"]
    assert not index.retain("v", 250.0)  # a time already past retains nothing


def test_each_owners_retained_bytes_are_capped() -> None:
    index = DiskIndex(budget_bytes=100, max_owner_bytes=3, clock=lambda: 0.0)
    for key, until in (("a1", 10.0), ("a2", 30.0), ("a3", 20.0)):
        index.add(key, 1, retention_expires_at_s=until, owner="a")
    index.add("b1", 2, retention_expires_at_s=5.0, owner="b")
    assert index.owner_bytes("a") == 3 and index.owner_bytes("b") == 2
    index.add("a4", 2, retention_expires_at_s=40.0, owner="a")  # over a's cap: a's earliest expiries go
    assert index.owner_bytes("a") == 3 and index.retention("a1") is None and index.retention("a3") is None
    assert index.retention("a2") is not None and index.retention("a4") is not None and "a1" in index
    assert index.owner_bytes("b") == 2  # another owner is untouched
    assert not index.retain("a5", 50.0, "a")  # not stored
    assert index.add("big", 4, retention_expires_at_s=50.0, owner="a") == []
    assert index.retention("big") is None  # stored, but more than the cap alone: not retained


def test_retentions_survive_a_restart_until_they_expire(tmp_path: Path) -> None:
    pool = make_pool()
    probe = make_tier(tmp_path / "probe", pool=pool)
    save_prompt(probe, pool, PROMPT[:PS])
    one_block = probe.stats().bytes_used
    budget = 5 * one_block  # a block's file grows with its prefix: room for 4 or so
    tier = make_tier(tmp_path / "kv", budget_bytes=budget, pool=pool)
    kept = [9] * (2 * PS)
    keys = tier.keys(kept, None)
    expires_at_s = time.time() + 3600
    assert tier.save(kept, None, keys, 0, 2, pool.page_bytes, retention_expires_at_s=expires_at_s, owner="tenant") == 2
    short = [8] * PS
    tier.save(short, None, tier.keys(short, None), 0, 1, pool.page_bytes, retention_expires_at_s=time.time() + 0.05, owner="t2")
    assert tier.stats().retained_blocks == 3 and stat.S_IMODE(os.stat(tmp_path / "kv" / "retained.json").st_mode) == 0o600
    time.sleep(0.1)
    restarted = make_tier(tmp_path / "kv", budget_bytes=budget, pool=pool)
    assert restarted.stats().retained_blocks == 2  # the short one expired meanwhile
    assert restarted.retention(keys[1]).expires_at_s == expires_at_s
    for filler in range(6):  # a burst of other blocks: the retained pair stays
        save_prompt(restarted, pool, [filler + 20] * PS)
    assert len(load_prompt(restarted, kept)) == 2
    evicted = restarted.residency_stats().evicted_blocks
    assert evicted["capacity"] >= 4 and evicted["retained"] == 0


@settings(max_examples=200, deadline=None)
@given(
    budget=st.integers(0, 12),
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "touch", "remove", "pop"]), st.integers(0, 6), st.integers(1, 5), st.booleans()),
        max_size=40,
    ),
)
def test_disk_index_against_a_reference(budget: int, ops) -> None:
    """Bytes stay within the budget and equal the sum of the sizes; victims go least recently
    used first, plain before retained (retained ones, never expiring, in the order retained)."""
    index = DiskIndex(budget)
    ref: dict[int, tuple[int, bool]] = {}  # key -> (size, retained), in use order

    def order() -> list[int]:
        return [k for k in ref if not ref[k][1]] + [k for k in ref if ref[k][1]]

    for op, key, size, retained in ops:
        if op == "add":
            evicted = index.add(key, size, retention_expires_at_s=FOREVER if retained else 0.0)
            if size > budget:
                assert evicted is None
                continue
            ref.pop(key, None)
            expected = []
            victims = order()
            while sum(s for s, _ in ref.values()) + size > budget:
                victim = victims.pop(0)
                expected.append(victim)
                del ref[victim]
            assert evicted == expected
            ref[key] = (size, retained)
        elif op == "touch":
            assert index.touch(key) == (key in ref)
            if key in ref and not ref[key][1]:
                ref[key] = ref.pop(key)
        elif op == "remove":
            assert index.remove(key) == (ref.pop(key)[0] if key in ref else 0)
        else:
            victims = order()
            assert index.pop_victim() == (victims[0] if victims else None)
            if victims:
                del ref[victims[0]]
        assert index.bytes_used == sum(s for s, _ in ref.values()) <= budget
        assert list(index) == order()


def test_a_window_model_s_blocks_carry_their_window_kv_where_they_have_it(tmp_path):
    """Layer groups: a block is stored with its full layers' KV and, where it has it, its window
    layers' KV after it (two payload sizes); both read back whole, the index tells which blocks
    carry window KV from file sizes alone (after a restart too), and a file of any other size is
    refused unread."""
    pool, window_bytes = make_pool(), 96
    tier = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT, page_size=PS, payload_bytes=pool.page_nbytes, window_payload_bytes=window_bytes)
    tokens = list(range(100, 100 + 3 * PS))
    keys = tier.keys(tokens, None)
    payloads = [pool.page_bytes(0) + bytes([7]) * window_bytes, pool.page_bytes(1), pool.page_bytes(2) + bytes([9]) * window_bytes]
    assert tier.save(tokens, None, keys, 0, 3, lambda i: payloads[i]) == 3
    assert tier.load(tokens, None, keys, 0, 3) == payloads
    assert [tier.holds_window(keys[b], b) for b in range(3)] == [True, False, True]
    tier.close()
    reopened = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT, page_size=PS, payload_bytes=pool.page_nbytes, window_payload_bytes=window_bytes)
    assert [reopened.holds_window(keys[b], b) for b in range(3)] == [True, False, True]
    path = reopened.files.block_path(keys[2])
    path.write_bytes(path.read_bytes()[:-window_bytes // 2])  # neither size: torn
    read = reopened.read(tokens, None, keys, 0, 3)
    assert read.payloads == payloads[:2] and read.failure == "truncated"
    reopened.close()
