"""Sessions in the engine (engine/sessions.py): a turn retains its prompt and reply for the idle
time, the next turn supersedes it, release and idle expiry end it (and say its tail is dead), the
caps are per owner and refuse before any work, and resuming reads the disk blocks ahead."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixkv.cache.eviction import Liveness
from radixkv.cache.radix import Node
from radixkv.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.sessions import SessionRef
from radixkv.errors import ConfigError, InvalidRequest, OwnerCapExceeded
from tests.helpers.engine import assert_pages_returned, run_to_end

PAGE_SIZE = 4


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class Signals:
    """Records what the session book tells the eviction order."""

    def __init__(self) -> None:
        self.dead: list[Node] = []
        self.cold: list[Node] = []
        self.hot: list[Node] = []

    def mark(self, node: Node, liveness: Liveness, *, below_blocks: int = 0) -> int:
        {Liveness.DEAD: self.dead, Liveness.COLD: self.cold, Liveness.HOT: self.hot}[liveness].append(node)
        return 1


def make(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, **options: object) -> tuple[Engine, Clock, Signals]:
    config = dict(
        model=str(tiny_llama), dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=64, check_invariants=True, seed=0
    )
    config.update(options)
    engine = Engine(EngineConfig(**config))  # type: ignore[arg-type]
    clock, signals = Clock(), Signals()
    monkeypatch.setattr(engine.tree, "_now_s", clock)  # retention expiry and the session book read this clock
    engine.sessions.signals = signals
    return engine, clock, signals


def prompt(seed: int, pages: int) -> list[int]:
    return [1 + (7 * seed + 13 * j) % 300 for j in range(pages * PAGE_SIZE)]


def turn(engine: Engine, tokens: list[int], ref: SessionRef | None, max_tokens: int = 6) -> list[int]:
    """Run one request to its end; prompt + reply token ids."""
    request_id = engine.add_request(tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), session=ref)
    output = run_to_end(engine)[request_id]
    return list(output.prompt_token_ids) + output.outputs[0].token_ids


def test_a_turn_retains_its_prompt_and_reply_and_the_next_supersedes_it(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _, signals = make(tiny_llama, monkeypatch)
    ref = SessionRef("alice", "s1")
    first = turn(engine, prompt(1, 5) + [5], ref)  # 21 + 6 tokens: 6 full pages computed
    [info] = engine.sessions.of_owner("alice")
    assert (info.key, info.num_turns) == ("s1", 1)
    assert info.num_retained_tokens == (len(first) - 1) // PAGE_SIZE * PAGE_SIZE  # the reply's last token is not computed
    [retention] = engine.tree.retentions("alice")
    assert retention.num_pages == info.num_retained_tokens // PAGE_SIZE

    second = turn(engine, first + prompt(2, 2), ref)
    [info] = engine.sessions.of_owner("alice")
    assert info.num_turns == 2
    [newer] = engine.tree.retentions("alice")  # the first turn's retention is gone: superseded
    assert newer.retention_id != retention.retention_id
    assert info.num_retained_tokens == (len(second) - 1) // PAGE_SIZE * PAGE_SIZE
    assert signals.cold == []  # the new turn continues the old one: nothing of it went cold
    assert_pages_returned(engine)


def test_a_turn_that_does_not_continue_the_last_marks_it_cold(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _, signals = make(tiny_llama, monkeypatch)
    ref = SessionRef("alice", "s1")
    turn(engine, prompt(1, 4), ref)
    [old] = engine.tree.retentions("alice")
    old_node = old.node
    turn(engine, prompt(9, 4), ref)  # an edited history: another path
    [new] = engine.tree.retentions("alice")
    assert new.node is not old_node
    assert signals.cold == [old_node] and signals.dead == []


def test_an_idle_session_expires_its_retention_and_says_its_tail_is_dead(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, clock, signals = make(tiny_llama, monkeypatch, session_idle_s=60.0)
    turn(engine, prompt(1, 4), SessionRef("alice", "s1"))
    [retention] = engine.tree.retentions("alice")
    clock.now_s += 59.0
    assert [s.key for s in engine.sessions.of_owner("alice")] == ["s1"]
    clock.now_s += 1.0
    assert engine.sessions.of_owner("alice") == []
    assert engine.tree.retentions("alice") == []
    assert signals.dead == [retention.node]
    assert engine.sessions.num_expired == 1


def test_a_request_may_ask_for_its_own_idle_time_up_to_the_cap(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, clock, _ = make(tiny_llama, monkeypatch, session_idle_s=60.0, max_session_idle_s=120.0)
    turn(engine, prompt(1, 4), SessionRef("alice", "s1", idle_s=100.0))
    clock.now_s += 99.0
    assert [s.idle_s for s in engine.sessions.of_owner("alice")] == [100.0]
    with pytest.raises(InvalidRequest) as info:
        engine.add_request(prompt(2, 4), SamplingParams(max_tokens=1), session=SessionRef("alice", "s2", idle_s=121.0))
    assert (info.value.param, info.value.limit) == ("session_idle_s", 120)
    assert not engine.has_unfinished()  # refused before it was queued


def test_release_ends_only_the_owners_own_session(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _, signals = make(tiny_llama, monkeypatch)
    turn(engine, prompt(1, 4), SessionRef("alice", "s1"))
    turn(engine, prompt(2, 4), SessionRef("bob", "s1"))  # the same key, another owner: another session
    assert [s.key for s in engine.sessions.of_owner("bob")] == ["s1"]
    [bobs] = engine.tree.retentions("bob")
    assert engine.sessions.release("mallory", "s1") is False
    assert engine.sessions.release("alice", "s1") is True
    assert engine.sessions.release("alice", "s1") is False
    assert engine.sessions.of_owner("alice") == [] and engine.tree.retentions("alice") == []
    assert engine.tree.retentions("bob") == [bobs]
    assert len(signals.dead) == 1


def test_a_new_session_past_the_count_ends_the_owners_idlest_one(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _, signals = make(tiny_llama, monkeypatch, max_sessions_per_owner=2)
    turn(engine, prompt(5, 2), SessionRef("bob", "b"))
    for key in ("a", "b"):
        turn(engine, prompt(len(key), 2), SessionRef("alice", key))
    turn(engine, prompt(4, 2), SessionRef("alice", "a"))  # "a" is now the more recently active
    turn(engine, prompt(6, 2), SessionRef("alice", "c"))
    assert [s.key for s in engine.sessions.of_owner("alice")] == ["a", "c"]
    assert [s.key for s in engine.sessions.of_owner("bob")] == ["b"]  # another owner's count is its own
    assert len(signals.dead) == 1


def test_the_session_count_refuses_only_when_every_session_runs(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _, _ = make(tiny_llama, monkeypatch, max_sessions_per_owner=2)
    for key in ("a", "b"):
        engine.add_request(prompt(len(key), 2), SamplingParams(max_tokens=2), session=SessionRef("alice", key))
    with pytest.raises(OwnerCapExceeded) as info:
        engine.add_request(prompt(3, 2), SamplingParams(max_tokens=1), session=SessionRef("alice", "c"))
    assert (info.value.param, info.value.limit, info.value.code) == ("session", 2, "session_limit_exceeded")
    assert engine.num_unfinished == 2  # refused before it was queued
    engine.add_request(prompt(4, 2), SamplingParams(max_tokens=1), session=SessionRef("alice", "a"))  # a live one goes on
    engine.add_request(prompt(5, 2), SamplingParams(max_tokens=1), session=SessionRef("bob", "c"))
    run_to_end(engine)
    engine.add_request(prompt(6, 2), SamplingParams(max_tokens=1), session=SessionRef("alice", "c"))
    run_to_end(engine)
    assert [s.key for s in engine.sessions.of_owner("alice")] == ["a", "c"]


def test_one_owners_sessions_give_up_their_own_pages_never_anothers(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _, signals = make(tiny_llama, monkeypatch, max_session_pages_per_owner=10)
    turn(engine, prompt(50, 6), SessionRef("bob", "b1"), max_tokens=1)
    [bobs] = engine.tree.retentions("bob")
    turn(engine, prompt(1, 6), SessionRef("alice", "a1"), max_tokens=1)
    turn(engine, prompt(2, 6), SessionRef("alice", "a2"), max_tokens=1)  # 6 + 6 > 10: a1 gives its up
    retained = {s.key: s.num_retained_tokens for s in engine.sessions.of_owner("alice")}
    assert retained == {"a1": 0, "a2": 6 * PAGE_SIZE}
    assert engine.tree.retentions("bob") == [bobs]
    assert len(signals.dead) == 1


def test_a_retained_turn_outlives_other_traffic(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _, _ = make(tiny_llama, monkeypatch, num_pages=32)
    agent = prompt(1, 6)
    with_session = turn(engine, agent, SessionRef("alice", "s1"), max_tokens=1)
    without = prompt(2, 6)
    turn(engine, without, None, max_tokens=1)
    for seed in range(10, 20):  # 6 pages each: the pool (32) turns over several times
        turn(engine, prompt(seed, 6), None, max_tokens=1)
    assert engine.lookup(with_session[:24], None).num_ram_tokens == 24
    assert engine.lookup(without, None).num_ram_tokens == 0
    assert_pages_returned(engine)


def test_an_aborted_turn_retains_nothing_and_the_session_idles(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, clock, _ = make(tiny_llama, monkeypatch, session_idle_s=60.0)
    request_id = engine.add_request(prompt(1, 4), SamplingParams(max_tokens=50), session=SessionRef("alice", "s1"))
    engine.step()
    clock.now_s += 3600.0
    assert [s.in_flight for s in engine.sessions.of_owner("alice")] == [1]  # no expiry mid-turn
    engine.abort(request_id)
    assert engine.tree.retentions("alice") == []
    clock.now_s += 60.0
    assert engine.sessions.of_owner("alice") == []
    assert_pages_returned(engine)


def test_a_session_released_mid_turn_stays_released(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _, _ = make(tiny_llama, monkeypatch)
    engine.add_request(prompt(1, 4), SamplingParams(max_tokens=4), session=SessionRef("alice", "s1"))
    engine.step()
    assert engine.sessions.release("alice", "s1")
    run_to_end(engine)
    assert engine.sessions.of_owner("alice") == [] and engine.tree.retentions("alice") == []


def test_resuming_reads_the_disk_blocks_ahead_before_admission(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    engine, _, _ = make(tiny_llama, monkeypatch, kv_disk_dir=str(tmp_path / "kv"))
    ref = SessionRef("alice", "s1")
    history = turn(engine, prompt(1, 8), ref, max_tokens=1)
    other = turn(engine, prompt(2, 8), None, max_tokens=1)
    engine.flush_cache(ram=True, disk=False)  # both written back to disk, RAM empty
    loader = engine.cache_view.loader
    assert loader is not None
    resumed = engine.add_request(history + [7, 8, 9], SamplingParams(max_tokens=1), session=ref)
    unnamed = engine.add_request(other + [7, 8, 9], SamplingParams(max_tokens=1))
    [resumed_seq], [unnamed_seq] = engine.requests[resumed], engine.requests[unnamed]
    assert loader.prefetcher.get(resumed_seq.seq_id) is not None  # reading since it arrived
    assert loader.prefetcher.get(unnamed_seq.seq_id) is None  # read only when the scheduler gets to it
    assert engine.sessions.num_resumed == 1
    finals = run_to_end(engine)
    assert finals[resumed].num_cached_tokens >= 8 * PAGE_SIZE
    engine.close()


@pytest.mark.parametrize(
    ("name", "value"), [("session_idle_s", 0), ("session_idle_s", True), ("max_sessions_per_owner", 0), ("max_session_pages_per_owner", -1)]
)
def test_the_session_knobs_are_validated(tiny_llama: Path, name: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(model=str(tiny_llama), **{name: value})  # type: ignore[arg-type]
    assert info.value.param == name


def test_the_default_idle_time_may_not_pass_the_cap(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(model=str(tiny_llama), session_idle_s=100.0, max_session_idle_s=50.0)
    assert info.value.param == "session_idle_s"


def test_the_eviction_order_hears_hot_dead_and_cold_past_the_shared_prefix(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from radixkv.cache.eviction import Liveness

    config = dict(model=str(tiny_llama), dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=64, seed=0, eviction_policy="session")
    engine = Engine(EngineConfig(**config))  # type: ignore[arg-type]  # the KVManager's own marks
    system = prompt(1, 4)
    turn(engine, system + [9], None, max_tokens=1)  # another request cached the system prompt first
    ref = SessionRef("alice", "s1")
    history = turn(engine, system + prompt(2, 3), ref)
    [retention] = engine.tree.retentions("alice")
    shared = engine.tree.deepest_node(system, None)
    assert shared is not None and retention.node.liveness is Liveness.HOT
    assert shared.liveness is Liveness.UNKNOWN  # the part the session found cached is not its own
    turn(engine, system + prompt(3, 3), ref)  # an edited history: the old turn goes cold
    assert retention.node.liveness is Liveness.COLD
    [newer] = engine.tree.retentions("alice")
    assert engine.sessions.release("alice", "s1")
    assert newer.node.liveness is Liveness.DEAD and shared.liveness is Liveness.UNKNOWN
    assert len(history) > len(system)
    assert_pages_returned(engine)


def _hit_prefix(engine: Engine, prefix: list[int], owner: str) -> None:
    """Two of `owner`'s requests share `prefix`: the second's hit makes it protected under slru."""
    for seed in (60, 61):
        engine.add_request(prefix + prompt(seed, 2), SamplingParams(max_tokens=1), owner=owner)
        run_to_end(engine)


def _evict_all_unretained_but(engine: Engine, num_pages: int) -> None:
    """Pressure: evict every unretained cached page but `num_pages` of them (what should be left)."""
    tree = engine.tree
    assert tree.locked_pages == 0
    tree.evict(tree.evictable_pages - tree.retained_pages - num_pages)


def test_a_session_turn_past_its_owners_page_cap_does_not_outrank_another_keys_hit_prefix(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 43: the caps retained only the turn's first pages; the rest was still marked hot, so
    it outlived another key's hit prefix under pressure. Hot reaches only as far as retained."""
    engine, _, _ = make(tiny_llama, monkeypatch, max_session_pages_per_owner=4)
    engine.sessions.signals = engine.kv  # the eviction order's own marks
    bobs = prompt(40, 6)
    _hit_prefix(engine, bobs, "bob")
    alices = turn(engine, prompt(1, 10), SessionRef("alice", "s1"), max_tokens=1)
    [retention] = engine.tree.retentions("alice")
    assert retention.num_pages == 4  # 10 pages computed, the first 4 retained
    _evict_all_unretained_but(engine, 6)
    assert engine.lookup(bobs, None).num_ram_tokens == 6 * PAGE_SIZE  # bob's hit prefix stayed whole
    assert engine.lookup(alices, None).num_ram_tokens == 4 * PAGE_SIZE  # alice's past her cap went
    assert_pages_returned(engine)


def test_a_session_turn_its_owners_retention_cap_released_is_ordinary(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner's own later retention pushed the session's turn out of its retention cap: the
    turn is no longer retained, so it is no longer hot either."""
    engine, _, _ = make(tiny_llama, monkeypatch, max_retained_pages_per_owner=8)
    engine.sessions.signals = engine.kv
    bobs = prompt(40, 6)
    _hit_prefix(engine, bobs, "bob")
    alices = turn(engine, prompt(1, 6), SessionRef("alice", "s1"), max_tokens=1)
    document = prompt(2, 6)
    turn(engine, document, None, max_tokens=1)
    assert engine.retain(document, None, 300.0, owner="alice") == 6 * PAGE_SIZE  # 6 + 6 > 8: the session's goes
    assert [r.num_pages for r in engine.tree.retentions("alice")] == [6]
    assert [s.num_retained_tokens for s in engine.sessions.of_owner("alice")] == [0]
    _evict_all_unretained_but(engine, 6)
    assert engine.lookup(bobs, None).num_ram_tokens == 6 * PAGE_SIZE
    assert engine.lookup(alices, None).num_ram_tokens == 0
    assert_pages_returned(engine)


def test_a_turn_is_a_keep_into_the_reply_the_request_carries_applied_when_it_finishes(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Move (a): the session's turn rides on the request as one Keep (whole prompt, then the
    reply, the idle time its ttl); nothing of it is retained at prefill, all of it at the finish,
    and a prompt keep beside it reports alone."""
    from radixkv.engine.request import Keep

    engine, _, _ = make(tiny_llama, monkeypatch, session_idle_s=60.0)
    tokens = prompt(1, 4) + [5]
    request_id = engine.add_request(
        tokens, SamplingParams(max_tokens=6, ignore_eos=True), session=SessionRef("alice", "s1"), owner="alice", keeps=(Keep(8, 30.0),)
    )
    [seq] = engine.requests[request_id]
    assert seq.keeps == (Keep(8, 30.0), Keep(len(tokens), 60.0, reply=True))
    while seq.num_computed_tokens < len(tokens):
        engine.step()
    assert [r.num_pages for r in engine.tree.retentions("alice")] == [2]  # the prompt keep alone
    output = run_to_end(engine)[request_id]
    assert output.kept is not None and output.kept.num_kept_tokens == (8,)
    [info] = engine.sessions.of_owner("alice")
    assert info.num_retained_tokens == (len(tokens) + 6 - 1) // PAGE_SIZE * PAGE_SIZE
    # The turn's retention covers the prompt keep's path, which the tree folds into it.
    assert [r.num_pages for r in engine.tree.retentions("alice")] == [info.num_retained_tokens // PAGE_SIZE]
    assert_pages_returned(engine)


def test_only_a_session_makes_a_keep_into_the_reply(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from radixkv.engine.request import Keep

    engine, _, _ = make(tiny_llama, monkeypatch)
    for keep in (Keep(4, 60.0, reply=True), Keep(4, 60.0, lock=True, reply=True)):
        with pytest.raises(InvalidRequest) as info:
            engine.add_request(prompt(1, 2), SamplingParams(max_tokens=1), keeps=(keep,))
        assert info.value.param == "keeps"
    assert not engine.has_unfinished()


# -- parent and child sessions (subagents) ------------------------------------------------------


def _fan_out(engine: Engine, prefix: list[int], owner: str = "alice") -> list[list[int]]:
    """A parent turn over `prefix`, then 8 children branching from it (each a turn, then a
    final turn continuing it); the children's final histories."""
    turn(engine, prefix, SessionRef(owner, "parent"), max_tokens=4)
    histories = []
    for child in range(8):
        first = turn(engine, prefix + prompt(20 + child, 2), SessionRef(owner, f"child-{child}", parent="parent"), max_tokens=4)
        final = SessionRef(owner, f"child-{child}", parent="parent", final=True)
        histories.append(turn(engine, first + prompt(40 + child, 1), final, max_tokens=4))
    return histories


def test_final_children_release_their_tails_and_the_parents_prefix_is_still_hit(tiny_llama: Path) -> None:
    config = dict(model=str(tiny_llama), dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=40, check_invariants=True, seed=0)
    engine = Engine(EngineConfig(**config))  # type: ignore[arg-type]  # the KVManager's own marks
    prefix = prompt(1, 8)  # the long shared prefix: 8 of the pool's 40 pages
    histories = _fan_out(engine, prefix)
    assert [s.key for s in engine.sessions.of_owner("alice")] == ["parent"]  # every final child ended
    tree = engine.tree
    for history in histories:
        tail = tree.deepest_node(history, None)
        if tail is not None and len(tail.tokens) and tail is not tree.deepest_node(prefix, None):
            assert tail.liveness is Liveness.DEAD  # the child's private tail, past the parent's prefix
    shared = tree.deepest_node(prefix, None)
    assert shared is not None and shared.liveness is not Liveness.DEAD
    # Pressure: other traffic needs nearly the whole pool; the children's tails go first.
    for seed in range(6):
        engine.add_request(prompt(80 + seed, 6), SamplingParams(max_tokens=2, ignore_eos=True), owner="bob")
        run_to_end(engine)
    for history in histories:
        kept = tree.deepest_node(history, None)
        assert kept is None or sum(len(n.pages) for n in _path(kept)) <= len(prefix) // PAGE_SIZE
    request_id = engine.add_request(prefix + prompt(99, 1), SamplingParams(max_tokens=1), session=SessionRef("alice", "parent"))
    assert run_to_end(engine)[request_id].num_cached_tokens >= len(prefix)  # the parent's prefix is still hit
    assert_pages_returned(engine)


def _path(node: Node) -> list[Node]:
    path = []
    current: Node | None = node
    while current is not None:
        path.append(current)
        current = current.parent
    return path


def test_another_owners_parent_key_is_not_found_and_does_nothing_to_the_real_parent(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _, signals = make(tiny_llama, monkeypatch)
    prefix = prompt(1, 6)
    turn(engine, prefix, SessionRef("alice", "parent"))
    [retention] = engine.tree.retentions("alice")
    turn(engine, prefix + prompt(2, 2), SessionRef("bob", "child", parent="parent"))
    assert engine.sessions.get("bob", "child").parent_id is None  # alice's parent is not bob's
    turn(engine, prefix + prompt(2, 2) + [5], SessionRef("bob", "child", parent="parent", final=True))
    assert engine.sessions.get("bob", "child") is None  # bob's own session ended
    assert engine.sessions.get("alice", "parent").parent_id is None
    assert engine.tree.retentions("alice") == [retention] and retention.node not in signals.dead
    request_id = engine.add_request(prefix + [7], SamplingParams(max_tokens=1), session=SessionRef("alice", "parent"))
    assert run_to_end(engine)[request_id].num_cached_tokens == len(prefix)


def test_a_child_marks_dead_only_past_what_it_shares_with_its_parent(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _, signals = make(tiny_llama, monkeypatch, eviction_policy="session")
    engine.sessions.signals = engine.kv  # the KVManager's own marks
    prefix = prompt(1, 6)
    turn(engine, prefix, SessionRef("alice", "parent"))
    history = turn(engine, prefix + prompt(2, 2), SessionRef("alice", "child", parent="parent"))
    assert engine.sessions.get("alice", "child").parent_id == engine.sessions.get("alice", "parent").session_id
    turn(engine, history + [5], SessionRef("alice", "child", final=True))
    assert engine.sessions.get("alice", "child") is None
    assert engine.tree.deepest_node(prefix, None).liveness is not Liveness.DEAD
    child_tail = engine.tree.deepest_node(history, None)
    assert child_tail is not None and child_tail.liveness is Liveness.DEAD


def test_a_parent_key_past_the_cap_is_refused_before_any_work(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _, _ = make(tiny_llama, monkeypatch)
    with pytest.raises(InvalidRequest) as refused:
        engine.add_request(prompt(1, 2), SamplingParams(max_tokens=1), session=SessionRef("alice", "c", parent="p" * 1025))
    assert refused.value.param == "session_parent" and engine.sessions.get("alice", "c") is None


def test_the_turn_kept_when_the_reply_ends_is_on_the_output(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, clock, _ = make(tiny_llama, monkeypatch)
    request_id = engine.add_request(prompt(1, 5) + [5], SamplingParams(max_tokens=6, ignore_eos=True), session=SessionRef("alice", "s1", idle_s=100.0))
    output = run_to_end(engine)[request_id]
    [info] = engine.sessions.of_owner("alice")
    assert output.kept is not None and output.kept.num_turn_tokens == info.num_retained_tokens > len(output.prompt_token_ids)
    assert output.kept.most_kept_tokens == info.num_retained_tokens and output.kept.num_kept_tokens == ()
    assert output.kept.expires_at_s == clock.now_s + 100.0
    plain = engine.add_request(prompt(2, 3), SamplingParams(max_tokens=2))
    assert run_to_end(engine)[plain].kept is None  # no session, no keeps: nothing kept
    assert_pages_returned(engine)


def test_a_resume_hint_reads_the_turn_ahead_and_its_request_takes_the_read(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    engine, _, _ = make(tiny_llama, monkeypatch, kv_disk_dir=str(tmp_path / "kv"))
    ref = SessionRef("alice", "s1")
    history = turn(engine, prompt(1, 8), ref, max_tokens=1)
    engine.flush_cache(ram=True, disk=False)  # written back to disk, RAM empty
    loader = engine.cache_view.loader
    assert loader is not None
    reads: list[tuple[int, int]] = []  # (first block, blocks) of every read of the tier's files
    real_read = loader.tier.read

    def counted(tokens, salt, keys, start, num, **kwargs):
        reads.append((start, num))
        return real_read(tokens, salt, keys, start, num, **kwargs)

    monkeypatch.setattr(loader.tier, "read", counted)
    # Another owner's session of the same key, and an unknown key: nothing is read.
    assert engine.read_ahead_session(SessionRef("bob", "s1")) == 0
    assert engine.read_ahead_session(SessionRef("alice", "s2")) == 0
    assert engine.read_ahead_session(SessionRef("alice", "s1", namespace="other")) == 0
    assert loader.prefetcher.room_blocks() > 0 and reads == []
    num = engine.read_ahead_session(ref)
    assert num == 8  # the turn's full blocks before its last token... and all are on disk
    [hint] = [p for seq_id, p in loader.prefetcher._pending.items() if seq_id < 0]
    assert hint.done.wait(10) and hint.num_read() == num and reads == [(0, num)]
    resumed = engine.add_request(history + [7, 8, 9], SamplingParams(max_tokens=1), session=ref)
    [seq] = engine.requests[resumed]
    assert loader.prefetcher.get(seq.seq_id) is hint  # taken over, not read again
    finals = run_to_end(engine)
    assert finals[resumed].num_cached_tokens >= num * PAGE_SIZE
    assert reads == [(0, num)]  # one read of those blocks in all
    assert engine.cache_view.disk_stats().prefetched_blocks >= num
    engine.close()


def test_a_childs_turn_does_not_take_its_parents_retention(tiny_llama: Path) -> None:
    """A child's retained turn covers the parent's prefix, which the tree would let supersede
    the parent's retention (one owner's): the parent's turn stays retained beside each child's
    and after every final child ended, under plain LRU too, where hits protect nothing."""
    config = dict(
        model=str(tiny_llama), dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=40, check_invariants=True, seed=0,
        eviction_policy="lru",
    )  # fmt: skip
    engine = Engine(EngineConfig(**config))  # type: ignore[arg-type]
    prefix = prompt(1, 8)
    _fan_out(engine, prefix)
    [parent] = engine.sessions.of_owner("alice")
    assert parent.key == "parent" and parent.num_retained_tokens >= len(prefix)
    [retention] = engine.tree.retentions("alice")
    assert retention.num_pages * PAGE_SIZE >= len(prefix)
    for seed in range(6):  # other traffic needs nearly the whole pool
        engine.add_request(prompt(80 + seed, 6), SamplingParams(max_tokens=2, ignore_eos=True), owner="bob")
        run_to_end(engine)
    request_id = engine.add_request(prefix + prompt(99, 1), SamplingParams(max_tokens=1), session=SessionRef("alice", "parent"))
    assert run_to_end(engine)[request_id].num_cached_tokens >= len(prefix)
    assert_pages_returned(engine)
