"""Real workloads run side by side with peers, the cache bench, the CPU kernel bench, the load
test. Installed as `radixkv.scenarios` (pyproject.toml maps this folder there), so `radixkv bench
NAME` and `python -m radixkv.scenarios.NAME` work from any directory.

Every module here is a scenario with `main(argv) -> int`, except the library modules below.
"""

from __future__ import annotations

import pkgutil

LIBRARY_MODULES = frozenset({"harness", "peers", "report", "serve_http", "llama_server", "session_inference", "byte_budget"})


def scenario_names() -> list[str]:
    """The runnable scenarios, sorted: every module of this package but the library ones."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in LIBRARY_MODULES and not m.ispkg)
