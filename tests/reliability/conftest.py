"""Fixtures for the reliability tests: the tiny model loaded once and shared by many engines
(hypothesis builds a fresh engine per example), and a live server on 127.0.0.1 with two API keys."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from radixkv.attention import make_backend
from radixkv.model.loader import LoadedModel, load_model
from tests.helpers.live_server import LiveServer, make_async_engine, serve


@pytest.fixture(scope="session")
def tiny_loaded(tiny_llama: Path) -> LoadedModel:
    """Weights loaded once; every Engine built on it owns its own page pool and tree."""
    return load_model(str(tiny_llama), make_backend("torch", "cpu"), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def live(tiny_llama: Path) -> Iterator[LiveServer]:
    """A server whose context (80 tokens) bounds every valid request, so fuzzed bodies that
    are accepted still finish in a moment; a pool and queue large enough that n=64 fits."""
    async_engine = make_async_engine(tiny_llama, num_pages=2048, max_model_len=80, max_queue_len=2048)
    with serve(async_engine) as live_server:
        yield live_server
