"""Sessions inferred from shared prefixes on handcrafted traces: continuation, superseded and
forked turns, shared system prompts left unmarked, both idle rules; the `session` replay keeps
a live session that LRU loses to a flood of one-off prompts; and the multi-turn trace
generator's shape (deterministic, Mooncake's fields, turns that extend their predecessor)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixkv.cache import BlockHasher, Liveness, PagePool, RadixTree
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.request import SequenceState
from radixkv.engine.sampling_params import SamplingParams
from radixkv.scenarios import multi_turn_trace, trace_replay
from radixkv.scenarios.session_inference import IdleRule, SessionInference

PAGE_SIZE = 2
S = [900, 901]  # a shared system prompt of two blocks


class Replayer:
    """Requests through the real KVManager, as trace_replay serves them, with the inference."""

    def __init__(self, rule: IdleRule, num_pages: int = 200) -> None:
        pool = PagePool(num_pages, PAGE_SIZE)
        self.tree = RadixTree(pool, BlockHasher(PAGE_SIZE, seed=0), eviction_policy="session")
        self.kv = KVManager(pool, self.tree, self.tree.hasher, enable_prefix_caching=True)
        self.sessions = SessionInference(self.tree, rule)
        self.number = 0

    def serve(self, hash_ids: list[int], at_s: float) -> None:
        prompt = [t for h in hash_ids for t in trace_replay.block_tokens(h, PAGE_SIZE)] + [0]
        seq = SequenceState(self.number, f"r{self.number}", 0, prompt, SamplingParams(max_tokens=1), None, 0)
        number = self.number
        trace_replay.serve_request(self.kv, None, seq, lambda s, hit: self.sessions.served(
            self.kv.block_hashes(s), s.tree_node, hit, at_s, number,
        ))  # fmt: skip
        self.number += 1
        self.tree.check_invariants()

    def liveness(self, hash_ids: list[int]) -> Liveness:
        tokens = [t for h in hash_ids for t in trace_replay.block_tokens(h, PAGE_SIZE)]
        node = self.tree.deepest_node(tokens)
        assert node is not None and len(node.tokens) // PAGE_SIZE <= len(hash_ids)
        return node.liveness


def test_a_continued_session_is_hot_a_lone_request_unknown_the_shared_prompt_never_marked() -> None:
    r = Replayer(IdleRule(idle_s=100.0))
    r.serve(S + [1], 0.0)  # session A, turn 1: nobody has extended it yet
    r.serve(S + [2], 1.0)  # B: its first turn finds the system prompt cached (shared)
    assert r.liveness(S + [1]) == Liveness.UNKNOWN
    r.serve(S + [1, 10, 11], 2.0)  # A, turn 2
    assert r.liveness(S + [1, 10, 11]) == Liveness.HOT
    assert r.liveness(S + [1]) == Liveness.HOT  # turn 1's node lies on the newest turn's path
    assert r.liveness(S) == Liveness.UNKNOWN  # a branch point (A and B)
    assert r.liveness(S + [2]) == Liveness.UNKNOWN
    assert r.sessions.num_sessions == 2 and r.sessions.num_continued == 1


def test_a_fork_leaves_the_superseded_newest_turn_cold() -> None:
    r = Replayer(IdleRule(idle_s=100.0))
    r.serve(S + [1], 0.0)
    r.serve(S + [2], 0.5)
    r.serve(S + [1, 10], 1.0)
    r.serve(S + [1, 10, 20], 2.0)  # A's newest turn
    r.serve(S + [1, 10, 30], 3.0)  # extends turn 2 again: a regenerated reply
    assert r.liveness(S + [1, 10, 30]) == Liveness.HOT
    assert r.liveness(S + [1, 10, 20]) == Liveness.COLD
    assert r.liveness(S + [1, 10]) == Liveness.UNKNOWN  # now a branch point


@pytest.mark.parametrize("rule", [IdleRule(idle_s=5.0), IdleRule(idle_requests=2)])
def test_an_idle_session_dies_by_time_or_by_requests(rule: IdleRule) -> None:
    r = Replayer(rule)
    r.serve(S + [1], 0.0)  # A
    r.serve(S + [2], 1.0)  # B, never extended
    r.serve(S + [1, 10], 2.0)
    r.serve([50, 51, 52], 3.0)  # a one-off
    r.serve(S + [1, 10, 11], 4.0)
    assert r.liveness(S + [2]) == (Liveness.DEAD if rule.idle_requests else Liveness.UNKNOWN)
    r.serve(S + [1, 10, 11, 12], 6.5)  # A is still live: its gaps are short
    assert r.liveness(S + [2]) == Liveness.DEAD
    assert r.liveness(S + [1, 10, 11, 12]) == Liveness.HOT
    r.serve(S + [1, 10, 11, 12, 13], 7.0)
    r.serve([60, 61], 20.0)
    r.serve([70, 71], 21.0)
    r.serve([80, 81], 22.0)
    assert r.liveness(S + [1, 10, 11, 12, 13]) == Liveness.DEAD  # idle 13 s, and 3 requests
    assert r.liveness([50, 51, 52]) == Liveness.DEAD
    assert r.liveness(S) == Liveness.UNKNOWN  # shared: never dead
    # A request extending a dead session starts a new one: it is a lone request again.
    r.serve(S + [1, 10, 11, 12, 13, 14], 23.0)
    assert r.liveness(S + [1, 10, 11, 12, 13, 14]) == Liveness.UNKNOWN


def test_an_idle_rule_must_end_sessions() -> None:
    with pytest.raises(ValueError, match="idle_s or idle_requests"):
        SessionInference(Replayer(IdleRule(idle_s=1.0)).tree, IdleRule())


def flood_trace(path: Path) -> Path:
    """One long session whose turns come between floods of one-off prompts, each flood larger
    than the cache: LRU loses the session's history every time, `session` keeps it."""
    records, next_id, at_ms = [], 1000, 0
    history = [1, 2]
    for turn in range(6):
        if turn:
            history = history + [100 + 2 * turn, 101 + 2 * turn]
        records.append({"timestamp": at_ms, "input_length": 0, "output_length": 1, "hash_ids": history})
        for _ in range(4):  # the flood: 4 one-offs of 6 blocks
            at_ms += 1000
            records.append({"timestamp": at_ms, "input_length": 0, "output_length": 1, "hash_ids": list(range(next_id, next_id + 6))})
            next_id += 6
        at_ms += 1000
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_session_replay_keeps_the_live_session_that_lru_loses(tmp_path: Path) -> None:
    trace = trace_replay.load_trace(flood_trace(tmp_path / "flood.jsonl"))
    ram = 20  # the session's history (up to 12 blocks) fits; a flood (24 blocks) does not
    rows = {
        policy: trace_replay.replay(trace, policy, 0.0, 0.0, ram, 0, 4, rule)
        for policy, rule in (("lru", None), ("session", IdleRule(idle_s=60.0)), ("session-n", IdleRule(idle_requests=30)))
    }
    session_blocks = sum(len(h) for h in trace.requests[::5])
    hits = {policy: round(row.hit_ratio * trace.num_blocks) for policy, row in rows.items()}
    assert hits["lru"] == 0
    # From turn 3 on the session is hot (turn 2 made it a session; turn 1 was a lone request
    # the flood took): every earlier turn's blocks hit.
    expected = sum(len(h) - 2 for h in trace.requests[10::5])
    assert hits["session"] == hits["session-n"] == expected > 0
    assert expected < session_blocks


def test_a_trace_without_timestamps_replays_session_n_only(tmp_path: Path) -> None:
    path = tmp_path / "untimed.jsonl"
    path.write_text("".join(json.dumps({"hash_ids": [1, 2, i]}) + "\n" for i in range(5)))
    trace = trace_replay.load_trace(path)
    assert trace.arrivals_s is None
    row = trace_replay.replay(trace, "session-n", 0.5, 0.0, 8, 0, 2)
    assert row.hit_ratio > 0
    with pytest.raises(SystemExit, match="no timestamps"):
        trace_replay.replay(trace, "session", 0.5, 0.0, 8, 0, 2)


def test_the_multi_turn_trace_is_deterministic_and_shaped_as_documented(tmp_path: Path) -> None:
    shape = multi_turn_trace.TraceShape(num_sessions=80, session_gap_ms=20_000.0)  # a window of many think times
    records = multi_turn_trace.generate(7, shape)
    assert records == multi_turn_trace.generate(7, shape)
    assert records != multi_turn_trace.generate(8, shape)
    assert [r.timestamp for r in records] == sorted(r.timestamp for r in records)
    path = tmp_path / "trace.jsonl"
    multi_turn_trace.write(records, path)
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) == {"timestamp", "input_length", "output_length", "hash_ids"}
    assert all(0 < r.input_length <= 512 * len(r.hash_ids) for r in records)
    # Every request either extends an earlier one's whole prompt or starts anew; the starts
    # outnumber the sessions by the one-shots; some sessions run long.
    prompts: set[tuple[int, ...]] = set()
    extended, turns_of = 0, {}
    for record in records:
        ids = tuple(record.hash_ids)
        parent = next((ids[:n] for n in range(len(ids) - 1, 0, -1) if ids[:n] in prompts), None)
        extended += parent is not None
        turns_of[ids] = turns_of.get(parent, 0) + 1
        prompts.add(ids)
    assert 0 < extended < len(records)
    assert len(records) - extended > shape.num_sessions  # the one-shots
    assert max(turns_of.values()) >= 5
    systems = {tuple(r.hash_ids[:2]) for r in records}
    assert len(systems) < len(records) / 2  # shared system prompts


def test_named_sessions_are_hot_from_the_first_turn_and_dead_once_released() -> None:
    r = Replayer(IdleRule(idle_s=100.0))
    r.sessions = SessionInference(r.tree, IdleRule(idle_s=100.0), named=True)

    def serve(hash_ids: list[int], at_s: float, name: int | None, released: bool = False) -> None:
        prompt = [t for h in hash_ids for t in trace_replay.block_tokens(h, PAGE_SIZE)] + [0]
        seq = SequenceState(r.number, f"r{r.number}", 0, prompt, SamplingParams(max_tokens=1), None, 0)
        number = r.number
        trace_replay.serve_request(r.kv, None, seq, lambda s, hit: r.sessions.served(
            r.kv.block_hashes(s), s.tree_node, hit, at_s, number, name=name, released=released,
        ))  # fmt: skip
        r.number += 1
        r.tree.check_invariants()

    serve(S + [1], 0.0, name=7)
    assert r.liveness(S + [1]) == Liveness.HOT  # named: a session from its first turn
    serve(S + [2], 1.0, name=None)
    serve(S + [1, 10], 2.0, name=None)  # extends session 7's prompt but names none: a lone request
    assert r.liveness(S + [1, 10]) == Liveness.UNKNOWN and r.sessions.num_continued == 0
    serve(S + [1, 11], 3.0, name=7, released=True)  # its last turn: the client releases it
    assert r.liveness(S + [1, 11]) == Liveness.DEAD
    assert r.liveness(S + [2]) == Liveness.UNKNOWN and r.liveness(S) == Liveness.UNKNOWN
    assert r.sessions.num_released == 1
    serve(S + [1, 11, 12], 4.0, name=7)  # the name again: a new session
    assert r.liveness(S + [1, 11, 12]) == Liveness.HOT and r.sessions.num_sessions == 4


def test_session_ids_replay_reads_the_names_the_generator_writes(tmp_path: Path) -> None:
    shape = multi_turn_trace.TraceShape(num_sessions=40, session_gap_ms=20_000.0)
    records = multi_turn_trace.generate(3, shape)
    by_session: dict[int, list[multi_turn_trace.TraceRecord]] = {}
    for record in records:
        if record.session_id is not None:
            by_session.setdefault(record.session_id, []).append(record)
    for turns in by_session.values():
        assert not any(t.session_end for t in turns[:-1])  # only a last turn ends a session
        assert all(later.hash_ids[: len(t.hash_ids)] == t.hash_ids for t, later in zip(turns, turns[1:]))
    assert any(turns[-1].session_end for turns in by_session.values())
    plain, named = tmp_path / "plain.jsonl", tmp_path / "named.jsonl"
    multi_turn_trace.write(records, plain)
    multi_turn_trace.write(records, named, with_sessions=True)
    assert trace_replay.load_trace(plain).session_names is None
    trace = trace_replay.load_trace(named)
    assert trace.session_names == [r.session_id for r in records]
    assert trace.session_ends == [r.session_end for r in records]
    ram = trace_replay.capacity(trace, 0.05)
    row = trace_replay.replay(trace, "session-ids", 0.05, 0.0, ram, 0, 4)
    assert 0 < row.hit_ratio <= trace_replay.infinite_row(trace).hit_ratio
    with pytest.raises(SystemExit, match="names no sessions"):
        trace_replay.replay(trace_replay.load_trace(plain), "session-ids", 0.05, 0.0, ram, 0, 4)


def test_multi_turn_trace_main_writes_mooncake_records_and_names_on_request(tmp_path: Path) -> None:
    plain, named = tmp_path / "plain.jsonl", tmp_path / "named.jsonl"
    assert multi_turn_trace.main(["--seed", "5", "--out", str(plain)]) == 0
    assert multi_turn_trace.main(["--seed", "5", "--session-ids", "--out", str(named)]) == 0
    plain_records = [json.loads(line) for line in plain.read_text().splitlines()]
    named_records = [json.loads(line) for line in named.read_text().splitlines()]
    assert set(plain_records[0]) == {"timestamp", "input_length", "output_length", "hash_ids"}
    assert [{k: r[k] for k in plain_records[0]} for r in named_records] == plain_records
    assert {"session_id", "session_end"} <= set(named_records[0])
