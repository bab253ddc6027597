"""A real uvicorn server on 127.0.0.1 over a tiny model, shared by the server tests."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_model  # noqa: E402

from radixkv.config import EngineConfig
from radixkv.engine.async_engine import AsyncEngine
from radixkv.engine.engine import Engine
from radixkv.server.app import create_app
from radixkv.server.thread import ServerThread

KEY_A = "sk-test-tenant-a"
KEY_B = "sk-test-tenant-b"
MODEL = "tiny-llama"
MAX_QUEUE_LEN = 8
# The tiny tokenizer has none; real chat models bring their own.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass
class LiveServer:
    base_url: str
    async_engine: AsyncEngine

    def client(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0, timeout=60)

    def http(self, key: str | None = KEY_A) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=60)

    def engine_call(self, fn, timeout_s: float = 30.0):
        return self.async_engine.call(fn).result(timeout_s)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-server"), "llama", max_position_embeddings=512)


def make_async_engine(model_dir: Path, *, start: bool = True, **overrides) -> AsyncEngine:
    options = dict(
        model=str(model_dir), dtype="float32", device="cpu", page_size=4, num_pages=512, max_queue_len=MAX_QUEUE_LEN,
        check_invariants=True,
    )
    options.update(overrides)
    engine = Engine(EngineConfig(**options))
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    return AsyncEngine(engine, start=start)


@pytest.fixture(scope="session")
def live_server(tiny_model_dir) -> Iterator[LiveServer]:
    async_engine = make_async_engine(tiny_model_dir)
    app = create_app(async_engine, api_keys=[KEY_A, KEY_B], model_name=MODEL)
    try:
        with ServerThread(app) as thread:
            yield LiveServer(thread.base_url, async_engine)
    finally:
        async_engine.shutdown()


def metric_values(live: LiveServer) -> dict[tuple[str, tuple], float]:
    """Every sample on /metrics, keyed by (name, sorted labels)."""
    text = httpx.get(f"{live.base_url}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def wait_until(predicate, timeout_s: float = 20.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def assert_engine_idle_and_consistent(live: LiveServer) -> None:
    """No request left in the engine, and every page free or cached, none locked."""
    assert wait_until(lambda: live.async_engine.stats().num_unfinished == 0), live.async_engine.stats()

    def check(engine):
        engine.check_invariants()
        assert not engine.scheduler.running and not engine.scheduler.waiting
        assert engine.tree.locked_pages == 0
        assert engine.pool.num_free + engine.tree.cached_pages == engine.pool.num_pages
        return engine.num_unfinished

    assert live.engine_call(check) == 0
