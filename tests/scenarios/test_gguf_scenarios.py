"""scenarios/load_rss.py and scenarios/perplexity.py at their smallest, on a tiny GGUF: each
prints its table and writes its JSON with a row per load or format."""

from __future__ import annotations

import json
from pathlib import Path

from scenarios import load_rss, perplexity


def test_load_rss_measures_a_cold_and_a_warm_load_in_subprocesses(tiny_ggufs, tmp_path: Path, capsys) -> None:
    model = str(tiny_ggufs("Q4_1"))
    assert load_rss.main(["--model", model, "--weight-dtype", "auto", "--num-pages", "8", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "load_rss.json").read_text())["rows"]
    assert [row["phase"] for row in rows] == ["cold", "warm"]
    for row in rows:
        assert row["weight_format"] == "auto" and row["peak_rss_mb"] >= row["weight_mb"] > 0
        assert row["weight_mb"] <= row["file_tensor_mb"] * 1.4
    assert "| peak RSS MB |" in capsys.readouterr().out


def test_perplexity_of_every_format_against_the_float_model(tiny_ggufs, tmp_path: Path) -> None:
    model = str(tiny_ggufs("Q4_1"))
    assert perplexity.main(["--model", model, "--max-tokens", "48", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "perplexity.json").read_text())["rows"]
    assert [row["format"] for row in rows] == [label for label, _, _ in perplexity.FORMATS]
    assert [row["weight_format"] for row in rows] == ["float", "float", "auto", "int8"]
    assert all(row["tokens"] == 48 and math_finite(row["perplexity"]) for row in rows)
    assert rows[0]["ppl_change_pct"] == 0 and rows[2]["perplexity"] != rows[0]["perplexity"]


def math_finite(value: float) -> bool:
    return value == value and 1 <= value < float("inf")
