"""The live uvicorn server on 127.0.0.1 over the tiny model that the server tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.live_server import MAX_QUEUE_LEN, LiveServer, make_async_engine, serve


@pytest.fixture(scope="session")
def live_server(tiny_llama: Path) -> Iterator[LiveServer]:
    with serve(make_async_engine(tiny_llama, max_queue_len=MAX_QUEUE_LEN)) as live:
        yield live
