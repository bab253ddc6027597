"""The repository's layout: its root holds no importable package whose name an installed
distribution also provides (a process started in the root, pytest or `python -m`, would import
ours in its place); docs/architecture.md names only paths that exist; and no module imports from
a floor above its own in that document's floors table."""

from __future__ import annotations

import ast
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


def _floors(text: str) -> list[tuple[str, list[str]]]:
    """The floors table of docs/architecture.md, top floor first: (name, the paths it names)."""
    section = text.split("\n## Floors", 1)[1].split("\n## ", 1)[0]
    floors = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] not in ("", "floor") and not set(cells[0]) <= {"-"}:
            floors.append((cells[0], re.findall(r"`((?:radixkv|scenarios)/[\w./]*)`", cells[1])))
    return floors


def _floor_of(path: str, floors: list[tuple[str, list[str]]]) -> int | None:
    """The floor (0 the top) of a repository path: its longest match among the table's files and folders."""
    best: tuple[int, int] | None = None
    for index, (_, paths) in enumerate(floors):
        for named in paths:
            if (path == named or (named.endswith("/") and path.startswith(named))) and (best is None or len(named) > best[1]):
                best = (index, len(named))
    return None if best is None else best[0]


def _path_of(module: str) -> str | None:
    """The repository path of a radixkv module (radixkv.scenarios is scenarios/), None for others."""
    parts = module.split(".")
    if parts[0] != "radixkv":
        return None
    base = ["scenarios", *parts[2:]] if parts[1:2] == ["scenarios"] else parts
    for candidate in ("/".join(base) + ".py", "/".join(base) + "/__init__.py"):
        if (ROOT / candidate).is_file():
            return candidate
    return None


def _imported_modules(path: str, source: str) -> list[tuple[str, int]]:
    """Every module a file imports, anywhere in it (lazy imports too), with the line: for
    `from a import b` both a and a.b, since b may be a submodule."""
    package = path.rsplit("/", 1)[0].replace("/", ".")
    if package.startswith("scenarios"):
        package = "radixkv." + package
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found += [(base, node.lineno)] + [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def _climbs(path: str, source: str, floors: list[tuple[str, list[str]]]) -> list[str]:
    own = _floor_of(path, floors)
    climbs = []
    for module, line in _imported_modules(path, source):
        target = _path_of(module)
        floor = None if target is None else _floor_of(target, floors)
        if own is not None and floor is not None and floor < own:
            climbs.append(f"{path}:{line} ({floors[own][0]}) imports {module} ({floors[floor][0]})")
    return climbs


# The package's own __init__ re-exports the in-process API; Python imports it before any of
# its modules, so it is the front of the house rather than a floor.
_OFF_THE_FLOORS = {"radixkv/__init__.py"}


def test_no_module_imports_from_a_floor_above_its_own():
    floors = _floors((ROOT / "docs" / "architecture.md").read_text())
    assert len(floors) >= 8 and floors[0][0] == "entry points" and floors[-1][0] == "base"
    modules = sorted(p.relative_to(ROOT).as_posix() for folder in ("radixkv", "scenarios") for p in (ROOT / folder).rglob("*.py"))
    unplaced = [m for m in modules if _floor_of(m, floors) is None and m not in _OFF_THE_FLOORS]
    assert not unplaced, f"modules on no floor of docs/architecture.md's table (add them there): {unplaced}"
    climbs = [climb for m in modules for climb in _climbs(m, (ROOT / m).read_text(), floors)]
    assert not climbs, "imports that run up a floor:\n" + "\n".join(climbs)


def test_the_floor_check_sees_a_climb():
    """The check above is not vacuous: an import up a floor, lazy or relative, is found."""
    floors = _floors((ROOT / "docs" / "architecture.md").read_text())
    source = "def f():\n    from radixkv.server.app import create_app\nfrom ..engine import engine\n"
    climbs = _climbs("radixkv/cache/radix.py", source, floors)
    assert any("radixkv.server.app (server)" in c for c in climbs) and any("radixkv.engine.engine (engine)" in c for c in climbs)
    assert not _climbs("radixkv/server/app.py", "from radixkv.cache.radix import RadixTree\n", floors)
