"""API keys from a file and the environment (not only the command line, which the process list
shows), and the SDK's HTTP backend not sending OPENAI_API_KEY to arbitrary URLs unasked."""

from __future__ import annotations

from radixkv.sdk import HTTPBackend
from radixkv.server.guards.tenants import ADMIN_KEYS_ENV, API_KEYS_ENV, load_api_keys


def test_keys_come_from_the_command_line_a_file_and_the_environment(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\nsk-file-1\n\n  sk-file-2  \nsk-cli\n")
    keys = load_api_keys(["sk-cli"], key_file, {API_KEYS_ENV: "sk-env-1, sk-env-2\nsk-env-3"})
    assert keys == ["sk-cli", "sk-file-1", "sk-file-2", "sk-env-1", "sk-env-2", "sk-env-3"]
    assert load_api_keys(None, None, {}) == []


def test_admin_keys_come_from_a_file_and_their_own_environment_variable(tmp_path):
    key_file = tmp_path / "admin-keys"
    key_file.write_text("# operators\nsk-admin-file\n")
    environ = {API_KEYS_ENV: "sk-tenant", ADMIN_KEYS_ENV: "sk-admin-env"}
    assert load_api_keys(["sk-admin-cli"], key_file, environ, env_name=ADMIN_KEYS_ENV) == [
        "sk-admin-cli", "sk-admin-file", "sk-admin-env"
    ]


def test_the_http_backend_keeps_openai_api_key_to_itself_unless_asked(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-secret")
    monkeypatch.delenv("RADIXKV_API_KEY", raising=False)
    assert HTTPBackend("http://127.0.0.1:9").client.api_key != "sk-openai-secret"
    assert HTTPBackend("http://127.0.0.1:9", forward_openai_api_key=True).client.api_key == "sk-openai-secret"
    monkeypatch.setenv("RADIXKV_API_KEY", "sk-radixkv")
    assert HTTPBackend("http://127.0.0.1:9").client.api_key == "sk-radixkv"
    assert HTTPBackend("http://127.0.0.1:9", api_key="sk-given").client.api_key == "sk-given"


def test_serve_options_become_server_limits():
    import argparse

    from radixkv.cli import _pin_options, _server_limits

    args = argparse.Namespace(
        max_body_bytes=4096, stream_send_timeout_s=5.0, max_requests_per_key=3, max_seqs_per_key=6, max_pinned_pages_per_key=0,
        pin_ttl_s=0.0, max_parses_per_key=2, parse_cpu_share_per_key=0.5, allowed_origin=["https://app.example"], public_operator_endpoints=True,
        max_stored_responses_per_key=7, max_stored_response_bytes_per_key=1 << 20, max_cache_diagnoses_per_key=11,
        max_connections=7, header_read_timeout_s=2.5, body_read_timeout_s=4.0,
        exact_continuation=False, max_replies_per_key=9, max_reply_tokens_per_key=99, max_spliced_replies=5,
    )
    limits = _server_limits(args, keyless_remote=True)
    assert (limits.max_body_bytes, limits.stream_send_timeout_s, limits.max_requests_per_key, limits.max_seqs_per_key) == (4096, 5.0, 3, 6)
    assert _pin_options(args) == {"max_pinned_pages_per_owner": 0}  # the engine's cap per owner (one per key)
    assert limits.pin_ttl_s == 0.0 and limits.public_operator_endpoints
    assert (limits.max_stored_responses_per_key, limits.max_stored_response_bytes_per_key) == (7, 1 << 20)
    assert limits.max_parses_per_key == 2 and limits.parse_cpu_share_per_key == 0.5
    assert (limits.max_connections, limits.header_read_timeout_s, limits.body_read_timeout_s) == (7, 2.5, 4.0)
    assert limits.allowed_origins == ("https://app.example",) and limits.allowed_hosts == ("*",)
    assert (limits.exact_continuation, limits.max_replies_per_key, limits.max_reply_tokens_per_key) == (False, 9, 99)
    assert limits.max_spliced_replies == 5
    assert limits.max_cache_diagnoses_per_key == 11


def test_invalid_server_limits_name_the_field():
    import pytest

    from radixkv.errors import ConfigError
    from radixkv.server.limits import ServerLimits

    for bad in (
        {"max_body_bytes": 10}, {"stream_send_timeout_s": 0}, {"max_requests_per_key": 0}, {"allowed_origins": ("evil",)},
        {"max_stored_responses_per_key": 0}, {"max_stored_response_bytes_per_key": 10},
        {"max_stored_responses": 0}, {"max_stored_response_bytes": 1.5},
        {"max_connections": 0}, {"header_read_timeout_s": 0}, {"body_read_timeout_s": -1.0},
    ):
        with pytest.raises(ConfigError) as error:
            ServerLimits(**bad)
        assert error.value.param == next(iter(bad))
