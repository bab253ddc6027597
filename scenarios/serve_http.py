"""Servers in their own processes, driven over HTTP by one client: `radixkv serve` and any other
OpenAI-compatible server (llama.cpp's llama-server: scenarios/llama_server.py). Owns the server
process (start, health, RSS, stop), the pass-through of radixkv's newer knobs, and the streaming
client that times the first token and each one after it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

API_KEY = "sk-scenario"
START_TIMEOUT_S = 1800.0  # a dequantizing load of a 1B-shaped GGUF takes minutes on 2 cores
# EngineConfig knobs other branches add; passed on only when this checkout's config has them.
NEW_KNOBS = ("weight_dtype", "kv_dtype", "quant_kernel", "moe_kernel")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(slots=True)
class ServerProcess:
    """A server answering on base_url, its process and its log."""

    name: str
    process: subprocess.Popen
    base_url: str
    log_path: Path
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> ServerProcess:
        """Returns once /health answers 200 (llama-server answers 503 while it loads)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer within {timeout_s:.0f} s; log {self.log_path}")

    def memory(self) -> dict[str, int]:
        """The process's resident bytes now and at its peak (Linux /proc)."""
        from radixkv.scenarios.machine import process_memory

        return process_memory(self.process.pid)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM (both servers drain and exit on it), then SIGKILL past 30 s."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch(name: str, command: list[str], base_url: str, log_path: Path, api_key: str | None = None, env: dict | None = None) -> ServerProcess:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env or dict(os.environ))
    return ServerProcess(name, process, base_url, log_path, api_key)


# -- radixkv serve ---------------------------------------------------------------------------


def engine_knobs(options: dict[str, str | None]) -> dict[str, str]:
    """The given new knobs (NEW_KNOBS) this checkout's EngineConfig has; the rest are dropped,
    with a line saying so, so one scenario command runs before and after they are merged."""
    from dataclasses import fields

    from radixkv.config import EngineConfig

    have = {f.name for f in fields(EngineConfig)}
    given = {k: v for k, v in options.items() if v is not None}
    dropped = sorted(set(given) - have)
    if dropped:
        print(f"note: this radixkv's EngineConfig has no {', '.join(dropped)}: ignored", flush=True)
    return {k: v for k, v in given.items() if k in have}


def serve_flags(knobs: dict[str, str]) -> list[str]:
    """`radixkv serve` flags for the knobs its parser takes (--weight-dtype for weight_dtype)."""
    from radixkv import cli

    source = Path(cli.__file__).read_text()
    flags = []
    for name, value in knobs.items():
        flag = "--" + name.replace("_", "-")
        if f'"{flag}"' in source:
            flags += [flag, str(value)]
        else:
            print(f"note: radixkv serve takes no {flag}: {name}={value} not applied to the server", flush=True)
    return flags


def start_radixkv_serve(
    model: str | None, log_path: Path, *, dtype: str = "auto", num_pages: int | None = None, threads: int | None = None,
    knobs: dict[str, str] | None = None, extra: list[str] | None = None,
) -> ServerProcess:  # fmt: skip
    """`radixkv serve` on a free loopback port, ready to answer."""
    port = free_port()
    command = [sys.executable, "-m", "radixkv.cli", "serve", "--port", str(port), "--dtype", dtype, "--api-key", API_KEY, "--no-access-log"]
    if model:
        command += ["--model", model]
    if num_pages:
        command += ["--num-pages", str(num_pages)]
    if threads:
        command += ["--threads", str(threads)]
    command += serve_flags(knobs or {}) + (extra or [])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return launch("radixkv serve", command, f"http://127.0.0.1:{port}", log_path, API_KEY, env).wait_ready()


# -- the client ------------------------------------------------------------------------------


@dataclass(slots=True)
class Reply:
    """One streamed request, timed from the moment it was sent."""

    ttft_s: float | None = None
    wall_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)  # each token event's arrival
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not say
    error: str | None = None

    @property
    def decode_s_per_token(self) -> float | None:
        """Seconds per output token after the first: from the first token's event to the end of
        the stream over the tokens the usage counts. Not from the events' count: a server may
        send no event for a token with no text of its own (a partial UTF-8 byte, a padding
        token of a random model)."""
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.wall_s - self.ttft_s) / (self.completion_tokens - 1)


async def stream(client: httpx.AsyncClient, server: ServerProcess, path: str, body: dict, reply: Reply | None = None) -> Reply:
    """POST body (stream on, usage asked for) and read the events to the end, into `reply` (a
    caller that may cancel the read passes its own, to see what arrived before)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    reply = reply if reply is not None else Reply()
    start = time.perf_counter()
    try:
        async with client.stream("POST", server.base_url + path, json=body, headers=server.headers) as response:
            if response.status_code != 200:
                reply.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return reply
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data.strip() == "[DONE]":
                    break
                _take_event(json.loads(data), reply, time.perf_counter() - start)
    except httpx.HTTPError as error:
        reply.error = f"{type(error).__name__}: {error}"
    reply.wall_s = time.perf_counter() - start
    return reply


def _take_event(event: dict, reply: Reply, now: float) -> None:
    if "error" in event:
        reply.error = f"stream error: {event['error']}"
    usage = event.get("usage")
    if usage:
        reply.prompt_tokens = usage.get("prompt_tokens", 0)
        reply.completion_tokens = usage.get("completion_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        if "cached_tokens" in details:
            reply.cached_tokens = details["cached_tokens"]
    for choice in event.get("choices") or []:
        # A token's event carries its text, empty for a token with none of its own; a chat
        # stream's opening event carries the role and no text (both servers send one), no token.
        delta = choice.get("delta") or {}
        text = choice.get("text") if "text" in choice else delta.get("content")
        if text is not None and (text or "role" not in delta):
            if reply.ttft_s is None:
                reply.ttft_s = now
            reply.token_times_s.append(now)
            reply.text += text


def metric_total(server: ServerProcess, name: str) -> float | None:
    """A Prometheus counter's sum over its labels from the server's /metrics (None: absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=10).text
    except httpx.HTTPError:
        return None
    values = [s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]
    return sum(values) if values else None


def served_model(server: ServerProcess) -> str:
    """The model id the server lists first (/v1/models), to name in requests."""
    reply = httpx.get(f"{server.base_url}/v1/models", headers=server.headers, timeout=30)
    return reply.json()["data"][0]["id"]
