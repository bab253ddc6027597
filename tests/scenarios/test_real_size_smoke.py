"""single_stream, agent_sessions and decode_bound end to end at a tiny size, on the tiny
real-shape model (SmolLM2's tokenizer and chat template, random weights); llama-server joins
where RADIXKV_LLAMA_SERVER and llama.cpp's converter are given."""

from __future__ import annotations

import json
import os

import pytest

from radixkv.scenarios import agent_sessions, decode_bound, single_stream
from radixkv.scenarios.agent_sessions import Turn, busy_share, estimate_full, ratios, ttft_p90_lower_bound
from radixkv.scenarios.real_shape import SHAPES, make_hf_folder

LLAMA_TOOLS = ("RADIXKV_LLAMA_SERVER", "RADIXKV_LLAMA_CPP_DIR")
needs_llama = pytest.mark.skipif(any(not os.environ.get(v) for v in LLAMA_TOOLS), reason=f"llama.cpp not given ({', '.join(LLAMA_TOOLS)})")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_hf_folder(SHAPES["tiny"], tmp_path_factory.mktemp("tiny-shape") / "hf", seed=3)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from radixkv.scenarios.real_shape import ensure_gguf

    return ensure_gguf(SHAPES["tiny"], "Q4_K_M", tmp_path_factory.mktemp("tiny-gguf"), direct=True)


def test_single_stream_reports_every_peer(tiny_folder, tmp_path, capsys):
    argv = ["--model", str(tiny_folder), "--prompt-len", "24", "--output-len", "4", "--peers", "radixkv,radixkv-serve", "--limits", "0", "--out", str(tmp_path)]
    # This process's peak raised past what the tiny model's child can reach: the child's own
    # peak is reported, not this one (getrusage's ru_maxrss would carry it across exec).
    ballast = bytearray(1 << 30)
    ballast[:: 1 << 12] = b"\x01" * len(range(0, 1 << 30, 1 << 12))
    assert single_stream.main(argv) == 0
    del ballast
    report = json.loads((tmp_path / "single_stream.json").read_text())
    rows = {row["peer"]: row for row in report["rows"]}
    assert set(rows) == {"radixkv", "radixkv-serve"}
    for row in rows.values():
        assert row["error"] is None and row["output_tokens"] == 4
        assert row["prefill_s"] > 0 and row["decode_s_per_token"] > 0 and row["load_peak_rss_bytes"] > 0
    assert rows["radixkv"]["kv_pages"] == -(-(24 + 4) // 16) + 16  # the small pool asked for
    assert 0 < rows["radixkv"]["load_peak_rss_bytes"] <= rows["radixkv"]["peak_rss_bytes"] < 1 << 30
    assert (tmp_path / "single_stream.png").exists() and "decode s/tok" in capsys.readouterr().out


@needs_llama
def test_single_stream_beside_llama_server(tiny_gguf, tmp_path):
    argv = ["--model", str(tiny_gguf), "--prompt-len", "24", "--output-len", "4", "--peers", "llama-server", "--limits", "0", "--out", str(tmp_path)]
    assert single_stream.main(argv) == 0
    [row] = json.loads((tmp_path / "single_stream.json").read_text())["rows"]
    assert row["peer"] == "llama-server" and row["output_tokens"] == 4 and row["prompt_tokens"] == 24


def test_agent_sessions_runs_turns_over_http(tiny_folder, tmp_path, capsys):
    argv = ["--model", str(tiny_folder), "--servers", "radixkv", "--sessions", "3", "--prompts", "2", "--prompt-tokens", "64",
            "--turns", "2", "--reply-tokens", "3", "--limits", "0", "--out", str(tmp_path)]  # fmt: skip
    assert agent_sessions.main(argv) == 0
    report = json.loads((tmp_path / "agent_sessions.json").read_text())
    [row] = report["rows"]
    assert row["server"] == "radixkv" and row["requests"] == 6 and row["failed"] == 0
    assert [p["turn"] for p in row["per_turn"]] == [0, 1] and all(p["ttft_p90_s"] > 0 for p in row["per_turn"])
    # Three sessions over two prompts: a second turn resends its history, so some is cached.
    assert 0 < row["cached_share"] < 1 and row["peak_rss_bytes"] > 0 and row["full_size_estimate_s"] > 0
    assert (tmp_path / "agent_sessions.png").exists() and "ttft p90" in capsys.readouterr().out


@needs_llama
def test_agent_sessions_against_llama_server(tiny_gguf, tmp_path):
    argv = ["--model", str(tiny_gguf), "--servers", "llama-server,llama-server-kvu", "--sessions", "2", "--prompts", "1",
            "--prompt-tokens", "64", "--turns", "2", "--reply-tokens", "3", "--limits", "0", "--out", str(tmp_path)]  # fmt: skip
    assert agent_sessions.main(argv) == 0
    rows = json.loads((tmp_path / "agent_sessions.json").read_text())["rows"]
    assert [r["server"] for r in rows] == ["llama-server", "llama-server-kvu"]
    assert all(r["failed"] == 0 and r["output_tokens"] == 2 * 2 * 3 and r["cached_share"] is not None for r in rows)


def test_busy_share_and_full_estimate():
    turns = [Turn(0, 0, 0.0, 2.0, 5.0, 100, 0, 4, None), Turn(1, 0, 1.0, 2.0, 5.0, 100, 50, 4, None), Turn(0, 1, 6.0, 1.0, 2.0, 120, 100, 4, None)]
    assert busy_share(turns, 10.0) == pytest.approx(0.4)  # [0, 3] and [6, 7]
    args = agent_sessions.parse_args(["--sessions", "2", "--prompts", "1", "--prompt-tokens", "100", "--turns", "1", "--reply-tokens", "4"])
    # All prefill and nothing cached: the estimate scales with the full size's prompt tokens.
    full = estimate_full(args, wall=10.0, prompt=200, cached=0, output=8, prefill_share=1.0)
    history = 16 * sum(8192 + t * (128 + 24) + 24 for t in range(4))
    assert full == pytest.approx(10.0 * history / 200)


def test_ratios_take_the_better_llama_server():
    base = dict(server="radixkv", requests=4, failed=0, output_tokens_per_s=30.0, ttft_p90_s=1.0, wall_s=10.0)
    slow = dict(server="llama-server", requests=4, failed=0, output_tokens_per_s=5.0, ttft_p90_s=8.0, wall_s=60.0)
    fast = dict(server="llama-server-kvu", requests=4, failed=0, output_tokens_per_s=10.0, ttft_p90_s=4.0, wall_s=30.0)
    result = ratios([base, slow, fast])
    assert result["llama_server"] == "llama-server-kvu"
    assert result["throughput_ratio"] == pytest.approx(3.0) and result["ttft_p90_ratio"] == pytest.approx(0.25)


def test_a_run_past_its_deadline_is_cut_off_and_counted_as_such(tiny_folder, tmp_path):
    from radixkv.scenarios.harness import load_tokenizer

    args = agent_sessions.parse_args(["--model", str(tiny_folder), "--sessions", "2", "--prompts", "1", "--prompt-tokens", "64",
                                      "--turns", "2", "--reply-tokens", "4000", "--limits", "0"])  # fmt: skip
    systems = agent_sessions.system_prompts(load_tokenizer(None), 1, 64)
    row = agent_sessions.run_server("radixkv", args, systems, tmp_path, deadline_s=1.0)
    # 4,000 tokens each cannot stream in a second: both first turns are cut off, none failed.
    assert row["deadline_s"] == 1.0 and row["wall_s"] == 1.0 and not row["complete"]
    assert row["cut_off"] == 2 and row["failed"] == 0 and row["requests"] == 2
    assert row["ttft_p90_lower_bound_s"] is not None and 0 < row["output_tokens"] < 2 * 4000


def test_ttft_lower_bound_and_bounded_ratios():
    args = agent_sessions.parse_args(["--sessions", "2", "--turns", "2"])
    turns = [Turn(0, 0, 0.0, 3.0, 9.0, 100, 0, 4, None), Turn(0, 1, 9.0, None, 1.0, 0, None, 0, None, finished=False),
             Turn(1, 0, 0.0, None, 10.0, 0, None, 0, None, finished=False)]  # fmt: skip
    # 3 s, 1 s and 10 s waited, and one turn never sent (0 s): the p90 of [0, 1, 3, 10].
    assert ttft_p90_lower_bound(turns, args) == pytest.approx(agent_sessions.percentile([0.0, 1.0, 3.0, 10.0], 0.9))
    base = dict(server="radixkv", requests=4, failed=0, complete=True, output_tokens_per_s=30.0, ttft_p90_s=2.0, wall_s=10.0)
    cut = dict(server="llama-server", requests=3, failed=0, complete=False, output_tokens_per_s=4.0, ttft_p90_s=3.0,
               wall_s=30.0, deadline_s=30.0, ttft_p90_lower_bound_s=8.0)  # fmt: skip
    result = ratios([base, cut])
    assert result["bounded"] and result["throughput_ratio_above"] == pytest.approx(3.0)
    assert result["ttft_p90_ratio_below"] == pytest.approx(0.25) and result["wall_ratio_below"] == pytest.approx(1 / 3)


def test_decode_bound_counts_the_bytes_held(tiny_folder, tmp_path, capsys):
    argv = ["--model", str(tiny_folder), "--dtype", "float32", "--num-seqs", "2", "--context", "40", "--steps", "2", "--out", str(tmp_path)]
    assert decode_bound.main(argv) == 0
    r = json.loads((tmp_path / "decode_bound.json").read_text())
    shape = SHAPES["tiny"]
    norms = (2 * shape.num_layers + 1) * shape.hidden_size * 4
    # fp32 weights as held: every linear (packed, so a little padding past the shape's count),
    # the norms, the tied lm_head's packed copy, and not the embedding table a lookup reads a row of.
    by_shape = r["weight_bytes_at_compute_dtype"] + norms
    assert by_shape <= r["weight_bytes"] <= 1.01 * by_shape
    assert r["weight_bytes_by_dtype"] == {"float32": r["weight_bytes"]}
    assert r["kv_bytes_per_token"] == 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4
    assert 2 * 40 <= r["kv_tokens_read_per_step"] <= 2 * (40 + 2 + 4)
    assert r["bound_s"] > 0 and r["step_over_bound"] == pytest.approx(r["step_s"] / r["bound_s"])
    assert (tmp_path / "decode_bound.png").exists() and "step / bound" in capsys.readouterr().out
