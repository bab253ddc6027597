"""The live uvicorn server on 127.0.0.1 over the tiny model that the server tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.live_server import MAX_QUEUE_LEN, LiveServer, make_async_engine, serve
from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def live_server(tiny_llama: Path) -> Iterator[LiveServer]:
    with serve(make_async_engine(tiny_llama, max_queue_len=MAX_QUEUE_LEN)) as live:
        yield live


@pytest.fixture(scope="session")
def agent_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A live server over a tiny model with room for tool definitions: the tiny byte-level
    tokenizer spends about a token a character, so two tools and a reply overflow 512 positions."""
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-llama-2k"), "llama", max_position_embeddings=2048)
    with serve(make_async_engine(model, max_queue_len=MAX_QUEUE_LEN, num_pages=1024)) as live:
        yield live
