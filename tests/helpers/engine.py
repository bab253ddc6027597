"""Helpers for tests that drive an engine: transformers' greedy reference, engine and LLM
factories over tiny models, stepping to the end, and the page checks every test ends with."""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from radixkv import LLM
from radixkv.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.request_output import RequestOutput
from radixkv.model.loader import LoadedModel, hf_reference_model
from tests.helpers.tiny_models import CHAT_TEMPLATE

VOCAB = 320  # the tiny models' vocabulary
# Where make_llm's engines run: the CPU, unless a GPU run of the engine tests asks for cuda
# (tools/gpu_check.sh: RADIXKV_TEST_DEVICE=cuda pytest tests/engine), so a short loan of a GPU
# drives the same scheduling, caching and sampling tests through the Triton backend.
TEST_DEVICE = os.environ.get("RADIXKV_TEST_DEVICE", "cpu")


def hf_greedy(model_dir: Path | str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (no padding effects)."""
    model = hf_reference_model(model_dir, torch.float32)  # a GGUF's folder: transformers reads the GGUF
    model.eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
            )
            results.append(out[0, len(prompt) :].tolist())
    return results


def shared_prefix_prompts(seed: int, vocab: int = VOCAB, count: int = 6) -> list[list[int]]:
    """Prompts in two groups, each sharing a long prefix, with distinct tails of mixed length."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, vocab) for _ in range(37)], [rng.randrange(1, vocab) for _ in range(22)]]
    prompts = []
    for i in range(count):
        tail = [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 14))]
        prompts.append(systems[i % 2] + tail)
    return prompts


def make_llm(model_dir: Path | str, *, chat: bool = False, **options) -> LLM:
    """An LLM on TEST_DEVICE (the CPU) in fp32 with small pages and every invariant checked each
    step; with chat, the tiny chat template (the tiny tokenizer has none)."""
    defaults = dict(dtype="float32", device=TEST_DEVICE, page_size=4, num_pages=256, check_invariants=True, seed=0)
    defaults.update(options)
    llm = LLM(str(model_dir), **defaults)
    if chat:
        llm.tokenizer.chat_template = CHAT_TEMPLATE
    return llm


def make_engine(loaded: LoadedModel, **overrides) -> Engine:
    """An Engine over already loaded weights (its own page pool and tree), with a chat template."""
    options = dict(
        model=loaded.path, dtype="float32", device="cpu", page_size=4, num_pages=256, check_invariants=True, seed=0
    )
    options.update(overrides)
    engine = Engine(EngineConfig(**options), loaded=loaded)
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    return engine


def run_to_end(engine: Engine, max_steps: int = 5000) -> dict[str, RequestOutput]:
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
    return Counter(page for seq in engine.requests[request_id] for page in seq.page_table)


def refcounts(engine: Engine) -> list[int]:
    return [engine.pool.refcount(page) for page in range(engine.pool.num_pages)]


def assert_pages_returned(engine: Engine) -> None:
    """Once every request has ended: each page free or cached in the tree, none locked, and a
    cached page referred to by the tree alone."""
    engine.check_invariants()
    engine.pool.check_invariants()
    engine.tree.check_invariants(check_hashes=True)
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.has_unfinished()
    assert engine.tree.locked_pages == 0
    assert engine.pool.num_free + engine.tree.cached_pages == engine.pool.num_pages
    assert all(engine.pool.refcount(p) == 1 for p in engine.tree.cached_page_set())
    windows = engine.windows  # layer groups: every window page free or the tree's alone
    if windows is not None:
        assert windows.pool.num_free + windows.evictable_pages == windows.pool.num_pages


def wait_until(predicate: Callable[[], object], timeout_s: float = 20.0, interval_s: float = 0.02) -> bool:
    """Poll predicate until it holds or timeout_s passes; its last value, as a bool."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())
