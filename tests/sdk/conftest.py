"""Fixtures for the SDK tests: an in-process LLM and a live `radixkv serve` app over the same
tiny weights, so in-process and HTTP results can be compared token for token."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from radixkv import LLM
from tests.helpers.live_server import LiveServer, make_async_engine, serve
from tests.helpers.sdk import NUM_PAGES, PAGE_SIZE, make_sdk_llm


@pytest.fixture
def llm(tiny_llama: Path) -> LLM:
    return make_sdk_llm(tiny_llama)


@pytest.fixture(scope="session")
def live_server(tiny_llama: Path) -> Iterator[LiveServer]:
    with serve(make_async_engine(tiny_llama, page_size=PAGE_SIZE, num_pages=NUM_PAGES, seed=0)) as live:
        yield live
