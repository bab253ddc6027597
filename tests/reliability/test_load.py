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


def test_small_load_beside_abusive_clients(tiny_llama, tmp_path, capsys):
    """--abuse at a small size: the flooding key is refused with 429s, every oversized body
    with 413, slow readers are cut off, the well-behaved keys lose nothing and no page leaks.
    (The p99 ratio is reported, not judged here: tests do not assert on wall time.)"""
    argv = [
        "--model", str(tiny_llama), "--dtype", "float32", "--device", "cpu", "--page-size", "4", "--num-pages", "600",
        "--clients", "6", "--requests", "24", "--max-tokens", "8", "--groups", "2", "--system-len", "40",
        "--question-len", "10", "--disconnect-fraction", "0", "--abuse", "--well-keys", "2",
        "--flood-concurrency", "12", "--slow-readers", "2", "--slow-reader-tokens", "200", "--oversized", "3",
        "--max-body-bytes", str(2 << 20), "--stream-send-timeout-s", "1", "--max-p99-ratio", "1000",
        "--store-flood", "40", "--retain-cap", "16", "--echoes", "150",
        "--time-limit-s", "120", "--request-timeout-s", "60", "--out", str(tmp_path),
    ]  # fmt: skip
    assert load_test.main(argv) == 0, capsys.readouterr().out
    report = json.loads((tmp_path / "load_test.json").read_text())
    assert report["ok"] and report["abuse_ok"]
    assert [(row["completed_with_abuse"], row["failed_with_abuse"]) for row in report["keys"]] == [(12, 0), (12, 0)]
    abuse = report["abuse"]
    assert abuse["flood_refused_429"] > 0 and abuse["oversized_refused_413"] + abuse["oversized_cut_off"] == abuse["oversized_sent"] == 3
    # The request-shaped attacks: 30,000 tools, 64 breakpoints, a schema with no way on, each
    # refused; retention under rotating salts held to one cap; the well-behaved key kept its own.
    assert abuse["many_tools_sent"] > 0 and abuse["many_tools_refused"] == abuse["many_tools_sent"]
    assert abuse["breakpoints_sent"] > 0 and abuse["breakpoints_refused"] == abuse["breakpoints_sent"]
    assert abuse["dead_schema_sent"] > 0 and abuse["dead_schema_refused"] == abuse["dead_schema_sent"]
    assert abuse["salt_rotations_sent"] > 0 and abuse["retained_pages_end"] <= abuse["retained_pages_cap"]
    assert abuse["store_flood_sent"] == 40 and abuse["well_retained_kept"] and abuse["well_stored_kept"]
    # The doors: echoed replies around forged markers, grammar pairs, lookups past the context and
    # 5,000-digit logit_bias keys each answered without a 5xx; the victim's schema always served.
    doors = abuse["doors"]
    assert min(doors["echo_splice_sent"], doors["grammar_pairs_sent"], doors["lookups_past_context_sent"], doors["logit_bias_digits_sent"]) > 0
    assert doors["unexpected"] == 0 and doors["victim_schema_served"] == doors["victim_schema_sent"] > 0
    assert report["final_running"] == report["final_waiting"] == report["final_unfinished"] == 0 and report["invariant_ok"]
    assert "| well-behaved key" in capsys.readouterr().out
