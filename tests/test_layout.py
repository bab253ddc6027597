"""The repository's root holds no importable package whose name an installed distribution also
provides: a process started in the root (pytest, `python -m`) would import ours in its place."""

from __future__ import annotations

import importlib.metadata
import re
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


def _named_paths(text: str) -> set[str]:
    """Every repository path a document names in backticks: `radixkv/...`, `scenarios/...`,
    `tests/...`, `docs/...`, and a server/engine/... path relative to radixkv/."""
    paths = set()
    for token in re.findall(r"`([^`\s]+)`", text):
        token = token.rstrip(",.")
        if re.fullmatch(r"[\w./-]+(\.py|\.md|\.c|\.h|/)", token):
            paths.add(token)
    for token in re.findall(r"(?<![\w/`])((?:server|engine|cache|model|attention|cpu|kernels|kv_events|sdk)/[\w/]*\w\.py)", text):
        paths.add(token)
    return paths


def test_the_architecture_document_names_only_paths_that_exist():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = _named_paths(text)
    assert len(named) > 40, "the document names the modules it describes"
    missing = sorted(p for p in named if not (ROOT / p).exists() and not (ROOT / "radixkv" / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_the_suite_runs_at_one_torch_thread_outside_the_kernel_packages():
    import torch

    from tests.conftest import DEFAULT_THREADS, THREADED_PACKAGES

    assert torch.get_num_threads() == 1 and DEFAULT_THREADS >= 1
    assert THREADED_PACKAGES >= {"cpu"}
