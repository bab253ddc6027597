"""scenarios/load_test.py at a small size on the tiny model: concurrent streaming clients, shared
and distinct prompts, clients that leave mid-stream, a pool small enough to preempt — nothing
fails, nothing is left running, and the page accounting holds (checked every step, too)."""

from __future__ import annotations

import json

from radixkv.scenarios import load_test


def test_small_load_loses_nothing(tiny_llama, tmp_path, capsys):
    argv = [
        "--model", str(tiny_llama), "--dtype", "float32", "--device", "cpu", "--page-size", "4", "--num-pages", "40",
        "--clients", "16", "--requests", "64", "--max-tokens", "8", "--groups", "3", "--system-len", "40",
        "--question-len", "10", "--disconnect-fraction", "0.25", "--check-invariants",
        "--time-limit-s", "120", "--request-timeout-s", "60", "--out", str(tmp_path),
    ]  # fmt: skip
    assert load_test.main(argv) == 0, capsys.readouterr().out
    report = json.loads((tmp_path / "load_test.json").read_text())
    assert report["ok"] and report["failed"] == 0
    assert report["completed"] + report["aborted"] == report["requests"] == 64
    assert report["aborted"] > 0 and report["server_aborts"] <= report["aborted"]
    assert report["final_running"] == report["final_waiting"] == report["final_unfinished"] == 0
    assert report["invariant_ok"] and report["cached_token_fraction"] > 0
    assert report["latency_p50_s"] <= report["latency_p99_s"] and report["ttft_p50_s"] is not None
    assert "| completed" in capsys.readouterr().out


def test_percentiles_and_verdict():
    assert load_test.percentile([], 50) is None
    assert load_test.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert load_test.percentile(list(map(float, range(1, 101))), 99) == 99.0
    assert load_test.percentile([5.0], 99) == 5.0
