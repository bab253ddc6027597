"""The repository's root holds no importable package whose name an installed distribution also
provides: a process started in the root (pytest, `python -m`) would import ours in its place."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_top_level_package_shadows_an_installed_one():
    # transformers 5.25 depends on Hugging Face's `kernels` and imports it: a top-level kernels/
    # folder here (now radixkv/kernels/) broke every model load started in the root. radixkv is
    # our own distribution's, and no dependency imports a `tests` package at run time.
    provided = importlib.metadata.packages_distributions()
    clashes = {
        folder.name: provided[folder.name]
        for folder in ROOT.iterdir()
        if (folder / "__init__.py").is_file() and folder.name not in {"radixkv", "tests"} and folder.name in provided
    }
    assert not clashes, f"top-level folders shadow installed packages (move them under radixkv/): {clashes}"



def test_the_suite_runs_at_one_torch_thread_outside_the_kernel_packages():
    import torch

    from tests.conftest import DEFAULT_THREADS, THREADED_PACKAGES

    assert torch.get_num_threads() == 1 and DEFAULT_THREADS >= 1
    assert THREADED_PACKAGES >= {"cpu", "model"}
