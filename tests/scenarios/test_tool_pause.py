"""tool_pause at its smallest on a tiny model: after each pause the session's turn finds its
whole history cached while the turn without a session finds it evicted, and the JSON is written."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.tiny_models import make_tiny_model


def test_tool_pause_runs_and_the_session_keeps_the_history(tmp_path: Path) -> None:
    from scenarios import tool_pause  # this checkout's scenario, not the installed package's

    model = make_tiny_model(tmp_path / "model", "llama", max_position_embeddings=1024, seed=3)
    argv = [
        "--model", str(model), "--dtype", "float32", "--system-len", "96", "--turns", "3", "--turn-len", "8",
        "--reply-len", "8", "--others", "4", "--other-len", "96", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    assert tool_pause.main(argv) == 0
    report = json.loads((tmp_path / "out" / "tool_pause.json").read_text())
    without, with_session = report["runs"]["without a session"], report["runs"]["with a session"]
    for a, b in zip(without[1:], with_session[1:]):
        assert a["cached_share"] < 0.2  # the pause's traffic turned the pool over
        history = b["prompt_tokens"] - 8  # all but this turn's new tokens
        assert b["cached_tokens"] >= history - report["page_size"] - 8  # the retained turn, but its last block
