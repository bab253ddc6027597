"""The duel that guards the dead-block predictor's marks (cache/duel.py): marks that win against a
shadow LRU reach the cache, marks that lose are taken off, and the shadows stay within their size."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.cache.duel import MarkDuel, ShadowLRU
from radixkv.cache.eviction import Liveness
from tests.cache.test_dead_blocks import Server

HOT = list(range(6))  # a working set asked for every round


def _round(duel: MarkDuel, number: int, level_of) -> None:
    """The hot set, then two one-off documents of 4 blocks: LRU (capacity 10) loses the hot set
    to them, an order that evicts the one-offs first keeps it."""
    for request in (HOT, [10_000 + 10 * number + j for j in range(4)], [20_000 + 10 * number + j for j in range(4)]):
        duel.access(request, level_of)
        duel.settle()


def right(h: int) -> Liveness:
    return Liveness.DEAD if h >= 10_000 else Liveness.UNKNOWN


def wrong(h: int) -> Liveness:
    return Liveness.DEAD if h < 10_000 else Liveness.UNKNOWN


def test_marks_that_win_are_applied_and_marks_that_lose_are_switched_off() -> None:
    duel = MarkDuel(10, window=32)
    assert not duel.enabled  # off until the marks have won
    for number in range(20):
        _round(duel, number, right)
    assert duel.enabled and duel.score > 0 and duel.switches == 1
    # The traffic is the same but the predictor is now wrong: it calls the hot set dead.
    for number in range(20, 60):
        _round(duel, number, wrong)
    assert not duel.enabled and duel.score < 0 and duel.switches == 2


def test_marks_that_are_wrong_from_the_start_never_reach_the_cache() -> None:
    duel = MarkDuel(10, window=32)
    for number in range(40):
        _round(duel, number, wrong)
    assert not duel.enabled and duel.switches == 0


streams = st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=12, unique=True), min_size=1, max_size=60)


@settings(max_examples=80, deadline=None)
@given(streams, st.integers(1, 16), st.lists(st.sampled_from(list(Liveness)), min_size=31, max_size=31))
def test_the_shadows_hold_at_most_their_capacity_and_unmarked_they_are_lru(requests, capacity, levels) -> None:
    marked = MarkDuel(capacity)
    plain = MarkDuel(capacity)
    reference = ShadowLRU(capacity)
    for request in requests:
        marked.access(request, lambda h: levels[h])
        marked.settle()
        plain.access(request, lambda h: Liveness.UNKNOWN)
        plain.settle()
        reference.access(request)
        assert len(marked.lru) <= capacity and len(marked.marked) <= capacity
        # With no marks the marked shadow is LRU exactly: no score, never switched on.
        assert plain.score == 0 and not plain.enabled
        assert all(plain.marked.level(h) is not None for h in request[: min(len(request), capacity)])
    assert len(reference) == len(plain.lru)


def _guarded_server() -> Server:
    server = Server(num_pages=64)
    predictor = type(server.predictor)(lambda node, liveness, below: server.tree.set_liveness(node, liveness, below_blocks=below), guard_blocks=63)
    server.predictor = predictor
    return server


def _marked_nodes(server: Server) -> int:
    return sum(1 for node in server.tree.iter_nodes() if node.liveness is not Liveness.UNKNOWN)


def test_a_guarded_predictor_marks_the_tree_only_while_the_duel_is_on() -> None:
    server = _guarded_server()
    duel = server.predictor.duel
    assert duel is not None and not duel.enabled
    now = 0.0
    for i in range(40):  # two-turn chats: superseded remainders, the predictor learns them dead
        base = 10_000 + 100 * i
        server.serve([base, base + 1, base + 2], now)
        server.serve([base, base + 1, base + 3, base + 4], now + 10.0)
        now += 30.0
    levels = [tail.level for tail in server.predictor._order.values()]
    assert any(level is Liveness.DEAD for level in levels)
    # Evicting the dead remainders first gains nothing here (nothing else is asked for again):
    # a tie, so the duel stays off and none of the predictor's levels reached the tree.
    assert not duel.enabled and duel.score == 0 and _marked_nodes(server) == 0
    # Force a verdict each way: the flip re-marks every followed tail.
    duel.score, duel.enabled = 1e9, False
    server.serve([1, 2], now)
    assert duel.enabled and _marked_nodes(server) > 0
    duel.score = -1e9
    server.serve([1, 2], now + 1.0)
    assert not duel.enabled and _marked_nodes(server) == 0
    server.tree.check_invariants()



flips = st.lists(
    st.tuples(
        st.lists(st.integers(0, 5), min_size=1, max_size=6),
        st.booleans(),  # append a fresh private block
        st.floats(0.0, 30.0),  # think time
        st.sampled_from([None, "a", "b"]),  # the session's name
        st.booleans(),  # the client releases it (a dead mark at once)
        st.sampled_from([None, 1e9, -1e9]),  # force the duel's verdict (None: its own)
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(flips)
def test_the_tree_holds_its_invariants_while_the_duel_flips(trace) -> None:
    server = Server(num_pages=16)
    server.predictor = type(server.predictor)(lambda node, liveness, below: server.tree.set_liveness(node, liveness, below_blocks=below), guard_blocks=15)
    duel = server.predictor.duel
    now, fresh = 0.0, 1000
    for blocks, extend, think, name, released, verdict in trace:
        if extend:
            blocks, fresh = blocks + [fresh], fresh + 1
        now += think
        if verdict is not None:
            duel.score = verdict
        seq = server.start(blocks)
        if seq is None:
            continue
        server.finish(seq, now, name=name, released=released and name is not None)
        server.tree.check_invariants()
        server.pool.check_invariants()
        if not duel.enabled:
            assert _marked_nodes(server) == 0  # off: plain LRU, whatever the predictor thinks
