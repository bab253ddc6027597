"""The cache_report_cost scenario at its smallest, on the tiny Llama: it runs and prints each
figure, the engine's requests counted by reason."""

from __future__ import annotations

from pathlib import Path


def test_cache_report_cost_runs_and_reports(tiny_llama: Path, capsys) -> None:
    from scenarios import cache_report_cost

    argv = ["--model", str(tiny_llama), "--dtype", "float32", "--prompt-tokens", "40", "--requests", "6", "--messages", "4", "--num-pages", "4"]
    assert cache_report_cost.main(argv) == 0
    out = capsys.readouterr().out
    assert "explain" in out and "locate" in out and "bytes per remembered block" in out
    assert "'evicted'" in out and "'hit'" in out
