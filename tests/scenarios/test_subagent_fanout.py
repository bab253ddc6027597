"""subagent_fanout at its smallest on a tiny model: a parent and 8 children over one long prefix
under memory pressure (plain LRU, which protects no hit page): with sessions the parent's prefix
is still hit after the children end, without them it is not; every final child ended its
session, and the table's JSON is written."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.tiny_models import make_tiny_model


def test_subagent_fanout_runs_and_the_parents_prefix_is_still_hit(tmp_path: Path) -> None:
    from scenarios import subagent_fanout  # this checkout's scenario, not the installed package's

    model = make_tiny_model(tmp_path / "model", "llama", max_position_embeddings=1024, seed=3)
    argv = [
        "--model", str(model), "--dtype", "float32", "--prefix-len", "96", "--children", "8", "--child-len", "24",
        "--reply-len", "4", "--concurrency", "4", "--others", "4", "--other-len", "192", "--pool-contexts", "2.5",
        "--policy", "lru",
        "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    assert subagent_fanout.main(argv) == 0
    report = json.loads((tmp_path / "out" / "subagent_fanout.json").read_text())
    with_sessions = report["runs"]["parent and child sessions"]
    page = report["page_size"]
    assert with_sessions["parent_cached_tokens"] >= with_sessions["prefix_tokens"] // page * page - page
    assert with_sessions["sessions_left"] == ["parent"]  # each final child ended its own
    assert with_sessions["children_cached_share"] > 0.5  # the children found the parent's prefix
    without = report["runs"]["without sessions"]
    assert without["sessions_left"] == []
    # The pressure is real: under plain LRU, without sessions the other traffic took the prefix.
    assert without["parent_cached_tokens"] < with_sessions["parent_cached_tokens"]
