"""The disk tier trusts nothing in its directory it did not make: a directory others may write is
refused, a second tier on a locked directory is refused, and a planted symlink, pipe, huge file
or block forged without the directory's MAC key is a miss counted under its reason (read
unread where it can be), never a hit; the seed and the tenant secret are never left torn."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import xxhash

from radixkv.cache import disk_format
from radixkv.cache.disk import REJECTED_REASONS, DiskTier
from radixkv.errors import ConfigError
from radixkv.server.guards.tenants import persistent_secret
from tests.cache.test_disk import FINGERPRINT, PROMPT, PS, file_size_limit, load_prompt, make_pool, save_prompt


def open_tier(directory: Path, pool) -> DiskTier:
    return DiskTier(directory, 1 << 20, fingerprint=FINGERPRINT, page_size=PS, payload_bytes=pool.page_nbytes)


def rejected(tier: DiskTier) -> dict[str, int]:
    """The tier's misses by reason, each one /metrics exports (radixkv_disk_cache_rejected_blocks)."""
    found = tier.stats().rejected
    assert set(found) <= set(REJECTED_REASONS), found
    return found


def stored(tmp_path: Path) -> tuple[object, list[int], DiskTier]:
    """PROMPT's three blocks written by one tier, then the directory opened again (a restart)."""
    pool = make_pool()
    first = open_tier(tmp_path / "kv", pool)
    keys = save_prompt(first, pool, PROMPT)
    first.close()
    return pool, keys, open_tier(tmp_path / "kv", pool)


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o722], ids=oct)
def test_a_directory_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    directory = tmp_path / "kv"
    directory.mkdir()
    os.chmod(directory, mode)
    with pytest.raises(ConfigError, match="writable by others") as info:
        open_tier(directory, make_pool())
    assert info.value.param == "kv_disk_dir"
    os.chmod(directory, 0o755)  # readable by others is the owner's choice; writable is not
    assert open_tier(directory, make_pool()).enabled


@pytest.mark.skipif(os.getuid() != 0, reason="only root can give a folder to another user")
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)  # nobody
    with pytest.raises(ConfigError, match="belongs to uid") as info:
        open_tier(directory, make_pool())
    assert info.value.param == "kv_disk_dir"


def test_a_second_tier_on_a_directory_in_use_is_refused_until_the_first_closes(tmp_path: Path) -> None:
    pool = make_pool()
    first = open_tier(tmp_path / "kv", pool)
    with pytest.raises(ConfigError, match="in use by another engine") as info:
        open_tier(tmp_path / "kv", pool)
    assert info.value.param == "kv_disk_dir"
    save_prompt(first, pool, PROMPT)
    first.close()
    second = open_tier(tmp_path / "kv", pool)  # released at close
    assert len(load_prompt(second, PROMPT)) == 3
    assert not first.enabled and first.save(PROMPT, None, first.keys(PROMPT, None), 0, 3, pool.page_bytes) == 0


def test_a_planted_symlink_is_a_miss_and_its_target_untouched(tmp_path: Path) -> None:
    pool, keys, tier = stored(tmp_path)
    block = tier.files.block_path(keys[0])
    target = tmp_path / "elsewhere.kvb"
    target.write_bytes(block.read_bytes())  # a valid block: only following the link would serve it
    block.unlink()
    block.symlink_to(target)
    assert load_prompt(tier, PROMPT) == []
    assert rejected(tier) == {"symlink": 1}
    assert not block.is_symlink() and target.exists()


def test_a_planted_folder_symlink_is_a_miss(tmp_path: Path) -> None:
    pool, keys, tier = stored(tmp_path)
    folder = tier.files.block_path(keys[0]).parent
    copy = tmp_path / "copy"
    folder.rename(copy)
    folder.symlink_to(copy)  # every block under it would be read (and written) there
    assert load_prompt(tier, PROMPT) == []
    assert rejected(tier) == {"symlink": 1}


def test_an_oversized_block_is_a_miss_read_no_further_than_its_header(tmp_path: Path) -> None:
    pool, keys, tier = stored(tmp_path)
    block = tier.files.block_path(keys[0])
    with open(block, "r+b") as out:
        out.truncate(256 << 20)  # sparse: huge, but costs no disk
    assert load_prompt(tier, PROMPT) == []
    assert rejected(tier) == {"oversized": 1} and not block.exists()


def test_a_planted_pipe_is_a_miss_not_a_hang(tmp_path: Path) -> None:
    pool, keys, tier = stored(tmp_path)
    block = tier.files.block_path(keys[0])
    block.unlink()
    os.mkfifo(block, 0o600)
    result: list[list[bytes]] = []
    reader = threading.Thread(target=lambda: result.append(load_prompt(tier, PROMPT)), daemon=True)
    reader.start()
    reader.join(30)
    if reader.is_alive():  # blocked opening the pipe: let it go before failing
        os.close(os.open(block, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(30)
        pytest.fail("reading a planted pipe blocked")
    assert result == [[]] and rejected(tier) == {"not_a_file": 1}


def forge(path: Path) -> None:
    """Change a block's KV and fix its checksum, as anyone who knows the format can: only a key
    the forger cannot read tells the block apart."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    checked = disk_format._CHECKED_HEADER_BYTES
    body = bytes(data[disk_format.HEADER_BYTES :])
    hasher = xxhash.xxh3_128()
    hasher.update(bytes(data[:checked]))
    hasher.update(body)
    data[checked : checked + 16] = hasher.digest()
    path.write_bytes(bytes(data))


def test_a_block_forged_without_the_key_is_a_miss(tmp_path: Path) -> None:
    pool, keys, tier = stored(tmp_path)
    forge(tier.files.block_path(keys[1]))
    payloads = load_prompt(tier, PROMPT)
    assert payloads == [pool.page_bytes(0)]  # never the forged KV
    assert rejected(tier) == {"mac": 1} and not tier.files.block_path(keys[1]).exists()


def test_a_block_of_an_older_format_is_a_miss(tmp_path: Path) -> None:
    pool, keys, tier = stored(tmp_path)
    path = tier.files.block_path(keys[0])
    data = bytearray(path.read_bytes())
    data[4:6] = (disk_format.VERSION - 1).to_bytes(2, "little")
    path.write_bytes(bytes(data))
    assert load_prompt(tier, PROMPT) == [] and rejected(tier) == {"corrupt": 1}


def test_a_write_cut_short_leaves_no_torn_seed(tmp_path: Path) -> None:
    """A write that fails halfway (a full disk, a crash) leaves the seed whole or absent, never
    torn: a torn seed would silently change every key of the directory at the next start."""
    pool = make_pool()
    directory = tmp_path / "kv"
    with file_size_limit(4):  # half of the seed's 8 bytes
        off = open_tier(directory, pool)
    assert not off.enabled
    seed = directory / "seed"
    assert not seed.exists() or len(seed.read_bytes()) == 8
    assert [p.name for p in directory.iterdir() if p.name.startswith(".tmp")] == []
    tier = open_tier(directory, pool)  # the next start makes it whole
    keys = save_prompt(tier, pool, PROMPT)
    tier.close()
    assert open_tier(directory, pool).keys(PROMPT, None) == keys


def test_the_tenant_secret_is_written_whole_and_private(tmp_path: Path) -> None:
    path = tmp_path / "secrets" / "tenant_secret"
    path.parent.mkdir(mode=0o700)
    with file_size_limit(16), pytest.raises(OSError):
        persistent_secret(path)
    assert not path.exists()  # never a torn secret that the next start would replace
    secret = persistent_secret(path)
    assert len(secret) == 32 and persistent_secret(path) == secret
    assert os.stat(path).st_mode & 0o777 == 0o600
    os.chmod(path.parent, 0o777)
    with pytest.raises(PermissionError, match="writable by others"):
        persistent_secret(path)


def test_blocks_queued_for_the_writer_are_bounded_in_bytes(tmp_path: Path) -> None:
    """save(wait=False) returns at once with the blocks queued (and served from memory), but no
    more than max_queued_bytes wait unwritten: past it the caller waits for the writer."""
    pool = make_pool()
    tier = open_tier(tmp_path / "kv", pool)
    tier.writer.max_queued_bytes = pool.page_nbytes  # one block
    writer_may_go = threading.Event()
    real_write = tier.files.write_block
    tier.files.write_block = lambda key, data: writer_may_go.wait() and real_write(key, data)
    keys = tier.keys(PROMPT, None)
    assert tier.save(PROMPT, None, keys, 0, 1, pool.page_bytes, wait=False) == 1  # within the bound
    assert tier.read(PROMPT, None, keys, 0, 1).payloads == [pool.page_bytes(0)]  # from the queue
    second = threading.Thread(target=lambda: tier.save(PROMPT, None, keys, 1, 2, lambda i: pool.page_bytes(1 + i), wait=False))
    second.start()
    second.join(0.5)
    assert second.is_alive() and tier.writer.pending_bytes <= 3 * pool.page_nbytes  # held: two over the bound
    writer_may_go.set()
    second.join(30)
    assert not second.is_alive() and tier.counters["write_waits"] == 1
    tier.close()
    assert len(load_prompt(open_tier(tmp_path / "kv", pool), PROMPT)) == 3
