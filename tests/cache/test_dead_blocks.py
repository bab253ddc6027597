"""The online dead-block predictor (cache/dead_blocks.py) under the `predict` eviction order:
supersession, learning from reuse and ghost hits, client signals, and the cache's invariants
under its marks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.cache import BlockHasher, PagePool, RadixTree
from radixkv.cache.dead_blocks import SUPERSEDED, DeadBlockPredictor
from radixkv.cache.eviction import Liveness
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.request import SamplingParams, SequenceState

PAGE = 2


class Server:
    """Requests through the real KVManager (peek, admit, commit, release), each told to the
    predictor with its arrival time, as trace_replay's `predict` rows serve them."""

    def __init__(self, num_pages: int = 256) -> None:
        self.pool = PagePool(num_pages, PAGE)
        self.hasher = BlockHasher(PAGE, seed=0)
        self.tree = RadixTree(self.pool, self.hasher, eviction_policy="predict")
        self.kv = KVManager(self.pool, self.tree, self.hasher, enable_prefix_caching=True)
        self.predictor = DeadBlockPredictor(lambda node, liveness, below: self.tree.set_liveness(node, liveness, below_blocks=below))
        self.number = 0
        self.cached: dict[int, int] = {}  # seq_id -> blocks it found cached

    def seq(self, blocks: list[int]) -> SequenceState:
        prompt = [t for b in blocks for t in (2 * b + 1000, 2 * b + 1001)] + [0]
        self.number += 1
        return SequenceState(self.number, f"r{self.number}", 0, prompt, SamplingParams(max_tokens=1), None, 0)

    def start(self, blocks: list[int]) -> SequenceState | None:
        seq = self.seq(blocks)
        peek = self.kv.peek(seq)
        if not self.kv.can_admit(peek, seq.num_tokens - peek.num_cached_tokens):
            return None
        admitted = self.kv.admit(seq, seq.num_tokens - peek.num_cached_tokens)
        self.cached[seq.seq_id] = admitted.num_cached_tokens // PAGE
        return seq

    def finish(self, seq: SequenceState, at_s: float, **signals: object):
        seq.num_computed_tokens = seq.num_tokens
        self.kv.commit(seq)
        tail = self.predictor.served(self.kv.block_hashes(seq), seq.tree_node, self.cached.pop(seq.seq_id), at_s, **signals)
        self.kv.release(seq)
        return tail

    def serve(self, blocks: list[int], at_s: float, **signals: object):
        seq = self.start(blocks)
        assert seq is not None
        return self.finish(seq, at_s, **signals)

    def node_of(self, blocks: list[int]):
        tokens = [t for b in blocks for t in (2 * b + 1000, 2 * b + 1001)]
        return self.tree.deepest_node(tokens, None)


def _conversations(server: Server, first_id: int, count: int, start_s: float, gap_s: float = 10.0) -> float:
    """`count` two-turn chats whose second turn re-sends the first but its last (partial)
    block."""
    now = start_s
    for i in range(count):
        base = first_id + 100 * i
        first = [base, base + 1, base + 2]
        server.serve(first, now)
        server.serve([base, base + 1, base + 3, base + 4], now + gap_s)
        now += 3 * gap_s
    return now


def test_a_superseded_tail_is_predicted_dead_once_such_tails_are_never_asked_for_again() -> None:
    server = Server()
    now = _conversations(server, 10_000, 40, 0.0)
    assert server.predictor.num_superseded == 40
    assert server.predictor.p_reuse(SUPERSEDED) < 0.1
    first = [90_000, 90_001, 90_002]
    server.serve(first, now)
    second = server.serve([90_000, 90_001, 90_003, 90_004], now + 1.0)
    superseded = server.node_of(first)
    assert superseded is not None and superseded.liveness is Liveness.DEAD  # only its last block
    assert len(superseded.pages) == 1 and server.node_of([90_000, 90_001]).liveness is not Liveness.DEAD
    # The new turn is marked as its own class learned (these chats end at their second turn).
    assert server.node_of([90_000, 90_001, 90_003, 90_004]).liveness is server.predictor.level_of(second)
    server.tree.check_invariants()


def test_a_ghost_hit_revives_its_class() -> None:
    server = Server(num_pages=64)  # small: the remainders are evicted before they are asked for
    now = _conversations(server, 10_000, 40, 0.0)
    dead = server.predictor.p_reuse(SUPERSEDED)
    assert dead < 0.1
    # The traffic changes: superseded first turns are asked for again (as a client that
    # regenerates from them would), after RAM evicted them, as they were called dead.
    firsts = [[200_000 + 100 * i, 200_001 + 100 * i, 200_002 + 100 * i] for i in range(60)]
    now = _conversations(server, 200_000, 60, now + 1000.0)
    for i, first in enumerate(firsts):
        server.serve(first + [300_000 + i], now)
        now += 10.0
    assert server.predictor.num_ghost_hits > 0 and server.predictor.stats()[SUPERSEDED].ghost_hits > 0
    assert server.predictor.p_reuse(SUPERSEDED) > 0.5 > dead
    server.serve([500_000, 500_001, 500_002], now)
    server.serve([500_000, 500_001, 500_003], now + 1.0)
    assert server.node_of([500_000, 500_001, 500_002]).liveness is not Liveness.DEAD
    server.tree.check_invariants()


def test_a_released_session_is_dead_at_once_and_a_named_turn_follows_its_name() -> None:
    server = Server()
    server.serve([1, 2, 3], 0.0, name="s")
    tail = server.serve([1, 2, 3, 4, 5], 1.0, name="s")
    assert tail.turn == 1
    assert server.predictor.release_name("s") and not server.predictor.release_name("s")
    assert server.node_of([1, 2, 3, 4, 5]).liveness is Liveness.DEAD
    server.tree.check_invariants()


def test_a_fork_below_a_tails_end_is_a_shared_prefix_not_a_turn() -> None:
    server = Server()
    server.serve([1, 2, 3, 4, 5, 6], 0.0)  # a system prompt [1, 2] and a document
    tail = server.serve([1, 2, 7, 8, 9], 1.0)  # the same system prompt, another document
    assert tail.turn == 0 and server.predictor.num_superseded == 0
    assert server.node_of([1, 2, 3, 4, 5, 6]).liveness is not Liveness.DEAD


requests = st.lists(
    st.tuples(
        st.lists(st.integers(0, 5), min_size=1, max_size=8),  # blocks from a small alphabet: prefixes shared often
        st.booleans(),  # hold it running (locked) over the next request
        st.floats(0.0, 50.0),  # think time
        st.booleans(),  # append a fresh private block (a turn's new message)
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(requests)
def test_the_predictors_marks_never_evict_a_page_in_use_and_the_accounting_holds(trace) -> None:
    server = Server(num_pages=24)
    now, fresh = 0.0, 1000
    held: list[SequenceState] = []
    for blocks, hold, think, extend in trace:
        if extend:
            blocks, fresh = blocks + [fresh], fresh + 1
        now += think
        seq = server.start(blocks)  # may evict, while `held` runs
        for other in held:
            # A page a running sequence holds is never evictable, whatever the marks say.
            assert all(server.pool.refcount(page) > 0 for page in other.page_table)
            assert not set(other.page_table) & server.tree.evictable_page_set()
            server.finish(other, now)
        held = []
        if seq is None:
            continue
        if hold:
            held.append(seq)
        else:
            server.finish(seq, now)
        server.tree.check_invariants()
        server.pool.check_invariants()
        in_use = {page for other in held for page in other.page_table} - server.tree.evictable_page_set()
        assert server.pool.num_free + server.tree.evictable_pages + len(in_use | (server.tree.cached_page_set() - server.tree.evictable_page_set())) == server.pool.num_pages
    for other in held:
        server.finish(other, now)
    server.tree.check_invariants()
