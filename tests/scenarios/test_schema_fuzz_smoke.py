"""scenarios/schema_fuzz.py end to end at a tiny size: it serves, fuzzes every operation and
writes a passing report."""

from __future__ import annotations

import json

import pytest

from radixkv.scenarios import schema_fuzz


@pytest.mark.fuzz
def test_schema_fuzz_scenario_runs_and_reports(tiny_llama, tmp_path, capsys):
    argv = ["--model", str(tiny_llama), "--dtype", "float32", "--num-pages", "256", "--max-model-len", "48",
            "--examples", "3", "--out", str(tmp_path)]
    assert schema_fuzz.main(argv) == 0, capsys.readouterr().out
    report = json.loads((tmp_path / "schema_fuzz.json").read_text())
    assert report["ok"] and report["alive"] and report["page_check"] is None
    assert {row["operation"] for row in report["statuses"]} >= {"POST /v1/completions", "POST /v1/messages"}
    assert "verdict: PASS" in capsys.readouterr().out
