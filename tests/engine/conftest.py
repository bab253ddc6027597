"""Fixtures for engine tests: a second tiny architecture beside the shared tiny Llama."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 whose window (8 tokens on 3 of its 4 layers) every test prompt outgrows."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3", seed=3)
