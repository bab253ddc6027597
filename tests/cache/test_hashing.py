"""Tests for BlockHasher: chaining, full blocks only, seed and salt separation, input types."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.cache.hashing import BlockHasher

tokens_st = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40)


def test_only_full_blocks_are_hashed() -> None:
    hasher = BlockHasher(4, seed=1)
    assert hasher.hash_blocks([]) == []
    assert hasher.hash_blocks([1, 2, 3]) == []
    assert len(hasher.hash_blocks(list(range(11)))) == 2
    assert hasher.hash_blocks(list(range(11))) == hasher.hash_blocks(list(range(8)))


def test_hash_is_a_128_bit_int() -> None:
    (block_hash,) = BlockHasher(2, seed=1).hash_blocks([5, 6])
    assert isinstance(block_hash, int) and 0 <= block_hash < 2**128


@settings(deadline=None, max_examples=50)
@given(tokens=tokens_st, page_size=st.integers(1, 5), salt=st.sampled_from([None, "", "tenant"]))
def test_hash_blocks_chains_hash_block(tokens: list[int], page_size: int, salt: str | None) -> None:
    hasher = BlockHasher(page_size, seed=7)
    parent = None
    expected = []
    for start in range(0, len(tokens) // page_size * page_size, page_size):
        parent = hasher.hash_block(parent, tokens[start : start + page_size], salt)
        expected.append(parent)
    assert hasher.hash_blocks(tokens, salt) == expected


@settings(deadline=None, max_examples=50)
@given(head=tokens_st, tail=tokens_st)
def test_chain_continues_from_parent(head: list[int], tail: list[int]) -> None:
    hasher = BlockHasher(3, seed=7)
    head = head[: len(head) // 3 * 3]
    whole = hasher.hash_blocks(head + tail, "s")
    first = hasher.hash_blocks(head, "s")
    parent = first[-1] if first else None
    # A given parent already carries the salt; a different salt must not matter then.
    rest = hasher.hash_blocks(tail, "ignored" if parent is not None else "s", parent=parent)
    assert whole == first + rest


def test_one_hash_names_the_whole_prefix() -> None:
    hasher = BlockHasher(2, seed=3)
    a = hasher.hash_blocks([1, 2, 3, 4, 5, 6])
    b = hasher.hash_blocks([1, 2, 9, 4, 5, 6])
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2]  # the same third block under another prefix differs


def test_input_types_give_identical_hashes() -> None:
    hasher = BlockHasher(4, seed=11)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    expected = hasher.hash_blocks(tokens)
    assert hasher.hash_blocks(tuple(tokens)) == expected
    assert hasher.hash_blocks(np.array(tokens, dtype=np.int32)) == expected
    assert hasher.hash_blocks(np.array(tokens, dtype=np.int64)) == expected
    assert hasher.hash_blocks(torch.tensor(tokens)) == expected
    assert hasher.hash_block(None, np.array(tokens[:4])) == expected[0]


def test_seed_changes_every_hash() -> None:
    tokens = list(range(8))
    assert BlockHasher(4, seed=1).hash_blocks(tokens) == BlockHasher(4, seed=1).hash_blocks(tokens)
    a, b = BlockHasher(4, seed=1).hash_blocks(tokens), BlockHasher(4, seed=2).hash_blocks(tokens)
    assert a[0] != b[0] and a[1] != b[1]
    # No seed: a random one per hasher (per process in the engine).
    assert BlockHasher(4).hash_blocks(tokens) != BlockHasher(4).hash_blocks(tokens)


def test_salts_separate_tenants() -> None:
    hasher = BlockHasher(2, seed=5)
    tokens = [1, 2, 3, 4]
    by_salt = {salt: hasher.hash_blocks(tokens, salt) for salt in (None, "", "a", "b", "ab")}
    firsts = [hashes[0] for hashes in by_salt.values()]
    assert len(set(firsts)) == len(firsts)  # None != "" and no two salts agree
    # A salt must not be confusable with token bytes that follow it.
    assert hasher.hash_blocks([0, 0], "x") != hasher.hash_blocks([0, 0], "x\x00")


def test_custom_hash_fn_is_used() -> None:
    seen: list[bytes] = []

    def fake(data: bytes) -> int:
        seen.append(data)
        return 0

    hasher = BlockHasher(2, seed=1, hash_fn=fake)
    assert hasher.hash_blocks([1, 2, 3, 4, 5]) == [0, 0]
    assert len(seen) == 2 and seen[0] != seen[1]
    assert seen[0].endswith((1).to_bytes(8, "little") + (2).to_bytes(8, "little"))


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="page_size"):
        BlockHasher(0)
    hasher = BlockHasher(4, seed=1)
    with pytest.raises(ValueError, match="page_size=4"):
        hasher.hash_block(None, [1, 2, 3])
    with pytest.raises(ValueError, match="int64"):
        hasher.hash_blocks([2**63, 0, 0, 0])
