"""Test-wide environment, set at import time before anything imports the Triton kernels, and the
tiny model folder that the engine, server, reliability and SDK tests share."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_models import make_tiny_model

if not torch.cuda.is_available():
    # Triton's jit reads this when a kernel module is imported: run kernels on the CPU interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (seed 0, 512 positions) saved as an ordinary model folder; read-only."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", max_position_embeddings=512)
