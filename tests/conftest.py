"""Test-wide environment, set at import time before anything imports the Triton kernels; one
torch thread outside the kernel packages; and the tiny model folder that the engine, server,
reliability and SDK tests share."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.helpers.gguf_files import TinyGGUFs
from tests.helpers.tiny_models import make_tiny_model

if not torch.cuda.is_available():
    # Triton's jit reads this when a kernel module is imported: run kernels on the CPU interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Tiny models gain nothing from intra-op threads, and the OpenMP threads of torch and of the
# native kernels spin-wait on each other: on a 2-core machine a tiny model's step spent 20-40x
# the CPU time at two threads that it spent at one, more when other work shares the cores. So
# every test runs at one thread (subprocesses too: `radixkv serve` workers, scenario runs),
# except in tests/cpu, whose kernel tests reach the native kernels' split of work across threads
# through torch's default count. (tests/attention sets its thread counts itself; tests/model
# runs those kernels only through tests/cpu's; the Triton interpreter has no split to test.)
DEFAULT_THREADS = torch.get_num_threads()
THREADED_PACKAGES = frozenset({"cpu"})
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
_TESTS = Path(__file__).parent

# Hypothesis: no example fails for its wall time (a deadline, the too_slow health check): on a
# loaded machine those fail what a quiet one passes. A plain pytest run keeps drawing fresh
# examples each run (and replays the ones that failed before, from .hypothesis/); the CI gate,
# `make test`, selects "ci": the same examples every run (derandomize, no example database),
# so a red CI run means a change broke something. Sweep wider with --hypothesis-seed=N.
_NO_WALL_TIME = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("default", **_NO_WALL_TIME)
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, **_NO_WALL_TIME)
settings.load_profile("default")


@pytest.fixture(autouse=True)
def _torch_threads(request: pytest.FixtureRequest) -> Iterator[None]:
    """torch's own thread count for tests in THREADED_PACKAGES, one thread
    elsewhere. An engine thread keeps the count it started with (a session's live server)."""
    path = Path(request.node.path)
    parts = path.relative_to(_TESTS).parts if path.is_relative_to(_TESTS) else ()
    if len(parts) < 2 or parts[0] not in THREADED_PACKAGES:
        yield
        return
    torch.set_num_threads(DEFAULT_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_ggufs(tmp_path_factory: pytest.TempPathFactory) -> TinyGGUFs:
    """Tiny random Llama GGUF files by weight type (tests.helpers.gguf_files), written on first use; read-only."""
    return TinyGGUFs(tmp_path_factory.mktemp("tiny-ggufs"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (seed 0, 512 positions) saved as an ordinary model folder; read-only."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", max_position_embeddings=512)
