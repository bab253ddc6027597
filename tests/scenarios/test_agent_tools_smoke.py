"""The agent_tools scenario end to end at its smallest: `radixkv serve` subprocesses (cache on and
off) on a tiny random model, the Agents SDK calling them, the table, JSON and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.helpers.tiny_models import CHAT_TEMPLATE, make_tiny_model


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory) -> Path:
    """A tiny Llama whose saved tokenizer carries a chat template (serve loads it from disk)."""
    folder = make_tiny_model(tmp_path_factory.mktemp("agent-model"), "llama", max_position_embeddings=4096)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def test_agent_tools_runs_and_reports(tiny_chat_model, tmp_path, capsys):
    from radixkv.scenarios import agent_tools

    argv = ["--model", str(tiny_chat_model), "--dtype", "float32", "--turns", "1", "--system-repeats", "1"]
    argv += ["--max-output-tokens", "8", "--max-calls-per-turn", "2", "--out", str(tmp_path)]
    assert agent_tools.main(argv) == 0
    report = json.loads((tmp_path / "agent_tools.json").read_text())
    assert set(report["failed_turns"]) == {"cache", "nocache"}
    # A random model's replies rarely end before max_output_tokens, and the SDK refuses a cut
    # reply: a turn may fail, but every call that came back carries the server's usage.
    for call in report["calls"]:
        assert 0 <= call["cached_tokens"] < call["input_tokens"]
        assert call["mode"] != "nocache" or call["cached_tokens"] == 0
    assert (tmp_path / "agent_tools.png").exists()
    assert "agent_tools: per model call" in capsys.readouterr().out
