"""radixkv's tests: a package tree (every folder has an `__init__.py`), so test modules and the
shared helpers import by their full names, `from tests.helpers.engine import ...`, with no
`sys.path` edits; pytest puts the repository root on `sys.path` for the `tests` package."""
