"""Fixtures for engine tests: a second tiny architecture beside the shared tiny Llama."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1)
