"""GhostIndex against a model (a list in recency order): bounded, least recently evicted out
first, re-inserted blocks gone; partial tails found only by the tokens that begin them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from radixkv.cache.ghost import GhostIndex

ops = st.lists(st.tuples(st.sampled_from(["add", "discard"]), st.lists(st.integers(0, 20), max_size=5)), max_size=60)


@given(capacity=st.integers(1, 8), operations=ops)
def test_the_index_is_a_bounded_lru_of_evicted_hashes(capacity: int, operations) -> None:
    ghost = GhostIndex(capacity)
    model: list[int] = []
    for op, hashes in operations:
        if op == "add":
            ghost.add(hashes)
            for h in hashes:
                if h in model:
                    model.remove(h)
                model.append(h)
            model = model[-capacity:]
        else:
            ghost.discard(hashes)
            model = [h for h in model if h not in hashes]
        assert len(ghost) == len(model) <= capacity
        assert all((h in ghost) == (h in model) for h in range(21))


def test_a_tail_is_found_by_the_block_that_begins_with_it() -> None:
    ghost = GhostIndex(2)
    ghost.add_tail(7, [1, 2])
    assert ghost.continues_tail(7, [1, 2, 3, 4])
    assert not ghost.continues_tail(7, [1, 3, 3, 4])
    assert not ghost.continues_tail(8, [1, 2, 3, 4])
    assert not ghost.continues_tail(7, [1])  # shorter than the tail
    ghost.add_tail(8, [5])
    ghost.add_tail(9, [6])  # capacity 2: the oldest tail goes
    assert not ghost.continues_tail(7, [1, 2, 3, 4]) and ghost.continues_tail(9, [6, 0, 0, 0])
    assert ghost.num_tails == 2
    ghost.add_tail(10, [])  # nothing computed past the block: nothing to remember
    assert ghost.num_tails == 2
