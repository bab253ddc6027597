"""Pins in the engine (engine/pins.py): caps per owner and over all owners hold for in-process
callers as for HTTP ones, the owner is the caller's own (never a cache salt), only a pin's owner
releases it, and pins expire on time, even when the timer that expires them fires a moment early."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixkv.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.pins import Pins
from radixkv.engine.sampling_params import SamplingParams
from radixkv.errors import ConfigError, InvalidRequest, OwnerCapExceeded
from tests.helpers.engine import assert_pages_returned, make_llm, run_to_end

PAGE_SIZE = 4
NUM_PAGES = 256  # a quarter: 64 pages per owner; context 512 tokens = 128 pages, so 128 in all


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Engine:
    return make_llm(tiny_llama, page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_retained_pages_per_owner=16).engine


def cached(engine: Engine, prompt: list[int], salt: str | None = None) -> list[int]:
    engine.add_request(prompt, SamplingParams(max_tokens=1), salt=salt)
    run_to_end(engine)
    return prompt


def tokens(start: int, num_pages: int) -> list[int]:
    return [1 + (start + i) % 300 for i in range(num_pages * PAGE_SIZE)]


def test_one_owner_varying_cache_salt_shares_one_pin_and_one_retention_budget(engine: Engine) -> None:
    """The owner is the caller's own partition: a cache salt (a different tree root) buys no
    second share of either cap."""
    per_owner = engine.pins.max_pages_per_owner
    assert per_owner == NUM_PAGES // 4
    first = engine.pin(cached(engine, tokens(0, 40), "salt-1"), "salt-1", owner="key-a")
    assert first.num_pinned_tokens == 40 * PAGE_SIZE and first.owner == "key-a"
    over = cached(engine, tokens(7, per_owner - 40 + 1), "salt-2")
    with pytest.raises(OwnerCapExceeded) as refused:
        engine.pin(over, "salt-2", owner="key-a")
    assert refused.value.code == "pin_limit_exceeded" and refused.value.limit == per_owner
    other = engine.pin(over, "salt-2", owner="key-b")  # another owner's own share
    assert engine.tree.locked_pages == 40 + per_owner - 40 + 1
    # Retention: 16 pages per owner, whatever salts its prefixes live under.
    for i, salt in enumerate(("salt-3", "salt-4", "salt-5")):
        engine.retain(cached(engine, tokens(50 + 30 * i, 8), salt), salt, 300.0, owner="key-a")
    assert sum(r.num_pages for r in engine.tree.retentions("key-a")) <= 16
    assert [owner for owner in ("salt-3", "salt-4", "salt-5") if engine.tree.retentions(owner)] == []
    assert engine.unpin(first.pin_id, "key-a") and engine.unpin(other.pin_id, "key-b")
    assert_pages_returned(engine)


def test_in_process_pins_get_the_same_caps_and_only_their_owner_unpins(engine: Engine) -> None:
    prompt = cached(engine, tokens(100, 10))
    mine = engine.pin(prompt)  # in process: owner None, one owner together
    assert mine.owner is None and mine.expires_at_s is None and mine.num_prompt_tokens == len(prompt)
    assert not engine.unpin(mine.pin_id, "key-a")  # another owner's answer: as if unknown
    assert [p.pin_id for p in engine.pins_of()] == [mine.pin_id] and engine.pins_of("key-a") == []
    with pytest.raises(InvalidRequest) as empty:
        engine.pin([5, 6, 7])  # less than a page: nothing to pin, nothing pinned
    assert empty.value.code == "nothing_to_pin"
    with pytest.raises(InvalidRequest) as too_long:
        engine.pin([5] * 600)
    assert too_long.value.code == "context_length_exceeded" and too_long.value.param == "prompt"
    big = cached(engine, tokens(200, 64))
    with pytest.raises(OwnerCapExceeded):  # 10 + 64 > a quarter of the pool
        engine.pin(big)
    assert engine.tree.locked_pages == 10  # a refused pin locked nothing
    assert engine.unpin(mine.pin_id) and not engine.unpin(mine.pin_id)
    assert_pages_returned(engine)


def test_pins_of_all_owners_leave_room_for_a_full_context_request(engine: Engine) -> None:
    limit = engine.pins.max_pages
    assert limit == min(NUM_PAGES // 2, NUM_PAGES - 512 // PAGE_SIZE)
    made = [engine.pin(cached(engine, tokens(300 + 70 * i, 60)), owner=f"key{i}") for i in range(2)]
    with pytest.raises(InvalidRequest) as refused:
        engine.pin(cached(engine, tokens(500, 10)), owner="key9")
    assert refused.value.code == "pin_limit_exceeded" and not isinstance(refused.value, OwnerCapExceeded)
    assert refused.value.limit == limit
    for pinned in made:
        assert engine.unpin(pinned.pin_id, pinned.owner)
    assert_pages_returned(engine)


def test_a_pin_is_released_when_its_timer_fires_a_moment_early(engine: Engine) -> None:
    """A timer expiring a pin (the server's, one per pin) may fire a millisecond before
    time.monotonic() reaches the expiry (uvloop counts from its cached millisecond clock); the
    pin must go then, not stay locked until some later pin call."""
    prompt = cached(engine, tokens(600, 6))
    now = [100.0]
    pins = Pins(engine.kv, NUM_PAGES, PAGE_SIZE, engine.max_context_tokens, None, 8, clock=lambda: now[0])
    pinned = pins.pin(prompt, None, "key", ttl_s=2.0)
    assert pinned.expires_at_s == 102.0 and engine.tree.locked_pages == 6
    now[0] = 101.0  # half its ttl: kept
    assert pins.expire() == 0 and engine.tree.locked_pages == 6
    now[0] = 102.0 - 0.002  # the timer, 2 ms early
    assert pins.expire() == 1 and engine.tree.locked_pages == 0 and pins.pages == 0


def test_engine_pins_expire_after_their_ttl(engine: Engine) -> None:
    pinned = engine.pin(cached(engine, tokens(700, 3)), owner="key-a", ttl_s=1e-6)
    assert pinned.expires_at_s is not None
    assert engine.pins_of("key-a") == [] and engine.tree.locked_pages == 0  # expired at the next call
    assert_pages_returned(engine)


@pytest.mark.parametrize("name", ["max_pinned_pages_per_owner", "max_pinned_pages"])
@pytest.mark.parametrize("value", [-1, 1.5, True, "all"])
def test_the_pin_caps_are_validated(tiny_llama: Path, name: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(model=str(tiny_llama), **{name: value})
    assert info.value.param == name
