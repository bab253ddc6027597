"""A real uvicorn server on 127.0.0.1 over an engine, for the server, reliability and SDK tests:
the API keys and model name they share, clients with a key, calls into the engine thread, and
the check that a server ended idle with its pages all returned."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from radixkv.config import EngineConfig
from radixkv.engine.async_engine import AsyncEngine
from radixkv.engine.engine import Engine
from radixkv.server.app import create_app
from radixkv.server.limits import ServerLimits
from radixkv.server.thread import ServerThread
from tests.helpers.engine import assert_pages_returned, wait_until
from tests.helpers.tiny_models import CHAT_TEMPLATE

KEY_A = "sk-test-tenant-a"
KEY_B = "sk-test-tenant-b"
MODEL = "tiny-llama"
MAX_QUEUE_LEN = 8  # the waiting-queue bound of the server tests' live server

T = TypeVar("T")


@dataclass
class LiveServer:
    base_url: str
    async_engine: AsyncEngine
    app: Any

    def client(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0, timeout=60)

    def http(self, key: str | None = KEY_A, timeout_s: float = 60.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)

    def engine_call(self, fn: Callable[[Engine], T], timeout_s: float = 30.0) -> T:
        """fn(engine) run on the engine's own thread, between steps."""
        return self.async_engine.call(fn).result(timeout_s)

    def salt_of(self, key: str, cache_salt: str | None = None) -> str | None:
        """The cache salt the server gives a request with this key (and client salt)."""
        return self.app.state.radixkv.tenants.cache_salt(key.encode(), cache_salt)

    def assert_idle_and_consistent(self) -> None:
        """No request left in the engine, and every page free or cached, none locked."""
        assert wait_until(lambda: self.async_engine.stats().num_unfinished == 0, 30), self.async_engine.stats()
        self.engine_call(assert_pages_returned)


def make_async_engine(model_dir: Path, *, start: bool = True, **overrides) -> AsyncEngine:
    """An AsyncEngine over a tiny model folder, with the tiny chat template."""
    options = dict(
        model=str(model_dir), dtype="float32", device="cpu", page_size=4, num_pages=512, check_invariants=True
    )
    options.update(overrides)
    engine = Engine(EngineConfig(**options))
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    return AsyncEngine(engine, start=start)


@contextmanager
def serve(
    async_engine: AsyncEngine, keys: tuple[str, ...] = (KEY_A, KEY_B), limits: ServerLimits | None = None
) -> Iterator[LiveServer]:
    """The app over async_engine on a free loopback port; shuts the engine down on exit."""
    app = create_app(async_engine, api_keys=list(keys), model_name=MODEL, limits=limits)
    try:
        with ServerThread(app) as thread:
            yield LiveServer(thread.base_url, async_engine, app)
    finally:
        async_engine.shutdown()


def metric_values(live: LiveServer) -> dict[tuple[str, tuple], float]:
    """Every sample on /metrics (behind the key, as every page but /health), keyed by (name, sorted labels)."""
    text = httpx.get(f"{live.base_url}/metrics", headers={"Authorization": f"Bearer {KEY_A}"}).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
