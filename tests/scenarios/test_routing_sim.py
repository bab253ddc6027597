"""The routing simulation runs on a small trace of its format, and its numbers mean what they
say: with requests in families sharing long prefixes, the prefix-aware policies keep each
family on one replica and hit more than round robin, which spreads every family over all."""

from __future__ import annotations

import json
import random
from pathlib import Path

from radixkv.scenarios import routing_sim


def write_trace(path: Path, families: int = 6, per_family: int = 12, prefix_blocks: int = 8) -> Path:
    rng = random.Random(0)
    next_id = families * prefix_blocks
    rows = []
    for number in range(families * per_family):
        family = rng.randrange(families)
        own = [next_id + i for i in range(2)]
        next_id += 2
        hash_ids = [family * prefix_blocks + i for i in range(prefix_blocks)] + own
        rows.append({"timestamp": number * 100, "input_length": 512 * len(hash_ids), "output_length": 4, "hash_ids": hash_ids})
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def test_prefix_aware_policies_hit_more_than_round_robin(tmp_path, capsys):
    trace = write_trace(tmp_path / "trace.jsonl")
    argv = ["--trace", str(trace), "--replicas", "2,4", "--total-fraction", "1.0", "--out", str(tmp_path / "out")]
    assert routing_sim.main(argv) == 0
    results = json.loads((tmp_path / "out" / "routing_sim.json").read_text())["results"]
    by = {(r["replicas"], r["policy"]): r for r in results}
    assert len(results) == 2 * len(routing_sim.POLICIES)
    for replicas in (2, 4):
        assert by[(replicas, "prefix_affinity")]["hit_ratio"] > by[(replicas, "round_robin")]["hit_ratio"]
        assert by[(replicas, "cache_aware")]["hit_ratio"] > by[(replicas, "round_robin")]["hit_ratio"]
        assert all(r["load_imbalance"] >= 1.0 for r in results if r["load_imbalance"])
    assert (tmp_path / "out" / "routing_sim.png").exists()
    assert "prefill saved" in capsys.readouterr().out
