"""Tiny models for the SDK tests: an in-process LLM factory and a live `radixkv serve` app
over the same weights, so in-process and HTTP results can be compared token for token."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_model  # noqa: E402

from radixkv.config import EngineConfig
from radixkv.engine.async_engine import AsyncEngine
from radixkv.engine.engine import Engine
from radixkv.llm import LLM
from radixkv.server.app import create_app

PAGE_SIZE = 4
MODEL = "tiny-llama"
KEY_A = "sk-sdk-a"
KEY_B = "sk-sdk-b"
# The tiny tokenizer has none; real chat models bring their own.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ENGINE_OPTIONS = dict(dtype="float32", device="cpu", page_size=PAGE_SIZE, seed=0, check_invariants=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-sdk"), "llama", max_position_embeddings=512)


def make_llm(model_dir: Path, *, chat: bool = True, **overrides) -> LLM:
    options = {**ENGINE_OPTIONS, "num_pages": 512, **overrides}
    llm = LLM(str(model_dir), **options)
    if chat:
        llm.tokenizer.chat_template = CHAT_TEMPLATE
    return llm


@pytest.fixture
def llm(tiny_model_dir) -> LLM:
    return make_llm(tiny_model_dir)


@dataclass
class LiveServer:
    base_url: str
    async_engine: AsyncEngine

    def client(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0, timeout=60)

    def engine_call(self, fn, timeout_s: float = 30.0):
        return self.async_engine.call(fn).result(timeout_s)


@pytest.fixture(scope="session")
def live_server(tiny_model_dir) -> Iterator[LiveServer]:
    engine = Engine(EngineConfig(model=str(tiny_model_dir), num_pages=512, **ENGINE_OPTIONS))
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine, api_keys=[KEY_A, KEY_B], model_name=MODEL)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # bound before uvicorn starts: no port race
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        yield LiveServer(f"http://127.0.0.1:{sock.getsockname()[1]}", async_engine)
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
        async_engine.shutdown()
