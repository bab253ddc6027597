"""llama-server as the CPU peer: its command line, the variable its path comes from, and the
streaming client's reading of an OpenAI event stream."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixkv.errors import ConfigError
from radixkv.scenarios import llama_server
from radixkv.scenarios.llama_server import LlamaServerOptions
from radixkv.scenarios.serve_http import Reply, _take_event, engine_knobs


def test_missing_binary_names_the_variable(monkeypatch):
    monkeypatch.delenv(llama_server.SERVER_ENV, raising=False)
    with pytest.raises(ConfigError) as raised:
        llama_server.binary()
    assert raised.value.param == "RADIXKV_LLAMA_SERVER" and "RADIXKV_LLAMA_SERVER" in str(raised.value)


def test_command_sizes_slots_context_and_cache(monkeypatch, tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("")
    monkeypatch.setenv(llama_server.SERVER_ENV, str(fake))
    for unified in (False, True):
        options = LlamaServerOptions(slots=16, ctx_per_slot=9000, threads=2, cache_ram_mib=4096, unified_kv=unified)
        args = llama_server.command(Path("m.gguf"), 1234, options)
        value = lambda flag: args[args.index(flag) + 1]  # noqa: E731
        assert value("-np") == "16" and value("-c") == str(16 * 9000) and value("-t") == "2"
        assert value("--cache-ram") == "4096" and value("-m") == "m.gguf" and value("--port") == "1234"
        assert ("-kvu" in args) is unified and ("-no-kvu" in args) is not unified
        assert options.label == ("llama-server -kvu" if unified else "llama-server")


def test_not_a_gguf_is_refused(monkeypatch, tmp_path):
    with pytest.raises(ConfigError) as raised:
        llama_server.start_llama_server(tmp_path / "folder", tmp_path / "log")
    assert raised.value.param == "model"


def test_events_are_read_into_a_reply():
    reply = Reply()
    _take_event({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, reply, 0.1)  # the opening: no token
    _take_event({"choices": [{"delta": {"content": "Hel"}}]}, reply, 0.5)
    _take_event({"choices": [{"delta": {"content": ""}}]}, reply, 0.6)  # a token with no text of its own
    _take_event({"choices": [{"text": "lo"}]}, reply, 0.9)
    _take_event({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 8}}}, reply, 1.0)
    reply.wall_s = 1.3
    assert reply.text == "Hello" and reply.ttft_s == 0.5 and reply.token_times_s == [0.5, 0.6, 0.9]
    assert (reply.prompt_tokens, reply.completion_tokens, reply.cached_tokens) == (10, 5, 8)
    # Over the 5 tokens the usage counts, not the 3 events: one server sends no event for some.
    assert reply.decode_s_per_token == pytest.approx((1.3 - 0.5) / 4)
    other = Reply()
    _take_event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}, other, 1.0)
    assert other.cached_tokens is None  # the server did not say, which is not 0


def test_engine_knobs_pass_only_what_the_config_has(capsys):
    from dataclasses import fields

    from radixkv.config import EngineConfig

    have = {f.name for f in fields(EngineConfig)}
    given = dict(weight_dtype="auto", kv_dtype="bf16", quant_kernel=None, dtype="float32")
    kept = engine_knobs(given)
    assert kept == {k: v for k, v in given.items() if v is not None and k in have}
    if not {"weight_dtype", "kv_dtype"} <= have:
        assert "ignored" in capsys.readouterr().out
