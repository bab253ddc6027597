"""Unit tests for the eviction policies: under slru a burst of one-off prompts does not flush
a hot shared prefix (under lru it does), the protected share is capped, and the config offers
exactly the policies the cache implements."""

from __future__ import annotations

import pytest

from radixkv.cache import BlockHasher, PagePool, RadixTree
from radixkv.cache.eviction import EVICTION_POLICIES
from radixkv.config import EVICTION_POLICIES as CONFIG_POLICIES
from radixkv.config import EngineConfig
from radixkv.errors import ConfigError
from tests.cache.test_radix import run_request, seq

PAGE_SIZE = 4


def make_tree(policy: str, num_pages: int = 48, protected_fraction: float = 0.9) -> RadixTree:
    pool = PagePool(num_pages, PAGE_SIZE)
    return RadixTree(pool, BlockHasher(PAGE_SIZE, seed=7), eviction_policy=policy, protected_fraction=protected_fraction)


def serve(tree: RadixTree, tokens: list[int]) -> int:
    """One request as the engine runs it, evicting first when pages are short; returns the
    tokens it found cached."""
    cached = tree.peek(tokens).num_cached_tokens
    needed = -(-len(tokens) // PAGE_SIZE) - cached // PAGE_SIZE
    if needed > tree.pool.num_free:
        tree.evict(needed - tree.pool.num_free)
    run_request(tree, tokens)
    tree.check_invariants()
    return cached


SYSTEM = seq(10_000, 8 * PAGE_SIZE)  # a hot system prompt of 8 blocks


def chat(i: int) -> list[int]:
    return SYSTEM + seq(20_000 + 100 * i, 2 * PAGE_SIZE + 1)


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_burst_of_one_off_prompts_keeps_the_hot_prefix_under_slru(policy: str) -> None:
    tree = make_tree(policy)
    serve(tree, chat(0))
    assert serve(tree, chat(1)) == len(SYSTEM)  # the system prompt served a hit
    for i in range(40):  # one-off documents, each longer than what is left free
        serve(tree, seq(100_000 + 1000 * i, 12 * PAGE_SIZE + 1))
    hit = serve(tree, chat(2))
    if policy == "slru":
        assert hit == len(SYSTEM)
    else:
        assert hit == 0  # what slru is for: plain LRU lets the burst flush it


def test_protected_share_is_capped_so_new_prefixes_still_get_in() -> None:
    tree = make_tree("slru", num_pages=40, protected_fraction=0.5)
    for start in range(0, 4):  # four prefixes of 6 blocks, each hit once: all protected
        prompt = seq(1000 * start, 6 * PAGE_SIZE + 1)
        serve(tree, prompt)
        serve(tree, prompt)
    assert tree.protected_pages == tree.cached_pages == 24
    newcomer = seq(50_000, 6 * PAGE_SIZE + 1)
    for _ in range(3):  # never-hit pages fill the rest; the protected ones over the cap go first
        serve(tree, seq(90_000 + 1000 * _, 6 * PAGE_SIZE + 1))
    serve(tree, newcomer)
    assert tree.protected_pages <= 0.5 * tree.pool.num_pages  # whole 6-page nodes went: 24 -> 18
    assert tree.peek(newcomer).num_cached_tokens == 6 * PAGE_SIZE


def test_lru_policy_never_marks_an_order_by_hits() -> None:
    tree = make_tree("lru", num_pages=16)
    old, new = seq(0, 2 * PAGE_SIZE + 1), seq(500, 2 * PAGE_SIZE + 1)
    serve(tree, old)
    serve(tree, old)  # a hit: protected under slru, nothing special under lru
    serve(tree, new)
    assert tree.protected_pages == 2
    tree.evict(2)
    assert tree.peek(old).num_cached_tokens == 0 and tree.peek(new).num_cached_tokens == 2 * PAGE_SIZE


def test_config_offers_the_cache_policies() -> None:
    assert CONFIG_POLICIES == EVICTION_POLICIES
    assert EngineConfig().eviction_policy == "slru"
    with pytest.raises(ConfigError) as info:
        EngineConfig(eviction_policy="fifo")
    assert info.value.param == "eviction_policy"


def test_unknown_policy_is_refused_by_the_tree() -> None:
    with pytest.raises(ValueError):
        make_tree("mru")
