"""Graceful drain (radixkv.server.guards.drain): while draining, new work gets 503 and /health says so;
in-flight requests finish, or are aborted at the deadline; every page comes back; and a real
`radixkv serve` drains on SIGTERM with a stream in flight and exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from radixkv.server.guards.drain import DrainReport, drain_engine
from tests.helpers.engine import wait_until
from tests.helpers.live_server import KEY_A, MODEL, LiveServer, make_async_engine, metric_values, serve
from tests.server.test_serve import REPO, free_port

# A prompt the tiny model (seed 0) does not end early at temperature 0: its streams run to
# max_tokens, long enough (hundreds of steps) to be in flight when the drain starts.
PROMPT = "You are a helpful assistant. Question 1"
LONG = 400


@pytest.fixture
def server(tiny_llama: Path) -> Iterator[LiveServer]:
    """A server of its own: a drain does not end."""
    # The drain checks the page accounting itself; no per-step checks (they slow the streams).
    with serve(make_async_engine(tiny_llama, num_pages=128, check_invariants=False)) as live:
        yield live


class StreamReader:
    """A streamed completion read to its end on a thread; `started` once its first event came."""

    def __init__(self, base_url: str, max_tokens: int, key: str | None = KEY_A, model: str = MODEL) -> None:
        self.events: list[dict] = []
        self.done_marker = False
        self.started = threading.Event()
        body = {
            "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._thread = threading.Thread(target=self._read, args=(f"{base_url}/v1/completions", body, headers), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict, headers: dict) -> None:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    self.done_marker = True
                elif line.startswith("data: "):
                    self.events.append(json.loads(line[6:]))
                    self.started.set()

    def join(self) -> None:
        self._thread.join(60)
        assert not self._thread.is_alive()

    @property
    def text_tokens(self) -> int:
        return sum(1 for e in self.events if e.get("choices") and e["choices"][0].get("text"))

    @property
    def completion_tokens(self) -> int | None:
        """The tokens generated, from the usage chunk at the end (None if none came)."""
        usage = [e["usage"] for e in self.events if e.get("usage")]
        return usage[-1]["completion_tokens"] if usage else None

    @property
    def finish_reason(self) -> str | None:
        reasons = [c.get("finish_reason") for e in self.events for c in e.get("choices", [])]
        return next((r for r in reasons if r), None)


def drain(live: LiveServer, timeout_s: float) -> DrainReport:
    """drain_engine on this thread's own loop: it only reads the server's counters and talks
    to the engine thread through futures, so it need not run on the server's loop."""
    return asyncio.run(drain_engine(live.app.state.radixkv.drain, live.async_engine, timeout_s))


def test_a_draining_server_refuses_new_work_and_says_so(server):
    server.app.state.radixkv.drain.draining = True
    health = httpx.get(f"{server.base_url}/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "draining"
    refused = server.http().post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert refused.headers["retry-after"] == "1"
    anthropic = server.http().post("/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": []})
    assert anthropic.status_code == 529 and anthropic.json()["type"] == "error"  # in Anthropic's shape
    assert server.http().get("/v1/models").status_code == 503
    assert httpx.get(f"{server.base_url}/health_generate").status_code == 503
    # Routers and scrapers still see the worker go.
    assert server.http().get("/get_load").json()[0]["draining"] is True
    assert metric_values(server)[("radixkv_draining", ())] == 1
    server.assert_idle_and_consistent()


def test_drain_lets_a_stream_in_flight_finish(server):
    stream = StreamReader(server.base_url, max_tokens=64)
    assert stream.started.wait(30)
    report = drain(server, timeout_s=60)
    stream.join()
    assert report.aborted == 0 and report.clean, report.describe()
    # Every token of the stream reached the client (events may carry several tokens each).
    assert stream.finish_reason == "length" and stream.completion_tokens == 64 and stream.done_marker
    assert report.in_use_pages == 0 and report.free_pages + report.cached_pages == report.num_pages
    server.assert_idle_and_consistent()


def test_drain_aborts_what_outlives_the_deadline(server):
    stream = StreamReader(server.base_url, max_tokens=LONG)
    assert stream.started.wait(30)
    report = drain(server, timeout_s=0.05)
    stream.join()
    assert report.aborted == 1 and report.clean, report.describe()
    # The stream ends with an error event that names the abort, not a silent cut.
    assert stream.events[-1]["error"]["code"] == "aborted" and not stream.done_marker
    assert report.in_use_pages == 0 and report.unfinished == 0
    server.assert_idle_and_consistent()


def test_sigterm_drains_radixkv_serve_with_a_stream_in_flight(tiny_llama):
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "radixkv.cli", "serve", "--model", str(tiny_llama), "--port", str(port)]
    command += ["--num-pages", "128", "--dtype", "float32", "--drain-timeout-s", "60", "--no-access-log"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_until(lambda: _healthy(base_url) or process.poll() is not None, 90), "server did not come up"
        assert process.poll() is None, process.stdout.read()
        stream = StreamReader(base_url, max_tokens=200, key=None, model=tiny_llama.name)
        assert stream.started.wait(30)
        process.send_signal(signal.SIGTERM)
        # While the stream runs on, the worker says it is draining and refuses new work.
        assert wait_until(lambda: _health_code(base_url) == "draining", 10)
        refused = httpx.post(f"{base_url}/v1/completions", json={"model": tiny_llama.name, "prompt": "hi", "max_tokens": 1})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        stream.join()
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, output
    assert stream.finish_reason == "length" and stream.done_marker
    assert "0 request(s) aborted at the deadline" in output and " + 0 in use == 128 total, 0 request(s) left" in output, output
    # --no-access-log: the health checks above left no line each in the log.
    assert "GET /health" not in output, output


def _healthy(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _health_code(base_url: str) -> str | None:
    try:
        response = httpx.get(f"{base_url}/health", timeout=1)
    except httpx.TransportError:
        return None
    return response.json().get("error", {}).get("code") if response.status_code != 200 else "ok"
