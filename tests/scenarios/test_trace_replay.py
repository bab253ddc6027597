"""trace_replay on a small generated trace: the replay through the real tree agrees with a
direct LRU count, never beats Belady or the infinite cache, the disk tier adds hits, and the
JSON and plot are written."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

# The worktree's own scenarios folder (radixkv.scenarios is mapped to the installed checkout's).
from radixkv.scenarios import trace_replay


def write_trace(path: Path, num_requests: int = 300, seed: int = 0) -> Path:
    """Documents reused a few times at random, each use with a short private tail."""
    rng = random.Random(seed)
    next_id = 0
    docs: list[list[int]] = []
    lines = []
    for t in range(num_requests):
        if docs and rng.random() < 0.6:
            doc = rng.choice(docs)
        else:
            doc = list(range(next_id, next_id + rng.randint(2, 12)))
            next_id += len(doc)
            docs.append(doc)
        tail = list(range(next_id, next_id + rng.randint(0, 2)))
        next_id += len(tail)
        hash_ids = doc + tail
        lines.append(json.dumps({"timestamp": t, "input_length": 512 * len(hash_ids), "output_length": 4, "hash_ids": hash_ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def direct_lru(requests: list[list[int]], capacity: int) -> float:
    """Block-level LRU with the running request's blocks resident, deepest first on ties."""
    ids = trace_replay.prefix_ids(requests)
    cached: dict[int, tuple[int, int]] = {}
    hits = total = 0
    for t, row in enumerate(ids):
        hits += trace_replay._prefix_hits(row, cached)
        total += len(row)
        for block in row:
            cached.pop(block, None)
        while len(cached) + len(row) > capacity:
            del cached[min(cached, key=cached.__getitem__)]
        for depth, block in enumerate(row):
            cached[block] = (t, -depth)
    return hits / total


def test_replay_matches_a_direct_lru_count_and_stays_under_the_bounds(tmp_path: Path) -> None:
    trace = trace_replay.load_trace(write_trace(tmp_path / "trace.jsonl"))
    ram = trace_replay.capacity(trace, 0.1)
    lru = trace_replay.replay(trace, "lru", 0.1, 0.0, ram, 0, page_size=4)
    assert abs(lru.hit_ratio - direct_lru(trace.requests, ram)) < 0.02  # node vs block granularity
    belady = trace_replay.belady_row(trace, 0.1, 0.0, ram, 0)
    infinite = trace_replay.infinite_row(trace)
    slru = trace_replay.replay(trace, "slru", 0.1, 0.0, ram, 0, page_size=4)
    for row in (lru, slru):
        assert row.disk_hit_ratio == 0 and row.hit_ratio <= belady.hit_ratio <= infinite.hit_ratio
    with_disk = trace_replay.replay(trace, "slru", 0.1, 0.5, ram, trace_replay.capacity(trace, 0.5), page_size=4)
    assert with_disk.disk_hit_ratio > 0 and with_disk.written_blocks > 0
    assert slru.hit_ratio < with_disk.hit_ratio <= infinite.hit_ratio


def test_frequency_oracles_stay_under_belady(tmp_path: Path) -> None:
    """The frequency oracles know something of the future (a block's uses over the whole trace,
    or those still to come), yet never beat Belady, the optimal."""
    trace = trace_replay.load_trace(write_trace(tmp_path / "trace.jsonl", seed=3))
    ram = trace_replay.capacity(trace, 0.1)
    belady = trace_replay.belady_row(trace, 0.1, 0.0, ram, 0).hit_ratio
    popularity = trace_replay.oracle_row(trace, 0.1, ram, "popularity")
    remaining = trace_replay.oracle_row(trace, 0.1, ram, "remaining")
    assert (popularity.policy, remaining.policy) == ("lfu+oracle", "future+oracle")
    assert 0 < popularity.hit_ratio <= belady and 0 < remaining.hit_ratio <= belady


def test_main_writes_json_and_plot(tmp_path: Path, capsys) -> None:
    path = write_trace(tmp_path / "trace.jsonl", num_requests=120)
    argv = ["--trace", str(path), "--ram-fraction", "0.1,0.25", "--disk-fraction", "0,0.25", "--page-size", "2", "--out", str(tmp_path / "out")]
    assert trace_replay.main(argv) == 0
    report = json.loads((tmp_path / "out" / "trace_replay.json").read_text())
    kinds = {(row["kind"], row["policy"]) for row in report["rows"]}
    assert {("infinite", "-"), ("belady", "belady"), ("replay", "lru"), ("replay", "slru")} <= kinds
    # belady and each default policy (session-ids and predict-ids only where the trace names sessions, this one
    # does not) at each (RAM, disk) size, + the oracle at each RAM size
    assert len(report["rows"]) == 1 + 2 * 2 * (1 + len(trace_replay.REPLAY_POLICIES) - 2) + 2
    assert (tmp_path / "out" / "trace_replay.png").stat().st_size > 0
    assert "belady" in capsys.readouterr().out


def test_default_trace_is_found_or_named() -> None:
    try:
        path = trace_replay.resolve_trace(None)
    except SystemExit as error:
        assert "--trace" in str(error)
    else:
        assert path.name == trace_replay.TRACE_NAME


def test_a_ram_budget_in_bytes_holds_about_twice_the_int8_blocks(tmp_path: Path, capsys) -> None:
    """--ram-bytes prices each block in its kv dtype's bytes (int8 with its scales): the same
    budget holds 2 * 64 / 66 times the bf16 blocks (fp16 scales), and the JSON carries both side by side."""
    path = write_trace(tmp_path / "trace.jsonl", num_requests=120)
    block_bytes = {"bf16": 2 * 4 * 16 * 2 * 64 * 2, "int8": 2 * 4 * 16 * 2 * (64 + 2)}  # K+V, 4 layers, 16 tokens, 2 heads
    budget = 40 * block_bytes["bf16"]
    argv = ["--trace", str(path), "--ram-fraction", "0.1", "--policy", "lru", "--page-size", "2", "--out", str(tmp_path / "out"),
            "--ram-bytes", str(budget), "--kv-dtype", "bf16,int8", "--kv-shape", "4,2,64", "--block-tokens", "16"]  # fmt: skip
    assert trace_replay.main(argv) == 0
    rows = {row["kv_dtype"]: row for row in json.loads((tmp_path / "out" / "trace_replay.json").read_text())["byte_budget"]}
    assert rows["bf16"]["ram_blocks"] == 40
    assert rows["int8"]["ram_blocks"] == budget // block_bytes["int8"] == 77
    assert rows["int8"]["tokens_per_gib"] / rows["bf16"]["tokens_per_gib"] == pytest.approx(2 * 64 / 66, rel=1e-4)
    assert 0.0 <= rows["bf16"]["hit_ratio"] <= rows["int8"]["hit_ratio"] <= 1.0
    assert "tokens/GiB" in capsys.readouterr().out


def test_window_aware_pages_hold_more_at_the_same_bytes(tmp_path: Path, capsys) -> None:
    """--kv-window: with 3 of 4 layers attending to a one-block window, the same bytes keep about
    three times the full layers' blocks; the replay through the real WindowPages hits at least
    as often as every layer keeping every block, and both stay under the infinite cache."""
    path = write_trace(tmp_path / "trace.jsonl", num_requests=120)
    block_bytes = 2 * 4 * 16 * 2 * 64 * 2  # bf16 K+V, 4 layers, 16 tokens, 2 heads
    argv = ["--trace", str(path), "--ram-fraction", "0.1", "--policy", "lru", "--page-size", "2", "--out", str(tmp_path / "out"),
            "--ram-bytes", str(120 * block_bytes), "--kv-dtype", "bf16", "--kv-shape", "4,2,64", "--block-tokens", "16",
            "--kv-window", "3:16"]  # fmt: skip
    assert trace_replay.main(argv) == 0
    report = json.loads((tmp_path / "out" / "trace_replay.json").read_text())
    rows = report["window_budget"]
    every, aware = rows[0], rows[1:]
    assert every["layout"] == "all-layers" and every["full_blocks"] == 120
    infinite = next(row["hit_ratio"] for row in report["rows"] if row["kind"] == "infinite")
    for row in aware:
        assert row["full_blocks"] > 120 and row["window_blocks"] >= 1 + 1 + 8
        assert row["full_blocks"] * block_bytes // 4 + row["window_blocks"] * 3 * block_bytes // 4 <= 120 * block_bytes
    assert max(row["hit_ratio"] for row in aware) > every["hit_ratio"]
    assert all(row["hit_ratio"] <= infinite for row in rows)
    assert "window-aware" in capsys.readouterr().out
