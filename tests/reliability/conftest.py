"""Fixtures for the reliability tests: one tiny model loaded once and shared by many engines
(hypothesis builds a fresh engine per example), the page checks every test ends with, and a
live server on 127.0.0.1 with two API keys."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS / "engine"))
from engine_helpers import hf_greedy  # noqa: F401 - re-exported for the tests here
from server.conftest import CHAT_TEMPLATE, ServerThread, wait_until
from tiny_models import make_tiny_model

from radixkv.attention import make_backend
from radixkv.config import EngineConfig
from radixkv.engine.async_engine import AsyncEngine
from radixkv.engine.engine import Engine
from radixkv.model.loader import LoadedModel, load_model
from radixkv.server.app import create_app

KEY_A = "sk-reliability-a"
KEY_B = "sk-reliability-b"
MODEL = "tiny-llama"
VOCAB = 320


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine the
    threads' spin-waiting made each step ~20x slower; restored for the other packages."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-reliability"), "llama", max_position_embeddings=512)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_dir) -> LoadedModel:
    """Weights loaded once; every Engine built on it owns its own page pool and tree."""
    return load_model(str(tiny_dir), make_backend("torch", "cpu"), dtype="float32", device="cpu")


def make_engine(loaded: LoadedModel, **overrides) -> Engine:
    options = dict(
        model=loaded.path, dtype="float32", device="cpu", page_size=4, num_pages=256, check_invariants=True, seed=0
    )
    options.update(overrides)
    engine = Engine(EngineConfig(**options), loaded=loaded)
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    return engine


def run_to_end(engine: Engine, max_steps: int = 5000) -> dict[str, object]:
    """Step until every request ended; the final output of each request that finished."""
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return finals
        for delta in engine.step():
            if delta.finished:
                finals[delta.request_id] = delta.output
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {engine.stats()}")


def held_pages(engine: Engine, request_id: str) -> Counter[int]:
    """One count per page-table reference the request's sequences hold."""
    return Counter(page for seq in engine._requests[request_id] for page in seq.page_table)


def refcounts(engine: Engine) -> list[int]:
    return [engine.pool.refcount(page) for page in range(engine.pool.num_pages)]


def assert_pages_returned(engine: Engine) -> None:
    """Once every request has ended: each page free or cached in the tree, none locked."""
    engine.check_invariants()
    engine.pool.check_invariants()
    engine.tree.check_invariants(check_hashes=True)
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.has_unfinished()
    assert engine.tree.locked_pages == 0
    assert engine.pool.num_free + engine.tree.cached_pages == engine.pool.num_pages
    assert all(engine.pool.refcount(p) == 1 for p in engine.tree.cached_page_set())


@dataclass
class Live:
    base_url: str
    async_engine: AsyncEngine
    app: object

    def http(self, key: str | None = KEY_A, timeout_s: float = 60.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)

    def engine_call(self, fn, timeout_s: float = 30.0):
        return self.async_engine.call(fn).result(timeout_s)

    def salt_of(self, key: str, cache_salt: str | None = None) -> str | None:
        return self.app.state.radixkv.tenants.cache_salt(key.encode(), cache_salt)

    def assert_idle_and_consistent(self) -> None:
        assert wait_until(lambda: self.async_engine.stats().num_unfinished == 0, 30), self.async_engine.stats()
        self.engine_call(assert_pages_returned)


@pytest.fixture(scope="session")
def live(tiny_dir) -> Iterator[Live]:
    """A server whose context (80 tokens) bounds every valid request, so fuzzed bodies that
    are accepted still finish in a moment; a pool and queue large enough that n=64 fits."""
    engine = Engine(
        EngineConfig(
            model=str(tiny_dir), dtype="float32", device="cpu", page_size=4, num_pages=2048, max_model_len=80,
            max_queue_len=2048, check_invariants=True,
        )
    )
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine, api_keys=[KEY_A, KEY_B], model_name=MODEL)
    try:
        with ServerThread(app) as thread:
            yield Live(thread.base_url, async_engine, app)
    finally:
        async_engine.shutdown()
